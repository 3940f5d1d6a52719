// The fused B-spline KAN layer's three kernels on the CPU (kan_models/fused/__init__.py): for every
// input only its k + 1 non-zero bases are evaluated, and contracted straight away with the window of
// coefficients they select; the (batch, in, G + k) basis tensor is never formed.
//
// Layout: the spline weight is handed over as w[in][G + k][out] (contiguous along out), so every
// (input, basis) pair contributes one axpy along out:
//   forward      out[b, :]   += B_m(x[b, i]) * w[i, j(b, i) + m, :]
//   weight grad  gw[i, j, :] += B_m(x[b, i]) * grad_out[b, :]
//   input grad   gx[b, i]     = sum_m B'_m(x[b, i]) * <w[i, j(b, i) + m, :], grad_out[b, :]>
// The bases are evaluated by bases.h; the weight is laid out by layout.cpp.
//
// Speed (docs/performance.md, "The fused layer"): k is a template parameter (the Horner loops unroll),
// the cell search is vectorised over inputs, and every window is shifted to lie inside [0, G + k)
// with zero bases where it overhangs, so the inner loops carry no branch. The wide loops hold tiles
// of kLanes x kVectors outputs in vector registers (GCC/Clang vector extensions: AVX-512 where the
// CPU has it, narrower vectors elsewhere), over blocks of rows that share one pass of the weight
// through the caches and chunks of inputs whose bases stay in L2; the weight's rows are padded off
// multiples of 1 KiB (row_stride). Outputs past the last whole tile, and layers with few outputs,
// take narrow.h's loops, a row at a time with each input's window one short vector.
//
// This header holds what both directions share: the tiles' sizes, the blocking, the dispatch on k
// (forward.cpp and backward.cpp, two files so that the build compiles them side by side).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <type_traits>

#include "bases.h"
#include "memory.h"

namespace kanscale {

constexpr int64_t kVectors = 4;     // vectors of outputs per tile: 64 float32 outputs, 32 float64
constexpr int64_t kInputBlock = 8;  // inputs whose weight windows stay in L1 while every row uses them
constexpr int64_t kChunk = 16;      // vectors of outputs per dot-product chunk in the input gradient

// Rows per block: up to most, as many as share the weight while it streams through the cache once
// per block (with small blocks a wide layer's forward is bound by streaming its weight from memory
// again for every block), and at least one block per thread. The input gradient takes at most 128: it
// reads the block's rows of grad_out once per input, and 512 of them no longer stay in L2.
inline int64_t row_block(int64_t batch, int64_t most) {
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

inline void check(const at::Tensor& x, const at::Tensor& knots, const at::Tensor& w, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && knots.dim() == 2 && w.dim() == 3, "fused B-spline: x (batch, in), knots (in, n), "
              "w (in, G + k, out) expected");
  TORCH_CHECK(w.size(1) >= k + 1, "fused B-spline: G + k bases must be at least k + 1 (grid >= 1)");
  TORCH_CHECK(x.scalar_type() == knots.scalar_type() && x.scalar_type() == w.scalar_type(),
              "fused B-spline: one dtype for x, knots and w");
}

}  // namespace kanscale
