// GGUF block bytes straight into the packed matmul's layout (kvflow_cpu.h), one pass, no temporaries
// beyond one row: what kvflow/layers/quant/packing.py decodes and kernels/packed_matmul.py packs, for
// loading. Each type's row is decoded into unsigned codes with a float32 scale and offset per sub-block
// (exactly as packing.py does), the scales rounded to float16 (nearest even, as torch's .half()), and
// written into the layout; several tensors fuse along the output dim, each with an optional row order.
// Tests hold the bytes equal to the Python path's for every type.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvflow_cpu.h"
#include "packed_common.h"
#include "simd.h"
#include "threads.h"

namespace {

// ggml's type ids (ggml.h), for the types the packed kernel holds.
enum GgmlType : int32_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13,
  kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23, kMXFP4 = 39,
};

using kvflow::packed::kCodebook;

// The codebook of a type whose nibbles index a table (kvflow_cpu.h), else 0.
int32_t codebook_of(int32_t type) {
  switch (type) {
    case kIQ4_NL: case kIQ4_XS: return 1;
    case kMXFP4: return 2;
    default: return 0;
  }
}

// A table type's code for nibble i: the index itself where the packed weight keeps the codebook (MXFP4's
// -0, index 8, as +0, index 0: the same weight, and the one index packed_matmul.pack writes), else its
// 8-bit code.
inline uint8_t table_code(int32_t type, int i, bool indices) {
  if (!indices) return kCodebook[codebook_of(type)][i];
  return type == kMXFP4 && i == 8 ? 0 : static_cast<uint8_t>(i);
}

using kvflow::packed::half_value;

// A Q4_K or Q5_K block's own scales, undecoded: d and dmin (float16 bits) and its 8 sub-blocks' 6-bit sc
// and m (decode_block's scale d * sc and offset -(dmin * m)).
void k_scales(const uint8_t* b, uint16_t* d, uint16_t* dmin, uint8_t* sc, uint8_t* m) {
  std::memcpy(d, b, 2);
  std::memcpy(dmin, b + 2, 2);
  const uint8_t* sm = b + 4;
  for (int j = 0; j < 8; ++j) {
    sc[j] = static_cast<uint8_t>(j < 4 ? sm[j] & 63 : (sm[j + 4] & 15) | ((sm[j - 4] >> 6) << 4));
    m[j] = static_cast<uint8_t>(j < 4 ? sm[j + 4] & 63 : (sm[j + 4] >> 4) | ((sm[j] >> 6) << 4));
  }
}

// The codes' centre c of a symmetric type (w = scale (q - c): offset = -c scale, not stored), else 0.
int32_t centre_of(int32_t type) {
  switch (type) {
    case kQ8_0: case kIQ4_NL: case kIQ4_XS: case kMXFP4: return 128;
    case kQ5_0: return 16;
    case kQ4_0: return 8;
    case kQ6_K: return 32;
    case kQ3_K: return 4;
    default: return 0;
  }
}

// The bits the type's codes (as decode_block gives them) need: a table type's indices 4, its codes 8.
int code_bits(int32_t type, bool indices) {
  switch (type) {
    case kIQ4_NL: case kIQ4_XS: case kMXFP4: return indices ? 4 : 8;
    case kQ8_0: return 8;
    case kQ6_K: return 6;
    case kQ5_0: case kQ5_1: case kQ5_K: return 5;
    default: return 4;
  }
}

// The type's elements and bytes per block, and inputs per scale; false for a type not held here.
bool block_shape(int32_t type, int* elements, int* bytes, int* group) {
  switch (type) {
    case kQ8_0: *elements = 32; *bytes = 34; *group = 32; return true;
    case kQ4_0: *elements = 32; *bytes = 18; *group = 32; return true;
    case kQ4_1: *elements = 32; *bytes = 20; *group = 32; return true;
    case kQ5_0: *elements = 32; *bytes = 22; *group = 32; return true;
    case kQ5_1: *elements = 32; *bytes = 24; *group = 32; return true;
    case kIQ4_NL: *elements = 32; *bytes = 18; *group = 32; return true;
    case kMXFP4: *elements = 32; *bytes = 17; *group = 32; return true;
    case kQ4_K: *elements = 256; *bytes = 144; *group = 32; return true;
    case kQ5_K: *elements = 256; *bytes = 176; *group = 32; return true;
    case kQ6_K: *elements = 256; *bytes = 210; *group = 16; return true;
    case kQ3_K: *elements = 256; *bytes = 110; *group = 16; return true;
    case kQ2_K: *elements = 256; *bytes = 84; *group = 16; return true;
    case kIQ4_XS: *elements = 256; *bytes = 136; *group = 32; return true;
    default: return false;
  }
}

// One block of a type: codes q[elements], and per sub-block scale[] and offset[] (w = scale q + offset).
// indices: a table type's codes are its nibbles (the packed weight keeps the codebook).
void decode_block(int32_t type, const uint8_t* b, uint8_t* q, float* scale, float* offset, bool indices) {
  switch (type) {
    case kQ8_0: {
      const float d = half_value(b);
      for (int i = 0; i < 32; ++i) q[i] = static_cast<uint8_t>(static_cast<int8_t>(b[2 + i]) + 128);
      scale[0] = d, offset[0] = -128.f * d;
      return;
    }
    case kQ4_0:
    case kQ4_1:
    case kIQ4_NL: {
      const uint8_t* qs = b + (type == kQ4_1 ? 4 : 2);
      for (int i = 0; i < 16; ++i) q[i] = qs[i] & 15, q[i + 16] = qs[i] >> 4;
      const float d = half_value(b);
      scale[0] = d;
      if (type == kQ4_1) offset[0] = half_value(b + 2);
      if (type == kQ4_0) offset[0] = -8.f * d;
      if (type == kIQ4_NL) {
        for (int i = 0; i < 32; ++i) q[i] = table_code(type, q[i], indices);
        offset[0] = -128.f * d;
      }
      return;
    }
    case kMXFP4: {  // e (E8M0), then nibbles as Q4_0's: w = 2^(e - 128) * (doubled E2M1 value)
      for (int i = 0; i < 16; ++i)
        q[i] = table_code(type, b[1 + i] & 15, indices), q[i + 16] = table_code(type, b[1 + i] >> 4, indices);
      // Only a power of two that float16 holds exactly is kept; any other makes the packer refuse (NaN).
      const int e = b[0] - 128;
      scale[0] = e >= -24 && e <= 15 ? std::ldexp(1.f, e) : NAN;
      offset[0] = -128.f * scale[0];
      return;
    }
    case kQ5_0:
    case kQ5_1: {
      const int at = type == kQ5_1 ? 4 : 2;
      uint32_t qh;
      std::memcpy(&qh, b + at, 4);
      const uint8_t* qs = b + at + 4;
      for (int i = 0; i < 16; ++i) {
        q[i] = static_cast<uint8_t>((qs[i] & 15) | (((qh >> i) & 1) << 4));
        q[i + 16] = static_cast<uint8_t>((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
      }
      const float d = half_value(b);
      scale[0] = d;
      if (type == kQ5_1) {
        offset[0] = half_value(b + 2);
      } else {  // d (q5 - 16)
        offset[0] = -16.f * d;
      }
      return;
    }
    case kQ4_K:
    case kQ5_K: {
      const float d = half_value(b), dmin = half_value(b + 2);
      uint16_t d_bits, dmin_bits;
      uint8_t sc[8], m[8];
      k_scales(b, &d_bits, &dmin_bits, sc, m);
      for (int j = 0; j < 8; ++j) scale[j] = d * static_cast<float>(sc[j]), offset[j] = -(dmin * static_cast<float>(m[j]));
      const uint8_t* qs = b + (type == kQ5_K ? 48 : 16);
      for (int p = 0; p < 4; ++p)  // 32 bytes per pair of sub-blocks: low nibbles 2p, high ones 2p + 1
        for (int i = 0; i < 32; ++i) q[64 * p + i] = qs[32 * p + i] & 15, q[64 * p + 32 + i] = qs[32 * p + i] >> 4;
      if (type == kQ5_K)  // bit j of high byte i: sub-block j's element i
        for (int j = 0; j < 8; ++j)
          for (int i = 0; i < 32; ++i) q[32 * j + i] |= static_cast<uint8_t>(((b[16 + i] >> j) & 1) << 4);
      return;
    }
    case kQ6_K: {  // element 128 h + 64 nib + 32 w + l: nibble nib of ql[64 h + 32 w + l], pair 2 nib + w of qh[32 h + l]
      const uint8_t *ql = b, *qh = b + 128;
      for (int h = 0; h < 2; ++h)
        for (int nib = 0; nib < 2; ++nib)
          for (int w = 0; w < 2; ++w)
            for (int l = 0; l < 32; ++l)
              q[128 * h + 64 * nib + 32 * w + l] = static_cast<uint8_t>(
                  ((ql[64 * h + 32 * w + l] >> (4 * nib)) & 15) | (((qh[32 * h + l] >> (2 * (2 * nib + w))) & 3) << 4));
      const float d = half_value(b + 208);
      for (int j = 0; j < 16; ++j) {
        scale[j] = d * static_cast<float>(static_cast<int8_t>(b[192 + j]));
        offset[j] = -32.f * scale[j];
      }
      return;
    }
    case kQ3_K:
    case kQ2_K: {  // 2-bit codes: element 128 h + 32 j + l is bits 2 j of byte 32 h + l
      const uint8_t* qs = b + (type == kQ3_K ? 32 : 16);
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 4; ++j)
          for (int l = 0; l < 32; ++l) q[128 * h + 32 * j + l] = (qs[32 * h + l] >> (2 * j)) & 3;
      if (type == kQ2_K) {
        const float d = half_value(b + 80), dmin = half_value(b + 82);
        for (int s = 0; s < 16; ++s)
          scale[s] = d * static_cast<float>(b[s] & 15), offset[s] = -(dmin * static_cast<float>(b[s] >> 4));
        return;
      }
      for (int h = 0; h < 2; ++h)  // the high bit: bit 4 h + j of byte l
        for (int j = 0; j < 4; ++j)
          for (int l = 0; l < 32; ++l) q[128 * h + 32 * j + l] |= static_cast<uint8_t>(((b[l] >> (4 * h + j)) & 1) << 2);
      const uint8_t* sc = b + 96;  // scale s: low 4 bits from byte s % 8 (high nibble from 8), top 2 from byte 8 + s % 4
      const float d = half_value(b + 108);
      for (int s = 0; s < 16; ++s) {
        const int low = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4;
        const int top = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
        scale[s] = d * static_cast<float>((low | (top << 4)) - 32);
        offset[s] = -4.f * scale[s];
      }
      return;
    }
    case kIQ4_XS: {
      const float d = half_value(b);
      const int high = b[2] | (b[3] << 8);
      for (int j = 0; j < 8; ++j) {
        const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4);
        scale[j] = d * static_cast<float>(ls - 32), offset[j] = -128.f * scale[j];
        const uint8_t* qs = b + 8 + 16 * j;
        for (int i = 0; i < 16; ++i)
          q[32 * j + i] = table_code(type, qs[i] & 15, indices), q[32 * j + 16 + i] = table_code(type, qs[i] >> 4, indices);
      }
      return;
    }
    default:
      return;
  }
}

bool to_half(float x, kvflow::float16* out) {  // nearest float16; false where it is not finite
  *out = static_cast<kvflow::float16>(x);
  return std::isfinite(static_cast<float>(*out));
}

}  // namespace

extern "C" int32_t kvflow_pack_gguf(const KvflowGgufPart* parts, int32_t count, int64_t k, int32_t bits, int32_t block,
                                    int32_t centre, int32_t codebook, uint8_t* out, uint8_t* super_out,
                                    int32_t num_threads) {
  if (count <= 0 || !kvflow::packed::valid_bits(bits) || !kvflow::packed::valid_block(block) || k <= 0) return -1;
  if (codebook && (bits != 4 || centre != 128 || super_out)) return -1;
  const bool indices = codebook != 0;
  if (super_out) {  // the K-quants' own scales: every part Q4_K or Q5_K, blocks of 32
    if (block != 32 || centre || k % kvflow::packed::kSuperInputs) return -1;
    for (int32_t p = 0; p < count; ++p)
      if (parts[p].type != kQ4_K && parts[p].type != kQ5_K) return -1;
  }
  int64_t n = 0;
  for (int32_t p = 0; p < count; ++p) {
    int elements, bytes, group;
    if (!block_shape(parts[p].type, &elements, &bytes, &group) || k % elements || group % block ||
        parts[p].row_bytes != k / elements * bytes || code_bits(parts[p].type, indices) > bits ||
        parts[p].rows <= 0 || (centre && centre_of(parts[p].type) != centre) ||
        (indices && codebook_of(parts[p].type) != codebook))
      return -1;
    n += parts[p].rows;
  }
  const int64_t groups = (n + 15) / 16, blocks = k / block;
  const KvflowPackedWeight layout{nullptr, 0, k, bits, centre ? 0 : 1, block, centre, super_out, codebook};
  const size_t code_bytes = kvflow::packed::code_bytes(layout), chunk = kvflow::packed::chunk_bytes(layout);
  const int64_t supers = k / kvflow::packed::kSuperInputs;
  std::atomic<int32_t> failed{0};
  kvflow::parallel(num_threads, [&](kvflow::Team& team) {
    // A group's 16 rows decoded side by side, then its chunks written in order, once each.
    std::vector<uint8_t> q(16 * k);
    std::vector<float> scale(k), offset(k);  // per column, k / 16 sub-blocks at most
    std::vector<uint8_t> wide(64 * 8);        // one block of 32 as 8-bit code rows, for 4- and 6-bit weights
    // With super_out, per column: sc and m bytes per block of 32, d and dmin bits per 256 inputs.
    std::vector<uint8_t> sub_sc(super_out ? 16 * (k / 32) : 0), sub_m(sub_sc.size());
    std::vector<uint16_t> super_d(super_out ? 16 * supers : 0), super_dmin(super_d.size());
    int groups_of[16];
    team.for_dynamic(static_cast<int>(groups), [&](int g) {
      for (int c = 0; c < 16; ++c) {
        uint8_t* qc = q.data() + c * k;
        float *sc = scale.data() + c * (k / 16), *oc = offset.data() + c * (k / 16);
        int64_t row = g * 16 + c;
        if (row >= n) {  // columns past n: zero codes, scales and offsets
          std::memset(qc, 0, k);
          std::fill(sc, sc + k / 16, 0.f), std::fill(oc, oc + k / 16, 0.f);
          groups_of[c] = 16;
          if (super_out) {
            std::fill(sub_sc.begin() + c * (k / 32), sub_sc.begin() + (c + 1) * (k / 32), 0);
            std::fill(sub_m.begin() + c * (k / 32), sub_m.begin() + (c + 1) * (k / 32), 0);
            std::fill(super_d.begin() + c * supers, super_d.begin() + (c + 1) * supers, 0);
            std::fill(super_dmin.begin() + c * supers, super_dmin.begin() + (c + 1) * supers, 0);
          }
          continue;
        }
        int32_t p = 0;
        while (row >= parts[p].rows) row -= parts[p++].rows;
        const KvflowGgufPart& part = parts[p];
        const int64_t src = part.row_order ? part.row_order[row] : row;
        int elements, bytes;
        block_shape(part.type, &elements, &bytes, &groups_of[c]);
        const uint8_t* in = part.data + src * part.row_bytes;
        const int per_block = elements / groups_of[c];
        for (int64_t e = 0; e < k / elements; ++e)
          decode_block(part.type, in + e * bytes, qc + e * elements, sc + e * per_block, oc + e * per_block, indices);
        if (super_out)
          for (int64_t e = 0; e < supers; ++e) {
            k_scales(in + e * bytes, &super_d[c * supers + e], &super_dmin[c * supers + e],
                     &sub_sc[c * (k / 32) + 8 * e], &sub_m[c * (k / 32) + 8 * e]);
            if (!std::isfinite(half_value(in + e * bytes)) || !std::isfinite(half_value(in + e * bytes + 2)))
              failed.store(1, std::memory_order_relaxed);
          }
      }
      uint8_t* at = out + static_cast<size_t>(g) * blocks * chunk;
      for (int64_t b = 0; b < blocks; ++b, at += chunk) {
        const int64_t i0 = b * block;
        // The block as 8-bit code rows first (row r: inputs 4 r + t, 4 bytes a column); 4-bit rows are then
        // pairs of them, row 2 r in the low nibbles and 2 r + 1 in the high ones, and a 6-bit block's rows
        // of top bits fours of them (row 4 p + i in bits 2 i, 2 i + 1): 64-byte loops that vectorize.
        uint8_t* rows8 = bits == 8 ? at : wide.data();
        for (int r = 0; r < block / 4; ++r)
          for (int j = 0; j < 16; ++j) std::memcpy(rows8 + 64 * r + 4 * j, q.data() + j * k + i0 + 4 * r, 4);
        if (bits != 8)
          for (int r = 0; r < block / 8; ++r)
            for (int x = 0; x < 64; ++x)
              at[64 * r + x] = static_cast<uint8_t>((rows8[128 * r + x] & 15) | ((rows8[128 * r + 64 + x] & 15) << 4));
        if (bits == 6) {
          uint8_t* top = at + kvflow::packed::top_bits_at(block);
          for (int p = 0; p < block / 16; ++p)
            for (int x = 0; x < 64; ++x) {
              const uint8_t* four = rows8 + 256 * p + x;
              top[64 * p + x] = static_cast<uint8_t>((four[0] >> 4) | ((four[64] >> 4) << 2) | ((four[128] >> 4) << 4) |
                                                     ((four[192] >> 4) << 6));
            }
        }
        if (super_out) {  // sc and m bytes here; d and dmin once per 256 inputs
          for (int j = 0; j < 16; ++j) {
            at[code_bytes + j] = sub_sc[j * (k / 32) + b];
            at[code_bytes + 16 + j] = sub_m[j * (k / 32) + b];
          }
          if (b % 8 == 0) {
            uint8_t* d = super_out + (static_cast<size_t>(g) * supers + b / 8) * 64;
            for (int j = 0; j < 16; ++j) {
              std::memcpy(d + 2 * j, &super_d[j * supers + b / 8], 2);
              std::memcpy(d + 32 + 2 * j, &super_dmin[j * supers + b / 8], 2);
            }
          }
          continue;
        }
        for (int j = 0; j < 16; ++j) {
          const int64_t sub = j * (k / 16) + (groups_of[j] == 16 ? i0 >> 4 : i0 >> 5);
          kvflow::float16 sh, oh;
          if (!to_half(scale[sub], &sh) || (!centre && !to_half(offset[sub], &oh)))  // a centred offset is derived
            failed.store(1, std::memory_order_relaxed);
          std::memcpy(at + code_bytes + 2 * j, &sh, 2);
          if (!centre) std::memcpy(at + code_bytes + 32 + 2 * j, &oh, 2);
        }
      }
    });
  });
  return failed.load() ? -2 : 0;
}
