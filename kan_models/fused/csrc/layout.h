// The spline weight's layout for the kernels and its gradients back (layout.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

at::Tensor spline_weight(at::Tensor coef, at::Tensor scale_spline);
std::vector<at::Tensor> coefficient_grads(at::Tensor grad_w, at::Tensor coef, at::Tensor scale_spline);
