// Rows times packed 4-, 6- or 8-bit weights, with integer dot products: AVX512-VNNI (and AMX int8 tiles for
// several rows), AVX2 (with AVX-VNNI where the CPU has it), ARM NEON dotprod (and i8mm for row pairs), or
// the generic kernel's 16-bit multiplies (SSE2, NEON without dotprod, plain C++), whichever this tier's
// library was built for.
//
// Decode reads every weight once per step and does two flops with it, so its speed is how cheaply the
// packed bytes become products. The layout (kvflow_cpu.h) puts 16 output columns side by side, 4
// inputs each, so one 64-byte vector of codes (after masking out a nibble) is the unsigned operand of
// one vpdpbusd: 64 multiply-adds into 16 int32 column sums. The row's inputs are quantized per block of
// the weight's (32 inputs, or 16) to 16-bit integers x = s * (256 h + l) with h, l signed bytes; two vpdpbusd (h and l digits) give
// the block's exact integer dot product with the codes. Relative to the block's largest input the
// quantization error is 2^-16, finer than bfloat16's 2^-9 per element. The block's sum is then scaled
// by the column's weight scale times the block's input scale, and offset times input sum is added.
// Work is split by output columns only, so each column's sum runs in the same order whatever the row
// count or thread count: a row's result does not depend on the batch. Every tier computes the same exact
// integer sums and the same float epilogue, so the tiers' results are bitwise equal (tests hold them to it),
// but for the generic tier on x86 without FMA: there each multiply-add rounds twice (packed_generic.h).
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvflow_cpu.h"
#include "packed_common.h"
#include "threads.h"
#include "tuning.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "packed_vnni.h"
using Kernel = kvflow::packed::Vnni;
constexpr int32_t kPath = 4;
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KVFLOW_HAVE_AMX 1
#include "packed_amx.h"
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVFLOW_HAVE_AMX_BF16 1
#include "packed_amx_bf16.h"
#endif
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "packed_avx2.h"
using Kernel = kvflow::packed::Avx2;
#ifdef KVFLOW_AVX2_VNNI
constexpr int32_t kPath = 6;
#else
constexpr int32_t kPath = 2;
#endif
#elif defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
#include "packed_neon.h"
using Kernel = kvflow::packed::Neon;
#ifdef KVFLOW_NEON_I8MM
constexpr int32_t kPath = 7;
#else
constexpr int32_t kPath = 3;
#endif
#else
#include "packed_generic.h"
using Kernel = kvflow::packed::Generic;
constexpr int32_t kPath = 1;
#define KVFLOW_WIDE_INPUTS 1
#endif

using kvflow::packed::kBlock;
using kvflow::packed::Rows;

namespace {

// Rows [0, rows) of x (x_stride apart) quantized per block of the weight's into digits and block
// statistics, as every entry point below quantizes its inputs.
void quantize_inputs(const float* x, int64_t x_stride, int rows, int64_t k, int block, bool eight, int8_t* hi,
                     int8_t* lo, float* scale, float* sum) {
  const int64_t nb = k / block;
  for (int r = 0; r < rows; ++r) {
    if (eight)
      Kernel::quantize_row8(x + r * x_stride, k, block, hi + r * k, scale + r * nb, sum + r * nb);
    else
      Kernel::quantize_row(x + r * x_stride, k, block, hi + r * k, lo + r * k, scale + r * nb, sum + r * nb);
  }
}

// The rows as the kernel reads them: the generic one takes 16-bit inputs, made once a call (Rows::wide).
Rows for_kernel(const Rows& rows, int m) {
#if defined(KVFLOW_WIDE_INPUTS)
  return Kernel::widened(rows, m);
#else
  (void)m;
  return rows;
#endif
}

}  // namespace

extern "C" int32_t kvflow_packed_matmul_path(void) {
#if defined(KVFLOW_HAVE_AMX)
  return kvflow::amx_permitted() ? 5 : kPath;
#else
  return kPath;
#endif
}

extern "C" int32_t kvflow_packed_codebook(int32_t book, uint8_t* out) {
  if (book < 0 || book > kvflow::packed::kCodebooks) return -1;
  std::memcpy(out, kvflow::packed::kCodebook[book], 16);
  return 0;
}

extern "C" int32_t kvflow_packed_matmul(const KvflowPackedWeight* w, const float* x, int64_t x_stride, int32_t m,
                                        float* y, int64_t y_stride, int32_t input_bits, int32_t num_threads) {
  if (!kvflow::packed::valid_layout(*w) || m <= 0 || (input_bits != 8 && input_bits != 16))
    return -1;
  const int block = w->block;
  const int64_t nb = w->k / block;
  const bool eight = input_bits == 8;
#ifdef KVFLOW_HAVE_AMX
  // The AMX tiles hold blocks of 32; a weight of 16-input blocks runs on VNNI.
  const bool amx = !eight && block == kBlock && kvflow::packed::prefer_amx(*w, m) && kvflow::amx_permitted();
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
  quantize_inputs(x, x_stride, m, w->k, block, eight, hi, lo, scale, sum);
  for (int r = m; r < padded; ++r) {  // rows a tile reads but nobody uses: zeros, not stale bytes
    std::memset(hi + r * w->k, 0, w->k);
    std::memset(lo + r * w->k, 0, w->k);
    std::memset(scale + r * nb, 0, sizeof(float) * nb);
    std::memset(sum + r * nb, 0, sizeof(float) * nb);
  }
  const Rows rows = for_kernel({hi, eight ? nullptr : lo, w->k, scale, sum, nb}, m);
  const int64_t groups = (w->n + 15) / 16;
  // A thread team costs a few microseconds to wake: only tiny matrices run on the calling thread. One
  // thread streams weights from DRAM at about half the rate two do, so even a decode step's smaller
  // projections are split (benchmarks/RESULTS.md, session 6).
  const int team = groups * w->k * m >= 16 * 1024 ? num_threads : 1;
  kvflow::parallel(team, [&](kvflow::Team& workers) {
    const int t = workers.thread(), nt = workers.threads();
    const int64_t g_lo = groups * t / nt, g_hi = groups * (t + 1) / nt;
#ifdef KVFLOW_HAVE_AMX
    if (amx) {
      (tile_rows == 8 ? kvflow::packed::amx_groups<8> : kvflow::packed::amx_groups<16>)(*w, g_lo, g_hi, rows, m, y,
                                                                                        y_stride);
      return;
    }
#endif
    kvflow::packed::run_groups<Kernel>(*w, g_lo, g_hi, rows, m, y, y_stride);
  });
  return 0;
}

extern "C" int32_t kvflow_packed_matmul_bf16(const KvflowPackedWeight* w, const uint16_t* x, int64_t x_stride,
                                             int32_t m, uint16_t* y, int64_t y_stride, int32_t num_threads) {
#ifdef KVFLOW_HAVE_AMX_BF16
  if (!kvflow::packed::valid_layout(*w) || w->block != kBlock || m <= 0 || x_stride < w->k || y_stride < w->n ||
      !kvflow::amx_permitted())
    return -1;
  // The last rows short of a whole pair of tiles, zero-padded: a tile reads 32 rows.
  const int full = m / 32 * 32;
  thread_local std::vector<uint16_t> tail;
  tail.assign(static_cast<size_t>(32) * w->k, 0);
  for (int r = full; r < m; ++r)
    std::memcpy(tail.data() + static_cast<size_t>(r - full) * w->k, x + r * x_stride, sizeof(uint16_t) * w->k);
  const int64_t groups = (w->n + 15) / 16, pairs = (groups + 1) / 2;
  const uint16_t* padded = tail.data();
  kvflow::parallel(num_threads > 0 ? num_threads : 1, [&](kvflow::Team& workers) {
    const int t = workers.thread(), nt = workers.threads();
    const int64_t g_lo = 2 * (pairs * t / nt), g_hi = std::min<int64_t>(groups, 2 * (pairs * (t + 1) / nt));
    if (g_lo < g_hi) kvflow::packed::amx_bf16_groups(*w, g_lo, g_hi, x, x_stride, padded, m, y, y_stride);
  });
  return 0;
#else
  (void)w, (void)x, (void)x_stride, (void)m, (void)y, (void)y_stride, (void)num_threads;
  return -1;  // only the AMX tier's library has it
#endif
}

extern "C" int32_t kvflow_packed_matmul_many(const KvflowPackedWeight* w, int32_t count, const int32_t* rows,
                                             const float* x, int64_t x_stride, float* y, int64_t y_stride,
                                             int32_t input_bits, int32_t num_threads) {
  if (count <= 0) return count == 0 ? 0 : -1;
  const int64_t k = w[0].k;
  const int block = w[0].block;
  for (int i = 0; i < count; ++i)
    if (w[i].k != k || w[i].block != block || !kvflow::packed::valid_layout(w[i]) || w[i].n > y_stride ||
        (rows && rows[i] < 0))
      return -1;
  if ((input_bits != 8 && input_bits != 16) || (rows && x_stride == 0)) return -1;
  const bool eight = input_bits == 8;
  const int64_t nb = k / block;
  // first_row[i]: where weight i's rows start; cost[i]: the work before weight i (column groups x rows).
  thread_local std::vector<int64_t> first_row, cost;
  first_row.assign(count + 1, 0);
  cost.assign(count + 1, 0);
  for (int i = 0; i < count; ++i) {
    const int64_t m = rows ? rows[i] : 1;
    first_row[i + 1] = first_row[i] + m;
    cost[i + 1] = cost[i] + (w[i].n + 15) / 16 * m;
  }
  // Every input row quantized once, as kvflow_packed_matmul quantizes it (one row, where all share it).
  const int64_t inputs = x_stride == 0 ? 1 : first_row[count];
  thread_local std::vector<int8_t> digits;
  thread_local std::vector<float> block_stats;
  digits.resize(static_cast<size_t>(2 * inputs) * k);
  block_stats.resize(static_cast<size_t>(2 * inputs) * nb);
  int8_t* hi = digits.data();
  int8_t* lo = hi + static_cast<size_t>(inputs) * k;
  float* scale = block_stats.data();
  float* sum = scale + static_cast<size_t>(inputs) * nb;
  quantize_inputs(x, x_stride, static_cast<int>(inputs), k, block, eight, hi, lo, scale, sum);
  const Rows all = for_kernel({hi, eight ? nullptr : lo, k, scale, sum, nb}, static_cast<int>(inputs));
  const int64_t total = cost[count];
  const int64_t* const starts = cost.data();
  const int64_t* const row0 = first_row.data();
  const int team = total * k >= 16 * 1024 ? num_threads : 1;
  kvflow::parallel(team, [&](kvflow::Team& workers) {
    // Each thread takes one contiguous share of the work; weight i's column groups split where the shares'
    // ends fall in it (rounded up to whole groups), so every group runs on exactly one thread.
    const int t = workers.thread(), nt = workers.threads();
    const int64_t c_lo = total * t / nt, c_hi = total * (t + 1) / nt;
    for (int i = 0; i < count; ++i) {
      const int64_t m = row0[i + 1] - row0[i], groups = (w[i].n + 15) / 16;
      if (m == 0) continue;
      auto group_at = [&](int64_t c) {
        const int64_t g = (c - starts[i] + m - 1) / m;
        return g < 0 ? 0 : g > groups ? groups : g;
      };
      const int64_t g_lo = group_at(c_lo), g_hi = group_at(c_hi);
      if (g_lo < g_hi)
        kvflow::packed::run_groups<Kernel>(w[i], g_lo, g_hi, all.from(x_stride == 0 ? 0 : static_cast<int>(row0[i])),
                                           static_cast<int>(m), y + row0[i] * y_stride, y_stride);
    }
  });
  return 0;
}
