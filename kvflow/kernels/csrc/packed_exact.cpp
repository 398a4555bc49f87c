// Exact reads of a packed weight: rows dequantized exactly (embedding lookups) and the best outputs of a
// packed matmul recomputed in double from the stored codes (an output head's greedy choice).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvflow_cpu.h"
#include "row_ops.h"
#include "simd.h"

namespace {

constexpr float kMaxIntValue = 32639.f;  // kMaxInt, also where the VNNI code is not built

// Column j of a packed weight times x, from the stored codes, summed in double: the exact product.
// The layout's sizes (kvflow_cpu.h): codes, then 16 scales, then 16 offsets where there are offsets.
size_t code_bytes(const KvflowPackedWeight& w) { return static_cast<size_t>(2 * w.block * w.bits); }
size_t chunk_bytes(const KvflowPackedWeight& w) { return code_bytes(w) + (w.has_offset ? 64 : 32); }

int code_at(const KvflowPackedWeight& w, const uint8_t* at, int c, int k) {  // input k of column c in a block
  if (w.bits == 4) {
    const uint8_t byte = at[64 * (k / 8) + 4 * c + k % 4];
    return (k % 8) < 4 ? (byte & 0x0f) : (byte >> 4);
  }
  return at[64 * (k / 4) + 4 * c + k % 4];
}

double exact_column(const KvflowPackedWeight& w, int64_t j, const float* x) {
  const int64_t nb = w.k / w.block;
  const size_t chunk = chunk_bytes(w), code_bytes = ::code_bytes(w);
  const int c = static_cast<int>(j % 16);
  const uint8_t* group = w.data + static_cast<size_t>(j / 16) * nb * chunk;
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* at = group + b * chunk;
    kvflow::float16 scale16, offset16 = 0;
    std::memcpy(&scale16, at + code_bytes + 2 * c, 2);
    if (w.has_offset) std::memcpy(&offset16, at + code_bytes + 32 + 2 * c, 2);
    const double scale = static_cast<double>(scale16);
    const double offset = w.has_offset ? static_cast<double>(offset16) : -w.centre * scale;
    const float* xb = x + b * w.block;
    double dot = 0.0, sum = 0.0;
    for (int k = 0; k < w.block; ++k) {
      dot += static_cast<double>(code_at(w, at, c, k)) * xb[k];
      sum += xb[k];
    }
    total += scale * dot + offset * sum;
  }
  return total;
}

}  // namespace

extern "C" int32_t kvflow_packed_refine_top(const KvflowPackedWeight* w, const float* x, int64_t x_stride, int32_t m,
                                            float* y, int64_t y_stride, const float* block_abs_sum,
                                            int32_t input_bits) {
  const float max_int = input_bits == 8 ? 127.f : kMaxIntValue;
  const int block = w->block;
  const int64_t nb = w->k / block;
  float w_max = 0.f;
  for (int64_t b = 0; b < nb; ++b) w_max = block_abs_sum[b] > w_max ? block_abs_sum[b] : w_max;
  int recomputed = 0;
  for (int r = 0; r < m; ++r) {
    const float* xr = x + r * x_stride;
    float* yr = y + r * y_stride;
    // The bound PackedLinear.error_bound states: half an input step per block times the block's |w| sum.
    float spread = 0.f, l1 = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      float amax = 0.f;
      for (int i = 0; i < block; ++i) {
        const float v = std::fabs(xr[b * block + i]);
        amax = v > amax ? v : amax;
        l1 += v;
      }
      spread += amax * block_abs_sum[b];
    }
    const float bound = spread / (2.f * max_int) * 1.01f + 1e-6f * l1 * w_max;
    const float floor = kvflow::largest(yr, w->n) - 2.f * bound;
    // A vector of outputs at a time: only one whose largest lane reaches the floor is looked into.
    namespace v = kvflow::simd;
    int64_t j = 0;
    for (; j + v::kLanes <= w->n; j += v::kLanes) {
      if (v::reduce_max(v::load(yr + j)) < floor) continue;
      for (int i = 0; i < v::kLanes; ++i)
        if (yr[j + i] >= floor) {
          yr[j + i] = static_cast<float>(exact_column(*w, j + i, xr));
          ++recomputed;
        }
    }
    for (; j < w->n; ++j) {
      if (yr[j] >= floor) {
        yr[j] = static_cast<float>(exact_column(*w, j, xr));
        ++recomputed;
      }
    }
  }
  return recomputed;
}

extern "C" void kvflow_packed_rows(const KvflowPackedWeight* w, const int64_t* ids, int32_t count, float* out) {
  const int64_t nb = w->k / w->block;
  const size_t chunk = chunk_bytes(*w), code_bytes = ::code_bytes(*w);
  for (int i = 0; i < count; ++i) {
    const int c = static_cast<int>(ids[i] % 16);
    const uint8_t* group = w->data + static_cast<size_t>(ids[i] / 16) * nb * chunk;
    float* row = out + static_cast<int64_t>(i) * w->k;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* at = group + b * chunk;
      kvflow::float16 scale16, offset16 = 0;
      std::memcpy(&scale16, at + code_bytes + 2 * c, 2);
      if (w->has_offset) std::memcpy(&offset16, at + code_bytes + 32 + 2 * c, 2);
      const float scale = static_cast<float>(scale16);
      const float offset = w->has_offset ? static_cast<float>(offset16) : scale * -static_cast<float>(w->centre);
      for (int k = 0; k < w->block; ++k)  // scale * q is exact: one rounding
        row[b * w->block + k] = static_cast<float>(code_at(*w, at, c, k)) * scale + offset;
    }
  }
}
