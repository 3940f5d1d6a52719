// The fused B-spline KAN layer on the CPU (kan_models/fused/__init__.py): for every input only its
// k + 1 non-zero bases are evaluated, in registers, and contracted straight away with the window of
// coefficients they select; the (batch, in, G + k) basis tensor is never formed.
//
// Layout: the spline weight is handed over as w[in][G + k][out] (contiguous along out), so every
// (input, basis) pair contributes one axpy along out, which the compiler vectorises:
//   forward      out[b, :]       += B_m(x[b, i]) * w[i, j(b, i, m), :]
//   weight grad  gw[i, j, :]     += B_m(x[b, i]) * grad_out[b, :]      (threads own inputs i)
//   input grad   gx[b, i]         = sum_m B'_m(x[b, i]) * <w[i, j, :], grad_out[b, :]>
// The bases are the uniform-grid polynomials of bspline_fast.py (basis_matrix), evaluated by Horner's
// rule in the local coordinate r of the input's cell, with the same clamping and, for k = 1, the same
// choice of cell at a knot as the stored knots give.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>
#include <cmath>
#include <vector>

namespace {

constexpr int kMaxOrder = 8;  // k <= 7: the model accepts k 1-5

struct Cell {
  int64_t first;  // basis number of the cell's first non-zero basis (c - k)
  double r;       // local coordinate in [0, 1)
};

// u's cell and local coordinate, as local_bases in bspline_fast.py computes them.
template <typename scalar_t>
inline Cell locate(scalar_t x_in, const scalar_t* knots, int64_t n_knots, int64_t k) {
  const double t0 = knots[0];
  const double inv_h = double(n_knots - 1) / (double(knots[n_knots - 1]) - t0);
  const double n_cells = double(n_knots - 1);
  const double x = double(x_in);
  double u = (x - t0) * inv_h;
  if (std::isnan(u)) u = -double(k) - 1.0;
  u = std::min(std::max(u, -double(k) - 1.0), n_cells + 1.0);
  double cell = std::floor(u);
  if (k == 1) {  // at a knot, the stored knots' [t_c, t_c+1): the reference's right-hand slope
    const int64_t at = std::min<int64_t>(std::max<int64_t>(int64_t(cell), 0), n_knots - 2);
    cell = cell - (x < double(knots[at]) ? 1.0 : 0.0) + (x >= double(knots[at + 1]) ? 1.0 : 0.0);
  }
  return {int64_t(cell) - k, u - cell};
}

// values[m] = B_{first + m}(x), slopes[m] = its derivative in x (in units of inv_h already applied).
inline void bases(const Cell& c, int64_t k, const double* value_rows, const double* slope_rows, double inv_h,
                  double* values, double* slopes) {
  for (int64_t m = 0; m <= k; ++m) {
    double v = value_rows[k * (k + 1) + m];
    for (int64_t a = k - 1; a >= 0; --a) v = v * c.r + value_rows[a * (k + 1) + m];
    values[m] = v;
    if (slopes != nullptr) {
      double s = slope_rows[(k - 1) * (k + 1) + m];
      for (int64_t a = k - 2; a >= 0; --a) s = s * c.r + slope_rows[a * (k + 1) + m];
      slopes[m] = s * inv_h;
    }
  }
}

template <typename scalar_t>
inline double inverse_step(const scalar_t* knots, int64_t n_knots) {
  return double(n_knots - 1) / (double(knots[n_knots - 1]) - double(knots[0]));
}

}  // namespace

// out (batch, out): the spline term of the layer.
torch::Tensor fused_forward(torch::Tensor x, torch::Tensor knots, torch::Tensor w, int64_t k,
                            torch::Tensor value_rows, torch::Tensor slope_rows) {
  TORCH_CHECK(k >= 1 && k < kMaxOrder, "fused B-spline: k must be 1-", kMaxOrder - 1);
  x = x.contiguous(); knots = knots.contiguous(); w = w.contiguous();
  const int64_t batch = x.size(0), n_in = x.size(1), n_bases = w.size(1), n_out = w.size(2), n_knots = knots.size(1);
  auto out = torch::zeros({batch, n_out}, x.options());
  const double* vr = value_rows.data_ptr<double>();
  const double* sr = slope_rows.data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "fused_bspline_forward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* kp = knots.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(n_out);
      double values[kMaxOrder];
      for (int64_t b = begin; b < end; ++b) {
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for (int64_t i = 0; i < n_in; ++i) {
          const scalar_t* ki = kp + i * n_knots;
          const Cell c = locate(xp[b * n_in + i], ki, n_knots, k);
          bases(c, k, vr, sr, 0.0, values, nullptr);
          for (int64_t m = 0; m <= k; ++m) {
            const int64_t j = c.first + m;
            if (j < 0 || j >= n_bases) continue;
            const acc_t v = acc_t(values[m]);
            const scalar_t* wj = wp + (i * n_bases + j) * n_out;
            for (int64_t o = 0; o < n_out; ++o) acc[o] += v * acc_t(wj[o]);
          }
        }
        for (int64_t o = 0; o < n_out; ++o) op[b * n_out + o] = scalar_t(acc[o]);
      }
    });
  });
  return out;
}

// (grad_x of the spline term (batch, in) or an empty tensor, grad_w (in, G + k, out) or empty)
std::vector<torch::Tensor> fused_backward(torch::Tensor grad_out, torch::Tensor x, torch::Tensor knots,
                                          torch::Tensor w, int64_t k, torch::Tensor value_rows,
                                          torch::Tensor slope_rows, bool need_x, bool need_w) {
  grad_out = grad_out.contiguous(); x = x.contiguous(); knots = knots.contiguous(); w = w.contiguous();
  const int64_t batch = x.size(0), n_in = x.size(1), n_bases = w.size(1), n_out = w.size(2), n_knots = knots.size(1);
  auto grad_x = need_x ? torch::empty_like(x) : torch::Tensor();
  auto grad_w = need_w ? torch::empty_like(w) : torch::Tensor();
  const double* vr = value_rows.data_ptr<double>();
  const double* sr = slope_rows.data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "fused_bspline_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* kp = knots.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    const scalar_t* gp = grad_out.data_ptr<scalar_t>();
    if (need_w) {  // threads own input features: no two write the same rows of grad_w
      scalar_t* gwp = grad_w.data_ptr<scalar_t>();
      at::parallel_for(0, n_in, 1, [&](int64_t begin, int64_t end) {
        std::vector<acc_t> acc(n_bases * n_out);
        double values[kMaxOrder];
        for (int64_t i = begin; i < end; ++i) {
          std::fill(acc.begin(), acc.end(), acc_t(0));
          const scalar_t* ki = kp + i * n_knots;
          for (int64_t b = 0; b < batch; ++b) {
            const Cell c = locate(xp[b * n_in + i], ki, n_knots, k);
            bases(c, k, vr, sr, 0.0, values, nullptr);
            const scalar_t* g = gp + b * n_out;
            for (int64_t m = 0; m <= k; ++m) {
              const int64_t j = c.first + m;
              if (j < 0 || j >= n_bases) continue;
              const acc_t v = acc_t(values[m]);
              acc_t* a = acc.data() + j * n_out;
              for (int64_t o = 0; o < n_out; ++o) a[o] += v * acc_t(g[o]);
            }
          }
          for (int64_t e = 0; e < n_bases * n_out; ++e) gwp[i * n_bases * n_out + e] = scalar_t(acc[e]);
        }
      });
    }
    if (need_x) {
      scalar_t* gxp = grad_x.data_ptr<scalar_t>();
      at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
        double values[kMaxOrder], slopes[kMaxOrder];
        for (int64_t b = begin; b < end; ++b) {
          const scalar_t* g = gp + b * n_out;
          for (int64_t i = 0; i < n_in; ++i) {
            const scalar_t* ki = kp + i * n_knots;
            const Cell c = locate(xp[b * n_in + i], ki, n_knots, k);
            bases(c, k, vr, sr, inverse_step(ki, n_knots), values, slopes);
            acc_t total = 0;
            for (int64_t m = 0; m <= k; ++m) {
              const int64_t j = c.first + m;
              if (j < 0 || j >= n_bases) continue;
              const scalar_t* wj = wp + (i * n_bases + j) * n_out;
              acc_t dot = 0;
              for (int64_t o = 0; o < n_out; ++o) dot += acc_t(wj[o]) * acc_t(g[o]);
              total += acc_t(slopes[m]) * dot;
            }
            gxp[b * n_in + i] = scalar_t(total);
          }
        }
      });
    }
  });
  return {grad_x, grad_w};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &fused_forward, "fused B-spline KAN layer: the spline term");
  m.def("backward", &fused_backward, "fused B-spline KAN layer: gradients of the spline term");
}
