// MLX primitive for float32 products with few rows over the column-panel weight layout
// (see kernels.h): y = x @ W with W given as panels [NB][K][16], the output cut to n columns.

#pragma once

#include "mlx/ops.h"
#include "mlx/utils.h"
#include "primitive.h"

namespace mtp_native {

namespace mx = mlx::core;

// y[..., n] = x[..., K] @ W[K, n]. x: float32, any leading dims, any strides. panels: float32
// [NB, K, P] (P = smallrow::kPanel) with P (NB - 1) < n <= P NB. threads: panels split over this many threads
// (1: all on the calling stream's thread). Runs on a CPU stream (the default CPU stream when
// none is given).
mx::array panel_matmul(
    const mx::array& x,
    const mx::array& panels,
    int n,
    int threads = 1,
    mx::StreamOrDevice s = {});

class PanelMatmul : public InferencePrimitive {
 public:
  PanelMatmul(mx::Stream stream, int n, int threads)
      : InferencePrimitive(stream), n_(n), threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "PanelMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int n_;
  int threads_;
};

// The kernel path compiled in: "avx512", "avx2" or "portable".
const char* isa();

} // namespace mtp_native
