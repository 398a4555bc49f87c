// The paged cache's K/V as AMX B tiles, for the prompt attention on tiles (prefill_attention_amx.cpp):
// where a sequence's rows live, and their bfloat16 repacking. B tiles hold pairs of values along the
// summed dimension in one 32-bit word: for Q K^T a key's dims side by side (so 16 keys' rows turn into 16
// tile rows of dim pairs), for P V two keys' values of each dim interleaved.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cache_layout.h"
#include "simd.h"
#include "threads.h"

namespace kvflow::prompt_tiles {

template <typename T>
inline __m512 load16(const T* p) {  // float32, bfloat16 bits or float16
  return kvflow::simd::load(p);
}
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

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

// Rows of KV head h for keys [first, first + count) (null past lk): one division for the keys that share
// a cache block.
template <typename T>
void key_rows(const Cache& c, const Sequence& s, const void* base, int h, int first, int count, const T** rows) {
  const int64_t step = c.head_major ? c.d : static_cast<int64_t>(c.hkv) * c.d;  // from one position to the next
  for (int n = 0; n < count;) {
    const int key = first + n;
    if (key >= s.lk) {
      rows[n++] = nullptr;
      continue;
    }
    const T* row = cache_row<T>(base, c, s.table, key, h);
    const int run = std::min({count - n, c.block_size - key % c.block_size, s.lk - key});  // same block
    for (int j = 0; j < run; ++j) rows[n++] = row + j * step;
  }
}

// 16 x 16 32-bit words: r[n] lane i becomes r[i] lane n.
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int k = 0; k < 16; k += 2) {
    t[k] = _mm512_unpacklo_epi32(r[k], r[k + 1]);
    t[k + 1] = _mm512_unpackhi_epi32(r[k], r[k + 1]);
  }
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // u[4 g + j] holds rows 4g..4g+3 of words 4 L + j, per 128-bit lane L
    const __m512i a = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), b = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
    const __m512i c = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88), e = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
    r[j] = _mm512_shuffle_i32x4(a, c, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(a, c, 0xdd);
    r[4 + j] = _mm512_shuffle_i32x4(b, e, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(b, e, 0xdd);
  }
}

// Keys [16 b, 16 b + 16) of KV head h as B tiles for Q K^T, written from `out` on: per 32 dims, 32-bit
// word (i, n) holds dims 2i, 2i+1 of key n. Keys past lk are zeros. One key at a time: for the pass that
// packs whole sequences ahead (pack_keys_turned is 0.9x there, measured, not understood).
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
    for (int ch = 0; ch < chunks; ++ch)
      for (int i = 0; i < 16; ++i) out[ch * 256 + i * 16 + n] = words[ch * 16 + i];
  }
}

// The same tiles with the 16 keys' words turned in registers: for an item that packs its own blocks while
// its rows wait (1.09x over pack_keys at 80 rows over 16K keys).
template <typename T>
void pack_keys_turned(const Cache& c, const Sequence& s, int h, int b, uint32_t* out) {
  const T* rows[16];
  key_rows<T>(c, s, c.k, h, b * 16, 16, rows);
  for (int ch = 0; ch < c.d / 32; ++ch) {
    __m512i r[16];  // key n's words i = dims 2i, 2i + 1 of this chunk of 32
    for (int n = 0; n < 16; ++n) {
      const T* row = rows[n] ? rows[n] + ch * 32 : nullptr;
      r[n] = row ? _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16(load16(row))), to_bf16(load16(row + 16)), 1)
                 : _mm512_setzero_si512();
    }
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + ch * 256 + i * 16, r[i]);
  }
}

// Keys [32 b, 32 b + 32) of KV head h's V as B tiles for P V, written from `out` on: per 16 dims, 32-bit
// word (i, n) holds dim n of keys 2i and 2i + 1. Keys past lk are zeros.
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
      _mm512_storeu_si512(out + g * 256 + i * 16, _mm512_permutexvar_epi16(idx, both));
    }
  }
}

// Keys [k0, k0 + keys) (k0 a multiple of 32, keys of 64) of KV head h, packed as pack_keys and pack_values
// lay out a whole sequence, from k_tiles and v_tiles on.
template <typename T>
void pack_block(const Cache& c, const Sequence& s, int h, int k0, int keys, uint32_t* k_tiles, uint32_t* v_tiles) {
  const int chunks = c.d / 32, groups = c.d / 16;
  for (int b = 0; b < keys / 16; ++b) pack_keys_turned<T>(c, s, h, k0 / 16 + b, k_tiles + static_cast<int64_t>(b) * chunks * 256);
  for (int b = 0; b < keys / 32; ++b) pack_values<T>(c, s, h, k0 / 32 + b, v_tiles + static_cast<int64_t>(b) * groups * 256);
}

void pack_block_any(const Cache& c, const Sequence& s, int h, int k0, int keys, uint32_t* k_tiles, uint32_t* v_tiles) {
  if (c.dtype == 0) pack_block<float>(c, s, h, k0, keys, k_tiles, v_tiles);
  else if (c.dtype == 1) pack_block<uint16_t>(c, s, h, k0, keys, k_tiles, v_tiles);
  else pack_block<kvflow::float16>(c, s, h, k0, keys, k_tiles, v_tiles);
}
// Key `key`'s K and V rows of KV head h into L2.
inline void prefetch_key(const Cache& c, const Sequence& s, int h, int key) {
  const int bytes = c.d * (c.dtype == 0 ? 4 : 2);
  const int64_t at = kvflow::cache_row_index(s.table[key / c.block_size], key % c.block_size, h, c.hkv, c.block_size,
                                             c.head_major) * bytes;
  for (int off = 0; off < bytes; off += 64) {
    _mm_prefetch(static_cast<const char*>(c.k) + at + off, _MM_HINT_T1);
    _mm_prefetch(static_cast<const char*>(c.v) + at + off, _MM_HINT_T1);
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
    pack_keys<T>(c, s, h, 2 * b, k_tiles + at + static_cast<int64_t>(2 * b) * (c.d / 32) * 256);
    pack_keys<T>(c, s, h, 2 * b + 1, k_tiles + at + static_cast<int64_t>(2 * b + 1) * (c.d / 32) * 256);
    pack_values<T>(c, s, h, b, v_tiles + at + static_cast<int64_t>(b) * (c.d / 16) * 256);
  });
}
}  // namespace kvflow::prompt_tiles
