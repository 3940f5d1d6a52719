// The fused layer's backward on the CPU: the gradients of its spline term for the weight and the
// inputs, a tile of outputs at a time (tiles.h).
#include "kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <vector>

#include "narrow.h"
#include "tiles.h"

namespace {

using namespace kanscale;  // the tiles' sizes and helpers (tiles.h), the bases, the memory

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
  for (int64_t i = 0; i < width; ++i) {
    int32_t* offsets = scratch.offsets + i * (n_bases + 1);
    int32_t* order = scratch.order + i * rows;
    std::fill(offsets, offsets + n_bases + 1, 0);
    for (int64_t r = 0; r < rows; ++r) ++offsets[bs.start(r)[i] + 1];
    for (int64_t j = 0; j < n_bases; ++j) offsets[j + 1] += offsets[j];
    int32_t* next = std::copy(offsets, offsets + n_bases, scratch.next) - n_bases;
    for (int64_t r = 0; r < rows; ++r) order[next[bs.start(r)[i]]++] = int32_t(r);
  }
  // one tile of outputs: grad_out's rows are already the packed tile (as forward_k's out)
  const bool in_place = n_out == tile;
  const T* packed = in_place ? grad + b0 * n_out : scratch.grad_tile;
  for (int64_t o0 = 0; o0 < whole; o0 += tile) {
    for (int64_t r = 0; r < rows && !in_place; ++r)
      std::copy(grad + (b0 + r) * n_out + o0, grad + (b0 + r) * n_out + o0 + tile, scratch.grad_tile + r * tile);
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
}

// gx[b0 + r, i] for rows of the block: the slopes' windows dotted with grad_out's row, in chunks
// of outputs (a chunk of the weight's window stays in L1 while every row of the block uses it);
// each chunk's dot is summed in T, the chunks in double.
template <int K, typename T>
void input_grad_block(const Bases<K, T>& bs, const T* grad, const T* w, T* gx, int64_t b0, int64_t rows, int64_t n_in,
                      int64_t c0, int64_t width, int64_t n_out, int64_t n_bases, int64_t ld, double* acc) {
  using S = Simd<T>;
  const int64_t chunk = kChunk * S::kLanes, whole = n_out / S::kLanes * S::kLanes;  // the rest: narrow.h
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
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t l = 0; l < width; ++l) gx[(b0 + r) * n_in + c0 + l] = T(acc[r * width + l]);
}

template <int K, typename T>
void backward_k(const T* grad, const T* x, const T* kp, const T* w, T* gx, T* gw, int64_t batch, int64_t n_in,
                int64_t n_knots, int64_t n_bases, int64_t n_out, int64_t ld, const double* vr, const double* sr) {
  const Grid<T> grid(kp, n_in, n_knots, n_bases);
  const int64_t tile = kVectors * Simd<T>::kLanes, whole = n_out / tile * tile;
  if (gw != nullptr && whole > 0) {  // threads own inputs: no two write one element of gw
    const int64_t rb = row_block(batch, 512), blocks = (batch + rb - 1) / rb, chunk = input_chunk<K, T>(n_in, rb);
    at::parallel_for(0, n_in, kInputBlock, [&](int64_t i0, int64_t i1) {
      Bases<K, T> bs(rb, chunk);
      GradScratch<T> scratch(rb, chunk, n_bases, tile);
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
  // the input gradient's dot products take whole vectors of outputs, not tiles
  const int64_t vectors = n_out / Simd<T>::kLanes * Simd<T>::kLanes;
  // the narrow rest in one pass for both, where both start past the same output (the study's last layer)
  const bool both_narrow = gw != nullptr && gx != nullptr && whole == vectors && whole < n_out;
  if (gw != nullptr && whole < n_out && !both_narrow)
    kanscale::weight_grad_rows<K>(grad, x, grid, gw, batch, n_in, n_out, ld, whole, vr, sr);
  if (gx != nullptr && vectors > 0) {  // threads own rows
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
  if (both_narrow)
    kanscale::grad_rows<K>(grad, x, grid, w, gx, gw, batch, n_in, n_out, ld, vectors, vr, sr, vectors > 0);
  else if (gx != nullptr && vectors < n_out)
    kanscale::input_grad_rows<K>(grad, x, grid, w, gx, batch, n_in, n_out, ld, vectors, vr, sr, vectors > 0);
}

}  // namespace

// (grad_x of the spline term (batch, in) or an empty tensor, grad_w (in, G + k, out) or empty).
std::vector<at::Tensor> fused_backward(at::Tensor grad_out, at::Tensor x, at::Tensor knots,
                                       at::Tensor w, int64_t k, at::Tensor value_rows,
                                       at::Tensor slope_rows, bool need_x, bool need_w) {
  check(x, knots, w, k);
  grad_out = grad_out.contiguous(); x = x.contiguous(); knots = knots.contiguous(); w = kanscale::rows_along_out(w);
  auto grad_x = need_x ? at::empty_like(x) : at::Tensor();
  // grad_w's rows as far apart as w's: the kernels take one row stride
  auto grad_w = need_w ? at::zeros({w.size(0), w.size(1), w.stride(1)}, w.options()).narrow(2, 0, w.size(2))
                       : at::Tensor();
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
