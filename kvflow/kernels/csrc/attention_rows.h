// The arithmetic of paged attention over one chunk of positions: dot products over a head, the
// softmax of a chunk, and the weighted sum of values, for one-token queries (all query heads of a KV
// head together) and for runs of prompt rows. Included by paged_attention.cpp only.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "row_ops.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace kvflow::attention {


// Positions per work item. A row's split depends on its own context only, so its result does too (not
// on the batch or the thread count). Long contexts take longer chunks: half the partial results to
// merge and half the restarts of each KV head's prefetch stream; shorter ones keep enough chunks to share
// among threads (figures for this and the constants below: benchmarks/RESULTS.md, "Figures behind the code").
constexpr int kMaxChunk = 256;
inline int chunk_length(int context) { return context >= 2048 ? 256 : 128; }
constexpr int kRowBlock = 16;  // consecutive query rows of one sequence per work item (prefill)
// How many positions ahead the fixed-size path asks for K rows. The rows of one KV head sit one token
// stride apart, a pattern the hardware prefetcher follows poorly; without this the kernel waits on
// memory at depth.
constexpr int kPrefetchAhead = 16;


using kvflow::bf16_to_float;
using kvflow::largest;
using kvflow::float_to_bf16;
#ifdef __AVX512F__
using kvflow::store16f;
#endif

// Dot products and row updates over head_dim values, float32 or bfloat16 storage. With AVX-512 the
// sum of a dot product is a tree over vector lanes; a plain loop would make the compiler add the 16
// lanes one after another (it may not reassociate float adds), which costs more than the multiplies.
#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const _Float16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

inline float widen(float x) { return x; }
inline float widen(uint16_t x) { return bf16_to_float(x); }
inline float widen(_Float16 x) { return static_cast<float>(x); }

template <typename T>
inline float dot(const float* q, const T* k, int d) {
#ifdef __AVX512F__
  if (d % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(k + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float total = 0.f;
  for (int i = 0; i < d; ++i) total += q[i] * widen(k[i]);
  return total;
}

template <typename T>
inline void add_scaled(float* acc, float w, const T* v, int d) {  // acc += w * v
#ifdef __AVX512F__
  if (d % 16 == 0) {
    const __m512 wv = _mm512_set1_ps(w);
    for (int i = 0; i < d; i += 16)
      _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(wv, load16(v + i), _mm512_loadu_ps(acc + i)));
    return;
  }
#endif
  for (int i = 0; i < d; ++i) acc[i] += w * widen(v[i]);
}

template <typename T>
inline void store_row(const float* src, T* dst, int d);

template <>
inline void store_row<float>(const float* src, float* dst, int d) {
  std::memcpy(dst, src, sizeof(float) * d);
}

// The narrow stores round to nearest even, 16 at a time where AVX-512 runs (a scalar float16
// conversion is a library call per value).
template <>
inline void store_row<uint16_t>(const float* src, uint16_t* dst, int d) {
  int i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= d; i += 16) store16f(dst + i, _mm512_loadu_ps(src + i));
#endif
  for (; i < d; ++i) dst[i] = float_to_bf16(src[i]);
}

template <>
inline void store_row<_Float16>(const float* src, _Float16* dst, int d) {
  int i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= d; i += 16) {
    const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h);
  }
#endif
  for (; i < d; ++i) dst[i] = static_cast<_Float16>(src[i]);
}

struct Shape {
  int num_kv_heads, head_dim, block_size, group;
  int64_t table_stride;
  float scale;
};

// exp(x[i] - m) in place, returning the sum. Inputs are <= 0 after subtracting the max.
inline float exp_shifted_sum(float* x, int n, float m) {
  int i = 0;
  float total = 0.f;
#ifdef __AVX512F__
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv));
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  total = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    total += x[i];
  }
  return total;
}

// Where each position [lo, lo + n) of a sequence starts in the cache (in elements), through its block
// table: one division for the chunk, then a walk (a division per position would cost as much as scoring
// it for short heads).
inline void chunk_offsets(const int32_t* table, int lo, int n, int block_size, int64_t token_stride,
                          int64_t* offsets) {
  int block = lo / block_size, within = lo - block * block_size;
  for (int p = 0; p < n; ++p) {
    offsets[p] = (static_cast<int64_t>(table[block]) * block_size + within) * token_stride;
    if (++within == block_size) within = 0, ++block;
  }
}

// One chunk of one sequence: scores of all query heads over positions [lo, hi), then softmax-weighted
// V. Loops run per (KV head, query head) over positions, so the query (or output) row stays in
// registers and the chunk's K/V rows of that KV head, read from memory once, are re-read from L1 by
// the other query heads of the group. Writes per query head the chunk's max score, exp-sum and
// unnormalised output, merged later.
template <typename T>
void attend_chunk(const float* q, const T* k_cache, const T* v_cache, const int32_t* table, int lo, int hi,
                  const Shape& s, float* scores, int64_t* offsets, float* max_out, float* sum_out, float* acc_out) {
  const int d = s.head_dim, g = s.group, hkv = s.num_kv_heads, n = hi - lo;
  const int64_t token_stride = static_cast<int64_t>(hkv) * d;
  chunk_offsets(table, lo, n, s.block_size, token_stride, offsets);
  for (int kv = 0; kv < hkv; ++kv) {
    for (int j = 0; j < g; ++j) {
      const int h = kv * g + j;
      float* sc = scores + h * kMaxChunk;
      for (int p = 0; p < n; ++p)
        sc[p] = dot(q + h * d, k_cache + offsets[p] + kv * d, d) * s.scale;
      const float m = largest(sc, n);
      max_out[h] = m;
      sum_out[h] = exp_shifted_sum(sc, n, m);
    }
  }
  std::memset(acc_out, 0, sizeof(float) * hkv * g * d);
  for (int kv = 0; kv < hkv; ++kv) {
    for (int j = 0; j < g; ++j) {
      const int h = kv * g + j;
      const float* sc = scores + h * kMaxChunk;
      for (int p = 0; p < n; ++p)
        add_scaled(acc_out + h * d, sc[p], v_cache + offsets[p] + kv * d, d);
    }
  }
}

#ifdef __AVX512F__
// Sums of four vectors' lanes, as one 4-float vector: three shuffle-and-add levels instead of four
// separate horizontal reductions.
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d d0 = _mm512_castps_pd(t0), d1 = _mm512_castps_pd(t1);
  const __m512 t2 = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)),
                                  _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(t2), _mm512_extractf32x8_ps(t2, 1));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// exp_shifted_sum for up to 4 heads' scores (kMaxChunk apart) at once: their exps are independent, so
// they overlap where one head's polynomial chain alone leaves the vector units waiting. Each head's
// result is bitwise what exp_shifted_sum gives.
inline void group_softmax_parts(float* sc, int heads, int n, float* max_out, float* sum_out) {
  __m512 mv[4], acc[4];
  for (int j = 0; j < heads; ++j) {
    max_out[j] = largest(sc + j * kMaxChunk, n);
    mv[j] = _mm512_set1_ps(max_out[j]);
    acc[j] = _mm512_setzero_ps();
  }
  int i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < heads; ++j) {
      float* x = sc + j * kMaxChunk + i;
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x), mv[j]));
      _mm512_storeu_ps(x, e);
      acc[j] = _mm512_add_ps(acc[j], e);
    }
  for (int j = 0; j < heads; ++j) {
    float* x = sc + j * kMaxChunk;
    float total = _mm512_reduce_add_ps(acc[j]);
    for (int t = i; t < n; ++t) {
      x[t] = std::exp(x[t] - max_out[j]);
      total += x[t];
    }
    sum_out[j] = total;
  }
}

// Softmax-weighted V rows for the J query heads j0.. of one KV head: each V row is read and widened once
// for all J heads, and the J * D / 16 accumulators stay in registers.
template <typename T, int D, int J>
inline void weighted_values(const T* v_head, const int64_t* offsets, int n, const float* sc, float* acc_out) {
  constexpr int V = D / 16;
  __m512 acc[J][V];
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < V; ++v) acc[j][v] = _mm512_setzero_ps();
  for (int i = 0; i < n; ++i) {
    const T* row = v_head + offsets[i];
    __m512 x[V];
    for (int v = 0; v < V; ++v) x[v] = load16(row + 16 * v);
    for (int j = 0; j < J; ++j) {
      const __m512 w = _mm512_set1_ps(sc[j * kMaxChunk + i]);
      for (int v = 0; v < V; ++v) acc[j][v] = _mm512_fmadd_ps(w, x[v], acc[j][v]);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc_out + j * D + 16 * v, acc[j][v]);
}

// attend_chunk for a head size known at compile time (64, 128), one KV head: its K rows are widened
// once and scored against every query head of its group (P positions at a time: independent FMA chains
// and one shuffle reduction), then each V row once for up to kHeadsPerPass heads. offsets[0, n) locate
// the chunk's positions (chunk_offsets); q, max_out, sum_out and acc_out are the row's, for all heads.
template <typename T, int D>
void attend_kv_head(const float* q, const T* k_cache, const T* v_cache, const int64_t* offsets, int n, int kv,
                    const Shape& s, float* scores, float* max_out, float* sum_out, float* acc_out) {
  constexpr int V = D / 16;
  constexpr int P = D == 64 ? 4 : 2;                // positions scored together: P * V widened rows in registers
  constexpr int kHeadsPerPass = D == 64 ? 4 : 2;    // J * V accumulators + V widened values in registers
  const int g = s.group;
  const __m128 scale4 = _mm_set1_ps(s.scale);
  const __m512 zero = _mm512_setzero_ps();
  const T* k_head = k_cache + kv * D;
  const T* v_head = v_cache + kv * D;
  const float* q_group = q + static_cast<int64_t>(kv) * g * D;
  float* sc_group = scores + kv * g * kMaxChunk;
  int p = 0;
  for (; p + P <= n; p += P) {
    {  // fetch K rows ahead, and this chunk's V rows for the weighted sum
      constexpr int kLines = (D * static_cast<int>(sizeof(T)) + 63) / 64;
      for (int i = 0; i < P; ++i) {
        const int ahead = p + i + kPrefetchAhead < n ? p + i + kPrefetchAhead : p + i;
        const char* k_next = reinterpret_cast<const char*>(k_head + offsets[ahead]);
        const char* v_row = reinterpret_cast<const char*>(v_head + offsets[p + i]);
        for (int line = 0; line < kLines; ++line) {
          _mm_prefetch(k_next + 64 * line, _MM_HINT_T0);
          _mm_prefetch(v_row + 64 * line, _MM_HINT_T0);
        }
      }
    }
    __m512 k[P][V];
    for (int i = 0; i < P; ++i)
      for (int v = 0; v < V; ++v) k[i][v] = load16(k_head + offsets[p + i] + 16 * v);
    for (int j = 0; j < g; ++j) {
      const float* qj = q_group + j * D;
      __m512 a[P];
      for (int i = 0; i < P; ++i) {
        a[i] = _mm512_mul_ps(_mm512_loadu_ps(qj), k[i][0]);
        for (int v = 1; v < V; ++v) a[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 16 * v), k[i][v], a[i]);
      }
      float* sc = sc_group + j * kMaxChunk + p;
      if constexpr (P == 4) {
        _mm_storeu_ps(sc, _mm_mul_ps(reduce4(a[0], a[1], a[2], a[3]), scale4));
      } else {
        _mm_storel_pi(reinterpret_cast<__m64*>(sc), _mm_mul_ps(reduce4(a[0], a[1], zero, zero), scale4));
      }
    }
  }
  for (; p < n; ++p) {
    const T* k = k_head + offsets[p];
    for (int j = 0; j < g; ++j) {
      const float* qj = q_group + j * D;
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qj), load16(k));
      for (int v = 1; v < V; ++v) a = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 16 * v), load16(k + 16 * v), a);
      sc_group[j * kMaxChunk + p] = _mm512_reduce_add_ps(a) * s.scale;
    }
  }
  for (int j0 = 0; j0 < g; j0 += 4) {
    const int count = g - j0 < 4 ? g - j0 : 4;
    group_softmax_parts(sc_group + j0 * kMaxChunk, count, n, max_out + kv * g + j0, sum_out + kv * g + j0);
  }
  for (int j0 = 0; j0 < g; j0 += kHeadsPerPass) {
    const float* sc = sc_group + j0 * kMaxChunk;
    float* out = acc_out + static_cast<int64_t>(kv * g + j0) * D;
    switch (g - j0 < kHeadsPerPass ? g - j0 : kHeadsPerPass) {
      case 1: weighted_values<T, D, 1>(v_head, offsets, n, sc, out); break;
      case 2: weighted_values<T, D, 2>(v_head, offsets, n, sc, out); break;
      case 3: weighted_values<T, D, (kHeadsPerPass >= 3 ? 3 : 1)>(v_head, offsets, n, sc, out); break;
      default: weighted_values<T, D, kHeadsPerPass>(v_head, offsets, n, sc, out); break;
    }
  }
}
#endif

// Consecutive rows of one sequence over one chunk of positions (a one-token query is a run of one): the
// positions are located once, and per KV head the rows take turns while its K/V rows are still in cache
// (L1, or L2 for larger heads). Each row runs the same code as alone (attend_kv_head; attend_chunk for
// other head sizes or without AVX-512), so its result is bitwise the same. Rows whose context ends
// before the chunk are skipped. part_at[i] is where row i's partial results go.
template <typename T>
void attend_rows(const float* const* q_rows, const int* contexts, const size_t* part_at, int count,
                 const T* k_cache, const T* v_cache, const int32_t* table, int lo, int len, const Shape& s,
                 float* scores, int64_t* offsets, float* part_max, float* part_sum, float* part_acc) {
  const int d = s.head_dim;
#ifdef __AVX512F__
  auto rows_with_kv_heads = [&](auto head_dim) {
    constexpr int D = decltype(head_dim)::value;
    int longest = 0;
    for (int i = 0; i < count; ++i) longest = contexts[i] > longest ? contexts[i] : longest;
    const int n_max = (longest < lo + len ? longest : lo + len) - lo;
    chunk_offsets(table, lo, n_max, s.block_size, static_cast<int64_t>(s.num_kv_heads) * D, offsets);
    for (int kv = 0; kv < s.num_kv_heads; ++kv)
      for (int i = 0; i < count; ++i) {
        if (contexts[i] <= lo) continue;
        const int n = (contexts[i] < lo + len ? contexts[i] : lo + len) - lo;
        const size_t at = part_at[i];
        attend_kv_head<T, D>(q_rows[i], k_cache, v_cache, offsets, n, kv, s, scores, part_max + at, part_sum + at,
                             part_acc + at * d);
      }
  };
  if (d == 64) return rows_with_kv_heads(std::integral_constant<int, 64>());
  if (d == 128) return rows_with_kv_heads(std::integral_constant<int, 128>());
#endif
  for (int i = 0; i < count; ++i) {
    if (contexts[i] <= lo) continue;
    const int hi = contexts[i] < lo + len ? contexts[i] : lo + len;
    const size_t at = part_at[i];
    attend_chunk(q_rows[i], k_cache, v_cache, table, lo, hi, s, scores, offsets, part_max + at, part_sum + at,
                 part_acc + at * d);
  }
}


}  // namespace kvflow::attention
