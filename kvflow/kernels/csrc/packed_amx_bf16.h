// Prefill-sized matmuls on bfloat16 AMX tiles straight from the packed weights (see kvflow_cpu.h,
// kvflow_packed_matmul_bf16): the rate of oneDNN's bfloat16 matmul without holding a bfloat16 copy of the
// weights (2 bytes a weight: 212 MB for the default model, 16 GB for an 8B one).
//
// Each thread takes two column groups (32 outputs) at a time, turns their codes over the whole input into
// bfloat16 panels in the tiles' pair layout, w = code * scale + offset rounded to nearest even (bitwise
// the copy's values), then runs every row through them, summing in float32 tiles over all blocks. The
// weights are read once a step; the dequantizing costs a few percent of a prompt chunk's matmul.
#pragma once

#include <immintrin.h>

#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "packed_amx.h"
#include "packed_common.h"
#include "packed_vnni.h"

namespace kvflow::packed {

constexpr int kPanelBlockBytes = 1024;  // one block of one group: 16 pair rows x 16 columns x 2 bfloat16

// Group g's codes, block by block, as bfloat16 pairs: in block b, row p (64 bytes) holds inputs 2p and
// 2p + 1 of each of the 16 columns, the B layout of TDPBF16PS.
inline void group_panel(const KvflowPackedWeight& w, int64_t g, uint16_t* panel) {
  const int64_t nb = w.k / kBlock;
  const size_t chunk = chunk_bytes(w);
  const size_t code_bytes = packed::code_bytes(w);
  alignas(64) uint8_t wide[512];
  const uint8_t* group = w.data + static_cast<size_t>(g) * nb * chunk;
  const __m512i byte = _mm512_set1_epi32(0xff);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* at = group + b * chunk;
    prefetch_ahead(at, chunk);
    // 8 rows of 64 bytes: row q, bytes 4c .. 4c + 3 are column c's codes of inputs 4q .. 4q + 3.
    const uint8_t* codes = at;
    if (w.bits != 8) {
      widen_codes(at, w.bits, w.codebook, wide);
      codes = wide;
    }
    __m512 scale, offset;
    vnni::scales_offsets(w, g, b, at + code_bytes, &scale, &offset);
    uint16_t* out = panel + b * (kPanelBlockBytes / 2);
    for (int q = 0; q < 8; ++q) {
      const __m512i four = _mm512_loadu_si512(codes + 64 * q);  // lane c: column c's four codes
      __m512i bf[4];
      for (int i = 0; i < 4; ++i) {
        const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(four, 8 * i), byte)),
                                         scale, offset);
        bf[i] = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
      }
      _mm512_store_si512(out + 64 * q, _mm512_or_si512(bf[0], _mm512_slli_epi32(bf[1], 16)));
      _mm512_store_si512(out + 64 * q + 32, _mm512_or_si512(bf[2], _mm512_slli_epi32(bf[3], 16)));
    }
  }
}

inline void configure_bf16_tiles() {
  // tmm0, tmm1: 16 rows x 32 inputs of x (two row tiles); tmm2, tmm3: one block of two groups' panels;
  // tmm4 .. tmm7: float32 sums, 16 rows x 16 columns, for each row tile and group.
  kvflow::TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  kvflow::load_tile_config(c);
}

// Column groups [g_lo, g_hi) for rows [0, m) of x (bfloat16, x_stride elements a row; rows past m up to a
// multiple of 32 are read from tail, 32 rows of k, zero past m). y: bfloat16, y_stride elements a row.
inline void amx_bf16_groups(const KvflowPackedWeight& w, int64_t g_lo, int64_t g_hi, const uint16_t* x,
                            int64_t x_stride, const uint16_t* tail, int m, uint16_t* y, int64_t y_stride) {
  const int64_t nb = w.k / kBlock;
  thread_local std::vector<uint16_t> panels_store;
  panels_store.resize(static_cast<size_t>(2 * nb) * (kPanelBlockBytes / 2) + 32);
  uint16_t* panel0 = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(panels_store.data()) + 63) & ~uintptr_t{63});
  uint16_t* panel1 = panel0 + nb * (kPanelBlockBytes / 2);
  alignas(64) float sums[4][256];
  const int full = m / 32 * 32;  // rows read straight from x; the rest from tail
  configure_bf16_tiles();
  for (int64_t g = g_lo; g < g_hi; g += 2) {
    const bool two = g + 1 < g_hi;
    group_panel(w, g, panel0);
    if (two) group_panel(w, g + 1, panel1);
    for (int r0 = 0; r0 < m; r0 += 32) {
      const uint16_t* a = r0 < full ? x + r0 * x_stride : tail;
      const int64_t a_stride = (r0 < full ? x_stride : w.k) * 2;
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t b = 0; b < nb; ++b) {
        _tile_loadd(0, a + b * kBlock, a_stride);
        _tile_loadd(1, a + 16 * (a_stride / 2) + b * kBlock, a_stride);
        _tile_loadd(2, panel0 + b * (kPanelBlockBytes / 2), 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(6, 1, 2);
        if (two) {
          _tile_loadd(3, panel1 + b * (kPanelBlockBytes / 2), 64);
          _tile_dpbf16ps(5, 0, 3);
          _tile_dpbf16ps(7, 1, 3);
        }
      }
      _tile_stored(4, sums[0], 64);
      _tile_stored(6, sums[2], 64);
      if (two) {
        _tile_stored(5, sums[1], 64);
        _tile_stored(7, sums[3], 64);
      }
      const int valid = m - r0 < 32 ? m - r0 : 32;
      for (int half = 0; half < (two ? 2 : 1); ++half) {
        const int64_t col = (g + half) * 16, left = w.n - col;
        const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
        for (int i = 0; i < valid; ++i) {
          const float* s = sums[(i >= 16 ? 2 : 0) + half] + 16 * (i & 15);
          _mm256_mask_storeu_epi16(y + (r0 + i) * y_stride + col, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(s)));
        }
      }
    }
  }
  _tile_release();
}

}  // namespace kvflow::packed
