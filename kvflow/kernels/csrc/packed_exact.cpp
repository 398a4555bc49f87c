// Exact reads of a packed weight: rows dequantized exactly (embedding lookups), the best outputs of a
// packed matmul recomputed in double from the stored codes (an output head's greedy choice), and the
// weight statistic that decides which outputs those are.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvflow_cpu.h"
#include "packed_common.h"
#include "row_ops.h"
#include "simd.h"
#include "threads.h"

namespace {

using kvflow::packed::chunk_bytes;
using kvflow::packed::code_at;

// Column j of a packed weight times x, from the stored codes, summed in double: the exact product.
double exact_column(const KvflowPackedWeight& w, int64_t j, const float* x) {
  const int64_t nb = w.k / w.block;
  const size_t chunk = chunk_bytes(w);
  const int c = static_cast<int>(j % 16);
  const uint8_t* group = w.data + static_cast<size_t>(j / 16) * nb * chunk;
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* at = group + b * chunk;
    float scale, offset;  // exact values, so the same in double
    kvflow::packed::column_scale_offset(w, j / 16, b, at, c, &scale, &offset);
    const float* xb = x + b * w.block;
    double dot = 0.0, sum = 0.0;
    for (int k = 0; k < w.block; ++k) {
      dot += static_cast<double>(code_at(at, w.bits, c, k, w.block, w.codebook)) * xb[k];
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
  const float max_int = static_cast<float>(input_bits == 8 ? kvflow::packed::kMaxInt8 : kvflow::packed::kMaxInt);
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
  const size_t chunk = chunk_bytes(*w);
  for (int i = 0; i < count; ++i) {
    const int c = static_cast<int>(ids[i] % 16);
    const uint8_t* group = w->data + static_cast<size_t>(ids[i] / 16) * nb * chunk;
    float* row = out + static_cast<int64_t>(i) * w->k;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* at = group + b * chunk;
      float scale, offset;
      kvflow::packed::column_scale_offset(*w, ids[i] / 16, b, at, c, &scale, &offset);
      for (int k = 0; k < w->block; ++k)  // scale * q is exact: one rounding
        row[b * w->block + k] = static_cast<float>(code_at(at, w->bits, c, k, w->block, w->codebook)) * scale + offset;
    }
  }
}

extern "C" void kvflow_packed_block_abs_sum(const KvflowPackedWeight* w, float* out, int32_t num_threads) {
  const int64_t nb = w->k / w->block, groups = (w->n + 15) / 16;
  const size_t chunk = chunk_bytes(*w);
  const int team = num_threads > 0 ? num_threads : 1;
  std::vector<float> largest(static_cast<size_t>(team) * nb, 0.f);  // per thread, then merged
  kvflow::parallel(team, [&](kvflow::Team& workers) {
    float* mine = largest.data() + static_cast<size_t>(workers.thread()) * nb;
    const int64_t g_lo = groups * workers.thread() / workers.threads();
    const int64_t g_hi = groups * (workers.thread() + 1) / workers.threads();
    for (int64_t g = g_lo; g < g_hi; ++g) {
      const int columns = w->n - g * 16 < 16 ? static_cast<int>(w->n - g * 16) : 16;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* at = w->data + (static_cast<size_t>(g) * nb + b) * chunk;
        for (int c = 0; c < columns; ++c) {
          float scale, offset;
          kvflow::packed::column_scale_offset(*w, g, b, at, c, &scale, &offset);
          double total = 0.0;  // each weight as kvflow_packed_rows gives it
          for (int i = 0; i < w->block; ++i)
            total += std::fabs(static_cast<float>(code_at(at, w->bits, c, i, w->block, w->codebook)) * scale + offset);
          const float sum = static_cast<float>(total);
          mine[b] = sum > mine[b] ? sum : mine[b];
        }
      }
    }
  });
  for (int64_t b = 0; b < nb; ++b) {
    float m = 0.f;
    for (int t = 0; t < team; ++t) {
      const float v = largest[static_cast<size_t>(t) * nb + b];
      m = v > m ? v : m;
    }
    out[b] = m;
  }
}
