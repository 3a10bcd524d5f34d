// MLX primitive for one row of the gated delta rule (Gated DeltaNet's recurrence,
// runner/models/gated_delta.py), per sequence b and value head h with a float32 state
// S [Dk, Dv]:
//
//   S = exp(g) S;  delta = beta (v - S^T k);  S = S + k delta^T;  y = S^T q
//
// in two passes over S (the first for S^T k, the second writing the new state and summing
// y as it goes) where the composed ops take several passes and a temporary of S each: the
// state is the step's whole memory traffic. Heads split over threads; each head's
// operations are its own whatever the split or the batch, so the bits depend on neither.

#pragma once

#include <vector>

#include "mlx/ops.h"
#include "mlx/utils.h"
#include "primitive.h"

namespace mtp_native {

// q, k: float32 [B, H, Dk]; v: [B, H, Dv]; g, beta: [B, H]; state: [B, H, Dk, Dv]; any
// strides. Returns {y [B, H, Dv], the new state [B, H, Dk, Dv]} (float32, dense).
std::vector<mx::array> delta_step(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& g,
    const mx::array& beta,
    const mx::array& state,
    int threads = 1,
    mx::StreamOrDevice s = {});

class DeltaStep : public InferencePrimitives {
 public:
  DeltaStep(mx::Stream stream, int threads) : InferencePrimitives(stream), threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "DeltaStep";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int threads_;
};

} // namespace mtp_native
