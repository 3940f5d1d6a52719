// The fused op's spline term on the CPU and its gradients (kernels.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

// out (batch, out): the spline term of the layer, w (in, G + k, out) from spline_weight.
torch::Tensor fused_forward(torch::Tensor x, torch::Tensor knots, torch::Tensor w, int64_t k,
                            torch::Tensor value_rows, torch::Tensor slope_rows);

// (grad_x of the spline term (batch, in) or an empty tensor, grad_w (in, G + k, out) or empty).
std::vector<torch::Tensor> fused_backward(torch::Tensor grad_out, torch::Tensor x, torch::Tensor knots,
                                          torch::Tensor w, int64_t k, torch::Tensor value_rows,
                                          torch::Tensor slope_rows, bool need_x, bool need_w);
