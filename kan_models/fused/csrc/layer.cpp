// The whole fused layer in one call each way, for eager steps on the CPU (FusedLayer in
// kan_models/fused/__init__.py): the SiLU base path, silu(x) scale_base^T, added to the spline term
// (backward: silu and its slope from one exp, silu.h), so that the step pays one Python call and one
// autograd node per layer, not four (at the study's size the base path's three nodes cost a large
// share of the step: docs/models.md).
#include "layer.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/silu.h>

#include "kernels.h"
#include "layout.h"
#include "silu.h"

namespace {

// grad_x += grad_silu silu'(x) where grad_x is defined, and silu(x) where asked for (else undefined).
at::Tensor silu_backward(const at::Tensor& x, const at::Tensor& grad_silu, at::Tensor grad_x, bool want_silu) {
  auto out = want_silu ? at::empty_like(x) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fused_layer_silu_backward", [&] {
    auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<scalar_t>() : nullptr; };
    kanscale::silu_backward(x.data_ptr<scalar_t>(), ptr(grad_silu), ptr(grad_x), ptr(out), x.numel());
  });
  return out;
}

}  // namespace

// silu(x) scale_base^T + the spline term, (batch, out).
at::Tensor layer_forward(at::Tensor x, at::Tensor knots, at::Tensor coef, at::Tensor scale_spline,
                         at::Tensor scale_base, int64_t k, at::Tensor value_rows, at::Tensor slope_rows) {
  return fused_forward(x, knots, spline_weight(coef, scale_spline), k, value_rows, slope_rows)
      .addmm_(at::silu(x), scale_base.t());
}

// (grad_x, grad_coef, grad_scale_spline, grad_scale_base), each an undefined tensor where not asked for.
std::vector<at::Tensor> layer_backward(at::Tensor grad_out, at::Tensor x, at::Tensor knots, at::Tensor coef,
                                       at::Tensor scale_spline, at::Tensor scale_base, int64_t k,
                                       at::Tensor value_rows, at::Tensor slope_rows, bool need_x, bool need_weight,
                                       bool need_base) {
  x = x.contiguous();
  auto spline = fused_backward(grad_out, x, knots, spline_weight(coef, scale_spline), k, value_rows, slope_rows,
                               need_x, need_weight);
  const auto grad_x = need_x ? spline[0] : at::Tensor();
  TORCH_CHECK(!need_x || grad_x.is_contiguous(), "layer_backward: the spline term's grad_x is not contiguous");
  const auto silu_x = need_x || need_base
      ? silu_backward(x, need_x ? at::mm(grad_out, scale_base) : at::Tensor(), grad_x, need_base)
      : at::Tensor();
  auto weight = need_weight ? coefficient_grads(spline[1], coef, scale_spline)
                            : std::vector<at::Tensor>{at::Tensor(), at::Tensor()};
  at::Tensor grad_base;
  // fewer inputs than outputs: BLAS handles the product with the long side as its rows far better
  // (the study's first layer, [2 -> 64])
  if (need_base && x.size(1) < scale_base.size(0)) {
    grad_base = at::mm(silu_x.t(), grad_out).t().contiguous();
  } else if (need_base) {
    grad_base = at::mm(grad_out.t(), silu_x);
  }
  return {grad_x, weight[0], weight[1], grad_base};
}
