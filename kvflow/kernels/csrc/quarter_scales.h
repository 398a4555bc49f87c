// The float side of one block for the 128-bit kernels (packed_generic.h, packed_neon.h): columns 4q ..
// 4q + 3's scales and offsets (w = scale * code + offset) as int_vectors.h's four-lane floats.
#pragma once

#include "int_vectors.h"
#include "packed_common.h"

namespace kvflow::packed {

// block: the block's bytes (block b of group g); minus_centre: -w.centre in every lane.
inline void quarter_scales(const KvflowPackedWeight& w, int64_t g, int64_t b, const uint8_t* block, int q,
                           ivec::f32x4 minus_centre, ivec::f32x4* scale, ivec::f32x4* offset) {
  using namespace ivec;
  const size_t codes_end = code_bytes(w);
  if (w.super_scales) {  // d * sc, -(dmin * m) (kvflow_cpu.h)
    const uint8_t* d = super_at(w, g, b) + 8 * q;
    *scale = mul(halves(d), bytes4(block + codes_end + 4 * q));
    *offset = neg(mul(halves(d + 32), bytes4(block + codes_end + 16 + 4 * q)));
  } else {
    *scale = halves(block + codes_end + 8 * q);
    *offset = w.has_offset ? halves(block + codes_end + 32 + 8 * q) : mul(*scale, minus_centre);
  }
}

}  // namespace kvflow::packed
