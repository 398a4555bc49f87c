// One forward step of a Llama-family decoder with packed weights, for steps of few rows (decode), in
// one call: every layer's norms, projections, rotary embedding, attention and MLP.
//
// A decode step does little arithmetic per layer (a few hundred thousand multiply-adds a row), so
// dispatching each op from Python costs as much as the op. Here the whole stack runs in C++ with
// the same kernels the Python layers call one at a time (kvflow_packed_matmul, kvflow_paged_attention);
// each row's arithmetic depends on its own inputs only, so a row's result does not depend on the batch.
#include <cmath>
#include <cstring>
#include <vector>

#include "kvflow_cpu.h"
#include "vector_exp.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

struct Buffers {
  std::vector<float> normed, qkv, attn, proj, gate_up, act;
};

// y = x / sqrt(mean(x^2) + eps) * weight, per row of `width`.
void rms_norm(const float* x, const float* weight, float* y, int rows, int width, float eps) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<int64_t>(r) * width;
    float* yr = y + static_cast<int64_t>(r) * width;
    int i = 0;
    float total = 0.f;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= width; i += 16) {
      const __m512 v = _mm512_loadu_ps(xr + i);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    total = _mm512_reduce_add_ps(acc);
#endif
    for (; i < width; ++i) total += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(total / static_cast<float>(width) + eps);
    for (int j = 0; j < width; ++j) yr[j] = xr[j] * inv * weight[j];
  }
}

// Rotate-half (NeoX) rotary embedding of `heads` heads at `pos`, in place.
void rotate(float* x, int heads, int d, const float* cos, const float* sin) {
  const int half = d / 2;
  for (int h = 0; h < heads; ++h) {
    float* v = x + h * d;
    for (int i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// a[j] = silu(gate[j]) * up[j] for one row.
void silu_mul(const float* gate, const float* up, float* a, int n) {
  int j = 0;
#ifdef __AVX512F__
  const __m512 one = _mm512_set1_ps(1.f);
  for (; j + 16 <= n; j += 16) {
    const __m512 g = _mm512_loadu_ps(gate + j);
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    _mm512_storeu_ps(a + j, _mm512_mul_ps(s, _mm512_loadu_ps(up + j)));
  }
#endif
  for (; j < n; ++j) a[j] = silu(gate[j]) * up[j];
}

}  // namespace

extern "C" int kvflow_decoder_step(const KvflowDecoder* m, float* hidden, const int64_t* positions, int rows,
                                   const KvflowStep* step, int num_threads) {
  const int h = m->hidden, d = m->head_dim, hq = m->num_heads, hkv = m->num_kv_heads, inter = m->intermediate;
  const int q_size = hq * d, kv_size = hkv * d, qkv_size = q_size + 2 * kv_size;
  thread_local Buffers buf;
  buf.normed.resize(static_cast<size_t>(rows) * h);
  buf.qkv.resize(static_cast<size_t>(rows) * qkv_size);
  buf.attn.resize(static_cast<size_t>(rows) * q_size);
  buf.proj.resize(static_cast<size_t>(rows) * h);
  buf.gate_up.resize(static_cast<size_t>(rows) * 2 * inter);
  buf.act.resize(static_cast<size_t>(rows) * inter);
  for (int r = 0; r < rows; ++r)
    if (positions[r] < 0 || positions[r] >= m->max_positions) return -2;

  for (int l = 0; l < m->num_layers; ++l) {
    const KvflowDecoderLayer& layer = m->layers[l];
    rms_norm(hidden, layer.input_norm, buf.normed.data(), rows, h, m->eps);
    if (kvflow_packed_matmul(&layer.qkv, buf.normed.data(), h, rows, buf.qkv.data(), qkv_size, num_threads))
      return -1;
    for (int r = 0; r < rows; ++r) {
      float* row = buf.qkv.data() + static_cast<int64_t>(r) * qkv_size;
      if (layer.qkv_bias)
        for (int j = 0; j < qkv_size; ++j) row[j] += layer.qkv_bias[j];
      if (layer.q_norm) {
        rms_norm(row, layer.q_norm, row, hq, d, m->eps);
        rms_norm(row + q_size, layer.k_norm, row + q_size, hkv, d, m->eps);
      }
      const float* cos = m->cos + positions[r] * d;
      const float* sin = m->sin + positions[r] * d;
      rotate(row, hq, d, cos, sin);
      rotate(row + q_size, hkv, d, cos, sin);
    }
    const float* q = buf.qkv.data();
    if (kvflow_paged_attention(q, qkv_size, q + q_size, qkv_size, q + q_size + kv_size, qkv_size, layer.k_cache,
                               layer.v_cache, m->cache_dtype, step->slots, rows, step->query_start,
                               step->seq_lens, step->block_tables, step->table_stride, step->num_seqs,
                               buf.attn.data(), q_size, hq, hkv, d, m->block_size, m->attn_scale, 1, num_threads))
      return -1;
    if (kvflow_packed_matmul(&layer.o, buf.attn.data(), q_size, rows, buf.proj.data(), h, num_threads)) return -1;
    for (int64_t i = 0; i < static_cast<int64_t>(rows) * h; ++i) hidden[i] += buf.proj[i];

    rms_norm(hidden, layer.post_norm, buf.normed.data(), rows, h, m->eps);
    if (kvflow_packed_matmul(&layer.gate_up, buf.normed.data(), h, rows, buf.gate_up.data(), 2 * inter,
                             num_threads))
      return -1;
    for (int r = 0; r < rows; ++r) {
      const float* gu = buf.gate_up.data() + static_cast<int64_t>(r) * 2 * inter;
      float* a = buf.act.data() + static_cast<int64_t>(r) * inter;
      silu_mul(gu, gu + inter, a, inter);
    }
    if (kvflow_packed_matmul(&layer.down, buf.act.data(), inter, rows, buf.proj.data(), h, num_threads)) return -1;
    for (int64_t i = 0; i < static_cast<int64_t>(rows) * h; ++i) hidden[i] += buf.proj[i];
  }
  rms_norm(hidden, m->final_norm, hidden, rows, h, m->eps);
  return 0;
}
