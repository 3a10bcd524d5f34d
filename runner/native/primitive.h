// What the native primitives share: an inference-only MLX primitive base (no GPU, no
// transforms), a strided-to-dense copy, and a split of work over threads.

#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/primitives.h"
#include "pool.h"

namespace mtp_native {

namespace mx = mlx::core;

// A CPU-only forward primitive: the GPU, differentiation and vmap refuse by name. `Base`:
// mx::UnaryPrimitive (one output) or mx::Primitive (several: InferencePrimitives).
template <class Base>
class Inference : public Base {
 public:
  explicit Inference(mx::Stream stream) : Base(stream) {}

  std::vector<mx::array> jvp(
      const std::vector<mx::array>&,
      const std::vector<mx::array>&,
      const std::vector<int>&) override {
    refuse("jvp is not implemented (inference only)");
  }
  std::vector<mx::array> vjp(
      const std::vector<mx::array>&,
      const std::vector<mx::array>&,
      const std::vector<int>&,
      const std::vector<mx::array>&) override {
    refuse("vjp is not implemented (inference only)");
  }
  std::pair<std::vector<mx::array>, std::vector<int>> vmap(
      const std::vector<mx::array>&,
      const std::vector<int>&) override {
    refuse("vmap is not implemented");
  }

 protected:
  [[noreturn]] void refuse(const char* what) const {
    throw std::runtime_error(std::string("[") + this->name() + "] " + what + ".");
  }
};

class InferencePrimitive : public Inference<mx::UnaryPrimitive> {
 public:
  using Inference::Inference;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    refuse("has no GPU implementation; use a CPU stream");
  }
};

// The same with several outputs (mx::array::make_arrays).
class InferencePrimitives : public Inference<mx::Primitive> {
 public:
  using Inference::Inference;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    refuse("has no GPU implementation; use a CPU stream");
  }
};

// Copy a strided float32 view into dense row-major order.
inline void densify(
    const float* src,
    const mx::Shape& shape,
    const mx::Strides& strides,
    float* dst) {
  const int nd = static_cast<int>(shape.size());
  int64_t count = 1;
  for (auto d : shape) count *= d;
  std::vector<int64_t> idx(nd, 0);
  int64_t loc = 0;
  for (int64_t i = 0; i < count; ++i) {
    dst[i] = src[loc];
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) {
        loc += strides[d];
        break;
      }
      loc -= strides[d] * (shape[d] - 1);
      idx[d] = 0;
    }
  }
}

// A [B, X, N, D] float32 operand as a pointer and the strides of its first three dims (rows of
// D contiguous), densified into `buf` when its rows are not contiguous.
struct Rows4 {
  const float* data;
  int64_t s0, s1, s2;
};

inline Rows4 rows4(
    const float* ptr,
    const mx::Shape& shape,
    const mx::Strides& st,
    std::vector<float>& buf) {
  if (shape[3] <= 1 || st[3] == 1) return {ptr, st[0], st[1], st[2]};
  int64_t count = 1;
  for (auto d : shape) count *= d;
  buf.resize(count);
  densify(ptr, shape, st, buf.data());
  const int64_t D = shape[3];
  return {buf.data(), shape[1] * shape[2] * D, shape[2] * D, D};
}

// Runs part(0) .. part(parts - 1), part 0 on the calling thread and the others on the
// process's kept workers (pool.h).
template <typename F>
void run_parts(int64_t parts, F&& part) {
  WorkerPool::instance().run(parts, part);
}

// Runs range(p0, p1) over contiguous panel ranges covering [0, panels), one per thread (up to
// `threads`); every column is computed by the same code whichever range holds it, so the
// split does not change the bits.
template <typename F>
void run_panel_ranges(int threads, int64_t panels, F&& range) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, panels));
  run_parts(parts, [&](int64_t t) { range(panels * t / parts, panels * (t + 1) / parts); });
}

} // namespace mtp_native
