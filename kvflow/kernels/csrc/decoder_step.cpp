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
#include "row_ops.h"

using kvflow::rms_norm;
using kvflow::rotate;
using kvflow::silu_mul;

namespace {

struct Buffers {
  std::vector<float> normed, qkv, attn, proj, gate_up, act;
};

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
