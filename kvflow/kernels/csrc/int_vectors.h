// 128-bit vectors for the generic tier's packed matmul (packed_generic.h), on whatever the baseline of the
// target gives: SSE2 on every x86-64 CPU, NEON on every AArch64 one (the tier of ARMv8.0 cores without
// dotprod, such as the Raspberry Pi 4's Cortex-A72), and plain arrays elsewhere. The generic tier is built
// without -mavx2 or -march=native (kernels/build.py), so these are what such a CPU runs.
//
// Only the few operations the kernel needs: bytes to 16-bit lanes, 16-bit products summed into 32-bit
// lanes (SSE2's pmaddwd; NEON's multiply-accumulate), and a float epilogue's multiply-add, fused where the
// CPU has one (NEON's always; an x86 CPU without AVX2 rarely has FMA, and then it rounds twice).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"

// KVFLOW_PLAIN_VECTORS: the plain branch on any CPU, so the tests build and check it on this one too.
#if defined(__SSE2__) && !defined(KVFLOW_PLAIN_VECTORS)
#include <emmintrin.h>
#if defined(__FMA__) || defined(__F16C__)
#include <immintrin.h>
#endif
#define KVFLOW_IVEC_SSE2 1
#elif defined(__ARM_NEON) && defined(__aarch64__) && !defined(KVFLOW_PLAIN_VECTORS)
#include <arm_neon.h>
#define KVFLOW_IVEC_NEON 1
#endif

namespace kvflow::ivec {

#if defined(KVFLOW_IVEC_SSE2)

using u8x16 = __m128i;  // 16 unsigned bytes
using i16x8 = __m128i;
using i32x4 = __m128i;
using f32x4 = __m128;

inline u8x16 load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline u8x16 low_nibbles(u8x16 v) { return _mm_and_si128(v, _mm_set1_epi8(0x0f)); }
inline u8x16 high_nibbles(u8x16 v) { return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f)); }
inline u8x16 bytes_or(u8x16 a, u8x16 b) { return _mm_or_si128(a, b); }
// Bits 2s and 2s + 1 of each byte, moved to bits 4 and 5 (a 6-bit code's top pair above its nibble).
inline u8x16 top_pair(u8x16 v, int s) {
  const __m128i moved = s <= 2 ? _mm_slli_epi16(v, 4 - 2 * s) : _mm_srli_epi16(v, 2 * s - 4);
  return _mm_and_si128(moved, _mm_set1_epi8(0x30));
}
inline u8x16 lookup16(u8x16 index, const uint8_t* table) {  // table[index] per byte (indices < 16); no pshufb in SSE2
  alignas(16) uint8_t v[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(v), index);
  for (auto& i : v) i = table[i];
  return _mm_load_si128(reinterpret_cast<const __m128i*>(v));
}
inline void widen(u8x16 v, i16x8* lo, i16x8* hi) {  // bytes 0..7 and 8..15 as 16-bit lanes
  const __m128i zero = _mm_setzero_si128();
  *lo = _mm_unpacklo_epi8(v, zero);
  *hi = _mm_unpackhi_epi8(v, zero);
}
inline i16x8 load8(const int16_t* p) { return _mm_load_si128(reinterpret_cast<const __m128i*>(p)); }  // 16-byte aligned
// Two columns' dot products so far (a's lanes 0-3 are one column's, 4-7 the next's): pmaddwd's pair sums.
using dots = __m128i;
inline dots zero_dots() { return _mm_setzero_si128(); }
inline dots add_products(dots acc, i16x8 a, i16x8 b) { return _mm_add_epi32(acc, _mm_madd_epi16(a, b)); }
// The four columns' sums from two columns' dots each: [a0 + a1, a2 + a3, b0 + b1, b2 + b3]
inline i32x4 column_sums(dots a, dots b) {
  const __m128 fa = _mm_castsi128_ps(a), fb = _mm_castsi128_ps(b);
  return _mm_add_epi32(_mm_castps_si128(_mm_shuffle_ps(fa, fb, _MM_SHUFFLE(2, 0, 2, 0))),
                       _mm_castps_si128(_mm_shuffle_ps(fa, fb, _MM_SHUFFLE(3, 1, 3, 1))));
}

inline f32x4 to_float(i32x4 v) { return _mm_cvtepi32_ps(v); }
inline f32x4 splat(float x) { return _mm_set1_ps(x); }
inline f32x4 loadf(const float* p) { return _mm_loadu_ps(p); }
inline f32x4 zerof() { return _mm_setzero_ps(); }
inline f32x4 mul(f32x4 a, f32x4 b) { return _mm_mul_ps(a, b); }
inline f32x4 neg(f32x4 a) { return _mm_xor_ps(a, _mm_set1_ps(-0.f)); }
inline void store(float* p, f32x4 v) { _mm_storeu_ps(p, v); }

inline f32x4 bytes4(const uint8_t* p) {  // four unsigned bytes as floats
  int32_t v;
  std::memcpy(&v, p, 4);
  const __m128i zero = _mm_setzero_si128();
  return _mm_cvtepi32_ps(_mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(v), zero), zero));
}

// Four IEEE halves as floats, exactly (simd.h's half_bits where there is no F16C).
inline f32x4 halves(const uint8_t* p) {
#if defined(__F16C__)
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  return half_bits(_mm_unpacklo_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), _mm_setzero_si128()));
#endif
}

#if defined(__FMA__)
inline f32x4 multiply_add(f32x4 a, f32x4 b, f32x4 c) { return _mm_fmadd_ps(a, b, c); }
#else
// No fused multiply-add: the product is rounded, then the sum. The generic x86 tier's results may then
// differ from the other tiers' in the last bits (an exact emulation through double, held to std::fma on
// 400,000 cases, cost this kernel 40% of its time: benchmarks/RESULTS.md, session 30).
#define KVFLOW_IVEC_ROUNDS_TWICE 1
inline f32x4 multiply_add(f32x4 a, f32x4 b, f32x4 c) { return _mm_add_ps(_mm_mul_ps(a, b), c); }
#endif

#elif defined(KVFLOW_IVEC_NEON)

using u8x16 = uint8x16_t;
using i16x8 = int16x8_t;
using i32x4 = int32x4_t;
using f32x4 = float32x4_t;

inline u8x16 load16(const uint8_t* p) { return vld1q_u8(p); }
inline u8x16 low_nibbles(u8x16 v) { return vandq_u8(v, vdupq_n_u8(0x0f)); }
inline u8x16 high_nibbles(u8x16 v) { return vshrq_n_u8(v, 4); }
inline u8x16 bytes_or(u8x16 a, u8x16 b) { return vorrq_u8(a, b); }
inline u8x16 top_pair(u8x16 v, int s) {
  const uint8x16_t moved = s == 0 ? vshlq_n_u8(v, 4) : s == 1 ? vshlq_n_u8(v, 2) : s == 2 ? v : vshrq_n_u8(v, 2);
  return vandq_u8(moved, vdupq_n_u8(0x30));
}
inline u8x16 lookup16(u8x16 index, const uint8_t* table) { return vqtbl1q_u8(vld1q_u8(table), index); }
inline void widen(u8x16 v, i16x8* lo, i16x8* hi) {
  *lo = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(v)));
  *hi = vreinterpretq_s16_u16(vmovl_high_u8(v));
}
inline i16x8 load8(const int16_t* p) { return vld1q_s16(p); }
// Two columns' dot products so far, one product a lane (a multiply-accumulate each, no pairing until the
// block ends): a block's lane sums 8 products below 2^23 at most.
struct dots {
  int32x4_t first, second;
};
inline dots zero_dots() { return {vdupq_n_s32(0), vdupq_n_s32(0)}; }
inline dots add_products(dots acc, i16x8 a, i16x8 b) {
  return {vmlal_s16(acc.first, vget_low_s16(a), vget_low_s16(b)), vmlal_high_s16(acc.second, a, b)};
}
inline i32x4 column_sums(dots a, dots b) {
  return vpaddq_s32(vpaddq_s32(a.first, a.second), vpaddq_s32(b.first, b.second));
}

inline f32x4 to_float(i32x4 v) { return vcvtq_f32_s32(v); }
inline f32x4 splat(float x) { return vdupq_n_f32(x); }
inline f32x4 loadf(const float* p) { return vld1q_f32(p); }
inline f32x4 zerof() { return vdupq_n_f32(0.f); }
inline f32x4 mul(f32x4 a, f32x4 b) { return vmulq_f32(a, b); }
inline f32x4 neg(f32x4 a) { return vnegq_f32(a); }
inline void store(float* p, f32x4 v) { vst1q_f32(p, v); }
inline f32x4 bytes4(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(v))))));
}
inline f32x4 halves(const uint8_t* p) { return vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(p))); }
inline f32x4 multiply_add(f32x4 a, f32x4 b, f32x4 c) { return vfmaq_f32(c, a, b); }

#else  // plain C++: the same operations lane by lane

struct u8x16 { uint8_t v[16]; };
struct i16x8 { int16_t v[8]; };
struct i32x4 { int32_t v[4]; };
struct f32x4 { float v[4]; };

inline u8x16 load16(const uint8_t* p) { u8x16 r; std::memcpy(r.v, p, 16); return r; }
inline u8x16 low_nibbles(u8x16 a) { for (auto& x : a.v) x &= 0x0f; return a; }
inline u8x16 high_nibbles(u8x16 a) { for (auto& x : a.v) x >>= 4; return a; }
inline u8x16 bytes_or(u8x16 a, u8x16 b) { for (int i = 0; i < 16; ++i) a.v[i] |= b.v[i]; return a; }
inline u8x16 top_pair(u8x16 a, int s) {
  for (auto& x : a.v) x = static_cast<uint8_t>(((x >> (2 * s)) & 3) << 4);
  return a;
}
inline u8x16 lookup16(u8x16 a, const uint8_t* table) { for (auto& x : a.v) x = table[x]; return a; }
inline void widen(u8x16 v, i16x8* lo, i16x8* hi) {
  for (int i = 0; i < 8; ++i) lo->v[i] = v.v[i], hi->v[i] = v.v[8 + i];
}
inline i16x8 load8(const int16_t* p) { i16x8 r; std::memcpy(r.v, p, 16); return r; }
using dots = i32x4;
inline dots zero_dots() { return {}; }
inline dots add_products(dots acc, i16x8 a, i16x8 b) {
  for (int i = 0; i < 4; ++i) acc.v[i] += a.v[2 * i] * b.v[2 * i] + a.v[2 * i + 1] * b.v[2 * i + 1];
  return acc;
}
inline i32x4 column_sums(dots a, dots b) {
  return {{a.v[0] + a.v[1], a.v[2] + a.v[3], b.v[0] + b.v[1], b.v[2] + b.v[3]}};
}

inline f32x4 to_float(i32x4 a) { f32x4 r; for (int i = 0; i < 4; ++i) r.v[i] = static_cast<float>(a.v[i]); return r; }
inline f32x4 splat(float x) { return {{x, x, x, x}}; }
inline f32x4 loadf(const float* p) { f32x4 r; std::memcpy(r.v, p, 16); return r; }
inline f32x4 zerof() { return {}; }
inline f32x4 mul(f32x4 a, f32x4 b) { for (int i = 0; i < 4; ++i) a.v[i] *= b.v[i]; return a; }
inline f32x4 neg(f32x4 a) { for (auto& x : a.v) x = -x; return a; }
inline void store(float* p, f32x4 v) { std::memcpy(p, v.v, 16); }
inline f32x4 bytes4(const uint8_t* p) { return {{float(p[0]), float(p[1]), float(p[2]), float(p[3])}}; }
inline f32x4 halves(const uint8_t* p) {
  f32x4 r;
  for (int i = 0; i < 4; ++i) {
    float16 h;
    std::memcpy(&h, p + 2 * i, 2);
    r.v[i] = kvflow::widen(h);
  }
  return r;
}
inline f32x4 multiply_add(f32x4 a, f32x4 b, f32x4 c) {
  for (int i = 0; i < 4; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return c;
}

#endif

}  // namespace kvflow::ivec
