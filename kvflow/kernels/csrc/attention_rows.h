// The arithmetic of paged attention over one chunk of positions: dot products over a head, the
// softmax of a chunk, and the weighted sum of values, for one-token queries (all query heads of a KV
// head together) and for runs of prompt rows. Written once against csrc/simd.h (every tier); included
// by paged_attention.cpp only.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cache_layout.h"
#include "row_ops.h"
#include "simd.h"

namespace kvflow::attention {

namespace v = kvflow::simd;

// Positions per work item. A row's split depends on its own context only, so its result does too (not
// on the batch or the thread count). Long contexts take longer chunks: half the partial results to
// merge and half the restarts of each KV head's prefetch stream; shorter ones keep enough chunks to share
// among threads (figures for this and the constants below: benchmarks/RESULTS.md, "Figures behind the code").
constexpr int kMaxChunk = 256;
inline int chunk_length(int context) { return context >= 2048 ? 256 : 128; }
constexpr int kRowBlock = 16;  // consecutive query rows of one sequence per work item (prefill)
// How many positions ahead the fixed-size path asks for K (and V) rows, into L2: a block's rows of one
// KV head are contiguous, but blocks lie anywhere, and without this the kernel waits on memory at each
// block's start. Into L2 rather than L1: a core holds few L1 misses in flight. Decode attention at depth
// 4,096 and 7,936 (benchmarks/ab_attention_source.py): 1.15 to 1.22x faster than L1 prefetches 16
// positions ahead; 16, 32 or 48 positions ahead differ by noise.
constexpr int kPrefetchAhead = 64;
constexpr int W = v::kLanes;

// An 8-bit cache (T = int8_t) keeps each head's row as head_dim values followed by their float32 scale
// (absmax / 127, one per token and KV head): a value is int8 * scale. The scale is applied once per row,
// not per value: a score is (q . k_int8) * k_scale * scale, and a V row is added with weight
// p * v_scale. Every path does it in that order (for other caches the row scale is 1, which changes no
// bit), so a row's result is still bitwise the same whichever path computes it.
template <typename T>
constexpr bool kScaled = std::is_same_v<T, int8_t>;

template <typename T>
constexpr int64_t head_stride(int d) {  // from one KV head's row to the next, in T elements
  return kScaled<T> ? d + 4 : d;
}

template <typename T>
inline float row_scale(const T* row, int d) {
  if constexpr (kScaled<T>) {
    float scale;
    std::memcpy(&scale, row + d, 4);
    return scale;
  } else {
    return 1.f;
  }
}

// Dot products and row updates over head_dim values, in any storage type. A vector dot product sums as
// a tree over lanes; a plain loop would make the compiler add lanes one after another (it may not
// reassociate float adds), which costs more than the multiplies.
template <typename T>
inline float dot(const float* q, const T* k, int d) {  // times the row's scale (an 8-bit cache's)
  return kScaled<T> ? v::dot(q, k, d) * row_scale(k, d) : v::dot(q, k, d);
}

template <typename T>
inline void add_scaled(float* acc, float w, const T* x, int d) {  // acc += w * x (x scaled by its row's scale)
  int i = 0;
  w *= row_scale(x, d);
  const v::vf wv = v::set1(w);
  for (; i + W <= d; i += W) v::store(acc + i, v::fmadd(wv, v::load(x + i), v::load(acc + i)));
  for (; i < d; ++i) acc[i] += w * widen(x[i]);
}

// New K/V rows into the cache, rounded to nearest even (a vector at a time: a scalar float16 conversion
// is a library call per value on x86).
template <typename T>
inline void store_row(const float* src, T* dst, int d) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, sizeof(float) * d);
  } else if constexpr (kScaled<T>) {  // symmetric: the largest magnitude becomes 127 (as kv_int8.py does)
    int i = 0;
    v::vf mv = v::zero();
    for (; i + W <= d; i += W) mv = v::max(mv, v::abs(v::load(src + i)));
    float amax = v::reduce_max(mv);
    for (; i < d; ++i) amax = std::fabs(src[i]) > amax ? std::fabs(src[i]) : amax;
    const float inv = amax > 0.f ? 127.f / amax : 0.f, scale = amax / 127.f;
    // Rounded half to even a vector at a time, then narrowed (each value is already a whole number).
    float rounded[W];
    for (i = 0; i + W <= d; i += W) {
      v::store(rounded, v::round_nearest(v::mul(v::load(src + i), v::set1(inv))));
      for (int j = 0; j < W; ++j) dst[i + j] = static_cast<int8_t>(rounded[j]);
    }
    for (; i < d; ++i) dst[i] = static_cast<int8_t>(std::nearbyint(src[i] * inv));
    std::memcpy(dst + d, &scale, 4);
  } else {
    int i = 0;
    for (; i + W <= d; i += W) v::store(dst + i, v::load(src + i));
    for (; i < d; ++i) narrow(src[i], dst + i);
  }
}

struct Shape {
  int num_kv_heads, head_dim, block_size, group;
  int64_t table_stride;
  float scale;
  int window;     // > 0: a row sees its last `window` positions only
  float softcap;  // > 0: scores become softcap * tanh(score / softcap)
  bool head_major;  // a block is [kv_heads, block_size, row]; else [block_size, kv_heads, row] (kvflow_cpu.h)
  const float* sinks;  // per query head, a logit in each row's softmax denominator (gpt-oss), or null
};

// Where a KV head's row of a position sits, in T elements (cache_layout.h): the row at (block, within,
// kv), and the steps between rows of the next block, KV head and position, for walking a chunk.
template <typename T>
inline int64_t row_offset(const Shape& s, int64_t block, int within, int kv) {
  return cache_row_index(block, within, kv, s.num_kv_heads, s.block_size, s.head_major) * head_stride<T>(s.head_dim);
}
template <typename T>
inline int64_t block_elems(const Shape& s) { return row_offset<T>(s, 1, 0, 0); }
template <typename T>
inline int64_t kv_step(const Shape& s) { return row_offset<T>(s, 0, 0, 1); }
template <typename T>
inline int64_t pos_step(const Shape& s) { return row_offset<T>(s, 0, 1, 0); }
template <typename T>
inline int64_t slot_offset(const Shape& s, int64_t slot, int kv) {
  const int64_t block = slot / s.block_size;
  return row_offset<T>(s, block, static_cast<int>(slot - block * s.block_size), kv);
}

// A row's scores over a chunk, before its softmax: capped (Gemma 2), and the first `masked` positions
// (before the row's sliding window) set to -inf, so they weigh exactly 0. Every path runs this same code
// on the same scores, so a row's result still does not depend on which path took it.
inline void cap_and_mask(float* sc, int n, int masked, float softcap) {
  if (softcap > 0.f)
    for (int p = masked; p < n; ++p) sc[p] = softcap * std::tanh(sc[p] / softcap);
  for (int p = 0; p < masked; ++p) sc[p] = -INFINITY;
}

// exp(x[i] - m) in place, returning the sum. Inputs are <= 0 after subtracting the max.
inline float exp_shifted_sum(float* x, int n, float m) {
  int i = 0;
  const v::vf mv = v::set1(m);
  v::vf acc = v::zero();
  for (; i + W <= n; i += W) {
    const v::vf e = v::exp(v::sub(v::load(x + i), mv));
    v::store(x + i, e);
    acc = v::add(acc, e);
  }
  float total = v::reduce_add(acc);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    total += x[i];
  }
  return total;
}

// Where each position [lo, lo + n) of a sequence starts in the cache (in elements), through its block
// table: one division for the chunk, then a walk (a division per position would cost as much as scoring
// it for short heads).
inline void chunk_offsets(const int32_t* table, int lo, int n, int block_size, int64_t block_elems,
                          int64_t pos_step, int64_t* offsets) {
  int block = lo / block_size, within = lo - block * block_size;
  for (int p = 0; p < n; ++p) {
    offsets[p] = static_cast<int64_t>(table[block]) * block_elems + within * pos_step;
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
                  int masked, const Shape& s, float* scores, int64_t* offsets, float* max_out, float* sum_out,
                  float* acc_out) {
  const int d = s.head_dim, g = s.group, hkv = s.num_kv_heads, n = hi - lo;
  const int64_t kv_stride = kv_step<T>(s);
  chunk_offsets(table, lo, n, s.block_size, block_elems<T>(s), pos_step<T>(s), offsets);
  for (int kv = 0; kv < hkv; ++kv) {
    for (int j = 0; j < g; ++j) {
      const int h = kv * g + j;
      float* sc = scores + h * kMaxChunk;
      for (int p = 0; p < n; ++p)
        sc[p] = dot(q + h * d, k_cache + offsets[p] + kv * kv_stride, d) * s.scale;
      cap_and_mask(sc, n, masked, s.softcap);
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
        add_scaled(acc_out + h * d, sc[p], v_cache + offsets[p] + kv * kv_stride, d);
    }
  }
}

// exp_shifted_sum for up to 4 heads' scores (kMaxChunk apart) at once: their exps are independent, so
// they overlap where one head's polynomial chain alone leaves the vector units waiting. Each head's
// result is bitwise what exp_shifted_sum gives.
inline void group_softmax_parts(float* sc, int heads, int n, float* max_out, float* sum_out) {
  v::vf mv[4], acc[4];
  for (int j = 0; j < heads; ++j) {
    max_out[j] = largest(sc + j * kMaxChunk, n);
    mv[j] = v::set1(max_out[j]);
    acc[j] = v::zero();
  }
  int i = 0;
  for (; i + W <= n; i += W)
    for (int j = 0; j < heads; ++j) {
      float* x = sc + j * kMaxChunk + i;
      const v::vf e = v::exp(v::sub(v::load(x), mv[j]));
      v::store(x, e);
      acc[j] = v::add(acc[j], e);
    }
  for (int j = 0; j < heads; ++j) {
    float* x = sc + j * kMaxChunk;
    float total = v::reduce_add(acc[j]);
    for (int t = i; t < n; ++t) {
      x[t] = std::exp(x[t] - max_out[j]);
      total += x[t];
    }
    sum_out[j] = total;
  }
}

// How the fixed-size path blocks a head of D values for this tier's registers: P positions scored
// together (P * D / W widened K vectors), and J heads' accumulators per pass over V (J * D / W of them,
// plus D / W widened values).
template <int D>
struct Blocking {
  static constexpr int V = D / W;
  static constexpr int P = V * 4 <= v::kRegisters / 2 ? 4 : (V * 2 <= v::kRegisters / 2 ? 2 : 1);
  static constexpr int J = (V * 5 <= v::kRegisters) ? 4 : ((V * 3 <= v::kRegisters) ? 2 : 1);
};

// Softmax-weighted V rows for the J query heads j0.. of one KV head: each V row is read and widened once
// for all J heads, and the J * D / W accumulators stay in registers.
template <typename T, int D, int J>
inline void weighted_values(const T* v_head, const int64_t* offsets, int n, const float* sc, float* acc_out) {
  constexpr int V = D / W;
  v::vf acc[J][V];
  for (int j = 0; j < J; ++j)
    for (int k = 0; k < V; ++k) acc[j][k] = v::zero();
  constexpr int kLines = (head_stride<T>(D) * static_cast<int>(sizeof(T)) + 63) / 64;
  for (int i = 0; i < n; ++i) {
    const T* row = v_head + offsets[i];
    const float row_weight = row_scale(row, D);
    if (i + kPrefetchAhead < n) {  // fetched here, not while scoring: a chunk's K rows would evict them first
      const char* ahead = reinterpret_cast<const char*>(v_head + offsets[i + kPrefetchAhead]);
      for (int line = 0; line < kLines; ++line) __builtin_prefetch(ahead + 64 * line, 0, 2);
    }
    v::vf x[V];
    for (int k = 0; k < V; ++k) x[k] = v::load(row + W * k);
    for (int j = 0; j < J; ++j) {
      const v::vf w = v::set1(sc[j * kMaxChunk + i] * row_weight);
      for (int k = 0; k < V; ++k) acc[j][k] = v::fmadd(w, x[k], acc[j][k]);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int k = 0; k < V; ++k) v::store(acc_out + j * D + W * k, acc[j][k]);
}

// One position's score the one-at-a-time way: the per-lane FMA chain over D values, then reduce_add.
template <typename T, int D>
inline float lane_dot(const float* q, const T* k) {  // times the row's scale, as dot
  v::vf a = v::mul(v::load(q), v::load(k));
  for (int c = 1; c < D / W; ++c) a = v::fmadd(v::load(q + W * c), v::load(k + W * c), a);
  return v::reduce_add(a) * row_scale(k, D);
}

// Each of g heads' softmax parts (scores kMaxChunk apart, up to four heads at a time).
inline void softmax_parts(float* sc_group, int g, int n, float* max_out, float* sum_out) {
  for (int j0 = 0; j0 < g; j0 += 4) {
    const int count = g - j0 < 4 ? g - j0 : 4;
    group_softmax_parts(sc_group + j0 * kMaxChunk, count, n, max_out + j0, sum_out + j0);
  }
}

// The rest of attend_kv_head once its g heads' scores sit in sc_group (kMaxChunk apart): each head's
// softmax parts, then its softmax-weighted V rows (v_head + offsets[i], J heads per pass).
template <typename T, int D>
inline void softmax_and_values(const T* v_head, const int64_t* offsets, int n, int g, float* sc_group,
                               float* max_out, float* sum_out, float* acc_out) {
  constexpr int J = Blocking<D>::J;
  softmax_parts(sc_group, g, n, max_out, sum_out);
  for (int j0 = 0; j0 < g; j0 += J) {
    const float* sc = sc_group + j0 * kMaxChunk;
    float* out = acc_out + static_cast<int64_t>(j0) * D;
    switch (g - j0 < J ? g - j0 : J) {
      case 1: weighted_values<T, D, 1>(v_head, offsets, n, sc, out); break;
      case 2: weighted_values<T, D, (J >= 2 ? 2 : 1)>(v_head, offsets, n, sc, out); break;
      case 3: weighted_values<T, D, (J >= 3 ? 3 : 1)>(v_head, offsets, n, sc, out); break;
      default: weighted_values<T, D, J>(v_head, offsets, n, sc, out); break;
    }
  }
}

// attend_chunk for a head size known at compile time (64, 128), one KV head: its K rows are widened
// once and scored against every query head of its group (P positions at a time: independent FMA chains
// and one shuffle reduction), then each V row once for up to J heads. offsets[0, n) locate the chunk's
// positions (chunk_offsets); q, max_out, sum_out and acc_out are the row's, for all heads.
template <typename T, int D>
void attend_kv_head(const float* q, const T* k_cache, const T* v_cache, const int64_t* offsets, int n, int masked,
                    int kv, const Shape& s, float* scores, float* max_out, float* sum_out, float* acc_out) {
  using B = Blocking<D>;
  constexpr int V = B::V, P = B::P;
  const int g = s.group;
  const T* k_head = k_cache + kv * kv_step<T>(s);
  const T* v_head = v_cache + kv * kv_step<T>(s);
  const float* q_group = q + static_cast<int64_t>(kv) * g * D;
  float* sc_group = scores + kv * g * kMaxChunk;
  int p = 0;
  for (; p + P <= n; p += P) {
    {  // fetch K rows ahead (V rows: weighted_values fetches its own)
      constexpr int kLines = (head_stride<T>(D) * static_cast<int>(sizeof(T)) + 63) / 64;
      for (int i = 0; i < P; ++i) {
        const int ahead = p + i + kPrefetchAhead < n ? p + i + kPrefetchAhead : p + i;
        const char* k_next = reinterpret_cast<const char*>(k_head + offsets[ahead]);
        for (int line = 0; line < kLines; ++line) __builtin_prefetch(k_next + 64 * line, 0, 2);
      }
    }
    v::vf k[P][V];
    float k_scales[4];
    for (int i = 0; i < P; ++i) {
      const T* row = k_head + offsets[p + i];
      k_scales[i] = row_scale(row, D);
      for (int c = 0; c < V; ++c) k[i][c] = v::load(row + W * c);
    }
    for (int j = 0; j < g; ++j) {
      const float* qj = q_group + j * D;
      v::vf a[4];
      for (int i = 0; i < P; ++i) {
        a[i] = v::mul(v::load(qj), k[i][0]);
        for (int c = 1; c < V; ++c) a[i] = v::fmadd(v::load(qj + W * c), k[i][c], a[i]);
      }
      for (int i = P; i < 4; ++i) a[i] = v::zero();
      float* sc = sc_group + j * kMaxChunk + p;
      if constexpr (P == 4 && !kScaled<T>) {  // scaled and stored as one vector, not four scalars
        v::reduce4(a[0], a[1], a[2], a[3], s.scale, sc);
      } else {
        float sums[4];
        v::reduce4(a[0], a[1], a[2], a[3], 1.f, sums);
        for (int i = 0; i < P; ++i) sc[i] = sums[i] * k_scales[i] * s.scale;
      }
    }
  }
  for (; p < n; ++p)
    for (int j = 0; j < g; ++j)
      sc_group[j * kMaxChunk + p] = lane_dot<T, D>(q_group + j * D, k_head + offsets[p]) * s.scale;
  if (masked > 0 || s.softcap > 0.f)
    for (int j = 0; j < g; ++j) cap_and_mask(sc_group + j * kMaxChunk, n, masked, s.softcap);
  softmax_and_values<T, D>(v_head, offsets, n, g, sc_group, max_out + kv * g, sum_out + kv * g,
                           acc_out + static_cast<int64_t>(kv * g) * D);
}

// How attend_kv_head reduces a position's lanes: the first n / P * P positions through reduce4 (whose
// four sums each depend on their own input only, so any four positions may share one), the rest one by
// one through reduce_add. The block path below keeps both, so its scores are bitwise attend_kv_head's.
template <int D>
inline int reduced_in_fours(int n) {
  constexpr int P = Blocking<D>::P;
  return n / P * P;
}

// Scores of two query vectors (qa, qb) over float32 K rows k_head + at[p], p in [lo, hi) (hi rounded
// up to four; at[] valid that far), each the per-lane FMA chain attend_kv_head runs: eight independent
// chains, where one query's four positions alone leave the FMA units waiting on their latency.
// k_scales[p]: an 8-bit cache's row scales (nullptr for other caches).
template <int D>
inline void score_two_queries(const float* qa, const float* qb, const float* k_head, const int64_t* at, int lo,
                              int hi, float scale, const float* k_scales, float* sa, float* sb) {
  constexpr int V = D / W;
  float sums[4];
  for (int p = lo; p < hi; p += 4) {
    const float* k[4] = {k_head + at[p], k_head + at[p + 1], k_head + at[p + 2], k_head + at[p + 3]};
    v::vf a[4], b[4];
    {
      const v::vf q0 = v::load(qa), r0 = v::load(qb);
      for (int i = 0; i < 4; ++i) {
        const v::vf x = v::load(k[i]);
        a[i] = v::mul(q0, x), b[i] = v::mul(r0, x);
      }
    }
    for (int c = 1; c < V; ++c) {
      const v::vf q = v::load(qa + W * c), r = v::load(qb + W * c);
      for (int i = 0; i < 4; ++i) {
        const v::vf x = v::load(k[i] + W * c);
        a[i] = v::fmadd(q, x, a[i]), b[i] = v::fmadd(r, x, b[i]);
      }
    }
    if (k_scales) {
      v::reduce4(a[0], a[1], a[2], a[3], 1.f, sums);
      for (int i = 0; i < 4; ++i) sa[p + i] = sums[i] * k_scales[p + i] * scale;
      v::reduce4(b[0], b[1], b[2], b[3], 1.f, sums);
      for (int i = 0; i < 4; ++i) sb[p + i] = sums[i] * k_scales[p + i] * scale;
    } else {
      v::reduce4(a[0], a[1], a[2], a[3], scale, sa + p);
      v::reduce4(b[0], b[1], b[2], b[3], scale, sb + p);
    }
  }
}

// Softmax-weighted float32 V rows for J query heads of one row (scores kMaxChunk apart, outputs D apart),
// C vectors of the head at a time: each V vector loaded once for the J heads, the J * C accumulators in
// registers. Per lane the same FMA sequence as weighted_values (an 8-bit cache's row scales already in sc).
template <int D, int J>
inline void weighted_float_values(const float* v_head, const int64_t* at, int n, const float* sc, float* out) {
  constexpr int V = D / W;
  constexpr int C = J * V + J + 1 <= v::kRegisters ? V : (J * (V / 2) + J + 1 <= v::kRegisters ? V / 2 : V / 4);
  static_assert(C >= 1 && V % C == 0, "head size must split into register blocks");
  for (int c0 = 0; c0 < V; c0 += C) {
    v::vf acc[J][C];
    for (int j = 0; j < J; ++j)
      for (int c = 0; c < C; ++c) acc[j][c] = v::zero();
    for (int p = 0; p < n; ++p) {
      const float* row = v_head + at[p] + W * c0;
      v::vf w[J];
      for (int j = 0; j < J; ++j) w[j] = v::set1(sc[j * kMaxChunk + p]);
      for (int c = 0; c < C; ++c) {
        const v::vf x = v::load(row + W * c);
        for (int j = 0; j < J; ++j) acc[j][c] = v::fmadd(w[j], x, acc[j][c]);
      }
    }
    for (int j = 0; j < J; ++j)
      for (int c = 0; c < C; ++c) v::store(out + j * D + W * (c0 + c), acc[j][c]);
  }
}

// Where attend_kv_head_rows finds position p's K/V row of a KV head, for p up to n_max rounded up to
// four (the extra ones repeat position 0, read and never used): the paged cache itself for a float32
// cache (offsets from chunk_offsets), else the widened copy, D floats a position. The same for every
// KV head.
template <typename T, int D>
inline void block_row_offsets(const int64_t* offsets, int n_max, int64_t* at) {
  const int padded = (n_max + 3) / 4 * 4;
  for (int p = 0; p < padded; ++p) {
    const int from = p < n_max ? p : 0;
    at[p] = std::is_same_v<T, float> ? offsets[from] : static_cast<int64_t>(from) * D;
  }
}

// attend_kv_head for a run of rows of one sequence (a prefill block) over the same chunk, as a small
// matrix product: the chunk's K and V rows of this KV head are widened to float32 once for all rows (in
// `widened`, 2 * kMaxChunk * D floats; a float32 cache is read in place; an 8-bit cache's row scales go
// to `scales`, 2 * (kMaxChunk + 4) floats, and are applied per row as attend_kv_head does), then scored 64 positions at a
// time (kept in L1) against every row's query heads two by two, and summed into values three heads at a
// time. Each row's result is bitwise what attend_kv_head gives it alone. scores holds count * g heads'
// scores (kMaxChunk apart); at, from block_row_offsets, locates positions [0, n_max rounded up to four).
template <typename T, int D>
void attend_kv_head_rows(const float* const* q_rows, const int* contexts, const int* starts, const size_t* part_at,
                         int count, const T* k_cache, const T* v_cache, const int64_t* offsets, int n_max, int lo,
                         int len, int kv, const Shape& s, float* scores, float* widened, float* scales,
                         int64_t* at, float* part_max, float* part_sum, float* part_acc) {
  constexpr int kSubBlock = 64;
  const int g = s.group;
  const int padded = (n_max + 3) / 4 * 4;
  const float *k_head, *v_head;
  const float *k_scales = nullptr, *v_scales = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    k_head = k_cache + kv * kv_step<T>(s), v_head = v_cache + kv * kv_step<T>(s);
  } else {
    float* kw = widened;
    float* vw = widened + kMaxChunk * D;
    for (int p = 0; p < n_max; ++p) {
      const T* k = k_cache + offsets[p] + kv * kv_step<T>(s);
      const T* x = v_cache + offsets[p] + kv * kv_step<T>(s);
      for (int c = 0; c < D; c += W) v::store(kw + p * D + c, v::load(k + c)), v::store(vw + p * D + c, v::load(x + c));
      if constexpr (kScaled<T>) scales[p] = row_scale(k, D), scales[kMaxChunk + 4 + p] = row_scale(x, D);
    }
    k_head = kw, v_head = vw;
    if constexpr (kScaled<T>) {
      for (int p = n_max; p < padded; ++p) scales[p] = scales[0];  // the padding repeats position 0
      k_scales = scales, v_scales = scales + kMaxChunk + 4;
    }
  }
  // A row's positions in this chunk, counted from lo (none where the chunk ends before its window starts).
  auto positions = [&](int i) {
    if (contexts[i] <= lo || starts[i] >= lo + len) return 0;
    return (contexts[i] < lo + len ? contexts[i] : lo + len) - lo;
  };
  const int queries = count * g;  // query vector u: row u / g, head kv * g + u % g
  auto query = [&](int u) { return q_rows[u / g] + static_cast<int64_t>(kv * g + u % g) * D; };
  for (int pb = 0; pb < padded; pb += kSubBlock) {
    const int pe = pb + kSubBlock < padded ? pb + kSubBlock : padded;
    for (int u = 0; u < queries; u += 2) {
      const int w = u + 1 < queries ? u + 1 : u;  // an odd last query is scored twice
      const int n = positions(u / g) > positions(w / g) ? positions(u / g) : positions(w / g);
      const int hi = ((n < pe ? n : pe) + 3) / 4 * 4;
      if (hi > pb)
        score_two_queries<D>(query(u), query(w), k_head, at, pb, hi, s.scale, k_scales, scores + u * kMaxChunk,
                             scores + w * kMaxChunk);
    }
  }
  for (int i = 0; i < count; ++i) {
    const int n = positions(i);
    if (n == 0) continue;
    float* sc_row = scores + i * g * kMaxChunk;
    for (int j = 0; j < g; ++j)  // positions attend_kv_head reduces one by one
      for (int p = reduced_in_fours<D>(n); p < n; ++p)
        sc_row[j * kMaxChunk + p] = (k_scales ? lane_dot<float, D>(query(i * g + j), k_head + at[p]) * k_scales[p]
                                               : lane_dot<float, D>(query(i * g + j), k_head + at[p])) * s.scale;
    const int masked = starts[i] > lo ? starts[i] - lo : 0;
    if (masked > 0 || s.softcap > 0.f)
      for (int j = 0; j < g; ++j) cap_and_mask(sc_row + j * kMaxChunk, n, masked, s.softcap);
    const size_t heads = part_at[i] + static_cast<size_t>(kv) * g;
    softmax_parts(sc_row, g, n, part_max + heads, part_sum + heads);
    if (v_scales)  // each weight times its V row's scale, as weighted_values does
      for (int j = 0; j < g; ++j)
        for (int p = 0; p < n; ++p) sc_row[j * kMaxChunk + p] *= v_scales[p];
    for (int j0 = 0; j0 < g; j0 += 3) {
      const float* sc = sc_row + j0 * kMaxChunk;
      float* out = part_acc + (heads + j0) * D;
      switch (g - j0 < 3 ? g - j0 : 3) {
        case 1: weighted_float_values<D, 1>(v_head, at, n, sc, out); break;
        case 2: weighted_float_values<D, 2>(v_head, at, n, sc, out); break;
        default: weighted_float_values<D, 3>(v_head, at, n, sc, out); break;
      }
    }
  }
}

// Consecutive rows of one sequence over one chunk of positions (a one-token query is a run of one): the
// positions are located once, and per KV head the rows take turns while its K/V rows are still in cache
// (L1, or L2 for larger heads). Each row runs the same code as alone (attend_kv_head for head sizes 64
// and 128 on vector tiers; attend_chunk otherwise), so its result is bitwise the same. Rows whose context
// ends before the chunk, or whose window (starts[i]: its first visible position) begins after it, are skipped. part_at[i] is where row i's partial results go.
// KV heads [kv_lo, kv_hi) only, where heads_split_ok (the head-size-specialised path); all of them
// otherwise.
inline bool heads_split_ok(const Shape& s) { return W >= 4 && (s.head_dim == 64 || s.head_dim == 128); }

template <typename T>
void attend_rows(const float* const* q_rows, const int* contexts, const int* starts, const size_t* part_at, int count,
                 const T* k_cache, const T* v_cache, const int32_t* table, int lo, int len, const Shape& s,
                 int kv_lo, int kv_hi, float* scores, int64_t* offsets, float* part_max, float* part_sum,
                 float* part_acc) {
  const int d = s.head_dim;
  if constexpr (W >= 4) {
    auto rows_with_kv_heads = [&](auto head_dim) {
      constexpr int D = decltype(head_dim)::value;
      int longest = 0;
      for (int i = 0; i < count; ++i) longest = contexts[i] > longest ? contexts[i] : longest;
      const int n_max = (longest < lo + len ? longest : lo + len) - lo;
      chunk_offsets(table, lo, n_max, s.block_size, block_elems<T>(s), pos_step<T>(s), offsets);
      if (count > 1) {
        thread_local std::vector<float> widened, row_scales, block_scores;
        thread_local std::vector<int64_t> at;
        widened.resize(2 * kMaxChunk * D);
        row_scales.resize(2 * (kMaxChunk + 4));
        block_scores.resize(static_cast<size_t>(count) * s.group * kMaxChunk);
        at.resize(kMaxChunk + 4);
        block_row_offsets<T, D>(offsets, n_max, at.data());
        for (int kv = kv_lo; kv < kv_hi; ++kv)
          attend_kv_head_rows<T, D>(q_rows, contexts, starts, part_at, count, k_cache, v_cache, offsets, n_max, lo,
                                    len, kv, s, block_scores.data(), widened.data(), row_scales.data(), at.data(),
                                    part_max, part_sum, part_acc);
        return;
      }
      for (int kv = kv_lo; kv < kv_hi; ++kv)
        for (int i = 0; i < count; ++i) {
          if (contexts[i] <= lo || starts[i] >= lo + len) continue;
          const int n = (contexts[i] < lo + len ? contexts[i] : lo + len) - lo;
          const size_t at = part_at[i];
          attend_kv_head<T, D>(q_rows[i], k_cache, v_cache, offsets, n, starts[i] > lo ? starts[i] - lo : 0, kv, s,
                               scores, part_max + at, part_sum + at, part_acc + at * d);
        }
    };
    if (d == 64) return rows_with_kv_heads(std::integral_constant<int, 64>());
    if (d == 128) return rows_with_kv_heads(std::integral_constant<int, 128>());
  }
  for (int i = 0; i < count; ++i) {
    if (contexts[i] <= lo || starts[i] >= lo + len) continue;
    const int hi = contexts[i] < lo + len ? contexts[i] : lo + len;
    const size_t at = part_at[i];
    attend_chunk(q_rows[i], k_cache, v_cache, table, lo, hi, starts[i] > lo ? starts[i] - lo : 0, s, scores, offsets, part_max + at, part_sum + at,
                 part_acc + at * d);
  }
}

}  // namespace kvflow::attention
