// The SiLU base path's backward for the whole layer (layer.cpp): silu(x) for scale_base's gradient and
// silu'(x) for the input's, from one exp per element. ATen's silu and silu_backward take one each, and
// the product joins the input's gradient in a third pass: one pass here instead of three, and no
// call from Python per op.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "memory.h"

namespace kanscale {

// exp(x) of 16 float32 lanes in registers: Cephes' expf (x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6
// polynomial for exp(r), 2^n in the exponent bits), within 1 ulp of exp over [-87, 88] (1.3M points); x is
// clamped to that range (exp(-87) ~ 1.6e-38, the smallest normal's neighbourhood). GCC vectorises
// nothing of libm's expf, so a loop of std::exp runs one element at a time, slower than ATen's silu.
inline Simd<float>::vec exp_lanes(Simd<float>::vec x) {
  using vec = Simd<float>::vec;
  typedef int32_t ivec __attribute__((vector_size(64)));
  x = x > 88.3762626647949f ? 88.3762626647949f : x;
  x = x < -87.3365447504f ? -87.3365447504f : x;
  const vec scaled = x * 1.44269504088896341f + 0.5f;
  ivec n = __builtin_convertvector(scaled, ivec);  // truncates: one less where scaled < 0 and not whole
  n += (__builtin_convertvector(n, vec) > scaled);  // a true lane is -1
  const vec fn = __builtin_convertvector(n, vec);
  const vec r = x - fn * 0.693359375f + fn * 2.12194440e-4f;  // ln 2 in two parts: r exact to float32
  vec p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const ivec bits = (n + 127) << 23;
  vec two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

// Calls f(x, count) on n elements in 16-lane vectors; the last, partial one zero-padded in a
// buffer, so f always sees whole vectors (and writes back count of them).
template <typename F>
inline void over_lanes(int64_t n, F&& f) {
  constexpr int64_t kLanes = Simd<float>::kLanes;
  at::parallel_for(0, (n + kLanes - 1) / kLanes, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v) f(v * kLanes, std::min(kLanes, n - v * kLanes));
  });
}

inline Simd<float>::vec load_lanes(const float* p, int64_t count) {
  using S = Simd<float>;
  if (count == S::kLanes) return S::load(p);
  float pad[S::kLanes] = {};
  std::copy(p, p + count, pad);
  return S::load(pad);
}

inline void store_lanes(float* p, const Simd<float>::vec& v, int64_t count) {
  using S = Simd<float>;
  if (count == S::kLanes) return S::store(p, v);
  float pad[S::kLanes];
  S::store(pad, v);
  std::copy(pad, pad + count, p);
}

// The logistic sigmoid s(x) = 1 / (1 + exp(-x)).
inline Simd<float>::vec sigmoid_lanes(const Simd<float>::vec& x) { return 1.0f / (1.0f + exp_lanes(-x)); }

// silu_out = silu(x) where silu_out is not null, and grad_x += grad_silu silu'(x) where grad_x is not
// null, from one exp: silu'(x) = s (1 + x (1 - s)).
template <typename T>
void silu_backward(const T* x, const T* grad_silu, T* grad_x, T* silu_out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const T s = 1 / (1 + std::exp(-x[i]));
    if (silu_out) silu_out[i] = x[i] * s;
    if (grad_x) grad_x[i] += grad_silu[i] * s * (1 + x[i] * (1 - s));
  }
}

template <>
inline void silu_backward<float>(const float* x, const float* grad_silu, float* grad_x, float* silu_out, int64_t n) {
  over_lanes(n, [&](int64_t i, int64_t count) {
    const auto xv = load_lanes(x + i, count);
    const auto s = sigmoid_lanes(xv);
    if (silu_out) store_lanes(silu_out + i, xv * s, count);
    if (grad_x) {
      const auto slope = s * (1.0f + xv * (1.0f - s));
      store_lanes(grad_x + i, load_lanes(grad_x + i, count) + load_lanes(grad_silu + i, count) * slope, count);
    }
  });
}

}  // namespace kanscale
