// Causal attention of prompt chunks on AMX tiles: bfloat16 products with float32 sums, float32 softmax.
// The native decoder's attention for prompt chunks on AMX CPUs (csrc/decoder_forward.cpp).
//
// A chunk's attention is two matmul-shaped products per head, Q K^T and P V. A tile op multiplies 16 x 32
// by 32 x 16 bfloat16 values at once, where float32 FMAs take hundreds of instructions. A work item is a
// block of query rows of one sequence for all the query heads of one KV head (about 64 rows), taken
// flash-style over blocks of 128 keys: scores 16 keys per tile, a running max and sum per row with the
// probabilities 2^(x - max) in AVX-512 rounded to bfloat16, then P V in four tiles (64 output dims) and
// the output rescaled when a row's max rose. Each block's K/V tiles are read once for all the item's
// rows and stay in cache while they are used: at a depth of 16K an item that read all keys for every 16
// rows of every head moved 18 GB per layer through the caches. For long chunks K and V are repacked
// (prompt_kv_tiles.h) once per call, shared by all query heads of a KV head and all their row blocks.
// Short chunks deep in a context (an agent's next turn, a speculative check) instead split the keys
// among items that each pack their own blocks: see kShortRows.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cache_layout.h"
#include "kvflow_cpu.h"
#include "simd.h"
#include "threads.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__)
#define KVFLOW_HAVE_AMX_BF16 1
#include <immintrin.h>

#include "amx_tiles.h"
#include "prompt_kv_tiles.h"
#endif

namespace {

#ifdef KVFLOW_HAVE_AMX_BF16
using namespace kvflow::prompt_tiles;

constexpr int kRows = 16;  // query rows per work item: one tile's rows
constexpr int kKeys = 64;  // keys per score step (four tiles); keys are padded to a multiple
constexpr int kItemRows = 64;  // query rows (all heads of a KV head) that share each K/V tile read

void configure_tiles() {  // eight tiles of 16 rows x 64 bytes; the configuration is per thread
  kvflow::TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  kvflow::load_tile_config(c);
}


// 2^t, to 7.5e-5 relative: far inside the bfloat16 rounding (2e-3) the probabilities get before P V, at a
// third of the work of a float32-exact exp. A degree-3 polynomial on the fraction (fitted for least
// relative error on [-0.5, 0.5]), scalef for the power, which gives 0 far below the float range.
inline __m512 exp2_coarse(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);  // in [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(0.055171604f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24261112f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693261f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99992807f));
  return _mm512_scalef_ps(p, n);
}

// Lanes of the 16 keys from `first` on that a row seeing keys [0, last] keeps.
inline __mmask16 visible_lanes(int first, int last) {
  const int left = last - first + 1;
  return left >= 16 ? 0xffff : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
}

// Pass 1 for keys [64 kb, 64 kb + 64): raw scores of the 16 rows into s (row stride s_stride floats).
void score_block(const uint16_t* q_rows, int d, const uint32_t* k_tiles, int kb, float* s, int s_stride) {
  const int chunks = d / 32;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int c = 0; c < chunks; ++c) {
    _tile_loadd(4, q_rows + c * 32, d * 2);
    const uint32_t* t = k_tiles + (static_cast<int64_t>(kb) * 4 * chunks + c) * 256;
    _tile_loadd(5, t, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, t + chunks * 256, 64);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, t + 2 * chunks * 256, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, t + 3 * chunks * 256, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  float* at = s + kb * kKeys;
  _tile_stored(0, at, s_stride * 4);
  _tile_stored(1, at + 16, s_stride * 4);
  _tile_stored(2, at + 32, s_stride * 4);
  _tile_stored(3, at + 48, s_stride * 4);
}

// Dims [16 g0, 16 g0 + 64) of P V over the first `keys` keys (a multiple of 64) into pv (row stride d).
void value_group(const uint16_t* p, int p_stride, int keys, int d, const uint32_t* v_tiles, int g0, float* pv) {
  const int groups = d / 16;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int b = 0; b < keys / 32; ++b) {
    _tile_loadd(4, p + b * 32, p_stride * 2);
    const uint32_t* t = v_tiles + (static_cast<int64_t>(b) * groups + g0) * 256;
    _tile_loadd(5, t, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, t + 256, 64);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, t + 512, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, t + 768, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, pv + g0 * 16, d * 4);
  _tile_stored(1, pv + g0 * 16 + 16, d * 4);
  _tile_stored(2, pv + g0 * 16 + 32, d * 4);
  _tile_stored(3, pv + g0 * 16 + 48, d * 4);
}

// Keys in blocks of kBlock with a running max and sum per row, the output rescaled when the max rises.
// The per-block rescale is a few vector ops per row against kBlock keys of tile products. Blocks of 128
// keys keep a block's K and V tiles (16 KB each at head size 64) in L1 beside the scores for all the
// item's rows; at 256 they spilled to L2, and the tiles reread them for every row tile (2,048 rows at a
// depth of 14,336: 1.17x, a cold 16K prefill 1.07x, on an AMX Xeon).
constexpr int kBlock = 128;

struct Scratch {  // per thread, grown as needed
  std::vector<uint16_t> q_rows, p;
  std::vector<float> s, pv, out, max, sum;
  std::vector<int> head, row;         // each item row's query head and chunk row (-1: a padding row)
  std::vector<uint32_t> k_block, v_block;  // one block's K/V tiles, where the item packs its own

  void start(int n, int d) {  // an item of n rows: room for its tiles, its sums from zero
    q_rows.resize(static_cast<size_t>(n) * d);
    s.resize(static_cast<size_t>(kRows) * kBlock);
    p.resize(static_cast<size_t>(kRows) * kBlock);
    pv.resize(static_cast<size_t>(kRows) * d);
    out.assign(static_cast<size_t>(n) * d, 0.f);
    max.assign(n, -INFINITY);
    sum.assign(n, 0.f);
  }
};

// One query row's output as bfloat16: its sum of p V over its sum of p.
inline void write_row(const float* acc, float sum, int d, uint16_t* o) {
  const __m512 inv = _mm512_set1_ps(1.f / sum);
  for (int j = 0; j < d; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j), to_bf16(_mm512_mul_ps(_mm512_loadu_ps(acc + j), inv)));
}

// One row's scores of a block (sr, its first tile_keys keys from k0 on; it sees keys up to `last`): its
// running max and sum brought up to date, 2^(x - max) into pr in bfloat16 (0 where masked), and the factor
// that rescales what the row had summed before (0 for its first keys).
inline float row_probabilities(const float* sr, uint16_t* pr, int k0, int tile_keys, int last, float scale2,
                               float& max, float& sum) {
  const int seen = std::max(0, std::min(tile_keys, last - k0 + 1));  // keys of the block this row sees
  const int whole = seen / 16 * 16;
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int j = 0; j < whole; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + j));
  if (whole < seen) mx = _mm512_mask_max_ps(mx, visible_lanes(k0 + whole, last), mx, _mm512_loadu_ps(sr + whole));
  const float block_max = _mm512_reduce_max_ps(mx), old = max;
  const float m = block_max > old ? block_max : old;
  const float alpha = old == -INFINITY ? 0.f : (m == old ? 1.f : std::exp2((old - m) * scale2));
  max = m;
  const __m512 s2 = _mm512_set1_ps(scale2), shift = _mm512_set1_ps(m * scale2);
  __m512 total = _mm512_setzero_ps();
  for (int j = 0; j < whole; j += 16) {  // (x - max) * scale2 as one fused op
    const __m512 e = exp2_coarse(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j), s2, shift));
    total = _mm512_add_ps(total, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), to_bf16(e));
  }
  for (int j = whole; j < tile_keys; j += 16) {  // the row's last partial vector, then zeros
    const __mmask16 keep = j < seen ? visible_lanes(k0 + j, last) : 0;
    const __m512 e = _mm512_maskz_mov_ps(keep, exp2_coarse(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j), s2, shift)));
    total = _mm512_add_ps(total, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), to_bf16(e));
  }
  sum = sum * alpha + _mm512_reduce_add_ps(total);
  return alpha;
}

// P V of a tile's block (its first `keys` keys), then out = out * alpha + P V per row.
inline void add_values(Scratch& w, int t, int keys, int d, const uint32_t* vt, const float* alpha) {
  for (int g0 = 0; g0 < d / 16; g0 += 4) value_group(w.p.data(), kBlock, keys, d, vt, g0, w.pv.data());
  for (int i = 0; i < kRows; ++i) {
    const __m512 a = _mm512_set1_ps(alpha[i]);
    float* o = w.out.data() + (static_cast<int64_t>(t) * kRows + i) * d;
    const float* pv = w.pv.data() + static_cast<int64_t>(i) * d;
    for (int j = 0; j < d; j += 16) _mm512_storeu_ps(o + j, _mm512_fmadd_ps(_mm512_loadu_ps(o + j), a, _mm512_loadu_ps(pv + j)));
  }
}

// The rows one long chunk's work item attends: R consecutive query rows of one sequence for every query
// head of one KV head (group * R rows, R a multiple of 16), so that each K/V tile read serves all of them,
// over K/V tiles packed ahead for the whole sequence; the rows' outputs written as bfloat16. Tile t holds
// rows [16 t, 16 t + 16) in head-major order: head t / (R / 16), rows r0 + 16 (t % (R / 16)) on.
struct ItemRows {
  int r0, rows;    // first chunk row and how many of the R are real (the rest are zero rows)
  int group, per;  // query heads per KV head; tiles per head (R / 16)
  int tiles() const { return group * per; }
  int last_row(int t) const { return r0 + (t % per) * kRows + kRows - 1; }  // chunk row of the tile's last row
};

void attend_item(const float* q, int64_t q_stride, int d, float scale, const Sequence& seq, int hk, const ItemRows& it,
                 const uint32_t* k_tiles, const uint32_t* v_tiles, uint16_t* out, int64_t out_stride, Scratch& w) {
  const int tiles = it.tiles(), n = tiles * kRows;
  const int offset = seq.lk - seq.lq;  // chunk row r sits at position offset + r and sees keys [0, offset + r]
  const int last_key = offset + it.r0 + it.rows - 1;  // the last key any real row sees
  w.start(n, d);
  for (int t = 0; t < tiles; ++t) {  // the rows as A tiles; rows past the chunk are zeros
    const int h = hk * it.group + t / it.per;
    for (int i = 0; i < kRows; ++i) {
      const int r = it.r0 + (t % it.per) * kRows + i;
      uint16_t* dst = w.q_rows.data() + (static_cast<int64_t>(t) * kRows + i) * d;
      if (r < it.r0 + it.rows) {
        const float* src = q + static_cast<int64_t>(seq.q_row + r) * q_stride + h * d;
        for (int j = 0; j < d; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), to_bf16(load16(src + j)));
      } else {
        std::memset(dst, 0, d * 2);
      }
    }
  }
  const float scale2 = scale * 1.44269504f;  // softmax in base 2: the same probabilities
  const int chunks = d / 32, groups = d / 16;
  for (int k0 = 0; k0 <= last_key; k0 += kBlock) {
    const uint32_t* kt = k_tiles + static_cast<int64_t>(k0 / 16) * chunks * 256;
    const uint32_t* vt = v_tiles + static_cast<int64_t>(k0 / 32) * groups * 256;
    // One tile of rows at a time, its scores and probabilities in L1, the block's K/V tiles in L1/L2 for all.
    for (int t = 0; t < tiles; ++t) {
      const int tile_last = std::min(offset + it.last_row(t), last_key);
      if (tile_last < k0) continue;  // sees none of this block (nor any after it)
      const int tile_keys = std::min(kBlock, (tile_last - k0) / kKeys * kKeys + kKeys);  // padded to kKeys
      const uint16_t* qa = w.q_rows.data() + static_cast<int64_t>(t) * kRows * d;
      for (int kb = 0; kb < tile_keys / kKeys; ++kb) score_block(qa, d, kt, kb, w.s.data(), kBlock);
      float alpha[kRows];
      for (int i = 0; i < kRows; ++i) {
        const int row = t * kRows + i, last = offset + it.r0 + (t % it.per) * kRows + i;  // last key it sees
        alpha[i] = row_probabilities(w.s.data() + static_cast<int64_t>(i) * kBlock, w.p.data() + static_cast<int64_t>(i) * kBlock,
                                     k0, tile_keys, last, scale2, w.max[row], w.sum[row]);
      }
      add_values(w, t, tile_keys, d, vt, alpha);
    }
  }
  for (int t = 0; t < tiles; ++t) {
    const int h = hk * it.group + t / it.per;
    for (int i = 0; i < kRows; ++i) {
      const int r = it.r0 + (t % it.per) * kRows + i, row = t * kRows + i;
      if (r >= it.r0 + it.rows) continue;
      write_row(w.out.data() + static_cast<int64_t>(row) * d, w.sum[row], d,
                out + static_cast<int64_t>(seq.q_row + r) * out_stride + h * d);
    }
  }
}

// The rows of a short chunk's work item: all rows of one KV head's query heads, packed together (n a
// multiple of 16: w.head and w.row say which query row each is, row -1 a padding row), over keys [k_begin,
// k_end) of the sequence (k_begin a multiple of kBlock), each block packed here from the cache while the
// rows wait (read once, no copy in memory) and the next one prefetched. Leaves in w.out the rows' unscaled
// sums of p V, and in w.max / w.sum their raw-score max and sum of 2^((x - max) scale2) (-inf / 0 for a
// row that sees none of the keys).
void attend_split(const float* q, int64_t q_stride, int d, float scale, const Cache& cache, const Sequence& seq, int hk,
                  int n, int k_begin, int k_end, Scratch& w) {
  const int tiles = n / kRows;
  const int offset = seq.lk - seq.lq;  // chunk row r sits at position offset + r and sees keys [0, offset + r]
  w.start(n, d);
  w.k_block.resize(static_cast<size_t>(kBlock) * d / 2);
  w.v_block.resize(static_cast<size_t>(kBlock) * d / 2);
  int last_key = -1;  // the last key any real row sees in [k_begin, k_end)
  for (int f = 0; f < n; ++f) {  // the rows as A tiles; padding rows are zeros
    uint16_t* dst = w.q_rows.data() + static_cast<int64_t>(f) * d;
    if (w.row[f] >= 0) {
      const float* src = q + static_cast<int64_t>(seq.q_row + w.row[f]) * q_stride + w.head[f] * d;
      for (int j = 0; j < d; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), to_bf16(load16(src + j)));
      last_key = std::max(last_key, std::min(offset + w.row[f], k_end - 1));
    } else {
      std::memset(dst, 0, d * 2);
    }
  }
  const float scale2 = scale * 1.44269504f;  // softmax in base 2: the same probabilities
  for (int k0 = k_begin; k0 <= last_key; k0 += kBlock) {
    pack_block_any(cache, seq, hk, k0, std::min(kBlock, (last_key - k0) / kKeys * kKeys + kKeys), w.k_block.data(),
                   w.v_block.data());
    // While the rows multiply this block, the next one's cache rows come into L2 (a slice per row tile):
    // blocks lie anywhere in memory, out of the hardware prefetcher's sight.
    const int next = k0 + kBlock, next_end = std::min(last_key + 1, next + kBlock);
    const int per_tile = (kBlock + tiles - 1) / tiles;
    for (int t = 0; t < tiles; ++t) {
      for (int key = next + t * per_tile; key < std::min(next_end, next + (t + 1) * per_tile); ++key)
        prefetch_key(cache, seq, hk, key);
      int tile_last = -1;  // the last key of this block any of the tile's rows sees
      for (int i = 0; i < kRows; ++i) {
        const int r = w.row[t * kRows + i];
        if (r >= 0) tile_last = std::max(tile_last, std::min(offset + r, last_key));
      }
      if (tile_last < k0) continue;  // sees none of this block
      const int tile_keys = std::min(kBlock, (tile_last - k0) / kKeys * kKeys + kKeys);  // padded to kKeys
      const uint16_t* qa = w.q_rows.data() + static_cast<int64_t>(t) * kRows * d;
      for (int kb = 0; kb < tile_keys / kKeys; ++kb) score_block(qa, d, w.k_block.data(), kb, w.s.data(), kBlock);
      float alpha[kRows];
      for (int i = 0; i < kRows; ++i) {
        const int row = t * kRows + i;
        const int last = w.row[row] >= 0 ? std::min(offset + w.row[row], k_end - 1) : -1;  // last key it sees
        alpha[i] = row_probabilities(w.s.data() + static_cast<int64_t>(i) * kBlock, w.p.data() + static_cast<int64_t>(i) * kBlock,
                                     k0, tile_keys, last, scale2, w.max[row], w.sum[row]);
      }
      add_values(w, t, tile_keys, d, w.v_block.data(), alpha);
    }
  }
}


#endif

}  // namespace

// Short chunks (an agent's next turn, a speculative check) deep in a long context: all rows of a KV
// head's query heads fit one item (at most kShortRows of them, the heads' rows packed together so few are
// padding), and the keys are split among items instead, each packing its own blocks from the cache: the
// context is read from memory once, not once per block of rows, and the threads share the work however
// few the rows. A split covers at least kSplitKeys keys; the splits' partial sums are merged at the end.
constexpr int kShortRows = 512;
constexpr int kSplitKeys = 2048;
constexpr int kMaxSplits = 8;

// For every sequence whose chunk has two or more rows: causal attention of its query rows (q float32,
// heads of size d side by side, row stride q_stride) over its first seq_len positions in the paged cache
// (the chunk's own K/V already stored), into out (bfloat16 rows, head h at h * d). Rows of one-token
// queries are left alone. Returns 0, or -1 where this build or CPU has no AMX, for head sizes that are
// not a multiple of 64 (up to 128), or for a sliding-window, soft-capped or sink layer.
extern "C" int32_t kvflow_prefill_attention_bf16(const KvflowAttention* layer, const KvflowStep* step, const float* q,
                                                 int64_t q_stride, uint16_t* out, int64_t out_stride, int32_t num_threads) {
#ifdef KVFLOW_HAVE_AMX_BF16
  const int hq = layer->num_heads, hkv = layer->num_kv_heads, d = layer->head_dim, cache_dtype = layer->cache_dtype;
  const float scale = layer->scale;
  const int32_t *query_start = step->query_start, *seq_lens = step->seq_lens, *tables = step->block_tables;
  const int64_t table_stride = step->table_stride;
  const int num_seqs = step->num_seqs;
  if (d % 64 != 0 || d > 128 || hkv < 1 || hq % hkv != 0 || cache_dtype < 0 || cache_dtype > 2 || !kvflow::amx_permitted())
    return -1;
  // Sliding windows, capped scores and sinks: not on tiles.
  if (layer->window > 0 || layer->softcap > 0.f || layer->sinks) return -1;
  const Cache cache{layer->k_cache, layer->v_cache, cache_dtype, layer->block_size, hkv, d, layer->head_major != 0};
  const int group = hq / hkv;
  // Long chunks: K/V packed once for the whole sequence (in `words` per KV head), items of rows. Short
  // ones: items of key splits, each with a slot of partial sums (`partial` floats in all).
  std::vector<Sequence> seqs;
  struct Item { int seq, hk; int r0, rows, per; int k_begin, k_end; int64_t slot; };  // slot < 0: a long chunk's
  std::vector<Item> items, splits;
  struct Merge { int seq, hk, n, count; int64_t slot; };  // a short chunk's KV head: its splits' slots
  std::vector<Merge> merges;
  int64_t words = 0, partial = 0;
  for (int b = 0; b < num_seqs; ++b) {
    const int lq = query_start[b + 1] - query_start[b], lk = seq_lens[b];
    if (lq < 2 || lq > lk) continue;
    const int i = static_cast<int>(seqs.size());
    if (group * lq <= kShortRows) {
      seqs.push_back({query_start[b], lq, lk, tables + b * table_stride, -1, 0});
      const int n = (group * lq + kRows - 1) / kRows * kRows;
      const int count = std::max(1, std::min(kMaxSplits, lk / kSplitKeys));
      const int span = (lk / count + kBlock - 1) / kBlock * kBlock;  // keys per split, whole blocks
      for (int hk = 0; hk < hkv; ++hk) {
        const int64_t first = partial;
        int made = 0;
        for (int k0 = 0; k0 < lk; k0 += span, ++made) {
          splits.push_back({i, hk, 0, n, 0, k0, std::min(lk, k0 + span), partial});
          partial += static_cast<int64_t>(n) * (d + 2);
        }
        merges.push_back({i, hk, n, made, first});
      }
      continue;
    }
    const int padded = (lk + kKeys - 1) / kKeys * kKeys;
    seqs.push_back({query_start[b], lq, lk, tables + b * table_stride, words, padded});
    words += static_cast<int64_t>(padded) * d / 2;
    // A row block is `per` tiles of 16 rows of each query head, for about kItemRows rows over the KV
    // head's query heads; the later row blocks (which see more keys) first.
    const int per = std::min((kItemRows + kRows * group - 1) / (kRows * group), (lq + kRows - 1) / kRows);
    const int span = per * kRows;
    for (int r0 = (lq - 1) / span * span; r0 >= 0; r0 -= span)
      for (int hk = 0; hk < hkv; ++hk) items.push_back({i, hk, r0, std::min(span, lq - r0), per, 0, lk, -1});
  }
  if (seqs.empty()) return 0;
  const int num_long = static_cast<int>(items.size());
  items.insert(items.end(), splits.begin(), splits.end());
  std::vector<int> long_seqs, first_unit(1, 0);
  for (size_t i = 0; i < seqs.size(); ++i)
    if (seqs[i].packed >= 0) {
      long_seqs.push_back(static_cast<int>(i));
      first_unit.push_back(first_unit.back() + hkv * seqs[i].padded / 32);
    }
  std::vector<Sequence> packed_seqs;
  for (int i : long_seqs) packed_seqs.push_back(seqs[i]);
  thread_local std::vector<uint32_t> k_tiles, v_tiles;  // reused across calls: no page faults per layer
  thread_local std::vector<float> partials;
  k_tiles.resize(words * hkv);
  v_tiles.resize(words * hkv);
  partials.resize(partial);
  uint32_t* kt = k_tiles.data();
  uint32_t* vt = v_tiles.data();
  float* parts = partials.data();
  const int num_items = static_cast<int>(items.size()), num_merges = static_cast<int>(merges.size());
  kvflow::parallel(num_threads, [&](kvflow::Team& team) {
    if (cache_dtype == 0) pack<float>(team, cache, packed_seqs, first_unit, kt, vt);
    else if (cache_dtype == 1) pack<uint16_t>(team, cache, packed_seqs, first_unit, kt, vt);
    else pack<kvflow::float16>(team, cache, packed_seqs, first_unit, kt, vt);
    configure_tiles();
    thread_local Scratch w;
    team.for_dynamic(num_long, [&](int i) {  // long chunks' row blocks
      const Item& it = items[i];
      const Sequence& s = seqs[it.seq];
      const int64_t at = s.packed * hkv + static_cast<int64_t>(it.hk) * s.padded * d / 2;
      attend_item(q, q_stride, d, scale, s, it.hk, ItemRows{it.r0, it.rows, group, it.per}, kt + at, vt + at, out,
                  out_stride, w);
    });
    team.for_dynamic(num_items - num_long, [&](int i) {  // short chunks' key splits
      const Item& it = items[num_long + i];
      const Sequence& s = seqs[it.seq];
      const int n = it.rows;  // the heads' rows one after the other, then padding
      w.head.resize(n);
      w.row.resize(n);
      for (int f = 0; f < n; ++f) {
        w.head[f] = it.hk * group + f / s.lq;
        w.row[f] = f < group * s.lq ? f % s.lq : -1;
      }
      attend_split(q, q_stride, d, scale, cache, s, it.hk, n, it.k_begin, it.k_end, w);
      float* slot = parts + it.slot;
      std::memcpy(slot, w.out.data(), sizeof(float) * n * d);
      std::memcpy(slot + static_cast<int64_t>(n) * d, w.max.data(), sizeof(float) * n);
      std::memcpy(slot + static_cast<int64_t>(n) * (d + 1), w.sum.data(), sizeof(float) * n);
    });
    _tile_release();
    // A short chunk's rows: the splits' sums rescaled to their common max, added, divided.
    const float scale2 = scale * 1.44269504f;
    team.for_static(num_merges, [&](int m) {
      const Merge& mg = merges[m];
      const Sequence& s = seqs[mg.seq];
      const int n = mg.n;
      const int64_t stride = static_cast<int64_t>(n) * (d + 2);
      alignas(64) float acc[128];
      for (int f = 0; f < group * s.lq; ++f) {
        float top = -INFINITY;
        for (int c = 0; c < mg.count; ++c) top = std::max(top, parts[mg.slot + c * stride + static_cast<int64_t>(n) * d + f]);
        float sum = 0.f;
        for (int j = 0; j < d; j += 16) _mm512_store_ps(acc + j, _mm512_setzero_ps());
        for (int c = 0; c < mg.count; ++c) {
          const float* slot = parts + mg.slot + c * stride;
          const float mx = slot[static_cast<int64_t>(n) * d + f];
          if (mx == -INFINITY) continue;  // this split held none of the row's keys
          const float wgt = std::exp2((mx - top) * scale2);
          sum += slot[static_cast<int64_t>(n) * (d + 1) + f] * wgt;
          const __m512 a = _mm512_set1_ps(wgt);
          for (int j = 0; j < d; j += 16)
            _mm512_store_ps(acc + j, _mm512_fmadd_ps(_mm512_loadu_ps(slot + static_cast<int64_t>(f) * d + j), a, _mm512_load_ps(acc + j)));
        }
        const int h = mg.hk * group + f / s.lq, r = f % s.lq;
        write_row(acc, sum, d, out + static_cast<int64_t>(s.q_row + r) * out_stride + h * d);
      }
    });
  });
  return 0;
#else
  (void)layer, (void)step, (void)q, (void)q_stride, (void)out, (void)out_stride, (void)num_threads;
  return -1;
#endif
}
