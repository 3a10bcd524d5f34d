// nanobind module _smallrow: the PanelMatmul and GatherPanelMatmul ops for Python (NB_DOMAIN
// mlx, so mlx.core's array and stream types pass straight through).

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>

#include <string>

#include "kernels.h"
#include "attention.h"
#include "gathered.h"
#include "quantized.h"
#include "rows.h"
#include "mlx/version.h"
#include "smallrow.h"

namespace nb = nanobind;
using namespace nb::literals;

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
      nb::kw_only(),
      "stream"_a = nb::none(),
      "softmax(scale q k^T) v for a few query rows q [B, H, L, D] over k, v [B, G, T, D], row i "
      "over keys 0 .. T - L + i, each row computed alone (the same bits whatever L).");
  m.def(
      "row_attention_quantized",
      &mtp_native::row_attention_quantized,
      "q"_a,
      "k"_a,
      "v"_a,
      "scale"_a,
      "bits"_a,
      "group"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "row_attention over packed quantized keys and values (cache.kv_quantized: uint32 "
      "[B, G, T, W]), each row dequantized as it is read.");
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
