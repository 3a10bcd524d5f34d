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

// The whole one-row mixer of a Gated DeltaNet layer (GatedDeltaNet.mix for one row) per
// sequence b: the causal depthwise conv over the conv rows and the new row, SiLU, q and k
// L2-normalised per key head (q also by Dk^-0.5), g = -exp(A_log) softplus(a + dt_bias),
// beta = sigmoid(b), then the step above, value head h reading key head h / (Hv / Hk). One
// node where the composed mixer takes a dozen small ones per layer and sequence.
//
// qkv: float32 [B, 1, C] with C = 2 Hk Dk + Hv Dv (q, k, v channels); conv: [B, K - 1, C];
// weight: [C, K, 1] (the conv's, MLX layout); b, a: [B, 1, Hv]; a_log, dt_bias: [Hv];
// state: [B, Hv, Dk, Dv]. Returns {y [B, 1, Hv, Dv], the conv rows after [B, K - 1, C], the
// new state}.
std::vector<mx::array> delta_row(
    const mx::array& qkv,
    const mx::array& conv,
    const mx::array& weight,
    const mx::array& b,
    const mx::array& a,
    const mx::array& a_log,
    const mx::array& dt_bias,
    const mx::array& state,
    int key_heads,
    int threads = 1,
    mx::StreamOrDevice s = {});

class DeltaRow : public InferencePrimitives {
 public:
  DeltaRow(mx::Stream stream, int key_heads, int threads)
      : InferencePrimitives(stream), key_heads_(key_heads), threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "DeltaRow";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int key_heads_, threads_;
};

} // namespace mtp_native
