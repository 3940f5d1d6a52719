// The whole fused layer, its SiLU base path with the spline term (layer.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

torch::Tensor layer_forward(torch::Tensor x, torch::Tensor knots, torch::Tensor w, torch::Tensor scale_base, int64_t k,
                            torch::Tensor value_rows, torch::Tensor slope_rows);
std::vector<torch::Tensor> layer_backward(torch::Tensor grad_out, torch::Tensor x, torch::Tensor knots, torch::Tensor w,
                                          torch::Tensor scale_base, int64_t k, torch::Tensor value_rows,
                                          torch::Tensor slope_rows, bool need_x, bool need_w, bool need_base);
