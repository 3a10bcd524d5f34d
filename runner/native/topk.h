// MLX primitive for a sampler's top-k: the ids of each row's k largest logits, in ascending id
// order, as argpartition and a sort compute them (runner.sampler.filter_rows) but in one pass
// over the row instead of a partition of all of it.

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

} // namespace mtp_native
