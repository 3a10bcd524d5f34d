// MLX primitive for a prefill chunk's attention: softmax(scale q k^T + causal mask) v fused
// per query block (flash.h), the blocks split over threads.

#pragma once

#include "mlx/ops.h"
#include "mlx/utils.h"
#include "primitive.h"

namespace mtp_native {

// q: float32 [B, H, L, D]; k, v: float32 [B, G, T, D] with G dividing H (grouped-query heads
// h read group h / (H / G)); any strides. causal: row i sits at position T - L + i and sees
// keys up to it (L <= T); otherwise every key. threads: blocks split over this many threads.
// Returns float32 [B, H, L, D].
mx::array flash_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    bool causal,
    int threads = 1,
    mx::StreamOrDevice s = {});

// The same over packed quantized keys and values (cache.kv_quantized): k, v uint32
// [B, G, T, W], W = D * bits / 32 + 2 * D / group; each key tile is dequantized as a block
// reads it (no float copy of the cache).
mx::array flash_attention_quantized(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    bool causal,
    int bits,
    int group,
    int threads = 1,
    mx::StreamOrDevice s = {});

class FlashAttention : public InferencePrimitive {
 public:
  FlashAttention(mx::Stream stream, float scale, bool causal, int threads, int bits = 0,
                 int group = 0)
      : InferencePrimitive(stream), scale_(scale), causal_(causal), threads_(threads),
        bits_(bits), group_(group) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "FlashAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
  bool causal_;
  int threads_;
  int bits_, group_;  // 0: float keys and values
};

// The attention kernel path compiled in: "avx2" or "portable".
const char* attention_isa();

} // namespace mtp_native
