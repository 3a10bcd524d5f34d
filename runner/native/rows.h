// MLX primitive for the attention of a few query rows (decode steps, verify rows): each row
// attends over the keys up to its own position with its own operations in its own order,
// whatever the row count (rows of one group are taken in tiles that share their reads of the
// keys and values, never an operation), so row i of an L-row call is bit-for-bit the one-row
// call that decoding that token alone makes. One primitive replaces the five-op composition
// per row.

#pragma once

#include <utility>
#include <vector>

#include "mlx/ops.h"
#include "mlx/utils.h"
#include "primitive.h"

namespace mtp_native {

// q: float32 [B, H, L, D]; k, v: float32 [B, G, T, D] (G divides H; head h reads group
// h / (H / G)), L <= T, any strides with unit stride along D. Row i sits at position
// T - L + i and sees keys 0 .. T - L + i. Returns float32 [B, H, L, D]. `threads` splits the
// query rows (b, h, i) over the process's workers when there is enough work; every row keeps
// its own operations whatever its tile or part, so the bits do not depend on it.
mx::array row_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    int threads = 1,
    mx::StreamOrDevice s = {});

class RowAttention : public InferencePrimitive {
 public:
  RowAttention(mx::Stream stream, float scale, int threads)
      : InferencePrimitive(stream), scale_(scale), threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "RowAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
  int threads_;
};

// Several sequences' rows at once (a forward shared by several requests): q float32
// [1, H, R, D] holds counts[0] rows of sequence 0, then counts[1] of sequence 1, ...;
// sequence i's keys and values are the first lengths[i] positions of its buffers keys[i],
// values[i] (float32 [1, G, capacity, D]: a cache's whole buffers, no fetched views), its
// row j at position lengths[i] - counts[i] + j. Each row has the bits RowAttention gives it
// over that sequence's cache alone; one node where R sequences took R.
mx::array rows_attention(
    const mx::array& q,
    const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values,
    const std::vector<int>& lengths,
    const std::vector<int>& counts,
    float scale,
    int threads = 1,
    mx::StreamOrDevice s = {});

class RowsAttention : public InferencePrimitive {
 public:
  RowsAttention(mx::Stream stream, float scale, int threads, std::vector<int> lengths,
                std::vector<int> counts)
      : InferencePrimitive(stream), scale_(scale), threads_(threads),
        lengths_(std::move(lengths)), counts_(std::move(counts)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "RowsAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
  int threads_;
  std::vector<int> lengths_, counts_;
};

// The same over a cache.kv_quantized packed cache: k, v uint32 [B, G, T, W] with
// W = D * bits / 32 + 2 * D / group (bits 4 or 8, group 32, 64 or 128; D a multiple of 16 up
// to 256), each key and value dequantized chunk by chunk as it is read (no float copy).
mx::array row_attention_quantized(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    int bits,
    int group,
    int threads = 1,
    mx::StreamOrDevice s = {});

class QuantizedRowAttention : public InferencePrimitive {
 public:
  QuantizedRowAttention(mx::Stream stream, float scale, int bits, int group, int threads)
      : InferencePrimitive(stream), scale_(scale), bits_(bits), group_(group), threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "QuantizedRowAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
  int bits_, group_, threads_;
};

} // namespace mtp_native
