// exp over 16 floats with AVX-512, shared by the kernels that need it (softmax, SiLU).
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>

// e^v as 2^k * e^r with |r| <= ln2 / 2 and a degree-6 polynomial for e^r (about 1 ulp, like expf); the
// 2^k scaling is one VSCALEFPS, which also turns results past the float range into inf. Inputs below
// -87.3 give exactly 0 (as before the scaling was built from integer exponent bits).
inline __m512 exp16(__m512 v) {
  const __m512 log2e = _mm512_set1_ps(1.44269504f), ln2_hi = _mm512_set1_ps(0.693359375f),
               ln2_lo = _mm512_set1_ps(-2.12194440e-4f), lowest = _mm512_set1_ps(-87.3f);
  const float c[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                      4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
  const __mmask16 tiny = _mm512_cmp_ps_mask(v, lowest, _CMP_LT_OQ);
  v = _mm512_max_ps(v, lowest);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, ln2_hi, v);
  r = _mm512_fnmadd_ps(k, ln2_lo, r);
  __m512 poly = _mm512_set1_ps(c[0]);
  for (int j = 1; j < 6; ++j) poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(c[j]));
  poly = _mm512_fmadd_ps(poly, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), poly, k);
}
#endif
