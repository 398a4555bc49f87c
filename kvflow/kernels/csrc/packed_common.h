// What every tier of the packed matmul shares: the layout's sizes, the rows' input digits, prefetching.
#pragma once

#include <cstddef>
#include <cstdint>

#include <xmmintrin.h>

#include "kvflow_cpu.h"

namespace kvflow::packed {

constexpr int kBlock = 32;
constexpr int32_t kMaxInt = 32639;  // |x| <= this keeps the high digit h = (x + 128) >> 8 within a signed byte
// How far ahead in each column group's bytes tile_group asks for weights: the hardware prefetcher alone
// leaves a decode step's matrices well below DRAM bandwidth (figures: benchmarks/RESULTS.md, session 6).
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

inline size_t chunk_bytes(const KvflowPackedWeight& w) {
  return (w.bits == 4 ? 256 : 512) + (w.has_offset ? 64 : 32);
}

}  // namespace kvflow::packed
