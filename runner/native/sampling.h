// MLX primitives for the sampler's row operations: top-k, the ids of each row's k largest
// logits in ascending id order, as argpartition and a sort compute them
// (runner.sampler.filter_rows) but in one pass over the row instead of a partition of all of
// it; argmax, mx.argmax's index of each row, from vector passes; the repeat, presence and
// frequency penalties, one copy of each row with its window's tokens rewritten.

#pragma once

#include "mlx/ops.h"
#include "mlx/utils.h"
#include "primitive.h"

namespace mtp_native {

// logits: float32 [R, V], any strides; 0 < k < V. Returns uint32 [R, k]: per row the ids of
// the k largest values, ties toward the lower id, -0.0 equal to 0.0, a NaN above +inf or below -inf by
// its sign bit (the order of the sampler's rank key: float bits made order-preserving, then the id descending),
// sorted ascending.
mx::array top_k_ids(const mx::array& logits, int k, mx::StreamOrDevice s = {});

class TopKIds : public InferencePrimitive {
 public:
  TopKIds(mx::Stream stream, int k) : InferencePrimitive(stream), k_(k) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "TopKIds";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int k_;
};

// logits: float32 [R, V], any strides, V >= 1. Returns int32 [R]: per row the index of the first
// NaN if the row has one, else of the first value equal to its maximum (mx.argmax's answer).
mx::array argmax_ids(const mx::array& logits, mx::StreamOrDevice s = {});

class ArgmaxIds : public InferencePrimitive {
 public:
  explicit ArgmaxIds(mx::Stream stream) : InferencePrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "ArgmaxIds";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
};

// logits: float32 [R, V], any strides; windows: int32 [R, W] or [1, W] (every row the same
// window), ids outside [0, V) ignored (the sampler's padding). Returns float32 [R, V]: the
// logits with each distinct token t of the row's window rewritten as runner.sampler's MLX
// path does it, in float32: v = old > 0 ? old / repeat : old * repeat (when repeat != 1),
// then v - presence (when presence != 0), then v - frequency * count(t) (when frequency != 0).
mx::array penalise_rows(
    const mx::array& logits,
    const mx::array& windows,
    float repeat,
    float presence,
    float frequency,
    mx::StreamOrDevice s = {});

class PenaliseRows : public InferencePrimitive {
 public:
  PenaliseRows(mx::Stream stream, float repeat, float presence, float frequency)
      : InferencePrimitive(stream), repeat_(repeat), presence_(presence), frequency_(frequency) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "PenaliseRows";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float repeat_, presence_, frequency_;
};

} // namespace mtp_native
