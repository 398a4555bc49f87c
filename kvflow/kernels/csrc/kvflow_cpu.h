// What kvflow's CPU kernel sources share: the packed weight format, and the entry points one source
// calls in another. Everything here is also declared, field for field, in the Python files that load
// the library through ctypes (kvflow/kernels/*.py).
#pragma once

#include <cstdint>

extern "C" {

// A [n, k] weight in 4 or 8 bits with an affine code per group of 32 inputs: w = scale * q + offset,
// q unsigned (0..15 or 0..255). Output columns come in groups of 16 and inputs in blocks of 32; the
// bytes of (group g, block b) sit at data + (g * (k / 32) + b) * chunk_bytes, so one group's weights
// are one contiguous stream. Its codes are rows of 64 bytes, byte 4 j + t of a row belonging to column j:
//   4 bits: 4 rows; row r holds input 8 r + t in the low nibble and input 8 r + 4 + t in the high one.
//   8 bits: 8 rows; row r holds input 4 r + t.
// then 16 float16 scales, then (when has_offset) 16 float16 offsets. A row (or its masked nibbles) is
// the unsigned operand of one AVX512-VNNI dot product: 16 columns x 4 inputs.
struct KvflowPackedWeight {
  const uint8_t* data;
  int64_t n;  // output features (a multiple of 16 is stored; columns past n are zero)
  int64_t k;  // input features, a multiple of 32
  int32_t bits;
  int32_t has_offset;
};

// y[m, n] = x[m, k] @ w^T, rows independent: a row's result is bitwise the same whatever m and the thread
// count. x is quantized per block of 32 to 16-bit integers (see packed_matmul.cpp); sums are exact integers
// per block, then float32. Returns -1 when this build cannot run it.
int kvflow_packed_matmul(const KvflowPackedWeight* w, const float* x, int64_t x_stride, int m, float* y,
                         int64_t y_stride, int num_threads);

// A Llama-family decoder whose projections are all packed (kvflow/kernels/decoder_step.py builds it).
struct KvflowDecoderLayer {
  KvflowPackedWeight qkv, o, gate_up, down;  // q/k/v and gate/up fused along the output dim
  const float* input_norm;
  const float* post_norm;
  const float* qkv_bias;  // or null
  const float* q_norm;    // per-head norms (Qwen3), or null
  const float* k_norm;
  void* k_cache;  // [slots, num_kv_heads, head_dim] in cache_dtype
  void* v_cache;
};

struct KvflowDecoder {
  int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
  float eps, attn_scale;
  const float* cos;  // [max_positions, head_dim]
  const float* sin;
  int64_t max_positions;
  const float* final_norm;
  int32_t cache_dtype, block_size;  // cache_dtype as kvflow_paged_attention takes it
  const KvflowDecoderLayer* layers;
};

// The step's attention metadata (see kvflow_paged_attention).
struct KvflowStep {
  const int64_t* slots;
  const int32_t* query_start;
  const int32_t* seq_lens;
  const int32_t* block_tables;
  int64_t table_stride;
  int32_t num_seqs;
};

// hidden [rows, hidden] holds the rows' embeddings and receives the final norm's output. Each row attends
// to its own sequence up to its position; the step's K/V are stored in the caches. Returns 0, -1 for a
// weight or shape the kernels refuse, -2 for a position past the rotary table.
int kvflow_decoder_step(const KvflowDecoder* m, float* hidden, const int64_t* positions, int rows,
                        const KvflowStep* step, int num_threads);

// For each row of y = x @ w^T from kvflow_packed_matmul: every output within two error bounds of the row's
// largest is recomputed exactly (double sums over the stored codes), so the row's argmax is the exact
// product's. The bound (PackedLinear.error_bound) needs block_abs_sum[b], the largest sum of |w| over
// block b of an output row. Returns how many outputs were recomputed.
int kvflow_packed_refine_top(const KvflowPackedWeight* w, const float* x, int64_t x_stride, int m, float* y,
                             int64_t y_stride, const float* block_abs_sum);

// Rows ids[0..count) of w (output features), dequantized exactly as float32 into out [count, k].
void kvflow_packed_rows(const KvflowPackedWeight* w, const int64_t* ids, int count, float* out);

int kvflow_paged_attention(const float* q, int64_t q_stride, const float* k_new, int64_t k_stride,
                           const float* v_new, int64_t v_stride, void* k_cache, void* v_cache, int cache_dtype,
                           const int64_t* slots, int num_tokens, const int32_t* query_start,
                           const int32_t* seq_lens, const int32_t* tables, int64_t table_stride, int num_seqs,
                           float* out, int64_t out_stride, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, float scale, int all_rows, int num_threads);
}
