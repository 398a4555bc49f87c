// Per-row pieces of a Llama-family layer (norm, rotary, SwiGLU) and bfloat16 conversion, shared by the
// fused decoder step and the many-row ops.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "vector_exp.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace kvflow {

// The largest of x[0, n) (a vector max: a scalar loop waits on each compare).
inline float largest(const float* x, int64_t n) {
  int64_t i = 0;
  float m = -INFINITY;
#ifdef __AVX512F__
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + i));
  m = _mm512_reduce_max_ps(mv);
#endif
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// 1 / sqrt(mean(x^2) + eps) over one row.
inline float rms_scale(const float* x, int width, float eps) {
  int i = 0;
  float total = 0.f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= width; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  total = _mm512_reduce_add_ps(acc);
#endif
  for (; i < width; ++i) total += x[i] * x[i];
  return 1.f / std::sqrt(total / static_cast<float>(width) + eps);
}

// y = x / sqrt(mean(x^2) + eps) * weight, per row of `width` (y may be x).
inline void rms_norm(const float* x, const float* weight, float* y, int rows, int width, float eps) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<int64_t>(r) * width;
    float* yr = y + static_cast<int64_t>(r) * width;
    const float inv = rms_scale(xr, width, eps);
    for (int j = 0; j < width; ++j) yr[j] = xr[j] * inv * weight[j];
  }
}

// Rotate-half (NeoX) rotary embedding of `heads` heads of size d at one position, in place.
inline void rotate(float* x, int heads, int d, const float* cos, const float* sin) {
  const int half = d / 2;
  for (int h = 0; h < heads; ++h) {
    float* v = x + h * d;
    for (int i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

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

// Row pieces whose inputs or outputs may be float32 or bfloat16: a value type each, loaded and stored
// 16 at a time.
#ifdef __AVX512F__
inline __m512 load16f(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16f(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16f(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16f(uint16_t* p, __m512 v) {  // round to nearest even (denormals flush to zero, harmlessly)
#ifdef __AVX512BF16__
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int i = 0; i < 16; ++i) p[i] = float_to_bf16(tmp[i]);
#endif
}
#endif
inline float load1f(const float* p) { return *p; }
inline float load1f(const uint16_t* p) { return bf16_to_float(*p); }
inline void store1f(float* p, float v) { *p = v; }
inline void store1f(uint16_t* p, float v) { *p = float_to_bf16(v); }

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// a[j] = silu(gate[j]) * up[j] for one row.
template <typename In, typename Out>
inline void silu_mul(const In* gate, const In* up, Out* a, int n) {
  int j = 0;
#ifdef __AVX512F__
  const __m512 one = _mm512_set1_ps(1.f);
  for (; j + 16 <= n; j += 16) {
    const __m512 g = load16f(gate + j);
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    store16f(a + j, _mm512_mul_ps(s, load16f(up + j)));
  }
#endif
  for (; j < n; ++j) store1f(a + j, silu(load1f(gate + j)) * load1f(up + j));
}

}  // namespace kvflow
