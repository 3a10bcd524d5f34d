// nanobind module _smallrow: the PanelMatmul and GatherPanelMatmul ops for Python (NB_DOMAIN
// mlx, so mlx.core's array and stream types pass straight through).

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/variant.h>

#include <string>

#include "kernels.h"
#include "attention.h"
#include "block.h"
#include "delta.h"
#include "gathered.h"
#include "quantized.h"
#include "rows.h"
#include "mlx/version.h"
#include "smallrow.h"
#include "sampling.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

NB_MODULE(_smallrow, m) {
  m.doc() = "Few-row float32 products over a column-panel weight layout (MLX CPU primitive).";

  m.def(
      "panel_matmul",
      &mtp_native::panel_matmul,
      "x"_a,
      "panels"_a,
      "n"_a,
      "threads"_a = 1,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "y[..., n] = x[..., K] @ W[K, n] with W as float32 panels [NB, K, PANEL]; threads splits "
      "the panels over that many threads (1: the stream's own thread).");
  m.def(
      "gather_panel_matmul",
      &mtp_native::gather_panel_matmul,
      "x"_a,
      "panels"_a,
      "indices"_a,
      "n"_a,
      "threads"_a = 1,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "y[t, j, :n] = x[t, j or 0] @ W[indices[t, j]] with the experts' W as float32 panels "
      "[E, NB, K, PANEL]; each selected expert's panels are read once for all its rows; threads "
      "splits the experts over that many threads.");
  m.def(
      "gather_qpanel_matmul",
      &mtp_native::gather_qpanel_matmul,
      "x"_a,
      "panels"_a,
      "indices"_a,
      "n"_a,
      "exact"_a,
      "threads"_a = 1,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "gather_panel_matmul over quantized experts: panels uint8 [E, NB, K / group, rows, "
      "2 bits], each expert's block to_qpanels of its weight; exact as qpanel_matmul.");
  m.def(
      "flash_attention",
      &mtp_native::flash_attention,
      "q"_a,
      "k"_a,
      "v"_a,
      "scale"_a,
      "causal"_a,
      "threads"_a = 1,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "softmax(scale q k^T + causal mask) v for q [B, H, L, D] and k, v [B, G, T, D] (G divides "
      "H), fused per block of query rows; threads splits the blocks.");
  m.def(
      "flash_attention_quantized",
      &mtp_native::flash_attention_quantized,
      "q"_a,
      "k"_a,
      "v"_a,
      "scale"_a,
      "causal"_a,
      "bits"_a,
      "group"_a,
      "threads"_a = 1,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "flash_attention over packed quantized keys and values (cache.kv_quantized: uint32 "
      "[B, G, T, W]), each key tile dequantized as a block reads it.");
  m.def(
      "qpanel_matmul",
      &mtp_native::qpanel_matmul,
      "x"_a,
      "panels"_a,
      "n"_a,
      "exact"_a,
      "threads"_a = 1,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "y[..., n] = x[..., K] @ W[K, n] with W as quantized panels (uint8 [NB, K / group, "
      "64 / bits + group, 2 bits]); exact: bit-for-bit the float32 product of the dequantized "
      "weight, else int8 activations per row; threads splits the panels.");
  m.def(
      "row_attention",
      &mtp_native::row_attention,
      "q"_a,
      "k"_a,
      "v"_a,
      "scale"_a,
      "threads"_a = 1,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "softmax(scale q k^T) v for a few query rows q [B, H, L, D] over k, v [B, G, T, D], row i "
      "over keys 0 .. T - L + i, each row computed alone (the same bits whatever L or threads).");
  m.def(
      "rows_attention",
      &mtp_native::rows_attention,
      "q"_a,
      "keys"_a,
      "values"_a,
      "lengths"_a,
      "counts"_a,
      "scale"_a,
      "threads"_a = 1,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "row_attention for several sequences in one node: q [1, H, R, D] holds counts[i] rows of "
      "sequence i in turn, each over the first lengths[i] positions of its buffers "
      "keys[i], values[i] [1, G, capacity, D].");
  m.def(
      "delta_step",
      &mtp_native::delta_step,
      "q"_a,
      "k"_a,
      "v"_a,
      "g"_a,
      "beta"_a,
      "state"_a,
      "threads"_a = 1,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "One row of the gated delta rule per sequence and value head: q, k [B, H, Dk], v "
      "[B, H, Dv], g, beta [B, H], state [B, H, Dk, Dv] (float32); returns [y, new state].");
  m.def(
      "delta_row",
      &mtp_native::delta_row,
      "qkv"_a,
      "conv"_a,
      "weight"_a,
      "b"_a,
      "a"_a,
      "a_log"_a,
      "dt_bias"_a,
      "state"_a,
      "key_heads"_a,
      "threads"_a = 1,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "A Gated DeltaNet layer's one-row mixer (conv, SiLU, q/k norms, decay, the delta step); "
      "returns [y [B, 1, Hv, Dv], the conv rows after, the new state].");
  m.def(
      "row_attention_quantized",
      &mtp_native::row_attention_quantized,
      "q"_a,
      "k"_a,
      "v"_a,
      "scale"_a,
      "bits"_a,
      "group"_a,
      "threads"_a = 1,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "row_attention over packed quantized keys and values (cache.kv_quantized: uint32 "
      "[B, G, T, W]), each row dequantized as it is read.");
  // A block's numbers as keywords (block.h's BlockSpec).
  auto spec = [](int heads, int kv_heads, int head_dim, int rotary, bool traditional, float eps,
                 float qk_eps, bool bias, bool qk_norm, bool exact, int threads) {
    mtp_native::BlockSpec sp;
    sp.heads = heads;
    sp.kv_heads = kv_heads;
    sp.head_dim = head_dim;
    sp.rotary = rotary;
    sp.traditional = traditional;
    sp.eps = eps;
    sp.qk_eps = qk_eps;
    sp.bias = bias;
    sp.qk_norm = qk_norm;
    sp.exact = exact;
    sp.threads = threads;
    return sp;
  };
  m.def(
      "block_front",
      [spec](const mx::array& x, const mx::array& norm, const mx::array& qkv,
             std::optional<mx::array> bias, std::optional<mx::array> q_norm,
             std::optional<mx::array> k_norm, const mx::array& cos, const mx::array& sin,
             int heads, int kv_heads, int head_dim, int rotary, bool traditional, float eps,
             float qk_eps, bool exact, int threads, mx::StreamOrDevice s) {
        const auto sp = spec(heads, kv_heads, head_dim, rotary, traditional, eps, qk_eps,
                             bias.has_value(), q_norm.has_value(), exact, threads);
        return mtp_native::block_front(x, norm, qkv, bias, q_norm, k_norm, cos, sin, sp, s);
      },
      "x"_a, "norm"_a, "qkv"_a, "bias"_a.none(), "q_norm"_a.none(), "k_norm"_a.none(),
      "cos"_a, "sin"_a, nb::kw_only(), "heads"_a, "kv_heads"_a, "head_dim"_a, "rotary"_a,
      "traditional"_a, "eps"_a, "qk_eps"_a, "exact"_a, "threads"_a = 1,
      "stream"_a = nb::none(),
      "A decoder block before its cache for a few rows: RMSNorm, the fused q/k/v product over "
      "panels (+ bias), per-head q/k RMSNorms, the rotation by cos/sin [L, head_dim]; returns "
      "[q, k, v] as [B, heads, L, head_dim] and [B, kv_heads, L, head_dim].");
  m.def(
      "block_back",
      [spec](const mx::array& x, const mx::array& attended, const mx::array& o,
             const mx::array& norm, const mx::array& gate_up, const mx::array& down, int heads,
             int kv_heads, int head_dim, float eps, bool exact, int threads,
             mx::StreamOrDevice s) {
        const auto sp = spec(heads, kv_heads, head_dim, 0, false, eps, eps, false, false, exact,
                             threads);
        return mtp_native::block_back(x, attended, o, norm, gate_up, down, sp, s);
      },
      "x"_a, "attended"_a, "o"_a, "norm"_a, "gate_up"_a, "down"_a, nb::kw_only(), "heads"_a,
      "kv_heads"_a, "head_dim"_a, "eps"_a, "exact"_a, "threads"_a = 1, "stream"_a = nb::none(),
      "A decoder block after its attention for a few rows: x + attended @ o, then + the SiLU "
      "MLP of its RMSNorm (gate/up fused, gate columns first); returns [B, L, dim].");
  m.def(
      "qpanel_columns",
      &mtp_native::qpanel_columns,
      "panels"_a,
      "ids"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "Columns ids (int32 or uint32 [T]) of the weight held as quantized panels, float32 "
      "[T, K], each value float32(s * q) + b; an id outside the panels gives zeros.");
  m.def(
      "top_k_ids",
      &mtp_native::top_k_ids,
      "logits"_a,
      "k"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "Per row of float32 logits [R, V] the ids (uint32 [R, k], ascending) of the k largest "
      "values, ties toward the lower id: the sampler's argpartition of its rank key and sort.");
  m.def(
      "argmax_ids",
      &mtp_native::argmax_ids,
      "logits"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "Per row of float32 logits [R, V] the index (int32 [R]) mx.argmax gives: the first NaN, "
      "else the first value equal to the row's maximum.");
  m.def(
      "penalise_rows",
      &mtp_native::penalise_rows,
      "logits"_a,
      "windows"_a,
      "repeat"_a,
      "presence"_a,
      "frequency"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "Float32 logits [R, V] with each distinct token of the row's window (int32 [R, W] or "
      "[1, W]; ids outside [0, V) ignored) rewritten by the repeat, presence and frequency "
      "penalties, as runner.sampler computes them.");
  m.def("qpanel_isa", &mtp_native::qpanel_isa, "The quantized fast product's integer path.");
  m.def("attention_isa", &mtp_native::attention_isa, "The attention kernel path compiled in.");
  m.def("isa", &mtp_native::isa, "The kernel path compiled in: avx512, avx2 or portable.");
  m.attr("PANEL") = smallrow::kPanel;
  m.attr("MAX_BLOCK") = smallrow::kMaxBlock;
  // The MLX headers this was compiled against: the wrapper refuses a module built for another
  // MLX (the Primitive ABI is not stable across versions).
  m.attr("MLX_VERSION") = std::to_string(MLX_VERSION_MAJOR) + "." +
      std::to_string(MLX_VERSION_MINOR) + "." + std::to_string(MLX_VERSION_PATCH);
}
