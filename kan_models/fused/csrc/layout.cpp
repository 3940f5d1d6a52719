// The spline weight coef (out, in, G + k) * scale_spline (out, in) laid out as the kernels read it,
// w (in, G + k, out) with padded rows, and the kernels' gradient of w folded back into the
// gradients of coef and scale_spline.
#include "layout.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>

#include "memory.h"

using kanscale::padded_weight;
using kanscale::rows_along_out;
using kanscale::scratch;

namespace {

constexpr int64_t kSide = 16;  // inputs and outputs per transposing tile: whole cache lines of float32

// Calls f(i0, inputs, o0, outputs, tile) for tiles of kSide inputs x kSide outputs, tile a buffer of
// kSide x (G + k) x kSide. The (out, in, G + k) side is touched in runs of kSide x (G + k) and the
// (in, G + k, out) side in whole lines through the buffer: a plain loop strides one side by
// in x (G + k) or out elements, which with widths of powers of two lands every access in one cache
// set (torch's permute-and-copy of the wide layer's weight is as slow as such a loop).
template <typename T, typename F>
void transposing_tiles(int64_t n_in, int64_t n_out, int64_t n_bases, F&& f) {
  at::parallel_for(0, (n_in + kSide - 1) / kSide, 1, [&](int64_t begin, int64_t end) {
    T* tile = scratch<T, 10>(kSide * n_bases * kSide);
    for (int64_t t = begin; t < end; ++t)
      for (int64_t o0 = 0; o0 < n_out; o0 += kSide)
        f(t * kSide, std::min(kSide, n_in - t * kSide), o0, std::min(kSide, n_out - o0), tile);
  });
}

}  // namespace

// w (in, G + k, out) = coef (out, in, G + k) * scale_spline (out, in), laid out along out as the
// kernels read it.
at::Tensor spline_weight(at::Tensor coef, at::Tensor scale_spline) {
  coef = coef.contiguous(); scale_spline = scale_spline.contiguous();
  const int64_t n_out = coef.size(0), n_in = coef.size(1), n_bases = coef.size(2);
  auto w = padded_weight(n_in, n_bases, n_out, coef.options());
  const int64_t ld = w.stride(1);
  AT_DISPATCH_FLOATING_TYPES(coef.scalar_type(), "fused_bspline_weight", [&] {
    const scalar_t* c = coef.data_ptr<scalar_t>();
    const scalar_t* s = scale_spline.data_ptr<scalar_t>();
    scalar_t* wp = w.data_ptr<scalar_t>();
    transposing_tiles<scalar_t>(n_in, n_out, n_bases, [&](int64_t i0, int64_t ni, int64_t o0, int64_t no,
                                                          scalar_t* tile) {
      for (int64_t o = 0; o < no; ++o)
        for (int64_t i = 0; i < ni; ++i) {
          const scalar_t scale = s[(o0 + o) * n_in + i0 + i];
          const scalar_t* row = c + ((o0 + o) * n_in + i0 + i) * n_bases;
          for (int64_t j = 0; j < n_bases; ++j) tile[(i * n_bases + j) * kSide + o] = row[j] * scale;
        }
      for (int64_t e = 0; e < ni * n_bases; ++e)
        std::copy(tile + e * kSide, tile + e * kSide + no, wp + (i0 * n_bases + e) * ld + o0);
    });
  });
  return w;
}

// (d loss / d coef (out, in, G + k), d loss / d scale_spline (out, in)) from grad_w (in, G + k, out),
// the gradient of w = coef * scale_spline.
std::vector<at::Tensor> coefficient_grads(at::Tensor grad_w, at::Tensor coef, at::Tensor scale_spline) {
  grad_w = rows_along_out(grad_w); coef = coef.contiguous(); scale_spline = scale_spline.contiguous();
  const int64_t n_out = coef.size(0), n_in = coef.size(1), n_bases = coef.size(2), ld = grad_w.stride(1);
  auto g_coef = at::empty_like(coef);
  auto g_scale = at::empty_like(scale_spline);
  AT_DISPATCH_FLOATING_TYPES(coef.scalar_type(), "fused_bspline_coefficient_grads", [&] {
    const scalar_t* gw = grad_w.data_ptr<scalar_t>();
    const scalar_t* c = coef.data_ptr<scalar_t>();
    const scalar_t* s = scale_spline.data_ptr<scalar_t>();
    scalar_t* gc = g_coef.data_ptr<scalar_t>();
    scalar_t* gs = g_scale.data_ptr<scalar_t>();
    transposing_tiles<scalar_t>(n_in, n_out, n_bases, [&](int64_t i0, int64_t ni, int64_t o0, int64_t no,
                                                          scalar_t* tile) {
      for (int64_t e = 0; e < ni * n_bases; ++e)
        std::copy(gw + (i0 * n_bases + e) * ld + o0, gw + (i0 * n_bases + e) * ld + o0 + no, tile + e * kSide);
      for (int64_t o = 0; o < no; ++o)
        for (int64_t i = 0; i < ni; ++i) {
          const int64_t at = (o0 + o) * n_in + i0 + i;
          const scalar_t scale = s[at];
          const scalar_t* row = c + at * n_bases;
          scalar_t* g_row = gc + at * n_bases;
          scalar_t total = 0;
          for (int64_t j = 0; j < n_bases; ++j) {
            const scalar_t g = tile[(i * n_bases + j) * kSide + o];
            g_row[j] = g * scale;
            total += g * row[j];
          }
          gs[at] = total;
        }
    });
  });
  return {g_coef, g_scale};
}
