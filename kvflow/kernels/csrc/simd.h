// One float vector for every tier: 16 lanes on AVX-512, 8 on AVX2 (with FMA and F16C), 4 on NEON, 4 on
// SSE2 (the generic tier on x86-64), 1 in plain C++. The kernels are written once against these few operations; the library of each tier is
// compiled with that tier's flags (kvflow/kernels/build.py), which picks the branch below.
//
// Loads and stores take float32, bfloat16 (uint16_t bits) and float16 (float16) values. Rounding is the
// same on every tier (nearest even); sums over lanes are trees whose shape depends on the lane count, so
// a result may differ in its last bits from one tier to another, never from one call to the next.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#define KVFLOW_SIMD_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVFLOW_SIMD_AVX2 1
#elif defined(__ARM_NEON) && !defined(KVFLOW_PLAIN_VECTORS)  // (int_vectors.h: for the tests)
#include <arm_neon.h>
#define KVFLOW_SIMD_NEON 1
#elif defined(__SSE2__) && !defined(KVFLOW_PLAIN_VECTORS)
#define KVFLOW_SIMD_SSE2 1
#endif
#if defined(__SSE2__)
#include <emmintrin.h>  // round_to_int, on every x86-64 tier
#endif

namespace kvflow {

// IEEE half precision as storage: float16 where C++ has it (GCC and Clang on x86, Clang on ARM), GCC's
// __fp16 on ARM. Conversions round to nearest even either way.
#if defined(__aarch64__) && !defined(__clang__)
using float16 = __fp16;
#else
using float16 = _Float16;
#endif

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

#if defined(KVFLOW_SIMD_SSE2)
// IEEE halves (the low 16 bits of each 32-bit lane) as floats, exactly, without F16C: exponent and mantissa
// moved to a float's place and scaled by 2^112 (which also makes a half subnormal a normal float);
// infinities and NaNs kept as such.
inline __m128 half_bits(__m128i h) {
  const __m128i magnitude = _mm_and_si128(h, _mm_set1_epi32(0x7fff));
  __m128 v = _mm_mul_ps(_mm_castsi128_ps(_mm_slli_epi32(magnitude, 13)), _mm_castsi128_ps(_mm_set1_epi32(0x77800000)));
  const __m128i special = _mm_cmpgt_epi32(magnitude, _mm_set1_epi32(0x7bff));  // exponent all ones
  v = _mm_or_ps(v, _mm_castsi128_ps(_mm_and_si128(special, _mm_set1_epi32(0x7f800000))));
  return _mm_or_ps(v, _mm_castsi128_ps(_mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16)));
}
inline float widen(float16 x) {  // a library call otherwise (libgcc's __extendhfsf2)
  uint16_t bits;
  std::memcpy(&bits, &x, 2);
  return _mm_cvtss_f32(half_bits(_mm_cvtsi32_si128(bits)));
}
#else
inline float widen(float16 x) { return static_cast<float>(x); }
#endif
inline float widen(float x) { return x; }
inline float widen(uint16_t x) { return bf16_to_float(x); }
inline float widen(int8_t x) { return static_cast<float>(x); }  // an 8-bit cache's value, before its scale
inline void narrow(float x, float* p) { *p = x; }
inline void narrow(float x, uint16_t* p) { *p = float_to_bf16(x); }
inline void narrow(float x, float16* p) { *p = static_cast<float16>(x); }

namespace simd {

// exp's polynomial (about 1 ulp, like expf): e^v = 2^k e^r, |r| <= ln2 / 2, degree 6 for e^r.
constexpr float kLog2e = 1.44269504f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpLowest = -87.3f;  // below: exactly 0
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(KVFLOW_SIMD_AVX512)
constexpr int kLanes = 16, kRegisters = 32;
using vf = __m512;
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline vf load(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline vf load(const float16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline vf load(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void store(uint16_t* p, vf v) {
#ifdef __AVX512BF16__
  _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v));
#else
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int i = 0; i < 16; ++i) p[i] = float_to_bf16(tmp[i]);
#endif
}
inline void store(float16* p, vf v) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf min(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf abs(vf a) { return _mm512_abs_ps(a); }
inline float reduce_add(vf a) { return _mm512_reduce_add_ps(a); }
inline float reduce_max(vf a) { return _mm512_reduce_max_ps(a); }
// 2^k * p for integral k, inf past the float range (VSCALEFPS).
inline vf scale_by_pow2(vf p, vf k) { return _mm512_scalef_ps(p, k); }
inline vf round_nearest(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf clear_below(vf v, vf x, vf limit) {  // v where x >= limit, else 0
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, limit, _CMP_GE_OQ), v);
}
// The four vectors' lane sums times scale, into out[0..4) (a vector multiply: one rounding, as a scalar one).
inline void reduce4(vf a0, vf a1, vf a2, vf a3, float scale, float* out) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d d0 = _mm512_castps_pd(t0), d1 = _mm512_castps_pd(t1);
  const __m512 t2 = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)),
                                  _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(t2), _mm512_extractf32x8_ps(t2, 1));
  const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
  _mm_storeu_ps(out, _mm_mul_ps(sums, _mm_set1_ps(scale)));
}

#elif defined(KVFLOW_SIMD_AVX2)
constexpr int kLanes = 8, kRegisters = 16;
using vf = __m256;
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline vf load(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline vf load(const float16* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline vf load(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline void store(uint16_t* p, vf v) {
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int i = 0; i < 8; ++i) p[i] = float_to_bf16(tmp[i]);
}
inline void store(float16* p, vf v) {
  _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float x) { return _mm256_set1_ps(x); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf min(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf abs(vf a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
inline float reduce_add(vf a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline float reduce_max(vf a) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}
inline vf scale_by_pow2(vf p, vf k) {  // k within the exponent range (exp clamps its input first)
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline vf round_nearest(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf clear_below(vf v, vf x, vf limit) { return _mm256_and_ps(v, _mm256_cmp_ps(x, limit, _CMP_GE_OQ)); }
inline void reduce4(vf a0, vf a1, vf a2, vf a3, float scale, float* out) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  _mm_storeu_ps(out, _mm_mul_ps(sums, _mm_set1_ps(scale)));
}

#elif defined(KVFLOW_SIMD_NEON)
constexpr int kLanes = 4, kRegisters = 32;
using vf = float32x4_t;
inline vf load(const float* p) { return vld1q_f32(p); }
inline vf load(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
inline vf load(const float16* p) { return vcvt_f32_f16(vld1_f16(reinterpret_cast<const float16_t*>(p))); }
inline vf load(const int8_t* p) {  // 4 values (reads 4 bytes more, inside an 8-bit cache's row: its scale follows)
  return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vld1_s8(p)))));
}
inline void store(float* p, vf v) { vst1q_f32(p, v); }
inline void store(uint16_t* p, vf v) {
  float tmp[4];
  vst1q_f32(tmp, v);
  for (int i = 0; i < 4; ++i) p[i] = float_to_bf16(tmp[i]);
}
inline void store(float16* p, vf v) { vst1_f16(reinterpret_cast<float16_t*>(p), vcvt_f16_f32(v)); }
inline vf zero() { return vdupq_n_f32(0.f); }
inline vf set1(float x) { return vdupq_n_f32(x); }
inline vf add(vf a, vf b) { return vaddq_f32(a, b); }
inline vf sub(vf a, vf b) { return vsubq_f32(a, b); }
inline vf mul(vf a, vf b) { return vmulq_f32(a, b); }
inline vf div(vf a, vf b) { return vdivq_f32(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
inline vf max(vf a, vf b) { return vmaxq_f32(a, b); }
inline vf min(vf a, vf b) { return vminq_f32(a, b); }
inline vf abs(vf a) { return vabsq_f32(a); }
inline float reduce_add(vf a) { return vaddvq_f32(a); }
inline float reduce_max(vf a) { return vmaxvq_f32(a); }
inline vf scale_by_pow2(vf p, vf k) {
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(k), vdupq_n_s32(127)), 23);
  return vmulq_f32(p, vreinterpretq_f32_s32(e));
}
inline vf round_nearest(vf a) { return vrndnq_f32(a); }
inline vf clear_below(vf v, vf x, vf limit) {
  return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(v), vcgeq_f32(x, limit)));
}
inline void reduce4(vf a0, vf a1, vf a2, vf a3, float scale, float* out) {
  vst1q_f32(out, vmulq_n_f32(vpaddq_f32(vpaddq_f32(a0, a1), vpaddq_f32(a2, a3)), scale));
}

#elif defined(KVFLOW_SIMD_SSE2)
// x86-64's baseline, for CPUs without AVX2. No fused multiply-add: fmadd rounds twice here (these kernels'
// results may differ in last bits from tier to tier; the packed matmul's epilogue, which may not, has its
// own exact one in int_vectors.h). No F16C: halves convert through half_bits below.
constexpr int kLanes = 4, kRegisters = 16;
using vf = __m128;
inline vf load(const float* p) { return _mm_loadu_ps(p); }
inline vf load(const uint16_t* p) {
  return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i*)p)));
}
inline vf load(const float16* p) { return half_bits(_mm_unpacklo_epi16(_mm_loadl_epi64((const __m128i*)p), _mm_setzero_si128())); }
inline vf load(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  const __m128i b = _mm_cvtsi32_si128(v);
  return _mm_cvtepi32_ps(_mm_srai_epi32(_mm_unpacklo_epi16(_mm_unpacklo_epi8(b, b), _mm_unpacklo_epi8(b, b)), 24));
}
inline void store(float* p, vf v) { _mm_storeu_ps(p, v); }
inline void store(uint16_t* p, vf v) {
  alignas(16) float tmp[4];
  _mm_store_ps(tmp, v);
  for (int i = 0; i < 4; ++i) p[i] = float_to_bf16(tmp[i]);
}
inline void store(float16* p, vf v) {
  alignas(16) float tmp[4];
  _mm_store_ps(tmp, v);
  for (int i = 0; i < 4; ++i) p[i] = static_cast<float16>(tmp[i]);
}
inline vf zero() { return _mm_setzero_ps(); }
inline vf set1(float x) { return _mm_set1_ps(x); }
inline vf add(vf a, vf b) { return _mm_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm_div_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm_add_ps(_mm_mul_ps(a, b), c); }
inline vf max(vf a, vf b) { return _mm_max_ps(a, b); }
inline vf min(vf a, vf b) { return _mm_min_ps(a, b); }
inline vf abs(vf a) { return _mm_and_ps(a, _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff))); }
inline float reduce_add(vf a) {
  const __m128 t = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
inline float reduce_max(vf a) {
  const __m128 t = _mm_max_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
}
inline vf scale_by_pow2(vf p, vf k) {
  const __m128i e = _mm_slli_epi32(_mm_add_epi32(_mm_cvtps_epi32(k), _mm_set1_epi32(127)), 23);
  return _mm_mul_ps(p, _mm_castsi128_ps(e));
}
inline vf round_nearest(vf a) {  // through int32 (nearest even); from 2^23 on a float is whole already
  const __m128 whole = _mm_cmplt_ps(abs(a), _mm_set1_ps(8388608.f));
  const __m128 r = _mm_cvtepi32_ps(_mm_cvtps_epi32(a));
  return _mm_or_ps(_mm_and_ps(whole, r), _mm_andnot_ps(whole, a));
}
inline vf clear_below(vf v, vf x, vf limit) { return _mm_and_ps(v, _mm_cmpge_ps(x, limit)); }
inline void reduce4(vf a0, vf a1, vf a2, vf a3, float scale, float* out) {
  const __m128 t0 = _mm_add_ps(_mm_unpacklo_ps(a0, a1), _mm_unpackhi_ps(a0, a1));
  const __m128 t1 = _mm_add_ps(_mm_unpacklo_ps(a2, a3), _mm_unpackhi_ps(a2, a3));
  _mm_storeu_ps(out, _mm_mul_ps(_mm_add_ps(_mm_movelh_ps(t0, t1), _mm_movehl_ps(t1, t0)), _mm_set1_ps(scale)));
}

#else
constexpr int kLanes = 1, kRegisters = 16;
using vf = float;
inline vf load(const float* p) { return *p; }
inline vf load(const uint16_t* p) { return bf16_to_float(*p); }
inline vf load(const float16* p) { return widen(*p); }
inline vf load(const int8_t* p) { return static_cast<float>(*p); }
inline void store(float* p, vf v) { *p = v; }
inline void store(uint16_t* p, vf v) { *p = float_to_bf16(v); }
inline void store(float16* p, vf v) { *p = static_cast<float16>(v); }
inline vf zero() { return 0.f; }
inline vf set1(float x) { return x; }
inline vf add(vf a, vf b) { return a + b; }
inline vf sub(vf a, vf b) { return a - b; }
inline vf mul(vf a, vf b) { return a * b; }
inline vf div(vf a, vf b) { return a / b; }
inline vf fmadd(vf a, vf b, vf c) { return std::fma(a, b, c); }
inline vf max(vf a, vf b) { return a > b ? a : b; }
inline vf min(vf a, vf b) { return a < b ? a : b; }
inline vf abs(vf a) { return std::fabs(a); }
inline float reduce_add(vf a) { return a; }
inline float reduce_max(vf a) { return a; }
inline vf scale_by_pow2(vf p, vf k) { return std::ldexp(p, static_cast<int>(k)); }
inline vf round_nearest(vf a) { return std::nearbyint(a); }
inline vf clear_below(vf v, vf x, vf limit) { return x >= limit ? v : 0.f; }
inline void reduce4(vf a0, vf a1, vf a2, vf a3, float scale, float* out) {
  out[0] = a0 * scale, out[1] = a1 * scale, out[2] = a2 * scale, out[3] = a3 * scale;
}
#endif

// x rounded to the nearest integer, ties to even (|x| < 2^31): one instruction on x86-64 (in the default
// rounding mode), where std::nearbyint is a library call without SSE4.1.
inline int32_t round_to_int(float x) {
#if defined(__SSE2__)
  return _mm_cvtss_si32(_mm_set_ss(x));
#else
  return static_cast<int32_t>(std::nearbyint(x));
#endif
}

// e^v per lane. Inputs below kExpLowest give exactly 0; past the float range, inf (AVX-512) or the
// largest finite power of two times the polynomial (elsewhere: exp's callers only pass v <= 0).
inline vf exp(vf v) {
  const vf lowest = set1(kExpLowest);
  const vf x = max(v, lowest);
#if defined(KVFLOW_SIMD_AVX512)
  const vf clamped = x;  // VSCALEFPS gives inf past the range
#else
  const vf clamped = min(x, set1(88.7f));  // 2^k must stay a finite exponent
#endif
  const vf k = round_nearest(mul(clamped, set1(kLog2e)));
  vf r = fmadd(k, set1(-kLn2Hi), clamped);
  r = fmadd(k, set1(-kLn2Lo), r);
  vf poly = set1(kExpPoly[0]);
  for (int j = 1; j < 6; ++j) poly = fmadd(poly, r, set1(kExpPoly[j]));
  poly = fmadd(poly, mul(r, r), add(r, set1(1.f)));
  return clear_below(scale_by_pow2(poly, k), v, lowest);
}

// Portable loops over n values: vector steps, then a scalar tail.
template <typename T>
inline float dot(const float* a, const T* b, int n) {
  int i = 0;
  vf acc = zero();
  for (; i + kLanes <= n; i += kLanes) acc = fmadd(load(a + i), load(b + i), acc);
  float total = reduce_add(acc);
  for (; i < n; ++i) total += a[i] * widen(b[i]);
  return total;
}

inline float largest(const float* x, int64_t n) {
  int64_t i = 0;
  float m = -INFINITY;
  if (n >= kLanes) {
    vf mv = set1(-INFINITY);
    for (; i + kLanes <= n; i += kLanes) mv = max(mv, load(x + i));
    m = reduce_max(mv);
  }
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

}  // namespace simd
}  // namespace kvflow
