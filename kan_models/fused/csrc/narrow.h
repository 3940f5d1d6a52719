// The fused op's loops over outputs past the last whole tile of tiles.h: every output of a narrow
// layer (the study's last, [64 -> 1]) and the rest of a wide one. A row at a time, vectorised over
// inputs: one pass evaluates the row's bases into a structure of arrays (a vector per basis, in L1),
// and each output gathers its inputs' windows of the weight from tables padded with zeros on both
// sides, so a window overhanging the bases reads zeros instead of being shifted inside. Stored
// window by window for every row of a block (the tiles' layout) and shifted one input at a time, the
// study's narrow layer was several times slower (docs/models.md).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "bases.h"
#include "memory.h"

namespace kanscale {

// An input's window of K + 1 bases (or weights) as one short vector, zero past K: a power of two
// lanes, so that the product of a window with its weights is one vector operation. The lanes past K
// (k = 2, 4-6) multiply the table's next entries by zero bases: nothing, while the weights are finite.
template <int K, typename T>
struct Window {
  static constexpr int64_t kLanes = K < 2 ? 2 : K < 4 ? 4 : 8;
  typedef T vec __attribute__((vector_size(kLanes * sizeof(T))));
  static vec load(const T* p) { vec v; std::memcpy(&v, p, sizeof(vec)); return v; }
  static void store(T* p, const vec& v) { std::memcpy(p, &v, sizeof(vec)); }
  static T sum(const vec& v) { T s = 0; for (int64_t l = 0; l < kLanes; ++l) s += v[l]; return s; }
};

// Outputs [o0, n_out) of w (in, G + k, out; rows ld apart) as one table per output and input:
// table(o)[i * length + K + 1 + j] = w[i][j][o0 + o], zero for j outside [0, G + k). K + 1 zeros
// before the bases and a window's lanes after hold a whole window wholly outside the bases, where
// windows past the grid are clamped. Slot: the thread's buffer (two sets at once in grad_rows).
template <int K, typename T, int Slot = 11>
class Tables {
 public:
  Tables(int64_t n_in, int64_t n_bases, int64_t outputs, bool zeroed)
      : n_in_(n_in), n_bases_(n_bases), length_(n_bases + K + 1 + Window<K, T>::kLanes + K + 1),
        data_(scratch<T, Slot>(outputs * n_in * length_)) {
    if (zeroed) std::fill(data_, data_ + outputs * n_in * length_, T(0));
  }
  T* table(int64_t o) const { return data_ + o * n_in_ * length_; }

  // Where input i's window starts in its table, from its cell (clamped: see the class).
  int32_t window(int64_t i, double cell) const {
    const double top = double(n_bases_ + K + 1);
    double at = cell + 1.0;
    at = at < 0.0 ? 0.0 : at;
    at = at > top ? top : at;
    return int32_t(i * length_ + int64_t(at));
  }

  void fill(const T* w, int64_t ld, int64_t o0, int64_t outputs) {
    for (int64_t o = 0; o < outputs; ++o)
      for (int64_t i = 0; i < n_in_; ++i) {
        T* t = table(o) + i * length_;
        std::fill(t, t + length_, T(0));
        for (int64_t j = 0; j < n_bases_; ++j) t[K + 1 + j] = w[(i * n_bases_ + j) * ld + o0 + o];
      }
  }

  // w[i][j][o0 + o] = the tables' entries for inputs [i0, i1) (their pads, where clamped windows
  // landed, dropped).
  void drain(T* w, int64_t ld, int64_t o0, int64_t outputs, int64_t i0, int64_t i1) const {
    for (int64_t o = 0; o < outputs; ++o)
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t j = 0; j < n_bases_; ++j) w[(i * n_bases_ + j) * ld + o0 + o] = table(o)[i * length_ + K + 1 + j];
  }

 private:
  int64_t n_in_, n_bases_, length_;
  T* data_;
};

// One row's bases of a range of inputs, a window each: value[i * Window::kLanes + m] that of the
// range's input i's own basis m (slope[...] its slope), at[i] where its window starts in its table.
// Vectorised across inputs instead, the windows take gathers and scatters, which cost more than the
// arithmetic they feed.
template <int K, typename T>
struct RowBases {
  static constexpr int64_t kLanes = Window<K, T>::kLanes;
  T* value;
  T* slope;
  int32_t* at;
  Rows<K, T> value_rows, slope_rows;
  // The buffers are the thread's, taken once per call (TLS lookups in a shared library cost ~10 ns).
  RowBases(int64_t width, const double* values, const double* slopes)
      : value(scratch<T, 12>(kLanes * width)), slope(scratch<T, 16>(kLanes * width)),
        at(scratch<int32_t, 13>(width)), value_rows(values, false), slope_rows(slopes, true) {}

  // Inputs [i0, i1) of row xr: their values where Values, their slopes where Slopes (both from one
  // cell and local coordinate).
  template <bool Values, bool Slopes, int Slot>
  void compute(const T* xr, const Grid<T>& g, const Tables<K, T, Slot>& tables, int64_t i0, int64_t i1) {
    const double lowest = -double(K) - 1.0, highest = double(g.n_knots - 1) + 1.0;
    for (int64_t i = i0; i < i1; ++i) {
      const double x = double(xr[i]), place = grid_place(x, g.t0[i], g.inv_h[i], lowest, highest);
      double cell = std::floor(place);
      if (K == 1) cell = knot_cell(g.knots + i * g.n_knots, g.n_knots, x, cell);
      const T local = T(place - cell), inv_h = T(g.inv_h[i]);
      T* v = value + (i - i0) * kLanes;
      T* d = slope + (i - i0) * kLanes;
      for (int m = 0; m < kLanes; ++m) {
        if (Values) v[m] = m <= K ? own_basis<K, T>(m, local, inv_h, value_rows, false) : T(0);
        if (Slopes) d[m] = m <= K ? own_basis<K, T>(m, local, inv_h, slope_rows, true) : T(0);
      }
      at[i - i0] = tables.window(i, cell);
    }
  }

  // acc[i] += go x (input i's slopes . its window of table t), for the range's inputs: the products
  // first, then each window's sum apart, in a loop GCC vectorises across inputs (a window's lanes
  // summed one input at a time cost shuffles, then a dependent chain into acc).
  void add_slope_dots(const T* t, T go, double* acc, T* products, int64_t width) const {
    using V = Window<K, T>;
    for (int64_t i = 0; i < width; ++i)
      V::store(products + i * kLanes, V::load(slope + i * kLanes) * V::load(t + at[i]));
    _Pragma("omp simd")
    for (int64_t i = 0; i < width; ++i) {
      T dot = 0;
      for (int64_t m = 0; m < kLanes; ++m) dot += products[i * kLanes + m];
      acc[i] += double(dot * go);
    }
  }

  // Each input's window of table t += go x its values.
  void add_values(T* t, T go, int64_t width) const {
    using V = Window<K, T>;
    for (int64_t i = 0; i < width; ++i) {
      T* window = t + at[i];
      V::store(window, V::load(window) + V::load(value + i * kLanes) * go);
    }
  }
};

// out[b, o] for o in [o0, n_out), every row.
template <int K, typename T>
void forward_rows(const T* x, const Grid<T>& g, const T* w, T* out, int64_t batch, int64_t n_in, int64_t n_out,
                  int64_t ld, int64_t o0, const double* value_rows, const double* slope_rows) {
  using V = Window<K, T>;
  Tables<K, T> tables(n_in, g.n_bases, n_out - o0, false);
  tables.fill(w, ld, o0, n_out - o0);
  at::parallel_for(0, batch, 16, [&](int64_t begin, int64_t end) {
    RowBases<K, T> bases(n_in, value_rows, slope_rows);
    for (int64_t b = begin; b < end; ++b) {
      bases.template compute<true, false>(x + b * n_in, g, tables, 0, n_in);
      for (int64_t o = o0; o < n_out; ++o) {
        const T* t = tables.table(o - o0);
        // four chains in four registers, so that one product's latency does not hold up the next;
        // indexed sum[i & 1], GCC keeps the sums on the stack, a store and a reload each input
        typename V::vec s0 = {}, s1 = {}, s2 = {}, s3 = {};
        auto product = [&](int64_t i) { return V::load(bases.value + i * V::kLanes) * V::load(t + bases.at[i]); };
        int64_t i = 0;
        for (; i + 4 <= n_in; i += 4) {
          s0 += product(i);
          s1 += product(i + 1);
          s2 += product(i + 2);
          s3 += product(i + 3);
        }
        for (; i < n_in; ++i) s0 += product(i);
        out[b * n_out + o] = V::sum((s0 + s1) + (s2 + s3));
      }
    }
  });
}

// gx[b, i] (+)= the slopes' windows of outputs [o0, n_out) dotted with grad_out's row, every row;
// added where the tiles wrote the other outputs' share.
template <int K, typename T>
void input_grad_rows(const T* grad, const T* x, const Grid<T>& g, const T* w, T* gx, int64_t batch, int64_t n_in,
                     int64_t n_out, int64_t ld, int64_t o0, const double* value_rows, const double* slope_rows,
                     bool add) {
  Tables<K, T> tables(n_in, g.n_bases, n_out - o0, false);
  tables.fill(w, ld, o0, n_out - o0);
  at::parallel_for(0, batch, 16, [&](int64_t begin, int64_t end) {
    RowBases<K, T> bases(n_in, value_rows, slope_rows);
    double* acc = scratch<double, 14>(n_in);
    T* products = scratch<T, 15>(n_in * Window<K, T>::kLanes);
    for (int64_t b = begin; b < end; ++b) {
      bases.template compute<false, true>(x + b * n_in, g, tables, 0, n_in);
      std::fill(acc, acc + n_in, 0.0);
      for (int64_t o = o0; o < n_out; ++o)
        bases.add_slope_dots(tables.table(o - o0), grad[b * n_out + o], acc, products, n_in);
      T* row = gx + b * n_in;
      for (int64_t i = 0; i < n_in; ++i) row[i] = T(acc[i]) + (add ? row[i] : T(0));
    }
  });
}

// gw[i, :, o] for o in [o0, n_out), from every row; threads own inputs, so no two write one entry.
template <int K, typename T>
void weight_grad_rows(const T* grad, const T* x, const Grid<T>& g, T* gw, int64_t batch, int64_t n_in, int64_t n_out,
                      int64_t ld, int64_t o0, const double* value_rows, const double* slope_rows) {
  Tables<K, T> tables(n_in, g.n_bases, n_out - o0, true);
  at::parallel_for(0, n_in, 8, [&](int64_t i0, int64_t i1) {
    RowBases<K, T> bases(i1 - i0, value_rows, slope_rows);
    for (int64_t b = 0; b < batch; ++b) {
      bases.template compute<true, false>(x + b * n_in, g, tables, i0, i1);
      for (int64_t o = o0; o < n_out; ++o) bases.add_values(tables.table(o - o0), grad[b * n_out + o], i1 - i0);
    }
    tables.drain(gw, ld, o0, n_out - o0, i0, i1);
  });
}

// Both at once, where both are asked for: input_grad_rows' gx and weight_grad_rows' gw in one pass
// over the rows, each input's cell and local coordinate found once for its values and its slopes.
// Threads own inputs, as for gw alone; gx's row-by-row sums are per input, so they split the same way.
template <int K, typename T>
void grad_rows(const T* grad, const T* x, const Grid<T>& g, const T* w, T* gx, T* gw, int64_t batch, int64_t n_in,
               int64_t n_out, int64_t ld, int64_t o0, const double* value_rows, const double* slope_rows, bool add) {
  Tables<K, T> weights(n_in, g.n_bases, n_out - o0, false);
  weights.fill(w, ld, o0, n_out - o0);
  Tables<K, T, 17> grads(n_in, g.n_bases, n_out - o0, true);
  at::parallel_for(0, n_in, 8, [&](int64_t i0, int64_t i1) {
    const int64_t width = i1 - i0;
    RowBases<K, T> bases(width, value_rows, slope_rows);
    double* acc = scratch<double, 14>(width);
    T* products = scratch<T, 15>(width * Window<K, T>::kLanes);
    for (int64_t b = 0; b < batch; ++b) {
      bases.template compute<true, true>(x + b * n_in, g, weights, i0, i1);
      std::fill(acc, acc + width, 0.0);
      for (int64_t o = o0; o < n_out; ++o) {
        const T go = grad[b * n_out + o];
        bases.add_slope_dots(weights.table(o - o0), go, acc, products, width);
        bases.add_values(grads.table(o - o0), go, width);
      }
      T* row = gx + b * n_in + i0;
      for (int64_t i = 0; i < width; ++i) row[i] = T(acc[i]) + (add ? row[i] : T(0));
    }
    grads.drain(gw, ld, o0, n_out - o0, i0, i1);
  });
}

}  // namespace kanscale
