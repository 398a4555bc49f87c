// Causal attention of prompt chunks on AMX tiles: bfloat16 products with float32 sums, float32 softmax.
// The native decoder's attention for prompt chunks on AMX CPUs (csrc/decoder_forward.cpp).
//
// A chunk's attention is two matmul-shaped products per head, Q K^T and P V. A tile op multiplies 16 x 32
// by 32 x 16 bfloat16 values at once, where float32 FMAs take hundreds of instructions. A work item is a
// block of query rows of one sequence for all the query heads of one KV head (about 64 rows), taken
// flash-style over blocks of 256 keys: scores 16 keys per tile, a running max and sum per row with the
// probabilities 2^(x - max) in AVX-512 rounded to bfloat16, then P V in four tiles (64 output dims) and
// the output rescaled when a row's max rose. Each block's K/V tiles are read once for all the item's
// rows and stay in cache while they are used: at a depth of 16K an item that read all keys for every 16
// rows of every head moved 18 GB per layer through the caches. B tiles hold pairs of values along the
// summed dimension in one 32-bit word, so K and V are read from the paged cache (through the block table)
// and repacked once per call, shared by all query heads of a KV head and all their rows.
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
#endif

namespace {

#ifdef KVFLOW_HAVE_AMX_BF16
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

template <typename T>
inline __m512 load16(const T* p) {  // float32, bfloat16 bits or float16
  return kvflow::simd::load(p);
}
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

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

// Where a sequence's K/V rows live: the cache, its block table, and this call's packed copy.
struct Sequence {
  int q_row;         // first query row of its chunk in q and out
  int lq, lk;        // chunk rows; positions it sees (the chunk is the last lq of them)
  const int32_t* table;
  int64_t packed;    // offset of its tiles in the packed buffers (32-bit words), per KV head: padded * d / 2
  int padded;        // lk rounded up to kKeys
};

struct Cache {
  const void* k;
  const void* v;
  int dtype;  // 0 float32, 1 bfloat16, 2 float16
  int block_size;
  int hkv, d;
  bool head_major;  // a block is [hkv, block_size, d], else [block_size, hkv, d] (kvflow_cpu.h)
};

template <typename T>
const T* cache_row(const void* base, const Cache& c, const int32_t* table, int pos, int h) {
  const int64_t row = kvflow::cache_row_index(table[pos / c.block_size], pos % c.block_size, h, c.hkv, c.block_size,
                                              c.head_major);
  return static_cast<const T*>(base) + row * c.d;
}

// Keys [16 b, 16 b + 16) of KV head h as B tiles for Q K^T: per 32 dims, 32-bit word (i, n) holds dims
// 2i, 2i+1 of key n. Keys past lk are zeros.
template <typename T>
void pack_keys(const Cache& c, const Sequence& s, int h, int b, uint32_t* out) {
  const int chunks = c.d / 32;
  for (int n = 0; n < 16; ++n) {
    const int key = b * 16 + n;
    alignas(64) uint32_t words[64];  // one key as bfloat16 pairs (head sizes up to 128)
    if (key < s.lk) {
      const T* row = cache_row<T>(c.k, c, s.table, key, h);
      for (int j = 0; j < c.d; j += 16) _mm256_store_si256(reinterpret_cast<__m256i*>(words + j / 2), to_bf16(load16(row + j)));
    } else {
      std::memset(words, 0, sizeof(words));
    }
    for (int ch = 0; ch < chunks; ++ch) {
      uint32_t* tile = out + (static_cast<int64_t>(b) * chunks + ch) * 256;
      for (int i = 0; i < 16; ++i) tile[i * 16 + n] = words[ch * 16 + i];
    }
  }
}

// Keys [32 b, 32 b + 32) of KV head h's V as B tiles for P V: per 16 dims, 32-bit word (i, n) holds dim
// n of keys 2i and 2i + 1. Keys past lk are zeros.
template <typename T>
void pack_values(const Cache& c, const Sequence& s, int h, int b, uint32_t* out) {
  const int groups = c.d / 16;
  alignas(64) static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(interleave);
  for (int i = 0; i < 16; ++i) {
    const int key = b * 32 + 2 * i;
    const T* even = key < s.lk ? cache_row<T>(c.v, c, s.table, key, h) : nullptr;
    const T* odd = key + 1 < s.lk ? cache_row<T>(c.v, c, s.table, key + 1, h) : nullptr;
    for (int g = 0; g < groups; ++g) {
      const __m256i a = even ? to_bf16(load16(even + g * 16)) : _mm256_setzero_si256();
      const __m256i bb = odd ? to_bf16(load16(odd + g * 16)) : _mm256_setzero_si256();
      const __m512i both = _mm512_inserti64x4(_mm512_zextsi256_si512(a), bb, 1);
      uint32_t* tile = out + (static_cast<int64_t>(b) * groups + g) * 256;
      _mm512_storeu_si512(tile + i * 16, _mm512_permutexvar_epi16(idx, both));
    }
  }
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

struct Scratch {  // per thread, grown as needed
  std::vector<uint16_t> q_rows, p;
  std::vector<float> s, pv, out, max, sum;
};

// The rows one work item attends: R consecutive query rows of one sequence for every query head of one
// KV head (group * R rows, R a multiple of 16), so that each K/V tile read serves all of them. Tile t
// holds rows [16 t, 16 t + 16) in head-major order: head t / (R / 16), rows r0 + 16 (t % (R / 16)) on.
struct ItemRows {
  int r0, rows;    // first chunk row and how many of the R are real (the rest are zero rows)
  int group, per;  // query heads per KV head; tiles per head (R / 16)
  int tiles() const { return group * per; }
  int last_row(int t) const { return r0 + (t % per) * kRows + kRows - 1; }  // chunk row of the tile's last row
};

// Rows r0 .. r0 + R - 1 of the query heads of KV head hk, flash-style: keys in blocks of kBlock, a running
// max and sum per row, and the output rescaled when the max rises. The per-block rescale is a few
// vector ops per row against kBlock keys of tile products, so blocks of 256 keys make it small, while
// the block's K/V tiles (32 KB each) stay in L1/L2 for all group * R rows.
constexpr int kBlock = 256;

void attend_item(const float* q, int64_t q_stride, int d, float scale, const Sequence& seq, int hk, const ItemRows& it,
                 const uint32_t* k_tiles, const uint32_t* v_tiles, uint16_t* out, int64_t out_stride, Scratch& w) {
  const int tiles = it.tiles(), n = tiles * kRows;
  const int offset = seq.lk - seq.lq;  // chunk row r sits at position offset + r and sees keys [0, offset + r]
  const int last_key = offset + it.r0 + it.rows - 1;  // the last key any real row sees
  w.q_rows.resize(static_cast<size_t>(n) * d);
  w.s.resize(static_cast<size_t>(kRows) * kBlock);
  w.p.resize(static_cast<size_t>(kRows) * kBlock);
  w.pv.resize(static_cast<size_t>(kRows) * d);
  w.out.assign(static_cast<size_t>(n) * d, 0.f);
  w.max.assign(n, -INFINITY);
  w.sum.assign(n, 0.f);
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
      // Per row: the new max, the rescale of what was summed, and 2^(x - max) in bfloat16 (0 where masked).
      float alpha[kRows];
      for (int i = 0; i < kRows; ++i) {
        const int row = t * kRows + i;
        const int last = offset + it.r0 + (t % it.per) * kRows + i;  // last key this row sees
        const float* sr = w.s.data() + static_cast<int64_t>(i) * kBlock;
        uint16_t* pr = w.p.data() + static_cast<int64_t>(i) * kBlock;
        const int seen = std::max(0, std::min(tile_keys, last - k0 + 1));  // keys of the block this row sees
        const int whole = seen / 16 * 16;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < whole; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + j));
        if (whole < seen) mx = _mm512_mask_max_ps(mx, visible_lanes(k0 + whole, last), mx, _mm512_loadu_ps(sr + whole));
        const float block_max = _mm512_reduce_max_ps(mx), old = w.max[row];
        const float m = block_max > old ? block_max : old;
        alpha[i] = old == -INFINITY ? 0.f : (m == old ? 1.f : std::exp2((old - m) * scale2));
        w.max[row] = m;
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
        w.sum[row] = w.sum[row] * alpha[i] + _mm512_reduce_add_ps(total);
      }
      // P V of the block, then out = out * alpha + P V.
      for (int g0 = 0; g0 < groups; g0 += 4) value_group(w.p.data(), kBlock, tile_keys, d, vt, g0, w.pv.data());
      for (int i = 0; i < kRows; ++i) {
        const __m512 a = _mm512_set1_ps(alpha[i]);
        float* o = w.out.data() + (static_cast<int64_t>(t) * kRows + i) * d;
        const float* pv = w.pv.data() + static_cast<int64_t>(i) * d;
        for (int j = 0; j < d; j += 16) _mm512_storeu_ps(o + j, _mm512_fmadd_ps(_mm512_loadu_ps(o + j), a, _mm512_loadu_ps(pv + j)));
      }
    }
  }
  for (int t = 0; t < tiles; ++t) {
    const int h = hk * it.group + t / it.per;
    for (int i = 0; i < kRows; ++i) {
      const int r = it.r0 + (t % it.per) * kRows + i, row = t * kRows + i;
      if (r >= it.r0 + it.rows) continue;
      const __m512 inv = _mm512_set1_ps(1.f / w.sum[row]);
      uint16_t* o = out + static_cast<int64_t>(seq.q_row + r) * out_stride + h * d;
      const float* acc = w.out.data() + static_cast<int64_t>(row) * d;
      for (int j = 0; j < d; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j), to_bf16(_mm512_mul_ps(_mm512_loadu_ps(acc + j), inv)));
    }
  }
}

// Inside a parallel region: the threads share the packing. One work unit is 32 keys of one KV head of one
// sequence (two K blocks of 16, one V block of 32); sequence i's units start at first_unit[i].
template <typename T>
void pack(kvflow::Team& team, const Cache& c, const std::vector<Sequence>& seqs, const std::vector<int>& first_unit,
          uint32_t* k_tiles, uint32_t* v_tiles) {
  team.for_static(first_unit.back(), [&](int u) {
    size_t i = 0;
    while (first_unit[i + 1] <= u) ++i;
    const Sequence& s = seqs[i];
    const int local = u - first_unit[i], h = local / (s.padded / 32), b = local % (s.padded / 32);
    const int64_t at = s.packed * c.hkv + static_cast<int64_t>(h) * s.padded * c.d / 2;
    pack_keys<T>(c, s, h, 2 * b, k_tiles + at);
    pack_keys<T>(c, s, h, 2 * b + 1, k_tiles + at);
    pack_values<T>(c, s, h, b, v_tiles + at);
  });
}
#endif

}  // namespace

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
  std::vector<Sequence> seqs;
  int64_t words = 0;  // packed words per KV head, all sequences
  for (int b = 0; b < num_seqs; ++b) {
    const int lq = query_start[b + 1] - query_start[b], lk = seq_lens[b];
    if (lq < 2 || lq > lk) continue;
    const int padded = (lk + kKeys - 1) / kKeys * kKeys;
    seqs.push_back({query_start[b], lq, lk, tables + b * table_stride, words, padded});
    words += static_cast<int64_t>(padded) * d / 2;
  }
  if (seqs.empty()) return 0;
  // Items: (sequence, row block, KV head), the sequences' later row blocks (which see more keys) first. A
  // row block is `per` tiles of 16 rows, for about kItemRows rows over the KV head's query heads.
  const int group = hq / hkv;
  struct Item { int seq, hk; ItemRows rows; };
  std::vector<Item> items;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int lq = seqs[i].lq;
    const int per = std::min((kItemRows + kRows * group - 1) / (kRows * group), (lq + kRows - 1) / kRows);
    const int span = per * kRows;
    for (int r0 = (lq - 1) / span * span; r0 >= 0; r0 -= span)
      for (int hk = 0; hk < hkv; ++hk) items.push_back({static_cast<int>(i), hk, {r0, std::min(span, lq - r0), group, per}});
  }
  std::vector<int> first_unit(seqs.size() + 1, 0);
  for (size_t i = 0; i < seqs.size(); ++i) first_unit[i + 1] = first_unit[i] + hkv * seqs[i].padded / 32;
  thread_local std::vector<uint32_t> k_tiles, v_tiles;  // reused across calls: no page faults per layer
  k_tiles.resize(words * hkv);
  v_tiles.resize(words * hkv);
  uint32_t* kt = k_tiles.data();
  uint32_t* vt = v_tiles.data();
  const int num_items = static_cast<int>(items.size());
  kvflow::parallel(num_threads, [&](kvflow::Team& team) {
    if (cache_dtype == 0) pack<float>(team, cache, seqs, first_unit, kt, vt);
    else if (cache_dtype == 1) pack<uint16_t>(team, cache, seqs, first_unit, kt, vt);
    else pack<kvflow::float16>(team, cache, seqs, first_unit, kt, vt);
    configure_tiles();
    thread_local Scratch scratch;
    team.for_dynamic(num_items, [&](int i) {
      const Item& it = items[i];
      const Sequence& s = seqs[it.seq];
      const int64_t at = s.packed * hkv + static_cast<int64_t>(it.hk) * s.padded * d / 2;
      attend_item(q, q_stride, d, scale, s, it.hk, it.rows, kt + at, vt + at, out, out_stride, scratch);
    });
    _tile_release();
  });
  return 0;
#else
  (void)layer, (void)step, (void)q, (void)q_stride, (void)out, (void)out_stride, (void)num_threads;
  return -1;
#endif
}
