// The fused op's Python entry points (kan_models/fused/__init__.py): pybind11 with torch's tensor
// casters alone. torch/extension.h would bring torch's whole C++ API, which triples this file's
// compile time; the other files take single ATen headers (ATen/core/Tensor.h and the ops they
// call) rather than ATen/ATen.h, for the same reason (docs/models.md).
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"
#include "layer.h"
#include "layout.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &fused_forward, "fused B-spline KAN layer: the spline term");
  m.def("backward", &fused_backward, "fused B-spline KAN layer: gradients of the spline term");
  m.def("layer", &fused_layer, "the whole layer with autograd: its backward runs layer_backward, no Python");
  m.def("spline_weight", &spline_weight, "the spline weight coef * scale_spline as (in, G + k, out)");
  m.def("coefficient_grads", &coefficient_grads, "grad_w (in, G + k, out) to the gradients of coef and scale_spline");
}
