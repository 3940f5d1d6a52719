// The fused layer's forward on the CPU: its spline term, a tile of outputs at a time (tiles.h).
#include "kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>

#include "narrow.h"
#include "tiles.h"

namespace {

using namespace kanscale;  // the tiles' sizes and helpers (tiles.h), the bases, the memory

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

template <int K, typename T>
void forward_k(const T* x, const T* kp, const T* w, T* out, int64_t batch, int64_t n_in, int64_t n_knots,
               int64_t n_bases, int64_t n_out, int64_t ld, const double* vr, const double* sr) {
  const Grid<T> grid(kp, n_in, n_knots, n_bases);
  const int64_t tile = kVectors * Simd<T>::kLanes, whole = n_out / tile * tile;
  if (whole < n_out) kanscale::forward_rows<K>(x, grid, w, out, batch, n_in, n_out, ld, whole, vr, sr);
  if (whole == 0) return;
  const int64_t rb = row_block(batch, 512), blocks = (batch + rb - 1) / rb, chunk = input_chunk<K, T>(n_in, rb);
  for (int64_t b = 0; b < batch; ++b) std::fill(out + b * n_out, out + b * n_out + whole, T(0));
  // one tile of outputs (the study's first layer, [2 -> 64]): out's rows are the tile's packed rows, so
  // the tile accumulates there, not in a copy (a second 128 KiB of the study's working set)
  const bool in_place = n_out == tile;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    Bases<K, T> bs(rb, chunk);
    T* acc = in_place ? nullptr : scratch<T, 8>(rb * tile);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t b0 = blk * rb, rows = std::min(rb, batch - b0);
      T* a = in_place ? out + b0 * n_out : acc;
      for (int64_t c0 = 0; c0 < n_in; c0 += chunk) {
        const int64_t width = std::min(chunk, n_in - c0);
        bs.compute(x, n_in, c0, c0 + width, b0, rows, grid, vr, sr, false);
        for (int64_t o0 = 0; o0 < whole; o0 += tile) {
          for (int64_t r = 0; r < rows && !in_place; ++r)
            std::copy(out + (b0 + r) * n_out + o0, out + (b0 + r) * n_out + o0 + tile, acc + r * tile);
          for (int64_t l0 = 0; l0 < width; l0 += kInputBlock)
            forward_tile(bs, w, a, rows, n_bases, ld, o0, c0, l0, std::min(l0 + kInputBlock, width));
          for (int64_t r = 0; r < rows && !in_place; ++r)
            std::copy(acc + r * tile, acc + (r + 1) * tile, out + (b0 + r) * n_out + o0);
        }
      }
    }
  });
}

}  // namespace

// out (batch, out): the spline term of the layer.
at::Tensor fused_forward(at::Tensor x, at::Tensor knots, at::Tensor w, int64_t k,
                         at::Tensor value_rows, at::Tensor slope_rows) {
  check(x, knots, w, k);
  x = x.contiguous(); knots = knots.contiguous(); w = kanscale::rows_along_out(w);
  auto out = at::empty({x.size(0), w.size(2)}, x.options());
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
