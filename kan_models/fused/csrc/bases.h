// The non-zero bases of a block of inputs, for the fused B-spline op's CPU kernels (tiles.h): the
// uniform-grid polynomials of bspline_bases.py (basis_matrix), evaluated by Horner's rule in the local
// coordinate of each input's cell, with the fast layer's clamping and, for k = 1, the reference's
// choice of cell at a knot.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "memory.h"

namespace kanscale {

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

// An input's place on its grid in knot steps from the first knot, clamped to [-K - 1, n_knots]
// (far enough out that every basis is zero there); NaN fails lowest < v, so it goes below the grid, as
// in the fast layer. Value selects, not std::min/max: their references became loads the vectoriser
// refused.
inline double grid_place(double x, double t0, double inv_h, double lowest, double highest) {
  double v = (x - t0) * inv_h;
  v = lowest < v ? v : lowest;
  return highest < v ? highest : v;
}

// For k = 1 at a knot, the cell of the stored knots' [t_c, t_c+1) (the reference's right-hand slope):
// the scaled place can round to either side of a knot.
template <typename T>
inline double knot_cell(const T* knots, int64_t n_knots, double x, double cell) {
  const int64_t at = std::min<int64_t>(std::max<int64_t>(int64_t(cell), 0), n_knots - 2);
  return cell + (x >= double(knots[at + 1]) ? 1.0 : 0.0) - (x < double(knots[at]) ? 1.0 : 0.0);
}

// A basis matrix's rows (bspline_bases.py's basis_matrix, value or slope rows) rounded to C once a call.
// The narrow rows (narrow.h) evaluate the polynomials in T: the local coordinate, found in double, is
// within T's rounding of [0, 1), and the float32 layer's error against a float64 truth is unchanged
// by it (tests/test_bspline_fused.py bounds it), while in float32 the Horner steps take twice the
// lanes. The tiles' bases stay in double: their loop over a block's few inputs (the study's first
// layer has 2) is slower with the conversions than without.
template <int K, typename C>
struct Rows {
  C at[(K + 1) * (K + 1)];
  Rows(const double* rows, bool slopes) {
    for (int j = 0; j < (slopes ? K : K + 1) * (K + 1); ++j) at[j] = C(rows[j]);
  }
};

// The value (or, times the inverse knot step, the slope) of an input's own basis m (basis cell - K + m)
// at its local coordinate in the cell, by Horner's rule over the rows.
template <int K, typename C>
inline C own_basis(int m, C local, C inv_h, const Rows<K, C>& rows, bool slopes) {
  const C* r = rows.at;
  if (slopes) {
    C v = r[(K - 1) * (K + 1) + m];
    for (int a = K - 2; a >= 0; --a) v = v * local + r[a * (K + 1) + m];
    return v * inv_h;
  }
  C v = r[K * (K + 1) + m];
  for (int a = K - 1; a >= 0; --a) v = v * local + r[a * (K + 1) + m];
  return v;
}

// The bases of rows [b0, b0 + rows) and inputs [i0, i1): for row r, start(r)[i - i0] is the first
// basis number of input i's window (inside [0, G + k - K)) and basis(r)[(i - i0) * (K + 1) + m] the
// value (or slope) of basis start + m there, zero where the input's own window overhangs. A row at a
// time, in double (see Rows), in loops the compiler vectorises over inputs.
template <int K, typename T>
class Bases {
 public:
  Bases(int64_t rows, int64_t width)
      : basis_stride_(row_stride(width * (K + 1), sizeof(T))), start_stride_(row_stride(width, sizeof(int32_t))),
        basis_(scratch<T, 0>(rows * basis_stride_)), start_(scratch<int32_t, 1>(rows * start_stride_)),
        u_(scratch<double, 2>(width)), cell_(scratch<double, 3>(width)) {}
  const T* basis(int64_t r) const { return basis_ + r * basis_stride_; }
  const int32_t* start(int64_t r) const { return start_ + r * start_stride_; }

  void compute(const T* x, int64_t n_in, int64_t i0, int64_t i1, int64_t b0, int64_t rows, const Grid<T>& g,
               const double* value_rows, const double* slope_rows, bool slopes) {
    const int64_t width = i1 - i0, last = g.n_bases - (K + 1);
    const double lowest = -double(K) - 1.0, highest = double(g.n_knots - 1) + 1.0;
    const double* t0 = g.t0.data() + i0;
    const double* inv_h = g.inv_h.data() + i0;
    const Rows<K, double> rows_t(slopes ? slope_rows : value_rows, slopes);
    double* u = u_;
    double* cell = cell_;
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = x + (b0 + r) * n_in + i0;
      for (int64_t i = 0; i < width; ++i) u[i] = double(xr[i]);
      _Pragma("omp simd")
      for (int64_t i = 0; i < width; ++i) {
        u[i] = grid_place(u[i], t0[i], inv_h[i], lowest, highest);
        cell[i] = std::floor(u[i]);
      }
      if (K == 1)
        for (int64_t i = 0; i < width; ++i)
          cell[i] = knot_cell(g.knots + (i0 + i) * g.n_knots, g.n_knots, double(xr[i]), cell[i]);
      T* out = basis_ + r * basis_stride_;
      int32_t* first = start_ + r * start_stride_;
      _Pragma("omp simd")
      for (int64_t i = 0; i < width; ++i) {
        const double local = u[i] - cell[i];
        for (int m = 0; m <= K; ++m)
          out[i * (K + 1) + m] = T(own_basis<K, double>(m, local, inv_h[i], rows_t, slopes));
        const int64_t own = int64_t(cell[i]) - K;
        first[i] = int32_t(own < 0 ? 0 : own > last ? last : own);
      }
      for (int64_t i = 0; i < width; ++i) {
        const int64_t shift = int64_t(cell[i]) - K - first[i];
        if (shift == 0) continue;
        T shifted[K + 1];  // rare: a window overhanging the bases, shifted inside
        for (int m = 0; m <= K; ++m)  // basis first + m is the input's own basis m - shift
          shifted[m] = m - shift >= 0 && m - shift <= K ? out[i * (K + 1) + m - shift] : T(0);
        std::copy(shifted, shifted + K + 1, out + i * (K + 1));
      }
    }
  }

 private:
  int64_t basis_stride_, start_stride_;
  T* basis_;
  int32_t* start_;
  double *u_, *cell_;  // one row's scaled inputs and cells
};

}  // namespace kanscale
