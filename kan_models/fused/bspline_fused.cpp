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
#include <memory>
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

// Working memory kept for the thread's next call, uninitialised: fresh vectors of a few hundred KiB
// were mapped, zeroed and faulted in on every call (about 80 of the study's narrow layer's 130 us).
// Slot tells apart the buffers one call holds at once.
template <typename T, int Slot>
T* scratch(int64_t n) {
  thread_local std::unique_ptr<T[]> buffer;
  thread_local int64_t size = 0;
  if (n > size) {
    buffer.reset(new T[n]);
    size = n;
  }
  return buffer.get();
}

constexpr int64_t kVectors = 4;     // vectors of outputs per tile: 64 float32 outputs, 32 float64
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

// The row stride, in elements, of a matrix whose rows are read a few lines at a time, many rows
// at once: its width rounded up to whole cache lines, and one line more where that is a multiple of
// 1 KiB. Rows 4 KiB apart (1024 float32 outputs, or 256 inputs x 4 bases) all fall in one set of L1
// (12 ways), so a tile of them missed L1 on every access.
int64_t row_stride(int64_t width, int64_t element_size) {
  const int64_t line = 64 / element_size;
  if (width < line) return width;  // narrow rows: a window's values in one line, not one line each
  const int64_t ld = (width + line - 1) / line * line;
  return ld * element_size % 1024 == 0 ? ld + line : ld;
}

// The bases of rows [b0, b0 + rows) and inputs [i0, i1): for row r, start(r)[i - i0] is the first
// basis number of input i's window (inside [0, G + k - K)) and basis(r)[(i - i0) * (K + 1) + m] the
// value (or slope) of basis start + m there, zero where the input's own window overhangs. A row at a
// time, in double, in loops the compiler vectorises over inputs.
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
    double* u = u_;
    double* cell = cell_;
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = x + (b0 + r) * n_in + i0;
      for (int64_t i = 0; i < width; ++i) u[i] = double(xr[i]);
      _Pragma("omp simd")
      for (int64_t i = 0; i < width; ++i) {
        // clamped; NaN fails lowest < v, so it goes below the grid, as in the fast layer. Value
        // selects, not std::min/max: their references became loads the vectoriser refused.
        double v = (u[i] - t0[i]) * inv_h[i];
        v = lowest < v ? v : lowest;
        v = highest < v ? highest : v;
        u[i] = v;
        cell[i] = std::floor(v);
      }
      if (K == 1) {  // at a knot, the stored knots' [t_c, t_c+1): the reference's right-hand slope
        for (int64_t i = 0; i < width; ++i) {
          const T* ki = g.knots + (i0 + i) * g.n_knots;
          const double xv = double(xr[i]);
          const int64_t at = std::min<int64_t>(std::max<int64_t>(int64_t(cell[i]), 0), g.n_knots - 2);
          cell[i] += (xv >= double(ki[at + 1]) ? 1.0 : 0.0) - (xv < double(ki[at]) ? 1.0 : 0.0);
        }
      }
      T* out = basis_ + r * basis_stride_;
      int32_t* first = start_ + r * start_stride_;
      _Pragma("omp simd")
      for (int64_t i = 0; i < width; ++i) {
        const double local = u[i] - cell[i];
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

// acc[r * tile + :] for a block's rows, accumulated over the chunk's inputs [l0, l1) (numbered
// from the chunk's first input c0) for one tile of outputs. acc is packed: the rows of out lie 4 KiB
// apart at 1024 outputs.
template <int K, typename T>
void forward_tile(const Bases<K, T>& bs, const T* w, T* acc, int64_t rows, int64_t n_bases, int64_t ld, int64_t o0,
                  int64_t c0, int64_t l0, int64_t l1) {
  using S = Simd<T>;
  for (int64_t r = 0; r < rows; ++r) {
    T* a = acc + r * kVectors * S::kLanes;
    typename S::vec sum[kVectors];
    for (int64_t v = 0; v < kVectors; ++v) sum[v] = S::load(a + v * S::kLanes);
    const T* b = bs.basis(r);
    const int32_t* s = bs.start(r);
    for (int64_t l = l0; l < l1; ++l) {
      const T* wr = w + ((c0 + l) * n_bases + s[l]) * ld + o0;
      for (int m = 0; m <= K; ++m)
        for (int64_t v = 0; v < kVectors; ++v) sum[v] += b[l * (K + 1) + m] * S::load(wr + m * ld + v * S::kLanes);
    }
    for (int64_t v = 0; v < kVectors; ++v) S::store(a + v * S::kLanes, sum[v]);
  }
}

// out[b0 + r, o] += the chunk's dot products, for o in [o_begin, n_out), vectorised over inputs.
template <int K, typename T>
void forward_narrow(const Bases<K, T>& bs, const T* w, T* out, int64_t b0, int64_t rows, int64_t c0, int64_t width,
                    int64_t n_out, int64_t n_bases, int64_t ld, int64_t o_begin) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = o_begin; o < n_out; ++o) {
      T total = 0;
      const T* b = bs.basis(r);
      const int32_t* s = bs.start(r);
      _Pragma("omp simd reduction(+ : total)")
      for (int64_t l = 0; l < width; ++l) {
        const T* wr = w + ((c0 + l) * n_bases + s[l]) * ld + o;
        for (int m = 0; m <= K; ++m) total += b[l * (K + 1) + m] * wr[m * ld];
      }
      out[(b0 + r) * n_out + o] += total;
    }
}

// Scratch of one thread's weight gradient: each input's rows grouped by window (a counting sort), so
// a group's sums stay in registers and reach gw once, and a packed tile of grad_out.
template <typename T>
struct GradScratch {
  int32_t *order, *offsets, *next;
  T* grad_tile;
  GradScratch(int64_t rows, int64_t width, int64_t n_bases, int64_t tile)
      : order(scratch<int32_t, 4>(rows * width)), offsets(scratch<int32_t, 5>(width * (n_bases + 1))),
        next(scratch<int32_t, 6>(n_bases)), grad_tile(scratch<T, 7>(rows * tile)) {}
};

// gw[i, :, :] for inputs [i0, i1) (this thread's alone), from rows [b0, b0 + rows).
template <int K, typename T>
void weight_grad_block(const Bases<K, T>& bs, const T* grad, T* gw, int64_t b0, int64_t rows, int64_t i0,
                       int64_t i1, int64_t n_out, int64_t n_bases, int64_t ld, GradScratch<T>& scratch) {
  using S = Simd<T>;
  const int64_t width = i1 - i0, tile = kVectors * S::kLanes, whole = n_out / tile * tile;
  for (int64_t i = 0; i < width && whole > 0; ++i) {
    int32_t* offsets = scratch.offsets + i * (n_bases + 1);
    int32_t* order = scratch.order + i * rows;
    std::fill(offsets, offsets + n_bases + 1, 0);
    for (int64_t r = 0; r < rows; ++r) ++offsets[bs.start(r)[i] + 1];
    for (int64_t j = 0; j < n_bases; ++j) offsets[j + 1] += offsets[j];
    int32_t* next = std::copy(offsets, offsets + n_bases, scratch.next) - n_bases;
    for (int64_t r = 0; r < rows; ++r) order[next[bs.start(r)[i]]++] = int32_t(r);
  }
  T* packed = scratch.grad_tile;
  for (int64_t o0 = 0; o0 < whole; o0 += tile) {
    for (int64_t r = 0; r < rows; ++r)
      std::copy(grad + (b0 + r) * n_out + o0, grad + (b0 + r) * n_out + o0 + tile, packed + r * tile);
    for (int64_t i = 0; i < width; ++i) {
      const int32_t* offsets = scratch.offsets + i * (n_bases + 1);
      const int32_t* order = scratch.order + i * rows;
      for (int64_t j = 0; j + K < n_bases; ++j) {
        if (offsets[j] == offsets[j + 1]) continue;
        typename S::vec sum[K + 1][kVectors] = {};
        for (int32_t at = offsets[j]; at < offsets[j + 1]; ++at) {
          const int64_t r = order[at];
          const T* b = bs.basis(r) + i * (K + 1);
          typename S::vec g[kVectors];
          for (int64_t v = 0; v < kVectors; ++v) g[v] = S::load(packed + r * tile + v * S::kLanes);
          for (int m = 0; m <= K; ++m)
            for (int64_t v = 0; v < kVectors; ++v) sum[m][v] += b[m] * g[v];
        }
        T* gr = gw + ((i0 + i) * n_bases + j) * ld + o0;
        for (int m = 0; m <= K; ++m)
          for (int64_t v = 0; v < kVectors; ++v) {
            T* p = gr + m * ld + v * S::kLanes;
            S::store(p, S::load(p) + sum[m][v]);
          }
      }
    }
  }
  // the remaining outputs: vectorised over inputs, whose windows lie in different rows of gw
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = whole; o < n_out; ++o) {
      const T go = grad[(b0 + r) * n_out + o];
      const T* b = bs.basis(r);
      const int32_t* s = bs.start(r);
      _Pragma("omp simd")
      for (int64_t i = 0; i < width; ++i) {
        T* gr = gw + ((i0 + i) * n_bases + s[i]) * ld + o;
        for (int m = 0; m <= K; ++m) gr[m * ld] += b[i * (K + 1) + m] * go;
      }
    }
}

// gx[b0 + r, i] for rows of the block: the slopes' windows dotted with grad_out's row, in chunks
// of outputs (a chunk of the weight's window stays in L1 while every row of the block uses it);
// each chunk's dot is summed in T, the chunks in double.
template <int K, typename T>
void input_grad_block(const Bases<K, T>& bs, const T* grad, const T* w, T* gx, int64_t b0, int64_t rows, int64_t n_in,
                      int64_t c0, int64_t width, int64_t n_out, int64_t n_bases, int64_t ld, double* acc) {
  using S = Simd<T>;
  const int64_t chunk = kChunk * S::kLanes, whole = n_out / S::kLanes * S::kLanes;
  std::fill(acc, acc + rows * width, 0.0);
  for (int64_t o0 = 0; o0 < whole; o0 += chunk) {
    const int64_t o1 = std::min(o0 + chunk, whole);
    for (int64_t l = 0; l < width; ++l)
      for (int64_t r = 0; r < rows; ++r) {
        const T* b = bs.basis(r) + l * (K + 1);
        const T* g = grad + (b0 + r) * n_out;
        const T* wr = w + ((c0 + l) * n_bases + bs.start(r)[l]) * ld;
        typename S::vec dot[K + 1] = {};
        for (int64_t o = o0; o < o1; o += S::kLanes) {
          const typename S::vec gv = S::load(g + o);
          for (int m = 0; m <= K; ++m) dot[m] += S::load(wr + m * ld + o) * gv;
        }
        typename S::vec total = b[0] * dot[0];
        for (int m = 1; m <= K; ++m) total += b[m] * dot[m];
        acc[r * width + l] += double(S::sum(total));
      }
  }
  for (int64_t r = 0; r < rows; ++r)  // the remaining outputs, vectorised over inputs
    for (int64_t o = whole; o < n_out; ++o) {
      const T go = grad[(b0 + r) * n_out + o];
      const T* b = bs.basis(r);
      const int32_t* s = bs.start(r);
      double* a = acc + r * width;
      _Pragma("omp simd")
      for (int64_t l = 0; l < width; ++l) {
        const T* wr = w + ((c0 + l) * n_bases + s[l]) * ld + o;
        T total = 0;
        for (int m = 0; m <= K; ++m) total += b[l * (K + 1) + m] * wr[m * ld];
        a[l] += double(total * go);
      }
    }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t l = 0; l < width; ++l) gx[(b0 + r) * n_in + c0 + l] = T(acc[r * width + l]);
}

// Rows per block: up to most, as many as share the weight while it streams through the cache once
// per block (at 128 rows the forward streamed the wide layer's 54 MB weight 8 times, 86 ms at this
// machine's 5 GB/s), and at least one block per thread. The input gradient takes at most 128: it
// reads the block's rows of grad_out once per input, and 512 of them no longer stay in L2.
int64_t row_block(int64_t batch, int64_t most) {
  const int64_t per_thread = (batch + at::get_num_threads() - 1) / at::get_num_threads();
  return std::min<int64_t>(most, std::max<int64_t>(16, (per_thread + 15) / 16 * 16));
}

// Inputs per chunk: a block's bases for them (and their window starts) about 512 KiB, in L2 while
// every tile of outputs reads them; whole blocks of kInputBlock.
template <int K, typename T>
int64_t input_chunk(int64_t n_in, int64_t row_block) {
  const int64_t fit = (int64_t(512) << 10) / (row_block * int64_t((K + 1) * sizeof(T) + sizeof(int32_t)));
  return std::min(n_in, std::max(kInputBlock, fit / kInputBlock * kInputBlock));
}

template <int K, typename T>
void forward_k(const T* x, const T* kp, const T* w, T* out, int64_t batch, int64_t n_in, int64_t n_knots,
               int64_t n_bases, int64_t n_out, int64_t ld, const double* vr, const double* sr) {
  const Grid<T> grid(kp, n_in, n_knots, n_bases);
  const int64_t rb = row_block(batch, 512), blocks = (batch + rb - 1) / rb, chunk = input_chunk<K, T>(n_in, rb);
  const int64_t tile = kVectors * Simd<T>::kLanes, whole = n_out / tile * tile;
  std::fill(out, out + batch * n_out, T(0));
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    Bases<K, T> bs(rb, chunk);
    T* acc = scratch<T, 8>(rb * tile);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t b0 = blk * rb, rows = std::min(rb, batch - b0);
      for (int64_t c0 = 0; c0 < n_in; c0 += chunk) {
        const int64_t width = std::min(chunk, n_in - c0);
        bs.compute(x, n_in, c0, c0 + width, b0, rows, grid, vr, sr, false);
        for (int64_t o0 = 0; o0 < whole; o0 += tile) {
          for (int64_t r = 0; r < rows; ++r)
            std::copy(out + (b0 + r) * n_out + o0, out + (b0 + r) * n_out + o0 + tile, acc + r * tile);
          for (int64_t l0 = 0; l0 < width; l0 += kInputBlock)
            forward_tile(bs, w, acc, rows, n_bases, ld, o0, c0, l0, std::min(l0 + kInputBlock, width));
          for (int64_t r = 0; r < rows; ++r)
            std::copy(acc + r * tile, acc + (r + 1) * tile, out + (b0 + r) * n_out + o0);
        }
        forward_narrow(bs, w, out, b0, rows, c0, width, n_out, n_bases, ld, whole);
      }
    }
  });
}

template <int K, typename T>
void backward_k(const T* grad, const T* x, const T* kp, const T* w, T* gx, T* gw, int64_t batch, int64_t n_in,
                int64_t n_knots, int64_t n_bases, int64_t n_out, int64_t ld, const double* vr, const double* sr) {
  const Grid<T> grid(kp, n_in, n_knots, n_bases);
  if (gw != nullptr) {  // threads own inputs: no two write one element of gw
    const int64_t rb = row_block(batch, 512), blocks = (batch + rb - 1) / rb, chunk = input_chunk<K, T>(n_in, rb);
    at::parallel_for(0, n_in, kInputBlock, [&](int64_t i0, int64_t i1) {
      Bases<K, T> bs(rb, chunk);
      GradScratch<T> scratch(rb, chunk, n_bases, kVectors * Simd<T>::kLanes);
      for (int64_t c0 = i0; c0 < i1; c0 += chunk) {
        const int64_t c1 = std::min(c0 + chunk, i1);
        for (int64_t blk = 0; blk < blocks; ++blk) {
          const int64_t b0 = blk * rb, rows = std::min(rb, batch - b0);
          bs.compute(x, n_in, c0, c1, b0, rows, grid, vr, sr, false);
          weight_grad_block(bs, grad, gw, b0, rows, c0, c1, n_out, n_bases, ld, scratch);
        }
      }
    });
  }
  if (gx != nullptr) {  // threads own rows
    const int64_t rb = row_block(batch, 128), blocks = (batch + rb - 1) / rb, chunk = input_chunk<K, T>(n_in, rb);
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      Bases<K, T> bs(rb, chunk);
      double* acc = scratch<double, 9>(rb * chunk);
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t b0 = blk * rb, rows = std::min(rb, batch - b0);
        for (int64_t c0 = 0; c0 < n_in; c0 += chunk) {
          const int64_t width = std::min(chunk, n_in - c0);
          bs.compute(x, n_in, c0, c0 + width, b0, rows, grid, vr, sr, true);
          input_grad_block(bs, grad, w, gx, b0, rows, n_in, c0, width, n_out, n_bases, ld, acc);
        }
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

// An uninitialised (in, G + k, out) tensor with that row stride (a view of a wider one).
torch::Tensor padded_weight(int64_t n_in, int64_t n_bases, int64_t n_out, const torch::TensorOptions& options) {
  const int64_t ld = row_stride(n_out, c10::elementSize(c10::typeMetaToScalarType(options.dtype())));
  return torch::empty({n_in, n_bases, ld}, options).narrow(2, 0, n_out);
}

// w as the kernels read it: along out contiguous, rows at any stride (spline_weight's are padded).
torch::Tensor rows_along_out(const torch::Tensor& w) {
  return w.stride(2) == 1 && w.stride(0) == w.size(1) * w.stride(1) ? w : w.contiguous();
}

}  // namespace

// out (batch, out): the spline term of the layer.
torch::Tensor fused_forward(torch::Tensor x, torch::Tensor knots, torch::Tensor w, int64_t k,
                            torch::Tensor value_rows, torch::Tensor slope_rows) {
  check(x, knots, w, k);
  x = x.contiguous(); knots = knots.contiguous(); w = rows_along_out(w);
  auto out = torch::empty({x.size(0), w.size(2)}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fused_bspline_forward", [&] {
    with_order(k, [&](auto order) {
      forward_k<decltype(order)::value, scalar_t>(
          x.data_ptr<scalar_t>(), knots.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
          x.size(0), x.size(1), knots.size(1), w.size(1), w.size(2), w.stride(1), value_rows.data_ptr<double>(),
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
  grad_out = grad_out.contiguous(); x = x.contiguous(); knots = knots.contiguous(); w = rows_along_out(w);
  auto grad_x = need_x ? torch::empty_like(x) : torch::Tensor();
  // grad_w's rows as far apart as w's: the kernels take one row stride
  auto grad_w = need_w ? torch::zeros({w.size(0), w.size(1), w.stride(1)}, w.options()).narrow(2, 0, w.size(2))
                       : torch::Tensor();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fused_bspline_backward", [&] {
    with_order(k, [&](auto order) {
      backward_k<decltype(order)::value, scalar_t>(
          grad_out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), knots.data_ptr<scalar_t>(),
          w.data_ptr<scalar_t>(), need_x ? grad_x.data_ptr<scalar_t>() : nullptr,
          need_w ? grad_w.data_ptr<scalar_t>() : nullptr, x.size(0), x.size(1), knots.size(1), w.size(1),
          w.size(2), w.stride(1), value_rows.data_ptr<double>(),
          slope_rows.data_ptr<double>());
    });
  });
  return {grad_x, grad_w};
}

namespace {

constexpr int64_t kSide = 16;  // inputs and outputs per transposing tile: whole cache lines of float32

// Calls f(i0, inputs, o0, outputs, tile) for tiles of kSide inputs x kSide outputs, tile a buffer of
// kSide x (G + k) x kSide. The (out, in, G + k) side is touched in runs of kSide x (G + k) and the
// (in, G + k, out) side in whole lines through the buffer: a plain loop strides one side by
// in x (G + k) or out elements, which with widths of powers of two lands every access in one cache
// set (torch's permute-and-copy of the wide layer's weight took 171 ms; a plain loop 72-186 ms).
template <typename T, typename F>
void transposing_tiles(int64_t n_in, int64_t n_out, int64_t n_bases, F&& f) {
  at::parallel_for(0, (n_in + kSide - 1) / kSide, 1, [&](int64_t begin, int64_t end) {
    T* tile = scratch<T, 10>(kSide * n_bases * kSide);
    for (int64_t t = begin; t < end; ++t)
      for (int64_t o0 = 0; o0 < n_out; o0 += kSide)
        f(t * kSide, std::min(kSide, n_in - t * kSide), o0, std::min(kSide, n_out - o0), tile);
  });
}

}  // namespace

// w (in, G + k, out) = coef (out, in, G + k) * scale_spline (out, in), laid out along out as the
// kernels read it.
torch::Tensor spline_weight(torch::Tensor coef, torch::Tensor scale_spline) {
  coef = coef.contiguous(); scale_spline = scale_spline.contiguous();
  const int64_t n_out = coef.size(0), n_in = coef.size(1), n_bases = coef.size(2);
  auto w = padded_weight(n_in, n_bases, n_out, coef.options());
  const int64_t ld = w.stride(1);
  AT_DISPATCH_FLOATING_TYPES(coef.scalar_type(), "fused_bspline_weight", [&] {
    const scalar_t* c = coef.data_ptr<scalar_t>();
    const scalar_t* s = scale_spline.data_ptr<scalar_t>();
    scalar_t* wp = w.data_ptr<scalar_t>();
    transposing_tiles<scalar_t>(n_in, n_out, n_bases, [&](int64_t i0, int64_t ni, int64_t o0, int64_t no,
                                                          scalar_t* tile) {
      for (int64_t o = 0; o < no; ++o)
        for (int64_t i = 0; i < ni; ++i) {
          const scalar_t scale = s[(o0 + o) * n_in + i0 + i];
          const scalar_t* row = c + ((o0 + o) * n_in + i0 + i) * n_bases;
          for (int64_t j = 0; j < n_bases; ++j) tile[(i * n_bases + j) * kSide + o] = row[j] * scale;
        }
      for (int64_t e = 0; e < ni * n_bases; ++e)
        std::copy(tile + e * kSide, tile + e * kSide + no, wp + (i0 * n_bases + e) * ld + o0);
    });
  });
  return w;
}

// (d loss / d coef (out, in, G + k), d loss / d scale_spline (out, in)) from grad_w (in, G + k, out),
// the gradient of w = coef * scale_spline.
std::vector<torch::Tensor> coefficient_grads(torch::Tensor grad_w, torch::Tensor coef, torch::Tensor scale_spline) {
  grad_w = rows_along_out(grad_w); coef = coef.contiguous(); scale_spline = scale_spline.contiguous();
  const int64_t n_out = coef.size(0), n_in = coef.size(1), n_bases = coef.size(2), ld = grad_w.stride(1);
  auto g_coef = torch::empty_like(coef);
  auto g_scale = torch::empty_like(scale_spline);
  AT_DISPATCH_FLOATING_TYPES(coef.scalar_type(), "fused_bspline_coefficient_grads", [&] {
    const scalar_t* gw = grad_w.data_ptr<scalar_t>();
    const scalar_t* c = coef.data_ptr<scalar_t>();
    const scalar_t* s = scale_spline.data_ptr<scalar_t>();
    scalar_t* gc = g_coef.data_ptr<scalar_t>();
    scalar_t* gs = g_scale.data_ptr<scalar_t>();
    transposing_tiles<scalar_t>(n_in, n_out, n_bases, [&](int64_t i0, int64_t ni, int64_t o0, int64_t no,
                                                          scalar_t* tile) {
      for (int64_t e = 0; e < ni * n_bases; ++e)
        std::copy(gw + (i0 * n_bases + e) * ld + o0, gw + (i0 * n_bases + e) * ld + o0 + no, tile + e * kSide);
      for (int64_t o = 0; o < no; ++o)
        for (int64_t i = 0; i < ni; ++i) {
          const int64_t at = (o0 + o) * n_in + i0 + i;
          const scalar_t scale = s[at];
          const scalar_t* row = c + at * n_bases;
          scalar_t* g_row = gc + at * n_bases;
          scalar_t total = 0;
          for (int64_t j = 0; j < n_bases; ++j) {
            const scalar_t g = tile[(i * n_bases + j) * kSide + o];
            g_row[j] = g * scale;
            total += g * row[j];
          }
          gs[at] = total;
        }
    });
  });
  return {g_coef, g_scale};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &fused_forward, "fused B-spline KAN layer: the spline term");
  m.def("backward", &fused_backward, "fused B-spline KAN layer: gradients of the spline term");
  m.def("spline_weight", &spline_weight, "the spline weight coef * scale_spline as (in, G + k, out)");
  m.def("coefficient_grads", &coefficient_grads, "grad_w (in, G + k, out) to the gradients of coef and scale_spline");
}
