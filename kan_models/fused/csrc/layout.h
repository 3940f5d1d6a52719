// The spline weight's layout for the kernels and its gradients back (layout.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

torch::Tensor spline_weight(torch::Tensor coef, torch::Tensor scale_spline);
std::vector<torch::Tensor> coefficient_grads(torch::Tensor grad_w, torch::Tensor coef, torch::Tensor scale_spline);
