// MLX primitives for the few-row part of a pre-norm decoder block around its cache (decode
// steps, verify rows, shared forwards): a block otherwise runs as ~40 graph nodes per layer
// (norms composed of 3 ops, the fused q/k/v product split into heads by views, the rotation,
// the gate), each a task of its own on the CPU stream, whose dispatch costs about as much as
// the products themselves once those read 4-bit weights. Two nodes do the same work:
//
// - block_front: RMSNorm, the fused q/k/v product (+ bias), per-head q/k RMSNorms, the
//   rotation by cos/sin tables; outputs q [B, H, L, D], k and v [B, G, L, D];
// - block_back: the output projection of the attended rows, the residual, RMSNorm, the fused
//   gate/up product, SiLU(gate) * up, the down projection, the residual; outputs [B, L, dim].
//
// Products read quantized panels (qkernels.h, fast or exact) or float32 panels (kernels.h).
// Every row is computed alone (per-row norms, rotations and activations; products that do
// not depend on the row count), so row i of an L-row call is the one-row call's bits.

#pragma once

#include "mlx/ops.h"
#include "mlx/utils.h"
#include "primitive.h"

namespace mtp_native {

namespace mx = mlx::core;

// Numbers a block's two nodes share.
struct BlockSpec {
  int heads = 0;      // query heads H
  int kv_heads = 0;   // key/value heads G (divides H)
  int head_dim = 0;   // D
  int rotary = 0;     // features rotated per head (<= D; the rest pass unchanged)
  bool traditional = false; // rotate adjacent pairs instead of the two halves
  float eps = 1e-6f;  // the block norms' epsilon
  float qk_eps = 1e-6f;
  bool bias = false;  // the fused q/k/v product has a bias
  bool qk_norm = false;
  bool exact = false; // quantized products bit-for-bit as their dequantized weight
  int threads = 1;    // products split over this many threads
};

// x: float32 [B, L, dim]; norm [dim]; qkv: panels of the fused [dim, (H + 2G) D] weight
// (quantized uint8 4-D or float32 3-D); bias [(H + 2G) D] when spec.bias; q_norm, k_norm [D]
// when spec.qk_norm; cos, sin: float32 [L, D] (row l's rotation). Returns q, k, v.
std::vector<mx::array> block_front(
    const mx::array& x,
    const mx::array& norm,
    const mx::array& qkv,
    const std::optional<mx::array>& bias,
    const std::optional<mx::array>& q_norm,
    const std::optional<mx::array>& k_norm,
    const mx::array& cos,
    const mx::array& sin,
    const BlockSpec& spec,
    mx::StreamOrDevice s = {});

// x: float32 [B, L, dim] (the block's input); attended: float32 [B, H, L, D]; o: panels of
// [H D, dim]; norm [dim]; gate_up: panels of [dim, 2 F] (gate columns first); down: panels of
// [F, dim]. Returns the block's output [B, L, dim].
mx::array block_back(
    const mx::array& x,
    const mx::array& attended,
    const mx::array& o,
    const mx::array& norm,
    const mx::array& gate_up,
    const mx::array& down,
    const BlockSpec& spec,
    mx::StreamOrDevice s = {});

class BlockFront : public mx::Primitive {
 public:
  BlockFront(mx::Stream stream, BlockSpec spec) : mx::Primitive(stream), spec_(spec) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override;
  const char* name() const override {
    return "BlockFront";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  BlockSpec spec_;
};

class BlockBack : public InferencePrimitive {
 public:
  BlockBack(mx::Stream stream, BlockSpec spec) : InferencePrimitive(stream), spec_(spec) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "BlockBack";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  BlockSpec spec_;
};

} // namespace mtp_native
