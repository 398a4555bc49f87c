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
#include "tuning.h"

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

#if defined(KVFLOW_HAVE_VNNI)
#include "packed_vnni.h"
#endif
#if defined(KVFLOW_HAVE_AMX)
#include "packed_amx.h"
#endif

namespace {
#if defined(KVFLOW_HAVE_VNNI)
using namespace kvflow::packed;
#endif
}  // namespace


extern "C" int32_t kvflow_packed_matmul_level(void) {
#if defined(KVFLOW_HAVE_AMX)
  return kvflow::amx_permitted() ? 2 : 1;
#elif defined(KVFLOW_HAVE_VNNI)
  return 1;
#else
  return 0;
#endif
}

extern "C" int32_t kvflow_packed_matmul(const KvflowPackedWeight* w, const float* x, int64_t x_stride, int32_t m,
                                        float* y, int64_t y_stride, int32_t num_threads) {
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
  // thread streams weights from DRAM at about half the rate two do, so even a decode step's smaller
  // projections are split (benchmarks/RESULTS.md, session 6).
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

