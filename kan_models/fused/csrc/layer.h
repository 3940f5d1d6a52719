// The whole fused layer, its SiLU base path with the spline term (layer.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

at::Tensor layer_forward(at::Tensor x, at::Tensor knots, at::Tensor coef, at::Tensor scale_spline,
                         at::Tensor scale_base, int64_t k, at::Tensor value_rows, at::Tensor slope_rows);
std::vector<at::Tensor> layer_backward(at::Tensor grad_out, at::Tensor x, at::Tensor knots, at::Tensor coef,
                                       at::Tensor scale_spline, at::Tensor scale_base, int64_t k,
                                       at::Tensor value_rows, at::Tensor slope_rows, bool need_x, bool need_weight,
                                       bool need_base);

// The layer with autograd: layer_forward, and layer_backward as its backward (function.cpp).
at::Tensor fused_layer(const at::Tensor& x, const at::Tensor& knots, const at::Tensor& coef,
                       const at::Tensor& scale_spline, const at::Tensor& scale_base, int64_t k,
                       const at::Tensor& value_rows, const at::Tensor& slope_rows);
