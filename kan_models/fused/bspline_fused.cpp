// The fused B-spline KAN layer on the CPU (kan_models/fused/__init__.py): for every input only its
// k + 1 non-zero bases are evaluated, and contracted straight away with the window of coefficients
// they select; the (batch, in, G + k) basis tensor is never formed.
//
// Layout: the spline weight is handed over as w[in][G + k][out] (contiguous along out), so every
// (input, basis) pair contributes one axpy along out:
//   forward      out[b, :]   += B_m(x[b, i]) * w[i, j(b, i) + m, :]
//   weight grad  gw[i, j, :] += B_m(x[b, i]) * grad_out[b, :]
//   input grad   gx[b, i]     = sum_m B'_m(x[b, i]) * <w[i, j(b, i) + m, :], grad_out[b, :]>
// The bases are the uniform-grid polynomials of bspline_fast.py (basis_matrix), evaluated by Horner's
// rule in the local coordinate r of the input's cell, with the same clamping and, for k = 1, the same
// choice of cell at a knot as the stored knots give.
//
// Speed: k is a template parameter (the Horner loops unroll), the cell search is vectorised over
// inputs, and every window is shifted to lie inside [0, G + k) with zero bases where it overhangs, so
// the inner loops carry no branch. The wide loops work on tiles of kLanes x kVectors outputs held in
// vector registers (GCC/Clang vector extensions: AVX-512 where the CPU has it, narrower vectors
// elsewhere); outputs past the last whole tile, and layers with few outputs, take the narrow loops,
// vectorised over inputs instead.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

template <typename T>
struct Simd {
  typedef T vec __attribute__((vector_size(64)));
  static constexpr int64_t kLanes = 64 / sizeof(T);
  static vec load(const T* p) { vec v; std::memcpy(&v, p, sizeof(vec)); return v; }
  static void store(T* p, const vec& v) { std::memcpy(p, &v, sizeof(vec)); }
  static T sum(const vec& v) { T s = 0; for (int64_t l = 0; l < kLanes; ++l) s += v[l]; return s; }
};

constexpr int64_t kVectors = 4;     // vectors of outputs per tile: 64 float32 outputs, 32 float64
constexpr int64_t kRowBlock = 128;  // rows whose bases are computed at once (they stay in L2)
constexpr int64_t kInputBlock = 8;  // inputs whose weight windows stay in L1 while every row uses them
constexpr int64_t kChunk = 16;      // vectors of outputs per dot-product chunk in the input gradient

// Per input: the first knot, the inverse knot step and the knots themselves (for k = 1 at a knot).
template <typename T>
struct Grid {
  const T* knots;
  int64_t n_knots, n_bases;
  std::vector<double> t0, inv_h;
  Grid(const T* kp, int64_t n_in, int64_t n_knots_, int64_t n_bases_)
      : knots(kp), n_knots(n_knots_), n_bases(n_bases_), t0(n_in), inv_h(n_in) {
    for (int64_t i = 0; i < n_in; ++i) {
      t0[i] = kp[i * n_knots];
      inv_h[i] = double(n_knots - 1) / (double(kp[i * n_knots + n_knots - 1]) - t0[i]);
    }
  }
};

// The bases of rows [b0, b0 + rows) and inputs [i0, i1): for element e = r * (i1 - i0) + (i - i0),
// start[e] is the first basis number of its window (inside [0, G + k - K)) and basis[e * (K + 1) + m]
// the value (or slope) of basis start + m there, zero where the input's own window overhangs.
// A row at a time, in double, in loops the compiler vectorises over inputs.
template <int K, typename T>
struct Bases {
  std::vector<T> basis;
  std::vector<int32_t> start;
  std::vector<double> u, cell;  // one row's scaled inputs and cells
  Bases(int64_t rows, int64_t width) : basis(rows * width * (K + 1)), start(rows * width), u(width), cell(width) {}

  void compute(const T* x, int64_t n_in, int64_t i0, int64_t i1, int64_t b0, int64_t rows, const Grid<T>& g,
               const double* value_rows, const double* slope_rows, bool slopes) {
    const int64_t width = i1 - i0, last = g.n_bases - (K + 1);
    const double lowest = -double(K) - 1.0, highest = double(g.n_knots - 1) + 1.0;
    const double* t0 = g.t0.data() + i0;
    const double* inv_h = g.inv_h.data() + i0;
    double* u_row = u.data();
    double* cell_row = cell.data();
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = x + (b0 + r) * n_in + i0;
      for (int64_t i = 0; i < width; ++i) u_row[i] = double(xr[i]);
      _Pragma("omp simd")
      for (int64_t i = 0; i < width; ++i) {
        double v = (u_row[i] - t0[i]) * inv_h[i];
        v = v != v ? lowest : v;  // NaN: below the grid, as the fast layer
        v = std::min(std::max(v, lowest), highest);
        u_row[i] = v;
        cell_row[i] = std::floor(v);
      }
      if (K == 1) {  // at a knot, the stored knots' [t_c, t_c+1): the reference's right-hand slope
        for (int64_t i = 0; i < width; ++i) {
          const T* ki = g.knots + (i0 + i) * g.n_knots;
          const double xv = double(xr[i]);
          const int64_t at = std::min<int64_t>(std::max<int64_t>(int64_t(cell_row[i]), 0), g.n_knots - 2);
          cell_row[i] += (xv >= double(ki[at + 1]) ? 1.0 : 0.0) - (xv < double(ki[at]) ? 1.0 : 0.0);
        }
      }
      T* out = basis.data() + r * width * (K + 1);
      int32_t* first = start.data() + r * width;
      _Pragma("omp simd")
      for (int64_t i = 0; i < width; ++i) {
        const double local = u_row[i] - cell_row[i];
        for (int m = 0; m <= K; ++m) {
          double v;
          if (slopes) {
            v = slope_rows[(K - 1) * (K + 1) + m];
            for (int a = K - 2; a >= 0; --a) v = v * local + slope_rows[a * (K + 1) + m];
            v *= inv_h[i];
          } else {
            v = value_rows[K * (K + 1) + m];
            for (int a = K - 1; a >= 0; --a) v = v * local + value_rows[a * (K + 1) + m];
          }
          out[i * (K + 1) + m] = T(v);
        }
        first[i] = int32_t(std::min(std::max<int64_t>(int64_t(cell_row[i]) - K, 0), last));
      }
      for (int64_t i = 0; i < width; ++i) {
        const int64_t shift = int64_t(cell_row[i]) - K - first[i];
        if (shift == 0) continue;
        T shifted[K + 1];  // rare: a window overhanging the bases, shifted inside
        for (int m = 0; m <= K; ++m)  // basis first + m is the input's own basis m - shift
          shifted[m] = m - shift >= 0 && m - shift <= K ? out[i * (K + 1) + m - shift] : T(0);
        std::copy(shifted, shifted + K + 1, out + i * (K + 1));
      }
    }
  }
};

// out[b0 + r, o0:o0 + tile] for whole tiles, accumulated over inputs [i0, i1) (first: from zero).
template <int K, typename T>
void forward_tile(const Bases<K, T>& bs, const T* w, T* out, int64_t b0, int64_t rows, int64_t n_in, int64_t n_out,
                  int64_t n_bases, int64_t o0, int64_t i0, int64_t i1) {
  using S = Simd<T>;
  for (int64_t r = 0; r < rows; ++r) {
    T* o = out + (b0 + r) * n_out + o0;
    typename S::vec acc[kVectors];
    for (int64_t v = 0; v < kVectors; ++v) acc[v] = i0 == 0 ? typename S::vec{} : S::load(o + v * S::kLanes);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = r * n_in + i;
      const T* b = bs.basis.data() + e * (K + 1);
      const T* wr = w + (i * n_bases + bs.start[e]) * n_out + o0;
      for (int m = 0; m <= K; ++m)
        for (int64_t v = 0; v < kVectors; ++v) acc[v] += b[m] * S::load(wr + m * n_out + v * S::kLanes);
    }
    for (int64_t v = 0; v < kVectors; ++v) S::store(o + v * S::kLanes, acc[v]);
  }
}

// out[b0 + r, o] for o in [o_begin, n_out): dot products over every input, vectorised over inputs.
template <int K, typename T>
void forward_narrow(const Bases<K, T>& bs, const T* w, T* out, int64_t b0, int64_t rows, int64_t n_in,
                    int64_t n_out, int64_t n_bases, int64_t o_begin) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = o_begin; o < n_out; ++o) {
      T total = 0;
      const T* b = bs.basis.data() + r * n_in * (K + 1);
      const int32_t* s = bs.start.data() + r * n_in;
      _Pragma("omp simd reduction(+ : total)")
      for (int64_t i = 0; i < n_in; ++i) {
        const T* wr = w + (i * n_bases + s[i]) * n_out + o;
        for (int m = 0; m <= K; ++m) total += b[i * (K + 1) + m] * wr[m * n_out];
      }
      out[(b0 + r) * n_out + o] = total;
    }
}

// gw[i, :, :] for inputs [i0, i1) (this thread's alone), from rows [b0, b0 + rows).
template <int K, typename T>
void weight_grad_block(const Bases<K, T>& bs, const T* grad, T* gw, int64_t b0, int64_t rows, int64_t i0,
                       int64_t i1, int64_t n_out, int64_t n_bases) {
  using S = Simd<T>;
  const int64_t width = i1 - i0, tile = kVectors * S::kLanes, whole = n_out / tile * tile;
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t o0 = 0; o0 < whole; o0 += tile)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t e = r * width + (i - i0);
        const T* b = bs.basis.data() + e * (K + 1);
        const T* g = grad + (b0 + r) * n_out + o0;
        T* gr = gw + (i * n_bases + bs.start[e]) * n_out + o0;
        typename S::vec gv[kVectors];
        for (int64_t v = 0; v < kVectors; ++v) gv[v] = S::load(g + v * S::kLanes);
        for (int m = 0; m <= K; ++m)
          for (int64_t v = 0; v < kVectors; ++v) {
            T* p = gr + m * n_out + v * S::kLanes;
            S::store(p, S::load(p) + b[m] * gv[v]);
          }
      }
  if (whole == n_out) return;
  // the remaining outputs: vectorised over inputs, whose windows lie in different rows of gw
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = whole; o < n_out; ++o) {
      const T go = grad[(b0 + r) * n_out + o];
      const T* b = bs.basis.data() + r * width * (K + 1);
      const int32_t* s = bs.start.data() + r * width;
      _Pragma("omp simd")
      for (int64_t i = i0; i < i1; ++i) {
        T* gr = gw + (i * n_bases + s[i - i0]) * n_out + o;
        for (int m = 0; m <= K; ++m) gr[m * n_out] += b[(i - i0) * (K + 1) + m] * go;
      }
    }
}

// gx[b0 + r, i] for rows of the block: the slopes' windows dotted with grad_out's row, in chunks
// of outputs (a chunk of the weight's window stays in L1 while every row of the block uses it);
// each chunk's dot is summed in T, the chunks in double.
template <int K, typename T>
void input_grad_block(const Bases<K, T>& bs, const T* grad, const T* w, T* gx, int64_t b0, int64_t rows, int64_t n_in,
                      int64_t n_out, int64_t n_bases, std::vector<double>& acc) {
  using S = Simd<T>;
  const int64_t chunk = kChunk * S::kLanes, whole = n_out / S::kLanes * S::kLanes;
  std::fill(acc.begin(), acc.begin() + rows * n_in, 0.0);
  for (int64_t c0 = 0; c0 < whole; c0 += chunk) {
    const int64_t c1 = std::min(c0 + chunk, whole);
    for (int64_t i = 0; i < n_in; ++i)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t e = r * n_in + i;
        const T* b = bs.basis.data() + e * (K + 1);
        const T* g = grad + (b0 + r) * n_out;
        const T* wr = w + (i * n_bases + bs.start[e]) * n_out;
        typename S::vec dot[K + 1] = {};
        for (int64_t o = c0; o < c1; o += S::kLanes) {
          const typename S::vec gv = S::load(g + o);
          for (int m = 0; m <= K; ++m) dot[m] += S::load(wr + m * n_out + o) * gv;
        }
        typename S::vec total = b[0] * dot[0];
        for (int m = 1; m <= K; ++m) total += b[m] * dot[m];
        acc[e] += double(S::sum(total));
      }
  }
  for (int64_t r = 0; r < rows; ++r)  // the remaining outputs, vectorised over inputs
    for (int64_t o = whole; o < n_out; ++o) {
      const T go = grad[(b0 + r) * n_out + o];
      const T* b = bs.basis.data() + r * n_in * (K + 1);
      const int32_t* s = bs.start.data() + r * n_in;
      double* a = acc.data() + r * n_in;
      _Pragma("omp simd")
      for (int64_t i = 0; i < n_in; ++i) {
        const T* wr = w + (i * n_bases + s[i]) * n_out + o;
        T total = 0;
        for (int m = 0; m <= K; ++m) total += b[i * (K + 1) + m] * wr[m * n_out];
        a[i] += double(total * go);
      }
    }
  for (int64_t e = 0; e < rows * n_in; ++e) gx[b0 * n_in + e] = T(acc[e]);
}

template <int K, typename T>
void forward_k(const T* x, const T* kp, const T* w, T* out, int64_t batch, int64_t n_in, int64_t n_knots,
               int64_t n_bases, int64_t n_out, const double* vr, const double* sr) {
  const Grid<T> grid(kp, n_in, n_knots, n_bases);
  const int64_t tile = kVectors * Simd<T>::kLanes, whole = n_out / tile * tile;
  const int64_t blocks = (batch + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    Bases<K, T> bs(kRowBlock, n_in);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t b0 = blk * kRowBlock, rows = std::min(kRowBlock, batch - b0);
      bs.compute(x, n_in, 0, n_in, b0, rows, grid, vr, sr, false);
      for (int64_t o0 = 0; o0 < whole; o0 += tile)
        for (int64_t i0 = 0; i0 < n_in; i0 += kInputBlock)
          forward_tile(bs, w, out, b0, rows, n_in, n_out, n_bases, o0, i0, std::min(i0 + kInputBlock, n_in));
      forward_narrow(bs, w, out, b0, rows, n_in, n_out, n_bases, whole);
    }
  });
}

template <int K, typename T>
void backward_k(const T* grad, const T* x, const T* kp, const T* w, T* gx, T* gw, int64_t batch, int64_t n_in,
                int64_t n_knots, int64_t n_bases, int64_t n_out, const double* vr, const double* sr) {
  const Grid<T> grid(kp, n_in, n_knots, n_bases);
  const int64_t blocks = (batch + kRowBlock - 1) / kRowBlock;
  if (gw != nullptr) {  // threads own inputs: no two write one element of gw
    at::parallel_for(0, n_in, kInputBlock, [&](int64_t i0, int64_t i1) {
      Bases<K, T> bs(kRowBlock, i1 - i0);
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t b0 = blk * kRowBlock, rows = std::min(kRowBlock, batch - b0);
        bs.compute(x, n_in, i0, i1, b0, rows, grid, vr, sr, false);
        weight_grad_block(bs, grad, gw, b0, rows, i0, i1, n_out, n_bases);
      }
    });
  }
  if (gx != nullptr) {  // threads own rows
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      Bases<K, T> bs(kRowBlock, n_in);
      std::vector<double> acc(kRowBlock * n_in);
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t b0 = blk * kRowBlock, rows = std::min(kRowBlock, batch - b0);
        bs.compute(x, n_in, 0, n_in, b0, rows, grid, vr, sr, true);
        input_grad_block(bs, grad, w, gx, b0, rows, n_in, n_out, n_bases, acc);
      }
    });
  }
}

// Calls f with k as a template parameter (std::integral_constant).
template <typename F>
void with_order(int64_t k, F&& f) {
  switch (k) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: TORCH_CHECK(false, "fused B-spline: k must be 1-7, got ", k);
  }
}

void check(const torch::Tensor& x, const torch::Tensor& knots, const torch::Tensor& w, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && knots.dim() == 2 && w.dim() == 3, "fused B-spline: x (batch, in), knots (in, n), "
              "w (in, G + k, out) expected");
  TORCH_CHECK(w.size(1) >= k + 1, "fused B-spline: G + k bases must be at least k + 1 (grid >= 1)");
  TORCH_CHECK(x.scalar_type() == knots.scalar_type() && x.scalar_type() == w.scalar_type(),
              "fused B-spline: one dtype for x, knots and w");
}

}  // namespace

// out (batch, out): the spline term of the layer.
torch::Tensor fused_forward(torch::Tensor x, torch::Tensor knots, torch::Tensor w, int64_t k,
                            torch::Tensor value_rows, torch::Tensor slope_rows) {
  check(x, knots, w, k);
  x = x.contiguous(); knots = knots.contiguous(); w = w.contiguous();
  auto out = torch::empty({x.size(0), w.size(2)}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fused_bspline_forward", [&] {
    with_order(k, [&](auto order) {
      forward_k<decltype(order)::value, scalar_t>(
          x.data_ptr<scalar_t>(), knots.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
          x.size(0), x.size(1), knots.size(1), w.size(1), w.size(2), value_rows.data_ptr<double>(),
          slope_rows.data_ptr<double>());
    });
  });
  return out;
}

// (grad_x of the spline term (batch, in) or an empty tensor, grad_w (in, G + k, out) or empty).
std::vector<torch::Tensor> fused_backward(torch::Tensor grad_out, torch::Tensor x, torch::Tensor knots,
                                          torch::Tensor w, int64_t k, torch::Tensor value_rows,
                                          torch::Tensor slope_rows, bool need_x, bool need_w) {
  check(x, knots, w, k);
  grad_out = grad_out.contiguous(); x = x.contiguous(); knots = knots.contiguous(); w = w.contiguous();
  auto grad_x = need_x ? torch::empty_like(x) : torch::Tensor();
  auto grad_w = need_w ? torch::zeros_like(w) : torch::Tensor();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fused_bspline_backward", [&] {
    with_order(k, [&](auto order) {
      backward_k<decltype(order)::value, scalar_t>(
          grad_out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), knots.data_ptr<scalar_t>(),
          w.data_ptr<scalar_t>(), need_x ? grad_x.data_ptr<scalar_t>() : nullptr,
          need_w ? grad_w.data_ptr<scalar_t>() : nullptr, x.size(0), x.size(1), knots.size(1), w.size(1),
          w.size(2), value_rows.data_ptr<double>(), slope_rows.data_ptr<double>());
    });
  });
  return {grad_x, grad_w};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &fused_forward, "fused B-spline KAN layer: the spline term");
  m.def("backward", &fused_backward, "fused B-spline KAN layer: gradients of the spline term");
}
