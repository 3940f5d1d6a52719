// Memory the fused B-spline op's CPU code shares (forward.cpp, backward.cpp, layout.cpp): vector
// registers through GCC/Clang vector extensions, working memory kept per thread, and the padded
// layout of the spline weight, w[in][G + k][out] with its rows a row_stride apart.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstring>
#include <memory>

namespace kanscale {

template <typename T>
struct Simd {
  typedef T vec __attribute__((vector_size(64)));
  static constexpr int64_t kLanes = 64 / sizeof(T);
  static vec load(const T* p) { vec v; std::memcpy(&v, p, sizeof(vec)); return v; }
  static void store(T* p, const vec& v) { std::memcpy(p, &v, sizeof(vec)); }
  static T sum(const vec& v) { T s = 0; for (int64_t l = 0; l < kLanes; ++l) s += v[l]; return s; }
};

// Working memory kept for the thread's next call, uninitialised: fresh vectors of a few hundred KiB
// are mapped, zeroed and faulted in on every call, which at the study's size costs more than the
// narrow layer's arithmetic.
// Slot tells apart the buffers one call holds at once.
template <typename T, int Slot>
inline T* scratch(int64_t n) {
  thread_local std::unique_ptr<T[]> buffer;
  thread_local int64_t size = 0;
  if (n > size) {
    buffer.reset(new T[n]);
    size = n;
  }
  return buffer.get();
}

// The row stride, in elements, of a matrix whose rows are read a few lines at a time, many rows
// at once: its width rounded up to whole cache lines, and one line more where that is a multiple of
// 1 KiB. Rows 4 KiB apart (1024 float32 outputs, or 256 inputs x 4 bases) all fall in one set of L1
// (12 ways), so a tile of them missed L1 on every access.
inline int64_t row_stride(int64_t width, int64_t element_size) {
  const int64_t line = 64 / element_size;
  if (width < line) return width;  // narrow rows: a window's values in one line, not one line each
  const int64_t ld = (width + line - 1) / line * line;
  return ld * element_size % 1024 == 0 ? ld + line : ld;
}

// An uninitialised (in, G + k, out) tensor with that row stride (a view of a wider one).
inline at::Tensor padded_weight(int64_t n_in, int64_t n_bases, int64_t n_out, const at::TensorOptions& options) {
  const int64_t ld = row_stride(n_out, c10::elementSize(c10::typeMetaToScalarType(options.dtype())));
  return at::empty({n_in, n_bases, ld}, options).narrow(2, 0, n_out);
}

// w as the kernels read it: along out contiguous, rows at any stride (spline_weight's are padded).
inline at::Tensor rows_along_out(const at::Tensor& w) {
  return w.stride(2) == 1 && w.stride(0) == w.size(1) * w.stride(1) ? w : w.contiguous();
}

}  // namespace kanscale
