// The fused op's spline term on the CPU and its gradients (forward.cpp, backward.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

// out (batch, out): the spline term of the layer, w (in, G + k, out) from spline_weight.
at::Tensor fused_forward(at::Tensor x, at::Tensor knots, at::Tensor w, int64_t k,
                         at::Tensor value_rows, at::Tensor slope_rows);

// (grad_x of the spline term (batch, in) or an empty tensor, grad_w (in, G + k, out) or empty).
std::vector<at::Tensor> fused_backward(at::Tensor grad_out, at::Tensor x, at::Tensor knots,
                                       at::Tensor w, int64_t k, at::Tensor value_rows,
                                       at::Tensor slope_rows, bool need_x, bool need_w);
