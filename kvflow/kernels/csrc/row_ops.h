// Per-row pieces of a Llama-family layer (norm, rotary, SwiGLU), shared by the native decoder and the
// kernels, written once against csrc/simd.h for every tier.
#pragma once

#include <cmath>
#include <cstdint>

#include "simd.h"

namespace kvflow {

using simd::largest;

// 1 / sqrt(mean(x^2) + eps) over one row.
inline float rms_scale(const float* x, int width, float eps) {
  int i = 0;
  simd::vf acc = simd::zero();
  for (; i + simd::kLanes <= width; i += simd::kLanes) {
    const simd::vf v = simd::load(x + i);
    acc = simd::fmadd(v, v, acc);
  }
  float total = simd::reduce_add(acc);
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

// y[j] += bias[j] over one row (a projection's bias, added in float32 as PyTorch's layers add it).
inline void add_bias(float* y, const float* bias, int n) {
  for (int j = 0; j < n; ++j) y[j] += bias[j];
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

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// a[j] = silu(gate[j]) * up[j] for one row; float32 or bfloat16 in and out.
template <typename In, typename Out>
inline void silu_mul(const In* gate, const In* up, Out* a, int n) {
  int j = 0;
  const simd::vf one = simd::set1(1.f);
  for (; j + simd::kLanes <= n; j += simd::kLanes) {
    const simd::vf g = simd::load(gate + j);
    const simd::vf s = simd::div(g, simd::add(one, simd::exp(simd::sub(simd::zero(), g))));
    simd::store(a + j, simd::mul(s, simd::load(up + j)));
  }
  for (; j < n; ++j) narrow(silu(widen(gate[j])) * widen(up[j]), a + j);
}

// gelu(g) with the tanh approximation, as x * sigmoid(2 u), u = sqrt(2 / pi) (x + 0.044715 x^3): the
// same value as 0.5 x (1 + tanh(u)), through one exp.
inline float gelu_tanh(float g) {
  const float u = 0.7978845608f * (g + 0.044715f * g * g * g);
  return g / (1.f + std::exp(-2.f * u));
}

// a[j] = gelu_tanh(gate[j]) * up[j] for one row (GeGLU: Gemma); float32 or bfloat16 in and out.
template <typename In, typename Out>
inline void gelu_tanh_mul(const In* gate, const In* up, Out* a, int n) {
  int j = 0;
  const simd::vf one = simd::set1(1.f), c0 = simd::set1(-2.f * 0.7978845608f), c1 = simd::set1(0.044715f);
  for (; j + simd::kLanes <= n; j += simd::kLanes) {
    const simd::vf g = simd::load(gate + j);
    const simd::vf inner = simd::mul(simd::mul(c0, g), simd::add(one, simd::mul(c1, simd::mul(g, g))));
    const simd::vf s = simd::div(g, simd::add(one, simd::exp(inner)));
    simd::store(a + j, simd::mul(s, simd::load(up + j)));
  }
  for (; j < n; ++j) narrow(gelu_tanh(widen(gate[j])) * widen(up[j]), a + j);
}

// gpt-oss's experts: g = min(gate, limit), u = clamp(up, -limit, limit), a = (u + 1) * g * sigmoid(alpha g),
// in that order of operations (as layers/activation.py's swiglu_oai_and_mul).
template <typename In, typename Out>
inline void swiglu_oai_mul(const In* gate, const In* up, Out* a, int n, float alpha, float limit) {
  int j = 0;
  const simd::vf one = simd::set1(1.f), hi = simd::set1(limit), lo = simd::set1(-limit), k = simd::set1(-alpha);
  for (; j + simd::kLanes <= n; j += simd::kLanes) {
    const simd::vf g = simd::min(simd::load(gate + j), hi);
    const simd::vf u = simd::max(simd::min(simd::load(up + j), hi), lo);
    const simd::vf glu = simd::div(g, simd::add(one, simd::exp(simd::mul(k, g))));
    simd::store(a + j, simd::mul(simd::add(u, one), glu));
  }
  for (; j < n; ++j) {
    const float g = std::fmin(widen(gate[j]), limit), u = std::fmax(std::fmin(widen(up[j]), limit), -limit);
    narrow((u + 1.f) * (g / (1.f + std::exp(-alpha * g))), a + j);
  }
}

// A gated MLP's activation on one row: 0 SiLU, 1 GELU-tanh, 2 gpt-oss's clamped SwiGLU (alpha, limit).
struct Activation {
  int kind;
  float alpha, limit;
};

template <typename In, typename Out>
inline void gated_activation(const Activation& act, const In* gate, const In* up, Out* a, int n) {
  if (act.kind == 2)
    swiglu_oai_mul(gate, up, a, n, act.alpha, act.limit);
  else if (act.kind == 1)
    gelu_tanh_mul(gate, up, a, n);
  else
    silu_mul(gate, up, a, n);
}

}  // namespace kvflow
