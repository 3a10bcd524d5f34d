// MLX primitive for few-row products over quantized column panels (qkernels.h): y = x @ W with
// W stored as 4- or 8-bit values and a float32 scale and bias per group of inputs.

#pragma once

#include "mlx/ops.h"
#include "mlx/utils.h"
#include "primitive.h"
#include "qkernels.h"

namespace mtp_native {

namespace mx = mlx::core;

// y[..., n] = x[..., K] @ W[K, n]. x: float32, any leading dims, any strides. panels: uint8
// [NB, K / group, 64 / bits + group, 2 bits] (runner.native.to_qpanels: one block per panel and
// group, its header rows the scales and biases, then one row of 16 values per input) with
// 16 (NB - 1) < n <= 16 NB. exact: the float32 product of the dequantized weight (bit for
// bit); otherwise activations quantized to int8 per row (qkernels.h). threads: panels split
// over this many threads.
mx::array qpanel_matmul(
    const mx::array& x,
    const mx::array& panels,
    int n,
    bool exact,
    int threads = 1,
    mx::StreamOrDevice s = {});

class QPanelMatmul : public InferencePrimitive {
 public:
  QPanelMatmul(mx::Stream stream, int n, bool exact, int threads)
      : InferencePrimitive(stream), n_(n), exact_(exact), threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "QPanelMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int n_;
  bool exact_;
  int threads_;
};

// Columns `ids` (int32 or uint32, one dimension) of the weight W[K, N] held as quantized
// panels, as float32 rows [T, K]: each value float32(s * q) + b, the dequantized weight's bits
// (a tied embedding's lookups from its output projection's panels). An id outside the panels'
// columns gives a row of zeros.
mx::array qpanel_columns(const mx::array& panels, const mx::array& ids, mx::StreamOrDevice s = {});

class QPanelColumns : public InferencePrimitive {
 public:
  explicit QPanelColumns(mx::Stream stream) : InferencePrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "QPanelColumns";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
};

// The layout numbers of quantized panels [NB, K / group, header rows + group, 2 bits] for
// n output columns; throws std::invalid_argument naming what does not fit.
qpanels::Shape qpanel_layout(const mx::array& panels, int n);
// The same from the panels' dims (uint8 assumed): NB, K / group, rows, 2 bits.
qpanels::Shape qpanel_layout(int64_t NB, int groups, int rows, int two_bits, int n);

// The fast product's integer path compiled in: "avx512-vnni", "avx512bw", "avx2" or
// "portable".
const char* qpanel_isa();

} // namespace mtp_native
