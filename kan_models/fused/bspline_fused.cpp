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

constexpr int64_t kRows = 32;     // batch rows per tile: their bases are computed once per tile
constexpr int64_t kOutputs = 64;  // outputs per tile: a weight slab of (G + k) x 64 stays in L1

// The bases (values or slopes) and first basis number of every input of rows [b0, b0 + n).
template <typename scalar_t>
void tile_bases(const scalar_t* xp, const scalar_t* kp, int64_t b0, int64_t n, int64_t n_in, int64_t n_knots,
                int64_t k, const double* vr, const double* sr, bool slopes_not_values, std::vector<double>& coef,
                std::vector<int64_t>& first) {
  double values[kMaxOrder], slopes[kMaxOrder];
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < n_in; ++i) {
      const scalar_t* ki = kp + i * n_knots;
      const Cell c = locate(xp[(b0 + r) * n_in + i], ki, n_knots, k);
      bases(c, k, vr, sr, inverse_step(ki, n_knots), values, slopes_not_values ? slopes : nullptr);
      first[r * n_in + i] = c.first;
      for (int64_t m = 0; m <= k; ++m) coef[(r * n_in + i) * (k + 1) + m] = slopes_not_values ? slopes[m] : values[m];
    }
  }
}

}  // namespace

// out (batch, out): the spline term of the layer. Tiles of kRows x kOutputs: for each input the
// weight slab w[i, :, o-tile] serves every row of the tile from L1.
torch::Tensor fused_forward(torch::Tensor x, torch::Tensor knots, torch::Tensor w, int64_t k,
                            torch::Tensor value_rows, torch::Tensor slope_rows) {
  TORCH_CHECK(k >= 1 && k < kMaxOrder, "fused B-spline: k must be 1-", kMaxOrder - 1);
  x = x.contiguous(); knots = knots.contiguous(); w = w.contiguous();
  const int64_t batch = x.size(0), n_in = x.size(1), n_bases = w.size(1), n_out = w.size(2), n_knots = knots.size(1);
  auto out = torch::empty({batch, n_out}, x.options());
  const double* vr = value_rows.data_ptr<double>();
  const double* sr = slope_rows.data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fused_bspline_forward", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* kp = knots.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t tiles = (batch + kRows - 1) / kRows;
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      std::vector<double> coef(kRows * n_in * (k + 1));
      std::vector<int64_t> first(kRows * n_in);
      std::vector<scalar_t> acc(kRows * kOutputs);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b0 = t * kRows, rows = std::min(kRows, batch - b0);
        tile_bases(xp, kp, b0, rows, n_in, n_knots, k, vr, sr, false, coef, first);
        for (int64_t o0 = 0; o0 < n_out; o0 += kOutputs) {
          const int64_t width = std::min(kOutputs, n_out - o0);
          std::fill(acc.begin(), acc.end(), scalar_t(0));
          for (int64_t i = 0; i < n_in; ++i) {
            const scalar_t* slab = wp + i * n_bases * n_out + o0;
            for (int64_t r = 0; r < rows; ++r) {
              scalar_t* a = acc.data() + r * kOutputs;
              for (int64_t m = 0; m <= k; ++m) {
                const int64_t j = first[r * n_in + i] + m;
                if (j < 0 || j >= n_bases) continue;
                const scalar_t v = scalar_t(coef[(r * n_in + i) * (k + 1) + m]);
                const scalar_t* row = slab + j * n_out;
                _Pragma("omp simd")
                for (int64_t o = 0; o < width; ++o) a[o] += v * row[o];
              }
            }
          }
          for (int64_t r = 0; r < rows; ++r)
            std::copy(acc.data() + r * kOutputs, acc.data() + r * kOutputs + width, op + (b0 + r) * n_out + o0);
        }
      }
    });
  });
  return out;
}

// (grad_x of the spline term (batch, in) or an empty tensor, grad_w (in, G + k, out) or empty).
// grad_w: threads own output tiles (no two write one element); grad_x: threads own row tiles.
std::vector<torch::Tensor> fused_backward(torch::Tensor grad_out, torch::Tensor x, torch::Tensor knots,
                                          torch::Tensor w, int64_t k, torch::Tensor value_rows,
                                          torch::Tensor slope_rows, bool need_x, bool need_w) {
  grad_out = grad_out.contiguous(); x = x.contiguous(); knots = knots.contiguous(); w = w.contiguous();
  const int64_t batch = x.size(0), n_in = x.size(1), n_bases = w.size(1), n_out = w.size(2), n_knots = knots.size(1);
  auto grad_x = need_x ? torch::empty_like(x) : torch::Tensor();
  auto grad_w = need_w ? torch::zeros_like(w) : torch::Tensor();
  const double* vr = value_rows.data_ptr<double>();
  const double* sr = slope_rows.data_ptr<double>();
  const int64_t row_tiles = (batch + kRows - 1) / kRows, out_tiles = (n_out + kOutputs - 1) / kOutputs;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fused_bspline_backward", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* kp = knots.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    const scalar_t* gp = grad_out.data_ptr<scalar_t>();
    if (need_w) {
      scalar_t* gwp = grad_w.data_ptr<scalar_t>();
      at::parallel_for(0, out_tiles, 1, [&](int64_t begin, int64_t end) {
        std::vector<double> coef(kRows * n_in * (k + 1));
        std::vector<int64_t> first(kRows * n_in);
        for (int64_t t = 0; t < row_tiles; ++t) {
          const int64_t b0 = t * kRows, rows = std::min(kRows, batch - b0);
          tile_bases(xp, kp, b0, rows, n_in, n_knots, k, vr, sr, false, coef, first);
          for (int64_t ot = begin; ot < end; ++ot) {
            const int64_t o0 = ot * kOutputs, width = std::min(kOutputs, n_out - o0);
            for (int64_t i = 0; i < n_in; ++i) {
              scalar_t* slab = gwp + i * n_bases * n_out + o0;
              for (int64_t r = 0; r < rows; ++r) {
                const scalar_t* g = gp + (b0 + r) * n_out + o0;
                for (int64_t m = 0; m <= k; ++m) {
                  const int64_t j = first[r * n_in + i] + m;
                  if (j < 0 || j >= n_bases) continue;
                  const scalar_t v = scalar_t(coef[(r * n_in + i) * (k + 1) + m]);
                  scalar_t* row = slab + j * n_out;
                  _Pragma("omp simd")
                  for (int64_t o = 0; o < width; ++o) row[o] += v * g[o];
                }
              }
            }
          }
        }
      });
    }
    if (need_x) {
      scalar_t* gxp = grad_x.data_ptr<scalar_t>();
      at::parallel_for(0, row_tiles, 1, [&](int64_t begin, int64_t end) {
        std::vector<double> coef(kRows * n_in * (k + 1));
        std::vector<int64_t> first(kRows * n_in);
        std::vector<double> acc(kRows * n_in);
        for (int64_t t = begin; t < end; ++t) {
          const int64_t b0 = t * kRows, rows = std::min(kRows, batch - b0);
          tile_bases(xp, kp, b0, rows, n_in, n_knots, k, vr, sr, true, coef, first);
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int64_t o0 = 0; o0 < n_out; o0 += kOutputs) {
            const int64_t width = std::min(kOutputs, n_out - o0);
            for (int64_t i = 0; i < n_in; ++i) {
              const scalar_t* slab = wp + i * n_bases * n_out + o0;
              for (int64_t r = 0; r < rows; ++r) {
                const scalar_t* g = gp + (b0 + r) * n_out + o0;
                double total = 0;
                for (int64_t m = 0; m <= k; ++m) {
                  const int64_t j = first[r * n_in + i] + m;
                  if (j < 0 || j >= n_bases) continue;
                  const scalar_t* row = slab + j * n_out;
                  scalar_t dot = 0;
                  _Pragma("omp simd reduction(+ : dot)")
                  for (int64_t o = 0; o < width; ++o) dot += row[o] * g[o];
                  total += coef[(r * n_in + i) * (k + 1) + m] * double(dot);
                }
                acc[r * n_in + i] += total;
              }
            }
          }
          for (int64_t e = 0; e < rows * n_in; ++e) gxp[b0 * n_in + e] = scalar_t(acc[e]);
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
