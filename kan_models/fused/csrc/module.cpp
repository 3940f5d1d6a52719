// The fused op's Python entry points (kan_models/fused/__init__.py). The one file that includes
// torch/extension.h (pybind11 and torch's whole C++ API, about 20 s of compiling a file here): the
// others take ATen alone, so the op builds in a fraction of the time on a user's first run.
#include <torch/extension.h>

#include "kernels.h"
#include "layer.h"
#include "layout.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &fused_forward, "fused B-spline KAN layer: the spline term");
  m.def("backward", &fused_backward, "fused B-spline KAN layer: gradients of the spline term");
  m.def("layer_forward", &layer_forward, "the whole layer: the SiLU base path and the spline term");
  m.def("layer_backward", &layer_backward, "the whole layer's gradients: x, the spline weight, scale_base");
  m.def("spline_weight", &spline_weight, "the spline weight coef * scale_spline as (in, G + k, out)");
  m.def("coefficient_grads", &coefficient_grads, "grad_w (in, G + k, out) to the gradients of coef and scale_spline");
}
