// The whole fused layer in one call each way, for eager steps on the CPU (FusedLayer in
// kan_models/fused/__init__.py): the SiLU base path, silu(x) scale_base^T, added to the spline term in
// ATen's own kernels, so that the step pays one Python call and one autograd node per layer, not
// four (the base path's three took 0.28 of the study's 0.95 ms step).
#include "layer.h"

#include <ATen/ops/mm.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/silu_backward.h>

#include "kernels.h"

// silu(x) scale_base^T + the spline term, (batch, out).
at::Tensor layer_forward(at::Tensor x, at::Tensor knots, at::Tensor w, at::Tensor scale_base, int64_t k,
                         at::Tensor value_rows, at::Tensor slope_rows) {
  return fused_forward(x, knots, w, k, value_rows, slope_rows).addmm_(at::silu(x), scale_base.t());
}

// (grad_x or empty, grad_w (in, G + k, out) or empty, grad_scale_base or empty).
std::vector<at::Tensor> layer_backward(at::Tensor grad_out, at::Tensor x, at::Tensor knots, at::Tensor w,
                                       at::Tensor scale_base, int64_t k, at::Tensor value_rows,
                                       at::Tensor slope_rows, bool need_x, bool need_w, bool need_base) {
  auto grads = fused_backward(grad_out, x, knots, w, k, value_rows, slope_rows, need_x, need_w);
  if (need_x) grads[0].add_(at::silu_backward(at::mm(grad_out, scale_base), x));
  if (!need_base) {
    grads.push_back(at::Tensor());
  } else if (x.size(1) < scale_base.size(0)) {  // fewer inputs than outputs: BLAS took 41 us for the study's
    grads.push_back(at::mm(at::silu(x).t(), grad_out).t().contiguous());  // first layer that way round, 10 this
  } else {
    grads.push_back(at::mm(grad_out.t(), at::silu(x)));
  }
  return grads;
}
