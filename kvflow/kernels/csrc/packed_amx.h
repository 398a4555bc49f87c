// The packed matmul on AMX int8 tiles (see packed_matmul.cpp): the VNNI path's row digits and epilogue.
#pragma once

#include <immintrin.h>

#include <vector>

#include "amx_tiles.h"
#include "packed_common.h"
#include "packed_vnni.h"
#include "tuning.h"

namespace kvflow::packed {

// Several rows: the same integer block sums from AMX tiles (TDPBSUD: signed input digits times unsigned
// codes), so the result is bitwise the one the VNNI path gives; only the speed differs. A tile op
// multiplies 16 rows by 16 columns over one block; the float epilogue is the VNNI path's, per row.
// The epilogue (per block, row and 16 columns) bounds it: past a few dozen rows oneDNN's bfloat16 matmul
// on a dense copy is faster, so the executor sends prefill-sized steps there.
// Which rows go to the tiles: the executor's table sets the crossovers (kvflow_set_tuning). A wide, shallow
// matrix (an output head) pays off on tiles from fewer rows than the layers' matrices; up to 8 rows the
// tiles are 8 rows high (half the epilogue and tile stores of 16). Figures: benchmarks/RESULTS.md.
bool prefer_amx(const KvflowPackedWeight& w, int m) {
  const KvflowTuning& t = kvflow::tuning();
  return m >= t.packed_amx_min_rows || (m >= t.packed_amx_min_rows_wide && w.n >= 16 * w.k);
}

void configure_tiles(int tile_rows) {
  // tmm0, tmm1: digits h, l of tile_rows rows x one block (32 bytes); tmm2: one block of one column
  // group's codes (8 rows of 4 inputs x 16 columns); tmm4, tmm5: int32 sums of h and l, tile_rows rows x
  // 16 columns.
  kvflow::TileConfig c;
  for (int t : {0, 1}) c.rows[t] = static_cast<uint8_t>(tile_rows), c.colsb[t] = 32;
  c.rows[2] = 8, c.colsb[2] = 64;
  for (int t : {4, 5}) c.rows[t] = static_cast<uint8_t>(tile_rows), c.colsb[t] = 64;
  kvflow::load_tile_config(c);
}

// 4- or 6-bit codes of one block (4-bit ones through their codebook) -> 8 rows of 64 unsigned bytes (row 2r: the codes of row r's low nibbles,
// 2r + 1: of its high ones), the 8-bit layout the tiles read.
inline void widen_codes(const uint8_t* src, int bits, int codebook, uint8_t* dst) {
  const __m512i low_nibble = _mm512_set1_epi8(0x0f), book = vnni::codebook_vector(codebook);
  for (int r = 0; r < 4; ++r) {
    __m512i first, second;
    if (bits == 6) {
      vnni::six_bit_codes<kBlock>(src, r, &first, &second);
    } else {  // nibbles, through the codebook (the identity where there is none)
      const __m512i v = _mm512_loadu_si512(src + 64 * r);
      first = _mm512_shuffle_epi8(book, _mm512_and_si512(v, low_nibble));
      second = _mm512_shuffle_epi8(book, _mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibble));
    }
    _mm512_store_si512(dst + 128 * r, first);
    _mm512_store_si512(dst + 128 * r + 64, second);
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
  const size_t code_bytes = packed::code_bytes(w);
  const bool widened = w.bits != 8;  // 4- and 6-bit codes go to the tiles as 8-bit rows
  const bool any_offset = w.has_offset != 0 || w.centre != 0;
  thread_local std::vector<uint8_t> wide_store;  // widened codes of one group, 64-byte aligned below
  wide_store.resize(static_cast<size_t>(nb) * 512 + 64);
  uint8_t* wide = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(wide_store.data()) + 63) & ~uintptr_t{63});
  alignas(64) int32_t sum_hi[256], sum_lo[256];
  for (int64_t g = g_lo; g < g_hi; ++g) {
    const uint8_t* group = w.data + static_cast<size_t>(g) * nb * chunk;
    if (widened)
      for (int64_t b = 0; b < nb; ++b) {
        prefetch_ahead(group + b * chunk, chunk);
        widen_codes(group + b * chunk, w.bits, w.codebook, wide + b * 512);
      }
    const int64_t left = w.n - g * 16;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    for (int r0 = 0; r0 < m; r0 += R) {
      __m512 acc[R];
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* at = group + b * chunk;
        if (!widened && r0 == 0) prefetch_ahead(at, chunk);
        _tile_loadd(2, widened ? wide + b * 512 : at, 64);
        _tile_loadd(0, rows.hi + r0 * rows.stride + b * kBlock, rows.stride);
        _tile_loadd(1, rows.lo + r0 * rows.stride + b * kBlock, rows.stride);
        _tile_zero(4);
        _tile_zero(5);
        _tile_dpbsud(4, 0, 2);
        _tile_dpbsud(5, 1, 2);
        _tile_stored(4, sum_hi, 64);
        _tile_stored(5, sum_lo, 64);
        __m512 scale, offset;
        vnni::scales_offsets(w, g, b, at + code_bytes, &scale, &offset);
        const float* row_scale = rows.scale + r0 * rows.blocks + b;
        const float* row_sum = rows.sum + r0 * rows.blocks + b;
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {  // the VNNI path's epilogue, operation for operation
          const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sum_hi + 16 * i), 8),
                                               _mm512_load_si512(sum_lo + 16 * i));
          const __m512 col_scale = _mm512_mul_ps(scale, _mm512_set1_ps(row_scale[i * rows.blocks]));
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), col_scale, acc[i]);
          if (any_offset) acc[i] = _mm512_fmadd_ps(offset, _mm512_set1_ps(row_sum[i * rows.blocks]), acc[i]);
        }
      }
      const int valid = m - r0 < R ? m - r0 : R;
      for (int i = 0; i < valid; ++i) _mm512_mask_storeu_ps(y + (r0 + i) * ys + g * 16, mask, acc[i]);
    }
  }
  _tile_release();
}
}  // namespace kvflow::packed
