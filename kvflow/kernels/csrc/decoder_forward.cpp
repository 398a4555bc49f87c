// The native decoder: one step of a Llama-family model in one call, token ids in, final hidden states
// and the sampled rows' logits out. Each layer does what kvflow/models/llama.py describes: norm, q/k/v
// (optional bias and per-head norms), rotary embedding, attention over the paged cache, o (optional
// bias), norm, gate/up, activation, down (or a mixture of experts: moe_mlp.cpp).
//
// A decode step does little arithmetic per layer, so dispatching each op from Python would cost as much
// as the op; here the whole stack runs without returning. The caller chooses, per step, how to multiply
// (kvflow/executors/cpu_fast.py):
//  - packed: the packed-integer kernel on float32 rows, every row through the paged attention kernel.
//    Each row's arithmetic depends on its own inputs only: a row's result does not depend on its batch.
//    With prompt_tiles, prompt chunks' rows attend on AMX tiles instead (a short chunk deep in a context,
//    an agent's next turn, attends several times faster there than row by row).
//  - dense (KvflowDense): bfloat16 rows times dense bfloat16 copies of the weights through the caller's
//    matmul, for steps of many rows where bfloat16 is native. Each pass between two matmuls reads the
//    last output and writes the next input in bfloat16 in one go; with prompt_attention_bf16, prompt
//    chunks attend on AMX tiles.
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kvflow_cpu.h"
#include "moe_mlp.h"
#include "row_ops.h"
#include "row_team.h"
#include "simd.h"

namespace {

struct Shape {
  int h, d, hq, hkv, inter, q_size, kv_size, qkv_size;
  explicit Shape(const KvflowDecoder& m)
      : h(m.hidden), d(m.head_dim), hq(m.num_heads), hkv(m.num_kv_heads), inter(m.intermediate),
        q_size(m.num_heads * m.head_dim), kv_size(m.num_kv_heads * m.head_dim), qkv_size(q_size + 2 * kv_size) {}
};

using kvflow::each_row;

// One row's q/k/v after its matmul: widened to float32 (from a bfloat16 output), bias, per-head norms
// and rotary, in place in `row`.
template <typename In>
void finish_qkv(const KvflowDecoder& m, const KvflowDecoderLayer& layer, const Shape& s, const In* src, float* row,
                int64_t position) {
  if constexpr (!std::is_same_v<In, float>)
    for (int j = 0; j < s.qkv_size; ++j) row[j] = kvflow::bf16_to_float(src[j]);
  if (layer.qkv_bias) kvflow::add_bias(row, layer.qkv_bias, s.qkv_size);
  if (layer.q_norm) {
    kvflow::rms_norm(row, layer.q_norm, row, s.hq, s.d, m.eps);
    kvflow::rms_norm(row + s.q_size, layer.k_norm, row + s.q_size, s.hkv, s.d, m.eps);
  }
  const float* cos = (layer.cos ? layer.cos : m.cos) + position * s.d;
  const float* sin = (layer.sin ? layer.sin : m.sin) + position * s.d;
  kvflow::rotate(row, s.hq, s.d, cos, sin);
  kvflow::rotate(row + s.q_size, s.hkv, s.d, cos, sin);
}

// x[j] += widen(delta[j]) (no delta: x as is), then out[j] = x[j] * inv_rms(x) * weight[j].
template <typename Delta, typename Out>
void add_norm_row(float* x, const Delta* delta, const float* weight, int width, float eps, Out* out) {
  namespace v = kvflow::simd;
  constexpr int W = v::kLanes;
  if (delta) {
    int j = 0;
    for (; j + W <= width; j += W) v::store(x + j, v::add(v::load(x + j), v::load(delta + j)));
    for (; j < width; ++j) x[j] += kvflow::widen(delta[j]);
  }
  const float inv = kvflow::rms_scale(x, width, eps);
  int j = 0;
  const v::vf inv_v = v::set1(inv);
  for (; j + W <= width; j += W) v::store(out + j, v::mul(v::mul(v::load(x + j), inv_v), v::load(weight + j)));
  for (; j < width; ++j) kvflow::narrow(x[j] * inv * weight[j], out + j);
}

// Gemma's norm of a sublayer's output before the residual add: row = rms_norm(widen(src)) * weight.
template <typename In>
void norm_output_row(const In* src, const float* weight, int width, float eps, float* row) {
  if constexpr (std::is_same_v<In, float>) {
    kvflow::rms_norm(src, weight, row, 1, width, eps);
  } else {
    for (int j = 0; j < width; ++j) row[j] = kvflow::widen(src[j]);
    kvflow::rms_norm(row, weight, row, 1, width, eps);
  }
}

// A fused projection: its first part's columns, then (where its parts come in two types) the rest's.
int fused_matmul(const KvflowPackedWeight& w, const KvflowPackedWeight& rest, const float* x, int64_t x_stride, int rows,
                 float* y, int64_t y_stride, int bits, int threads) {
  if (kvflow_packed_matmul(&w, x, x_stride, rows, y, y_stride, bits, threads)) return -1;
  return rest.data ? kvflow_packed_matmul(&rest, x, x_stride, rows, y + w.n, y_stride, bits, threads) : 0;
}

struct Buffers {
  std::vector<float> normed, qkv, attn, proj, gate_up, act;
  std::vector<int> one_token_rows, chunk_rows;  // rows of one-token queries; rows of chunks of two or more
  std::vector<uint16_t> attn_bf16;  // the tile kernel's output on the packed path
};

// Which of the step's rows are one-token queries and which belong to chunks of two or more rows.
void split_rows(const KvflowStep& queries, Buffers& b) {
  b.one_token_rows.clear();
  b.chunk_rows.clear();
  for (int i = 0; i < queries.num_seqs; ++i) {
    const int first = queries.query_start[i], n = queries.query_start[i + 1] - first;
    if (n == 1) b.one_token_rows.push_back(first);
    else
      for (int r = first; r < first + n; ++r) b.chunk_rows.push_back(r);
  }
}

Buffers& buffers(const Shape& s, int rows) {
  thread_local Buffers b;
  const size_t n = static_cast<size_t>(rows);
  b.normed.resize(n * s.h);
  b.qkv.resize(n * s.qkv_size);
  b.attn.resize(n * s.q_size);
  b.proj.resize(n * s.h);
  b.gate_up.resize(n * 2 * s.inter);
  b.act.resize(n * s.inter);
  return b;
}

// Every layer on the packed kernel, float32 throughout.
int packed_layers(const KvflowDecoder& m, const KvflowStep* steps, const int64_t* positions, int rows, float* hidden,
                  int bits, bool prompt_tiles, int threads) {
  const Shape s(m);
  Buffers& b = buffers(s, rows);
  split_rows(steps[0], b);  // every group's step has the same queries
  const bool tiles = prompt_tiles && !b.chunk_rows.empty();
  if (tiles) b.attn_bf16.resize(static_cast<size_t>(rows) * s.q_size);
  // hidden += proj, then normed = norm(hidden), per row.
  auto add_norm = [&](const float* delta, const float* weight) {
    each_row(rows, threads, [&](int r) {
      const int64_t at = static_cast<int64_t>(r) * s.h;
      add_norm_row(hidden + at, delta ? delta + at : nullptr, weight, s.h, m.eps, b.normed.data() + at);
    });
  };
  auto norm_outputs = [&](const float* weight) {  // proj = norm(proj), per row (Gemma's output norms)
    if (!weight) return;
    each_row(rows, threads, [&](int r) {
      float* row = b.proj.data() + static_cast<int64_t>(r) * s.h;
      norm_output_row(row, weight, s.h, m.eps, row);
    });
  };
  const kvflow::Activation act{m.activation, m.swiglu_alpha, m.swiglu_limit};
  for (int l = 0; l < m.num_layers; ++l) {
    const KvflowDecoderLayer& layer = m.layers[l];
    add_norm(l == 0 ? nullptr : b.proj.data(), layer.input_norm);
    if (fused_matmul(layer.qkv, layer.qkv_rest, b.normed.data(), s.h, rows, b.qkv.data(), s.qkv_size, bits, threads))
      return -1;
    each_row(rows, threads, [&](int r) {
      float* row = b.qkv.data() + static_cast<int64_t>(r) * s.qkv_size;
      finish_qkv<float>(m, layer, s, row, row, positions[r]);
    });
    const float* q = b.qkv.data();
    const KvflowRows qkv{q, s.qkv_size, q + s.q_size, s.qkv_size, q + s.q_size + s.kv_size, s.qkv_size};
    if (kvflow_paged_attention(&layer.attention, &steps[layer.kv_group], &qkv, b.attn.data(), s.q_size, tiles ? 0 : 1,
                               threads))
      return -1;
    if (tiles) {  // the chunks' rows on tiles, back to float32 for the packed o projection
      if (kvflow_prefill_attention_bf16(&layer.attention, &steps[layer.kv_group], q, s.qkv_size, b.attn_bf16.data(),
                                        s.q_size, threads))
        return -1;
      for (int r : b.chunk_rows)
        for (int j = 0; j < s.q_size; ++j)
          b.attn[static_cast<int64_t>(r) * s.q_size + j] = kvflow::bf16_to_float(b.attn_bf16[static_cast<int64_t>(r) * s.q_size + j]);
    }
    if (kvflow_packed_matmul(&layer.o, b.attn.data(), s.q_size, rows, b.proj.data(), s.h, bits, threads)) return -1;
    if (layer.o_bias)
      each_row(rows, threads, [&](int r) {
        kvflow::add_bias(b.proj.data() + static_cast<int64_t>(r) * s.h, layer.o_bias, s.h);
      });
    norm_outputs(layer.attn_out_norm);
    add_norm(b.proj.data(), layer.post_norm);
    if (layer.moe) {
      if (kvflow::moe_mlp(*layer.moe, act, b.normed.data(), s.h, rows, b.proj.data(), bits, threads)) return -1;
      norm_outputs(layer.mlp_out_norm);
      continue;
    }
    if (fused_matmul(layer.gate_up, layer.gate_up_rest, b.normed.data(), s.h, rows, b.gate_up.data(), 2 * s.inter,
                     bits, threads))
      return -1;
    each_row(rows, threads, [&](int r) {
      const float* gu = b.gate_up.data() + static_cast<int64_t>(r) * 2 * s.inter;
      kvflow::gated_activation(act, gu, gu + s.inter, b.act.data() + static_cast<int64_t>(r) * s.inter, s.inter);
    });
    if (kvflow_packed_matmul(&layer.down, b.act.data(), s.inter, rows, b.proj.data(), s.h, bits, threads)) return -1;
    norm_outputs(layer.mlp_out_norm);
  }
  each_row(rows, threads, [&](int r) {
    const int64_t at = static_cast<int64_t>(r) * s.h;
    add_norm_row(hidden + at, m.num_layers ? b.proj.data() + at : nullptr, m.final_norm, s.h, m.eps, hidden + at);
  });
  return 0;
}

// Every layer on dense bfloat16 copies through dense.matmul; attention as the file's head says.
int dense_layers(const KvflowDecoder& m, const KvflowStep* steps, const int64_t* positions, int rows, float* hidden,
                 const KvflowDense& dense, int threads) {
  const Shape s(m);
  Buffers& b = buffers(s, rows);
  split_rows(steps[0], b);  // every group's step has the same queries
  const uint16_t* delta = nullptr;  // the last matmul's output, not yet added to hidden
  const float* normed_delta = nullptr;  // or, after a Gemma output norm, that output normed (float32)
  // Row r of hidden += the pending output, then out = norm(hidden) * weight.
  auto add_pending_norm = [&](int r, const float* weight, auto* out) {
    const int64_t at = static_cast<int64_t>(r) * s.h;
    if (normed_delta)
      add_norm_row(hidden + at, normed_delta + at, weight, s.h, m.eps, out + at);
    else
      add_norm_row(hidden + at, delta ? delta + at : nullptr, weight, s.h, m.eps, out + at);
  };
  for (int l = 0; l < m.num_layers; ++l)  // experts run on the packed kernel only; o's bias is not added here
    if (m.layers[l].moe || m.layers[l].o_bias) return -1;
  const kvflow::Activation act{m.activation, m.swiglu_alpha, m.swiglu_limit};
  for (int l = 0; l < m.num_layers; ++l) {
    const KvflowDecoderLayer& layer = m.layers[l];
    each_row(rows, threads, [&](int r) { add_pending_norm(r, layer.input_norm, dense.normed); });
    if (dense.matmul(dense.context, l, 0, rows)) return -3;
    each_row(rows, threads, [&](int r) {
      const int64_t at = static_cast<int64_t>(r) * s.qkv_size;
      finish_qkv(m, layer, s, dense.qkv + at, b.qkv.data() + at, positions[r]);
    });
    const float* q = b.qkv.data();
    const KvflowRows qkv{q, s.qkv_size, q + s.q_size, s.qkv_size, q + s.q_size + s.kv_size, s.qkv_size};
    const bool tiles = dense.prompt_attention_bf16 != 0;
    // Stores every row's K/V; attends the one-token rows (all rows without the tile kernel).
    const KvflowStep& step = steps[layer.kv_group];
    if (kvflow_paged_attention(&layer.attention, &step, &qkv, b.attn.data(), s.q_size, tiles ? 0 : 1, threads))
      return -1;
    if (tiles) {
      if (kvflow_prefill_attention_bf16(&layer.attention, &step, q, s.qkv_size, dense.attn, s.q_size, threads)) return -1;
      for (int r : b.one_token_rows)
        for (int j = 0; j < s.q_size; ++j)
          dense.attn[static_cast<int64_t>(r) * s.q_size + j] = kvflow::float_to_bf16(b.attn[static_cast<int64_t>(r) * s.q_size + j]);
    } else {
      each_row(rows, threads, [&](int r) {
        const int64_t at = static_cast<int64_t>(r) * s.q_size;
        for (int j = 0; j < s.q_size; ++j) dense.attn[at + j] = kvflow::float_to_bf16(b.attn[at + j]);
      });
    }
    if (dense.matmul(dense.context, l, 1, rows)) return -3;
    each_row(rows, threads, [&](int r) {
      const int64_t at = static_cast<int64_t>(r) * s.h;
      if (layer.attn_out_norm) {
        norm_output_row(dense.proj + at, layer.attn_out_norm, s.h, m.eps, b.proj.data() + at);
        add_norm_row(hidden + at, b.proj.data() + at, layer.post_norm, s.h, m.eps, dense.normed + at);
      } else {
        add_norm_row(hidden + at, dense.proj + at, layer.post_norm, s.h, m.eps, dense.normed + at);
      }
    });
    if (dense.matmul(dense.context, l, 2, rows)) return -3;
    each_row(rows, threads, [&](int r) {
      const uint16_t* gu = dense.gate_up + static_cast<int64_t>(r) * 2 * s.inter;
      kvflow::gated_activation(act, gu, gu + s.inter, dense.act + static_cast<int64_t>(r) * s.inter, s.inter);
    });
    if (dense.matmul(dense.context, l, 3, rows)) return -3;
    delta = dense.proj;
    normed_delta = nullptr;
    if (layer.mlp_out_norm) {
      each_row(rows, threads, [&](int r) {
        const int64_t at = static_cast<int64_t>(r) * s.h;
        norm_output_row(dense.proj + at, layer.mlp_out_norm, s.h, m.eps, b.proj.data() + at);
      });
      normed_delta = b.proj.data();
    }
  }
  each_row(rows, threads, [&](int r) { add_pending_norm(r, m.final_norm, hidden); });
  return 0;
}

}  // namespace

extern "C" int32_t kvflow_decoder_forward(const KvflowDecoder* model, const KvflowStep* step, const int64_t* ids,
                                          const int64_t* positions, int32_t rows, const KvflowDense* dense,
                                          int32_t input_bits, int32_t prompt_tiles, const int64_t* logit_rows, int32_t num_logits,
                                          float* logits, float* hidden, int32_t num_threads) {
  const KvflowDecoder& m = *model;
  for (int r = 0; r < rows; ++r) {  // refuse before anything is written
    if (positions[r] < 0 || positions[r] >= m.max_positions) return -2;
    if (ids[r] < 0 || ids[r] >= m.vocab_size) return -4;
  }
  if (m.embedding.data) {
    kvflow_packed_rows(&m.embedding, ids, rows, hidden);
  } else {
    for (int r = 0; r < rows; ++r)
      std::memcpy(hidden + static_cast<int64_t>(r) * m.hidden, m.embedding_f32 + ids[r] * m.hidden, sizeof(float) * m.hidden);
  }
  if (m.embed_scale != 0.f)
    for (int64_t i = 0; i < static_cast<int64_t>(rows) * m.hidden; ++i) hidden[i] *= m.embed_scale;
  const int rc = dense ? dense_layers(m, step, positions, rows, hidden, *dense, num_threads)
                       : packed_layers(m, step, positions, rows, hidden, input_bits, prompt_tiles != 0, num_threads);
  if (rc || num_logits == 0 || !m.head.data) return rc;
  thread_local std::vector<float> picked;  // the sampled rows, side by side
  picked.resize(static_cast<size_t>(num_logits) * m.hidden);
  for (int i = 0; i < num_logits; ++i)
    std::memcpy(picked.data() + static_cast<int64_t>(i) * m.hidden, hidden + logit_rows[i] * m.hidden,
                sizeof(float) * m.hidden);
  if (kvflow_packed_matmul(&m.head, picked.data(), m.hidden, num_logits, logits, m.head.n, input_bits, num_threads))
    return -1;
  if (m.head_abs_sum)
    kvflow_packed_refine_top(&m.head, picked.data(), m.hidden, num_logits, logits, m.head.n, m.head_abs_sum, input_bits);
  return 0;
}
