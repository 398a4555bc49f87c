// The elementwise parts of a many-row forward (prefill chunks) in the fast mode, run between oneDNN's
// bfloat16 matmuls (kvflow/kernels/many_rows.py). Each reads the previous matmul's bfloat16 output and
// writes the next matmul's bfloat16 input in one pass, split across threads by rows; PyTorch would
// take several ops and float32 copies for each (about a quarter of a 512-token prefill).
#include "kvflow_cpu.h"
#include "row_ops.h"

#ifdef __AVX512F__
using kvflow::load16f;
using kvflow::store16f;
#endif

namespace {

// x[j] += widen(delta[j]), then out[j] = x[j] * inv_rms(x) * weight[j].
template <typename Out>
void add_norm_row(float* x, const uint16_t* delta, const float* weight, int width, float eps, Out* out) {
  int j = 0;
  if (delta) {
#ifdef __AVX512F__
    for (; j + 16 <= width; j += 16) _mm512_storeu_ps(x + j, _mm512_add_ps(_mm512_loadu_ps(x + j), load16f(delta + j)));
#endif
    for (; j < width; ++j) x[j] += kvflow::bf16_to_float(delta[j]);
  }
  const float inv = kvflow::rms_scale(x, width, eps);
  j = 0;
#ifdef __AVX512F__
  const __m512 inv16 = _mm512_set1_ps(inv);
  for (; j + 16 <= width; j += 16)
    store16f(out + j, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + j), inv16), _mm512_loadu_ps(weight + j)));
#endif
  for (; j < width; ++j) kvflow::store1f(out + j, x[j] * inv * weight[j]);
}

}  // namespace

extern "C" void kvflow_add_rms_norm(float* hidden, const uint16_t* delta, const float* weight, int rows, int width,
                                    float eps, uint16_t* out_bf16, float* out_f32, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int r = 0; r < rows; ++r) {
    const int64_t at = static_cast<int64_t>(r) * width;
    const uint16_t* d = delta ? delta + at : nullptr;
    if (out_bf16)
      add_norm_row(hidden + at, d, weight, width, eps, out_bf16 + at);
    else
      add_norm_row(hidden + at, d, weight, width, eps, out_f32 + at);
  }
}

extern "C" int kvflow_qkv_rotary(const KvflowDecoder* m, int layer, const uint16_t* qkv, int rows,
                                 const int64_t* positions, float* out, int num_threads) {
  for (int r = 0; r < rows; ++r)
    if (positions[r] < 0 || positions[r] >= m->max_positions) return -2;
  const KvflowDecoderLayer& l = m->layers[layer];
  const int d = m->head_dim, hq = m->num_heads, hkv = m->num_kv_heads;
  const int q_size = hq * d, width = q_size + 2 * hkv * d;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int r = 0; r < rows; ++r) {
    const uint16_t* src = qkv + static_cast<int64_t>(r) * width;
    float* row = out + static_cast<int64_t>(r) * width;
    for (int j = 0; j < width; ++j) row[j] = kvflow::bf16_to_float(src[j]);
    if (l.qkv_bias)
      for (int j = 0; j < width; ++j) row[j] += l.qkv_bias[j];
    if (l.q_norm) {
      kvflow::rms_norm(row, l.q_norm, row, hq, d, m->eps);
      kvflow::rms_norm(row + q_size, l.k_norm, row + q_size, hkv, d, m->eps);
    }
    const float* cos = m->cos + positions[r] * d;
    const float* sin = m->sin + positions[r] * d;
    kvflow::rotate(row, hq, d, cos, sin);
    kvflow::rotate(row + q_size, hkv, d, cos, sin);
  }
  return 0;
}

extern "C" void kvflow_silu_mul_rows(const uint16_t* gate_up, int rows, int inter, uint16_t* out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int r = 0; r < rows; ++r) {
    const uint16_t* gu = gate_up + static_cast<int64_t>(r) * 2 * inter;
    kvflow::silu_mul(gu, gu + inter, out + static_cast<int64_t>(r) * inter, inter);
  }
}
