// A few rows times packed 4- or 8-bit weights (decode steps), with AVX512-VNNI integer dot products.
//
// Decode reads every weight once per step and does two flops with it, so its speed is how cheaply the
// packed bytes become products. The layout (kvflow_cpu.h) puts 16 output columns side by side, 4
// inputs each, so one 64-byte vector of codes (after masking out a nibble) is the unsigned operand of
// one vpdpbusd: 64 multiply-adds into 16 int32 column sums. The row's inputs are quantized per block of
// 32 to 16-bit integers x = s * (256 h + l) with h, l signed bytes; two vpdpbusd (h and l digits) give
// the block's exact integer dot product with the codes. Relative to the block's largest input the
// quantization error is 2^-16, finer than bfloat16's 2^-9 per element. The block's sum is then scaled
// by the column's weight scale times the block's input scale, and offset times input sum is added.
// Work is split by output columns only, so each column's sum runs in the same order whatever the row
// count or thread count: a row's result does not depend on the batch.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvflow_cpu.h"
#include "row_ops.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVFLOW_HAVE_VNNI 1
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KVFLOW_HAVE_AMX 1
#include "amx_tiles.h"
#endif
#endif

namespace {

#ifdef KVFLOW_HAVE_VNNI

constexpr int kBlock = 32;
constexpr int32_t kMaxInt = 32639;  // |x| <= this keeps the high digit h = (x + 128) >> 8 within a signed byte
// How far ahead in each column group's bytes tile_group asks for weights. The hardware prefetcher alone
// left a decode step's matrices at 15 GB/s from DRAM here; 1280 bytes (4 blocks of Q4_1) ahead gave 7%
// more at one row and 15 to 20% at 4 and 8 rows, where the integer work hides behind the loads.
constexpr size_t kPrefetchBytes = 1280;

inline void prefetch_ahead(const uint8_t* block, size_t bytes) {  // the bytes kPrefetchBytes past block
  for (size_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes + line), _MM_HINT_T0);
}

struct Rows {  // the rows' inputs as digits h, l (int8 [m, k]) and per block: scale and sum of the inputs
  const int8_t* hi;
  const int8_t* lo;
  int64_t stride;
  const float* scale;
  const float* sum;
  int64_t blocks;
};

// One row's inputs -> digits, per block of 32: s = max|x| / kMaxInt, x_int = round(x / s).
void quantize_row(const float* x, int64_t k, int8_t* hi, int8_t* lo, float* scale, float* sum) {
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + b * kBlock), v1 = _mm512_loadu_ps(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, sign_off), _mm512_and_ps(v1, sign_off)));
    const float s = amax / kMaxInt;
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? kMaxInt / amax : 0.f);
    __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));  // round to nearest even
    __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
    const __m512i lim = _mm512_set1_epi32(kMaxInt), neg = _mm512_set1_epi32(-kMaxInt);
    q0 = _mm512_max_epi32(_mm512_min_epi32(q0, lim), neg);  // x / s can round past the bound by an ulp
    q1 = _mm512_max_epi32(_mm512_min_epi32(q1, lim), neg);
    const __m512i c128 = _mm512_set1_epi32(128);
    const __m512i h0 = _mm512_srai_epi32(_mm512_add_epi32(q0, c128), 8), h1 = _mm512_srai_epi32(_mm512_add_epi32(q1, c128), 8);
    const __m512i l0 = _mm512_sub_epi32(q0, _mm512_slli_epi32(h0, 8)), l1 = _mm512_sub_epi32(q1, _mm512_slli_epi32(h1, 8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + b * kBlock), _mm512_cvtepi32_epi8(h0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + b * kBlock + 16), _mm512_cvtepi32_epi8(h1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + b * kBlock), _mm512_cvtepi32_epi8(l0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + b * kBlock + 16), _mm512_cvtepi32_epi8(l1));
    scale[b] = s;
    sum[b] = s * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

inline __m512i broadcast4(const int8_t* p) {  // four input digits, in every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline size_t chunk_bytes(const KvflowPackedWeight& w) {
  return (w.bits == 4 ? 256 : 512) + (w.has_offset ? 64 : 32);
}

// Columns [16 g0, 16 (g0 + G)) for M rows: acc[r][g] holds 16 columns of row r.
template <int M, int G>
void tile_group(const KvflowPackedWeight& w, int64_t g0, const Rows& rows, float* y, int64_t y_stride) {
  const int64_t nb = w.k / kBlock;
  const size_t chunk = chunk_bytes(w);
  const size_t code_bytes = w.bits == 4 ? 256 : 512;
  const bool has_offset = w.has_offset != 0;
  const uint8_t* base[G];
  for (int g = 0; g < G; ++g) base[g] = w.data + static_cast<size_t>(g0 + g) * nb * chunk;
  const __m512i low_nibble = _mm512_set1_epi8(0x0f);
  __m512 acc[M][G];
  for (int r = 0; r < M; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i sum_hi[M][G], sum_lo[M][G];
    for (int r = 0; r < M; ++r)
      for (int g = 0; g < G; ++g) sum_hi[r][g] = sum_lo[r][g] = _mm512_setzero_si512();
    const size_t at = static_cast<size_t>(b) * chunk;
    for (int g = 0; g < G; ++g) prefetch_ahead(base[g] + at, chunk);
    auto step = [&](int quad, const __m512i* codes) {  // codes[g]: 16 columns x inputs 4 quad .. 4 quad + 3
      __m512i xh[M], xl[M];
      for (int r = 0; r < M; ++r) {
        xh[r] = broadcast4(rows.hi + r * rows.stride + b * kBlock + 4 * quad);
        xl[r] = broadcast4(rows.lo + r * rows.stride + b * kBlock + 4 * quad);
      }
      for (int g = 0; g < G; ++g)
        for (int r = 0; r < M; ++r) {
          sum_hi[r][g] = _mm512_dpbusd_epi32(sum_hi[r][g], codes[g], xh[r]);
          sum_lo[r][g] = _mm512_dpbusd_epi32(sum_lo[r][g], codes[g], xl[r]);
        }
    };
    if (w.bits == 4) {
      for (int row = 0; row < 4; ++row) {  // 64 bytes: low nibbles are inputs 8 row .. +3, high +4 .. +7
        __m512i lo[G], hi[G];
        for (int g = 0; g < G; ++g) {
          const __m512i v = _mm512_loadu_si512(base[g] + at + 64 * row);
          lo[g] = _mm512_and_si512(v, low_nibble);
          hi[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibble);
        }
        step(2 * row, lo);
        step(2 * row + 1, hi);
      }
    } else {
      for (int row = 0; row < 8; ++row) {
        __m512i codes[G];
        for (int g = 0; g < G; ++g) codes[g] = _mm512_loadu_si512(base[g] + at + 64 * row);
        step(row, codes);
      }
    }
    for (int g = 0; g < G; ++g) {
      const uint8_t* s = base[g] + at + code_bytes;
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
      const __m512 offset =
          has_offset ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32))) : _mm512_setzero_ps();
      for (int r = 0; r < M; ++r) {
        // 256 h + l: below 2^24 in magnitude for 4-bit codes, so exact in float32.
        const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(sum_hi[r][g], 8), sum_lo[r][g]);
        const __m512 col_scale = _mm512_mul_ps(scale, _mm512_set1_ps(rows.scale[r * rows.blocks + b]));
        acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), col_scale, acc[r][g]);
        if (has_offset) acc[r][g] = _mm512_fmadd_ps(offset, _mm512_set1_ps(rows.sum[r * rows.blocks + b]), acc[r][g]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const int64_t col = (g0 + g) * 16;
    const int64_t left = w.n - col;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    for (int r = 0; r < M; ++r) _mm512_mask_storeu_ps(y + r * y_stride + col, mask, acc[r][g]);
  }
}

// Groups [g_lo, g_hi) for M rows, groups as wide as the registers allow.
template <int M>
void rows_block(const KvflowPackedWeight& w, int64_t g_lo, int64_t g_hi, const Rows& rows, float* y, int64_t ys) {
  constexpr int G = M == 1 ? 4 : (M == 2 ? 2 : 1);
  int64_t g = g_lo;
  for (; g + G <= g_hi; g += G) tile_group<M, G>(w, g, rows, y, ys);
  for (; g < g_hi; ++g) tile_group<M, 1>(w, g, rows, y, ys);
}

// Groups [g_lo, g_hi) for rows [0, m): four groups at a time, and for each, all rows four at a time, so
// the groups' bytes come from memory once and stay in L1 for the later rows. (Rows outside, groups
// inside, read them again per 4 rows, from L2 at best.)
void run_groups(const KvflowPackedWeight& w, int64_t g_lo, int64_t g_hi, const Rows& rows, int m, float* y,
                int64_t ys) {
  constexpr int64_t kGroupsAtOnce = 4;
  for (int64_t g0 = g_lo; g0 < g_hi; g0 += kGroupsAtOnce) {
    const int64_t g1 = g0 + kGroupsAtOnce < g_hi ? g0 + kGroupsAtOnce : g_hi;
    for (int r0 = 0; r0 < m; r0 += 4) {
      Rows part = rows;
      part.hi += r0 * rows.stride;
      part.lo += r0 * rows.stride;
      part.scale += r0 * rows.blocks;
      part.sum += r0 * rows.blocks;
      float* yr = y + r0 * ys;
      switch (m - r0 >= 4 ? 4 : m - r0) {
        case 1: rows_block<1>(w, g0, g1, part, yr, ys); break;
        case 2: rows_block<2>(w, g0, g1, part, yr, ys); break;
        case 3: rows_block<3>(w, g0, g1, part, yr, ys); break;
        default: rows_block<4>(w, g0, g1, part, yr, ys); break;
      }
    }
  }
}

#ifdef KVFLOW_HAVE_AMX
// Several rows: the same integer block sums from AMX tiles (TDPBSUD: signed input digits times unsigned
// codes), so the result is bitwise the one the VNNI path gives; only the speed differs. A tile op
// multiplies 16 rows by 16 columns over one block; the float epilogue is the VNNI path's, per row.
// The epilogue (per block, row and 16 columns) bounds it: from about 64 rows oneDNN's bfloat16 matmul
// on a dequantized copy is faster, so prefill-sized chunks do not come here in the default mode.
constexpr int kAmxMinRows = 16;  // below this the VNNI path is faster (measured with 960x576 to 576x1536)
// A wide, shallow matrix (the output head, 49152 x 576) goes to the tiles from 8 rows: an 8-row decode
// step's head took 3.5 ms there against 5.0 through VNNI, while the layers' matrices measured alike.
// Up to 8 rows the tiles are 8 rows high (half the epilogue and tile stores of 16): the Q8_0 head at 8
// rows took 23% less time that way, and with its weights prefetched 35% less. The layers' 4-bit matrices
// stayed 17% slower on 8-row tiles than through VNNI, so their threshold stays at 16.
constexpr int kAmxMinRowsWide = 8;

bool prefer_amx(const KvflowPackedWeight& w, int m) {
  return m >= kAmxMinRows || (m >= kAmxMinRowsWide && w.n >= 16 * w.k);
}

void configure_tiles(int tile_rows) {
  // tmm0, tmm1: digits h, l of tile_rows rows x one block (32 bytes); tmm2: one block of one column
  // group's codes (8 rows of 4 inputs x 16 columns); tmm4, tmm5: int32 sums of h and l, tile_rows rows x
  // 16 columns.
  kvflow::TileConfig c;
  for (int t : {0, 1}) c.rows[t] = static_cast<uint8_t>(tile_rows), c.colsb[t] = 32;
  c.rows[2] = 8, c.colsb[2] = 64;
  for (int t : {4, 5}) c.rows[t] = static_cast<uint8_t>(tile_rows), c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// 4-bit codes of one block -> 8 rows of 64 unsigned bytes (row 2r: low nibbles of row r, 2r + 1: high).
inline void widen_codes(const uint8_t* src, uint8_t* dst) {
  const __m512i low_nibble = _mm512_set1_epi8(0x0f);
  for (int r = 0; r < 4; ++r) {
    const __m512i v = _mm512_loadu_si512(src + 64 * r);
    _mm512_store_si512(dst + 128 * r, _mm512_and_si512(v, low_nibble));
    _mm512_store_si512(dst + 128 * r + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibble));
  }
}

// Column groups [g_lo, g_hi) for rows [0, m), in tiles of R rows (8 or 16). Digit rows and their block
// scales and sums are padded to a multiple of R rows. Per group and R rows, the R accumulators stay in
// registers over all blocks.
template <int R>
void amx_groups(const KvflowPackedWeight& w, int64_t g_lo, int64_t g_hi, const Rows& rows, int m, float* y,
                int64_t ys) {
  configure_tiles(R);
  const int64_t nb = w.k / kBlock;
  const size_t chunk = chunk_bytes(w);
  const size_t code_bytes = w.bits == 4 ? 256 : 512;
  const bool has_offset = w.has_offset != 0;
  thread_local std::vector<uint8_t> wide_store;  // widened 4-bit codes of one group, 64-byte aligned below
  wide_store.resize(static_cast<size_t>(nb) * 512 + 64);
  uint8_t* wide = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(wide_store.data()) + 63) & ~uintptr_t{63});
  alignas(64) int32_t sum_hi[256], sum_lo[256];
  for (int64_t g = g_lo; g < g_hi; ++g) {
    const uint8_t* group = w.data + static_cast<size_t>(g) * nb * chunk;
    if (w.bits == 4)
      for (int64_t b = 0; b < nb; ++b) {
        prefetch_ahead(group + b * chunk, chunk);
        widen_codes(group + b * chunk, wide + b * 512);
      }
    const int64_t left = w.n - g * 16;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    for (int r0 = 0; r0 < m; r0 += R) {
      __m512 acc[R];
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* at = group + b * chunk;
        if (w.bits != 4 && r0 == 0) prefetch_ahead(at, chunk);
        _tile_loadd(2, w.bits == 4 ? wide + b * 512 : at, 64);
        _tile_loadd(0, rows.hi + r0 * rows.stride + b * kBlock, rows.stride);
        _tile_loadd(1, rows.lo + r0 * rows.stride + b * kBlock, rows.stride);
        _tile_zero(4);
        _tile_zero(5);
        _tile_dpbsud(4, 0, 2);
        _tile_dpbsud(5, 1, 2);
        _tile_stored(4, sum_hi, 64);
        _tile_stored(5, sum_lo, 64);
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + code_bytes)));
        const __m512 offset = has_offset
                                  ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + code_bytes + 32)))
                                  : _mm512_setzero_ps();
        const float* row_scale = rows.scale + r0 * rows.blocks + b;
        const float* row_sum = rows.sum + r0 * rows.blocks + b;
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {  // the VNNI path's epilogue, operation for operation
          const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sum_hi + 16 * i), 8),
                                               _mm512_load_si512(sum_lo + 16 * i));
          const __m512 col_scale = _mm512_mul_ps(scale, _mm512_set1_ps(row_scale[i * rows.blocks]));
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), col_scale, acc[i]);
          if (has_offset) acc[i] = _mm512_fmadd_ps(offset, _mm512_set1_ps(row_sum[i * rows.blocks]), acc[i]);
        }
      }
      const int valid = m - r0 < R ? m - r0 : R;
      for (int i = 0; i < valid; ++i) _mm512_mask_storeu_ps(y + (r0 + i) * ys + g * 16, mask, acc[i]);
    }
  }
  _tile_release();
}
#endif  // KVFLOW_HAVE_AMX

#endif  // KVFLOW_HAVE_VNNI

}  // namespace

extern "C" int kvflow_packed_matmul(const KvflowPackedWeight* w, const float* x, int64_t x_stride, int m, float* y,
                                    int64_t y_stride, int num_threads) {
#ifdef KVFLOW_HAVE_VNNI
  if (w->k % kBlock || (w->bits != 4 && w->bits != 8) || m <= 0) return -1;
  const int64_t nb = w->k / kBlock;
#ifdef KVFLOW_HAVE_AMX
  const bool amx = prefer_amx(*w, m) && kvflow::amx_permitted();
#else
  const bool amx = false;
#endif
  const int tile_rows = m <= 8 ? 8 : 16;
  const int padded = amx ? (m + tile_rows - 1) / tile_rows * tile_rows : m;  // AMX reads whole tiles
  thread_local std::vector<int8_t> digits;
  thread_local std::vector<float> block_stats;
  digits.resize(static_cast<size_t>(2 * padded) * w->k);
  block_stats.resize(static_cast<size_t>(2 * padded) * nb);
  int8_t* hi = digits.data();
  int8_t* lo = hi + static_cast<size_t>(padded) * w->k;
  float* scale = block_stats.data();
  float* sum = scale + static_cast<size_t>(padded) * nb;
  for (int r = 0; r < m; ++r)
    quantize_row(x + r * x_stride, w->k, hi + r * w->k, lo + r * w->k, scale + r * nb, sum + r * nb);
  for (int r = m; r < padded; ++r) {  // rows a tile reads but nobody uses: zeros, not stale bytes
    std::memset(hi + r * w->k, 0, w->k);
    std::memset(lo + r * w->k, 0, w->k);
    std::memset(scale + r * nb, 0, sizeof(float) * nb);
    std::memset(sum + r * nb, 0, sizeof(float) * nb);
  }
  const Rows rows{hi, lo, w->k, scale, sum, nb};
  const int64_t groups = (w->n + 15) / 16;
  // A thread team costs a few microseconds to wake: only tiny matrices run on the calling thread. One
  // thread streams weights from DRAM at about half the rate two do, so a layer's qkv, o and down
  // projections (0.3 to 0.9 M weights) are split too: 25% faster per decode step's matrices.
  const int team = groups * w->k * m >= 16 * 1024 ? num_threads : 1;
#pragma omp parallel num_threads(team) if (team > 1)
  {
#ifdef _OPENMP
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int t = 0, nt = 1;
#endif
#ifdef KVFLOW_HAVE_AMX
    if (amx)
      (tile_rows == 8 ? amx_groups<8> : amx_groups<16>)(*w, groups * t / nt, groups * (t + 1) / nt, rows, m, y,
                                                        y_stride);
    else
#endif
      run_groups(*w, groups * t / nt, groups * (t + 1) / nt, rows, m, y, y_stride);
  }
  return 0;
#else
  (void)w, (void)x, (void)x_stride, (void)m, (void)y, (void)y_stride, (void)num_threads;
  return -1;
#endif
}

namespace {

constexpr float kMaxIntValue = 32639.f;  // kMaxInt, also where the VNNI code is not built

// Column j of a packed weight times x, from the stored codes, summed in double: the exact product.
double exact_column(const KvflowPackedWeight& w, int64_t j, const float* x) {
  const int64_t nb = w.k / 32;
  const size_t chunk = (w.bits == 4 ? 256 : 512) + (w.has_offset ? 64 : 32);
  const size_t code_bytes = w.bits == 4 ? 256 : 512;
  const int c = static_cast<int>(j % 16);
  const uint8_t* group = w.data + static_cast<size_t>(j / 16) * nb * chunk;
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* at = group + b * chunk;
    _Float16 scale16, offset16 = 0;
    std::memcpy(&scale16, at + code_bytes + 2 * c, 2);
    if (w.has_offset) std::memcpy(&offset16, at + code_bytes + 32 + 2 * c, 2);
    const double scale = static_cast<double>(scale16), offset = static_cast<double>(offset16);
    const float* xb = x + b * 32;
    double dot = 0.0, sum = 0.0;
    for (int k = 0; k < 32; ++k) {
      int q;
      if (w.bits == 4) {
        const uint8_t byte = at[64 * (k / 8) + 4 * c + k % 4];
        q = (k % 8) < 4 ? (byte & 0x0f) : (byte >> 4);
      } else {
        q = at[64 * (k / 4) + 4 * c + k % 4];
      }
      dot += static_cast<double>(q) * xb[k];
      sum += xb[k];
    }
    total += scale * dot + offset * sum;
  }
  return total;
}

}  // namespace

extern "C" int kvflow_packed_refine_top(const KvflowPackedWeight* w, const float* x, int64_t x_stride, int m,
                                        float* y, int64_t y_stride, const float* block_abs_sum) {
  const int64_t nb = w->k / 32;
  float w_max = 0.f;
  for (int64_t b = 0; b < nb; ++b) w_max = block_abs_sum[b] > w_max ? block_abs_sum[b] : w_max;
  int recomputed = 0;
  for (int r = 0; r < m; ++r) {
    const float* xr = x + r * x_stride;
    float* yr = y + r * y_stride;
    // The bound PackedLinear.error_bound states: half an input step per block times the block's |w| sum.
    float spread = 0.f, l1 = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) {
        const float v = std::fabs(xr[b * 32 + i]);
        amax = v > amax ? v : amax;
        l1 += v;
      }
      spread += amax * block_abs_sum[b];
    }
    const float bound = spread / (2.f * kMaxIntValue) * 1.01f + 1e-6f * l1 * w_max;
    const float floor = kvflow::largest(yr, w->n) - 2.f * bound;
    int64_t j = 0;
#ifdef KVFLOW_HAVE_VNNI
    const __m512 fv = _mm512_set1_ps(floor);
    for (; j + 16 <= w->n; j += 16) {
      __mmask16 near = _mm512_cmp_ps_mask(_mm512_loadu_ps(yr + j), fv, _CMP_GE_OQ);
      while (near) {
        const int i = __builtin_ctz(near);
        near &= near - 1;
        yr[j + i] = static_cast<float>(exact_column(*w, j + i, xr));
        ++recomputed;
      }
    }
#endif
    for (; j < w->n; ++j) {
      if (yr[j] >= floor) {
        yr[j] = static_cast<float>(exact_column(*w, j, xr));
        ++recomputed;
      }
    }
  }
  return recomputed;
}

extern "C" void kvflow_packed_rows(const KvflowPackedWeight* w, const int64_t* ids, int count, float* out) {
  const int64_t nb = w->k / 32;
  const size_t chunk = (w->bits == 4 ? 256 : 512) + (w->has_offset ? 64 : 32);
  const size_t code_bytes = w->bits == 4 ? 256 : 512;
  for (int i = 0; i < count; ++i) {
    const int c = static_cast<int>(ids[i] % 16);
    const uint8_t* group = w->data + static_cast<size_t>(ids[i] / 16) * nb * chunk;
    float* row = out + static_cast<int64_t>(i) * w->k;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* at = group + b * chunk;
      _Float16 scale16, offset16 = 0;
      std::memcpy(&scale16, at + code_bytes + 2 * c, 2);
      if (w->has_offset) std::memcpy(&offset16, at + code_bytes + 32 + 2 * c, 2);
      const float scale = static_cast<float>(scale16), offset = static_cast<float>(offset16);
      for (int k = 0; k < 32; ++k) {
        int q;
        if (w->bits == 4) {
          const uint8_t byte = at[64 * (k / 8) + 4 * c + k % 4];
          q = (k % 8) < 4 ? (byte & 0x0f) : (byte >> 4);
        } else {
          q = at[64 * (k / 4) + 4 * c + k % 4];
        }
        row[b * 32 + k] = static_cast<float>(q) * scale + offset;  // scale * q is exact: one rounding
      }
    }
  }
}
