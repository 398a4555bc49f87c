// The C interface of kvflow's CPU kernels: every struct and entry point the Python side calls.
//
// This file is the one declaration of that interface. kvflow/kernels/abi.py reads it to build the ctypes
// structs and function signatures, so Python never restates a field or an argument list; the compiler
// checks each definition in csrc/*.cpp against it. Keep to the subset abi.py reads: `struct Name { ... };`
// with scalar, pointer or struct fields (several names a line are fine), `typedef R (*Name)(args);` for
// callbacks, and one prototype per entry point, inside the extern "C" block.
#pragma once

#include <cstdint>

extern "C" {

// A [n, k] weight in 4, 6 or 8 bits with an affine code per block of `block` inputs (32, or 16 for the
// K-quants whose scales cover 16): w = scale * q + offset, q unsigned (0..15, 0..63 or 0..255). Output
// columns come in groups of 16; the bytes of (group g, block b) sit at data + (g * (k / block) + b) *
// chunk_bytes, so one group's weights are one contiguous stream. Its codes are rows of 64 bytes, byte
// 4 j + t of a row belonging to column j:
//   4 bits: block / 8 rows; row r holds input 8 r + t in the low nibble and input 8 r + 4 + t in the high one.
//   6 bits: the code's low 4 bits as the 4-bit rows, then block / 16 rows of its top 2 bits: bits 2 i, 2 i + 1
//           of row p hold input 16 p + 4 i + t (Q6_K, Q5_K and Q5_1 kept at 7 bits a weight, not 9).
//   8 bits: block / 4 rows; row r holds input 4 r + t.
// then 16 float16 scales, then (when has_offset) 16 float16 offsets. A row (or its masked nibbles) is
// the unsigned operand of one AVX512-VNNI dot product: 16 columns x 4 inputs.
// With super_scales (the K-quants with mins, Q4_K and Q5_K: blocks of 32, k a multiple of 256) the codes
// are followed by 16 unsigned bytes sc and 16 bytes m instead, and super_scales holds per column group and
// 256 inputs 16 float16 d then 16 float16 dmin (64 bytes, at (g * (k / 256) + b / 8) * 64): scale =
// d * sc and offset = -(dmin * m), both exact in float32, as the file has them (4.625 bits a 4-bit weight,
// not 5).
// With a codebook (4 bits only; the types whose 16 values are a table, not a line: IQ4_NL and IQ4_XS 1,
// MXFP4 2) each nibble is an index, and the code q the sums use is that codebook's entry (an 8-bit code
// centred on 128, kvflow_packed_codebook): 4.5 bits a weight read, not 8.5.
struct KvflowPackedWeight {
  const uint8_t* data;
  int64_t n;  // output features (a multiple of 16 is stored; columns past n are zero)
  int64_t k;  // input features, a multiple of block
  int32_t bits;
  int32_t has_offset;
  int32_t block;  // inputs per scale: 32 or 16; the inputs are quantized per block of the same size
  int32_t centre;  // without stored offsets: offset = -centre * scale (symmetric codes, Q8_0's 128,
                   // Q4_0's 8, Q6_K's 32...), or no offset where centre is 0
  const uint8_t* super_scales;  // null: float16 scales (and offsets) in each block's bytes
  int32_t codebook;             // 0: a nibble is the code; 1 or 2: an index into that codebook
};

// The 16 8-bit codes of codebook `book` (1: IQ4_NL's values + 128, 2: MXFP4's doubled E2M1 values + 128)
// into out; returns 0, or -1 for a codebook it does not know.
int32_t kvflow_packed_codebook(int32_t book, uint8_t* out);

// Row-count crossovers inside the kernels, set by the executor from its table (kvflow/executors/
// thresholds.py) before the first call; until then no AMX tiles, and the thread team for every row count.
// Zero fields keep the current value.
struct KvflowTuning {
  int32_t packed_amx_min_rows;       // AMX int8 tiles from this many rows (below: VNNI)
  int32_t packed_amx_min_rows_wide;  // the same for wide, shallow matrices (n >= 16 k: an output head)
  int32_t parallel_min_rows;         // the native decoder's per-row passes on the thread team from here
};
void kvflow_set_tuning(const KvflowTuning* tuning);

// Which implementation of the packed matmul this library runs: 1 plain C++, 2 AVX2, 3 NEON dotprod,
// 4 AVX512-VNNI, 5 AVX512-VNNI with AMX int8 tiles (the process was granted the tile state).
int32_t kvflow_packed_matmul_path(void);

// y[m, n] = x[m, k] @ w^T, rows independent: a row's result is bitwise the same whatever m and the thread
// count. x is quantized per block of 32 to input_bits-bit integers, 16 (two digits; an error of 2^-16 of
// the block's largest input) or 8 (one digit, half the integer work; 2^-8); sums are exact integers per
// block, then float32. Returns -1 for a weight or input_bits it does not take.
int32_t kvflow_packed_matmul(const KvflowPackedWeight* w, const float* x, int64_t x_stride, int32_t m, float* y,
                             int64_t y_stride, int32_t input_bits, int32_t num_threads);

// Several weights (an array of structs, all of the same k and block), each times its own rows, in one thread
// team: weight i multiplies rows[i] consecutive rows of x (x_stride apart), those after weight i - 1's, into
// the same rows of y (y_stride apart, at least each n); rows null: one row each, and x_stride 0: that one
// row of x for every weight. Each row is bitwise what kvflow_packed_matmul gives it (the experts a MoE
// layer's tokens chose). Returns 0, or -1 for weights or shapes it does not take.
int32_t kvflow_packed_matmul_many(const KvflowPackedWeight* w, int32_t count, const int32_t* rows, const float* x,
                                  int64_t x_stride, float* y, int64_t y_stride, int32_t input_bits,
                                  int32_t num_threads);

// For each row of y = x @ w^T from kvflow_packed_matmul with these input_bits: every output within two
// error bounds of the row's largest is recomputed exactly (double sums over the stored codes), so the row's
// argmax is the exact product's. The bound (PackedLinear.error_bound) needs block_abs_sum[b], the largest
// sum of |w| over block b of an output row. Returns how many outputs were recomputed.
int32_t kvflow_packed_refine_top(const KvflowPackedWeight* w, const float* x, int64_t x_stride, int32_t m, float* y,
                                 int64_t y_stride, const float* block_abs_sum, int32_t input_bits);

// Rows ids[0..count) of w (output features), dequantized exactly as float32 into out [count, k].
// y (bfloat16 [m, n], y_stride elements a row) = x (bfloat16 [m, k]) times w's transpose on AMX bfloat16
// tiles, the weights dequantized on the fly (w = code * scale + offset rounded to bfloat16, as a dense
// bfloat16 copy holds them), sums in float32. For prompt-sized steps where no copy is held. Returns 0; -1
// where this library has no AMX bfloat16 (every tier but amx) or for a weight of 16-input blocks.
int32_t kvflow_packed_matmul_bf16(const KvflowPackedWeight* w, const uint16_t* x, int64_t x_stride, int32_t m,
                                  uint16_t* y, int64_t y_stride, int32_t num_threads);

void kvflow_packed_rows(const KvflowPackedWeight* w, const int64_t* ids, int32_t count, float* out);

// out[b] (k / block floats) = the largest sum of |w| over block b of an output row, each weight as
// kvflow_packed_rows gives it (the statistic kvflow_packed_refine_top's bound needs), in one pass.
void kvflow_packed_block_abs_sum(const KvflowPackedWeight* w, float* out, int32_t num_threads);

// One GGUF tensor as rows of a packed weight: `rows` rows of row_bytes block bytes of ggml type `type`
// (Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q2_K 10, Q3_K 11, Q4_K 12, Q5_K 13, Q6_K 14, IQ4_NL 20,
// IQ4_XS 23, MXFP4 39); output row i is source row row_order[i] (null: row i).
struct KvflowGgufPart {
  const uint8_t* data;
  int64_t rows, row_bytes;
  const int64_t* row_order;
  int32_t type;
};

// The parts, fused along the output dim, into the packed layout above (bits 4, 6 or 8, blocks of `block`
// inputs, with offsets; or, with centre, every part of a symmetric type of that centre, none stored): out
// holds ceil(n / 16) * (k / block) chunks. The codes and float32 scales are
// kernels/../layers/quant/packing.py's, the scales rounded to float16. Returns 0; -1 for parts it does
// not take (a type without a packed form, codes wider than `bits`, sizes that disagree); -2 where a
// scale or offset is not finite in float16 (out then unusable).
// With super_out (parts all Q4_K or Q5_K, blocks of 32) the K-quants' own scales are kept (the
// super_scales layout above: sc and m bytes in each block, d and dmin into super_out, (n + 15) / 16 *
// (k / 256) * 64 bytes), exactly. With codebook (bits 4, every part of a type of that codebook) the
// nibbles are the file's indices.
int32_t kvflow_pack_gguf(const KvflowGgufPart* parts, int32_t count, int64_t k, int32_t bits, int32_t block,
                         int32_t centre, int32_t codebook, uint8_t* out, uint8_t* super_out, int32_t num_threads);

// A step's place in the paged KV cache, the same for every layer. Sequence b owns query rows
// query_start[b] .. query_start[b + 1]; they are its last rows of seq_lens[b] positions, whose blocks are
// block_tables[b * table_stride ..]. Row t's new K/V go to cache slot slots[t].
struct KvflowStep {
  const int64_t* slots;
  const int32_t* query_start;
  const int32_t* seq_lens;
  const int32_t* block_tables;
  int64_t table_stride;
  int32_t num_seqs;
  int32_t num_tokens;
};

// One layer's paged cache and its heads. A head's row is head_dim values in cache_dtype (0 float32, 1
// bfloat16, 2 float16; 3 int8, followed by its float32 scale: head_dim + 4 bytes). A block holds
// block_size positions: [block_size, num_kv_heads, row] (token-major), or with head_major
// [num_kv_heads, block_size, row], where each KV head's rows of a block are one contiguous run (the
// hardware prefetcher follows it; decode at depth reads K/V 1.3 to 1.45x faster than token-major).
// window > 0: a row sees its last `window` positions only (itself included: sliding-window layers);
// softcap > 0: scores are capped as softcap * tanh(score / softcap) (Gemma 2). sinks: one logit per
// query head that joins each row's softmax denominator and adds no value (gpt-oss), or null.
struct KvflowAttention {
  void* k_cache;
  void* v_cache;
  int32_t cache_dtype, block_size;
  int32_t num_heads, num_kv_heads, head_dim;
  float scale;
  int32_t window;
  float softcap;
  int32_t head_major;
  const float* sinks;
};

// A step's query, key and value rows (float32, heads side by side; rows may be strided).
struct KvflowRows {
  const float* q;
  int64_t q_stride;
  const float* k;
  int64_t k_stride;
  const float* v;
  int64_t v_stride;
};

// Stores every row's K/V in its slot, then attends: the rows of one-token queries, or with all_rows every
// query row (row r of a sequence whose step brings n rows sits at position seq_len - n + r and sees the
// context up to itself). out: float32 rows of num_heads * head_dim. A row's result depends on its own
// inputs only. Returns 0, or -1 for head counts that do not group.
int32_t kvflow_paged_attention(const KvflowAttention* layer, const KvflowStep* step, const KvflowRows* rows,
                               float* out, int64_t out_stride, int32_t all_rows, int32_t num_threads);

// Causal attention of every prompt chunk of two or more rows over its cached context (the chunk's own K/V
// already stored), bfloat16 products on AMX tiles and a float32 softmax; out: bfloat16 rows. One-token
// rows are left alone. Returns -1 where this build or CPU has no AMX, or for head sizes or sinks it does not
// take.
int32_t kvflow_prefill_attention_bf16(const KvflowAttention* layer, const KvflowStep* step, const float* q,
                                      int64_t q_stride, uint16_t* out, int64_t out_stride, int32_t num_threads);

// ---- the native decoder: one call runs a whole step of a Llama-family model -------------------------

// One layer, as its model file describes it (kvflow/models/llama.py): norm, q/k/v (optional bias and
// per-head norms), rotary, attention (optional sinks), o (optional bias), norm, gate/up, activation, down.
// The projections are packed.
// A mixture-of-experts MLP (Qwen3-MoE, Mixtral), as kvflow/models/moe.py runs it: the router's logits,
// softmax and top_k in double, the chosen weights renormalized (normalize) and rounded to float32; each
// chosen expert is a gated MLP (gate/up fused, SiLU, down), and a row's output is the sum over its experts
// in ascending expert order, from zero, of the expert's output times its weight.
// gpt-oss adds biases: the router's (to its logits, before the softmax) and each expert's gate/up and down.
struct KvflowMoE {
  int32_t num_experts, top_k, normalize, intermediate;
  const float* router;               // [num_experts, hidden] float32, or null: router_packed
  KvflowPackedWeight router_packed;  // a quantized file's router
  const KvflowPackedWeight* gate_up;  // [num_experts]
  const KvflowPackedWeight* down;     // [num_experts]
  const float* router_bias;   // [num_experts], or null
  const float* gate_up_bias;  // [num_experts, 2 * intermediate], or null
  const float* down_bias;     // [num_experts, hidden], or null
};

struct KvflowDecoderLayer {
  KvflowPackedWeight qkv, o, gate_up, down;  // q/k/v and gate/up fused along the output dim
  // Where a fused projection's parts come in two types (a Q4_K_M file's Q4_K q/k beside its Q6_K v), the
  // columns after qkv's (gate_up's) n, packed in their own type; else data null.
  KvflowPackedWeight qkv_rest, gate_up_rest;
  const KvflowMoE* moe;  // or null: the dense gate_up and down
  const float* input_norm;
  const float* post_norm;      // the norm before the MLP
  const float* attn_out_norm;  // Gemma: the attention's output normed before the residual add, or null
  const float* mlp_out_norm;   // Gemma: the MLP's output, likewise, or null
  const float* qkv_bias;  // or null
  const float* o_bias;    // or null (gpt-oss)
  const float* q_norm;    // per-head norms (Qwen3, Gemma 3), or null
  const float* k_norm;
  const float* cos;  // this layer's rotary table [max_positions, head_dim] (Gemma 3's sliding layers have
  const float* sin;  // their own), or null: the model's
  int32_t kv_group;  // the step (of kvflow_decoder_forward's, one per KV group) whose slots and tables it uses
  KvflowAttention attention;
};

// A many-row step's matmuls on dense bfloat16 copies of the weights, through the caller (oneDNN, where
// bfloat16 is native): matmul(context, layer, projection, rows) sets output[projection] = input[projection]
// @ W^T for projection 0 q/k/v, 1 o, 2 gate/up, 3 down, and returns 0. The six buffers hold `rows` rows.
typedef int32_t (*KvflowDenseMatmul)(void* context, int32_t layer, int32_t projection, int32_t rows);
struct KvflowDense {
  KvflowDenseMatmul matmul;
  void* context;
  uint16_t* normed;   // [rows, hidden]: input of q/k/v and gate/up
  uint16_t* attn;     // [rows, num_heads * head_dim]: input of o
  uint16_t* act;      // [rows, intermediate]: input of down
  uint16_t* qkv;      // outputs
  uint16_t* gate_up;
  uint16_t* proj;     // [rows, hidden]: o and down
  int32_t prompt_attention_bf16;  // prompt chunks' attention on AMX tiles (kvflow_prefill_attention_bf16)
};

struct KvflowDecoder {
  int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
  int64_t vocab_size;
  float eps;
  const float* cos;  // [max_positions, head_dim]
  const float* sin;
  int64_t max_positions;
  const float* final_norm;
  KvflowPackedWeight embedding;  // token rows, packed; or data null and embedding_f32 set
  const float* embedding_f32;    // [vocab, hidden]
  KvflowPackedWeight head;       // the output projection, packed; or data null (the caller projects)
  const float* head_abs_sum;     // the head's block_abs_sum (kvflow_packed_refine_top), or null
  const KvflowDecoderLayer* layers;
  int32_t activation;  // the gated MLP's (experts' too): 0 SiLU, 1 GELU with the tanh approximation (Gemma),
                       // 2 gpt-oss's clamped SwiGLU (swiglu_alpha, swiglu_limit)
  float embed_scale;   // token embeddings times this (Gemma: sqrt(hidden)), or 0: as they are
  float swiglu_alpha, swiglu_limit;
};

// One step: token ids -> final-norm hidden states [rows, hidden] (hidden) and, when the head is packed,
// the logits of rows logit_rows[0 .. num_logits) into logits [num_logits, vocab] (before any soft-cap: the
// caller applies Gemma 2's), their best entries recomputed exactly. step: one KvflowStep per KV group (the
// same queries, each group's own slots and block tables; layer.kv_group picks). dense: null, or the
// many-row matmuls' buffers. input_bits: 16 or 8, how finely the packed matmuls (the head's included)
// quantize their inputs (kvflow_packed_matmul). prompt_tiles: on the packed path too, prompt chunks of
// two or more rows attend on AMX tiles (kvflow_prefill_attention_bf16), not row by row. Returns 0; -1 for a weight or shape a kernel refused; -2
// for a position past the rotary table and -4 for a token id outside the vocabulary (both before anything
// is written); -3 when dense->matmul failed.
int32_t kvflow_decoder_forward(const KvflowDecoder* model, const KvflowStep* step, const int64_t* ids,
                               const int64_t* positions, int32_t rows, const KvflowDense* dense,
                               int32_t input_bits, int32_t prompt_tiles, const int64_t* logit_rows, int32_t num_logits, float* logits,
                               float* hidden, int32_t num_threads);
}
