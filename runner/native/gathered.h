// MLX primitive for the routed experts of a mixture-of-experts block: few-row float32 products
// over per-expert column panels, each row through the experts its router picked.
//
// y[t, j, :n] = x[t, j or 0, :K] @ W[indices[t, j]] with every expert's W[K, n] stored as
// panels [NB][K][16] (kernels.h), the experts stacked: panels [E, NB, K, 16]. The (row, expert)
// pairs are grouped by expert, so each selected expert's panels are read once for all the rows
// that chose it (a verify feed whose rows share experts reads them once), and every pair is
// kernels.h's product: one FMA chain per output element in k order, whatever the grouping, so
// a row's result is bit-for-bit the same whatever other rows share its feed.

#pragma once

#include "mlx/ops.h"
#include "mlx/utils.h"
#include "primitive.h"

namespace mtp_native {

namespace mx = mlx::core;

// x: float32 [T, X, K] with X = 1 (every expert of row t reads x[t, 0]: gate/up) or X = k
// (pair (t, j) reads x[t, j]: down), any strides. panels: float32 [E, NB, K, P] (P =
// smallrow::kPanel) with P (NB - 1) < n <= P NB. indices: int32 or uint32 [T, k], any strides;
// an index outside [0, E) gives a zero row. threads: experts split over this many threads (1:
// all on the calling stream's thread). Returns float32 [T, k, n].
mx::array gather_panel_matmul(
    const mx::array& x,
    const mx::array& panels,
    const mx::array& indices,
    int n,
    int threads = 1,
    mx::StreamOrDevice s = {});

// The same over quantized experts: panels uint8 [E, NB, K / group, header rows + group,
// 2 bits] (expert e's block is runner.native.quantized.to_qpanels of its [n, K] weight),
// contiguous; each selected expert's rows are one qpanel_matmul (exact, or int8 activations
// per row: quantized.h), so a pair's result is its one-row product's whatever the feed.
mx::array gather_qpanel_matmul(
    const mx::array& x,
    const mx::array& panels,
    const mx::array& indices,
    int n,
    bool exact,
    int threads = 1,
    mx::StreamOrDevice s = {});

class GatherPanelMatmul : public InferencePrimitive {
 public:
  GatherPanelMatmul(mx::Stream stream, int n, int threads, bool quantized = false, bool exact = false)
      : InferencePrimitive(stream),
        n_(n),
        threads_(threads),
        quantized_(quantized),
        exact_(exact) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "GatherPanelMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int n_;
  int threads_;
  bool quantized_;
  bool exact_;
};

} // namespace mtp_native
