// The whole layer as a C++ autograd function (fused_layer in kan_models/fused/__init__.py), for eager
// steps on the CPU: the engine calls its backward without Python. As a torch.autograd.Function its
// Python backward, with the engine's crossing into Python and back, costs more at small batches than
// a linear layer's whole forward and backward (docs/models.md).
#include <torch/csrc/autograd/custom_function.h>

#include "layer.h"

namespace kanscale {

namespace {

// bf16 and fp16 operands are computed in float32 and the results rounded once (as the op's wide()).
at::Tensor widened(const at::Tensor& t) {
  const auto dtype = t.scalar_type();
  return dtype == at::kFloat || dtype == at::kDouble ? t : t.to(at::kFloat);
}

at::Tensor in_dtype(const at::Tensor& t, const at::Tensor& like) {
  return t.defined() && t.scalar_type() != like.scalar_type() ? t.to(like.scalar_type()) : t;
}

}  // namespace

struct FusedLayer : public torch::autograd::Function<FusedLayer> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& knots,
                            const at::Tensor& coef, const at::Tensor& scale_spline, const at::Tensor& scale_base,
                            int64_t k, const at::Tensor& value_rows, const at::Tensor& slope_rows) {
    ctx->save_for_backward({x, knots, coef, scale_spline, scale_base});  // the inputs only: bases are recomputed
    ctx->saved_data["k"] = k;
    ctx->saved_data["value_rows"] = value_rows;  // constants, not saved tensors (nothing for backward to count)
    ctx->saved_data["slope_rows"] = slope_rows;
    return in_dtype(layer_forward(widened(x), widened(knots), widened(coef), widened(scale_spline),
                                  widened(scale_base), k, value_rows, slope_rows),
                    x);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &coef = saved[2], &scale_spline = saved[3], &scale_base = saved[4];
    const bool need_x = ctx->needs_input_grad(0), need_coef = ctx->needs_input_grad(2),
               need_scale = ctx->needs_input_grad(3), need_base = ctx->needs_input_grad(4);
    const auto g = layer_backward(widened(grads[0].contiguous()), widened(x), widened(saved[1]), widened(coef),
                                  widened(scale_spline), widened(scale_base), ctx->saved_data["k"].toInt(),
                                  ctx->saved_data["value_rows"].toTensor(), ctx->saved_data["slope_rows"].toTensor(),
                                  need_x, need_coef || need_scale, need_base);
    // one gradient per input of forward, undefined for the knots, k and the rows
    return {need_x ? in_dtype(g[0], x) : at::Tensor(), at::Tensor(), need_coef ? in_dtype(g[1], coef) : at::Tensor(),
            need_scale ? in_dtype(g[2], scale_spline) : at::Tensor(),
            need_base ? in_dtype(g[3], scale_base) : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace kanscale

at::Tensor fused_layer(const at::Tensor& x, const at::Tensor& knots, const at::Tensor& coef,
                       const at::Tensor& scale_spline, const at::Tensor& scale_base, int64_t k,
                       const at::Tensor& value_rows, const at::Tensor& slope_rows) {
  return kanscale::FusedLayer::apply(x, knots, coef, scale_spline, scale_base, k, value_rows, slope_rows);
}
