// The QPanelColumns primitive: a tied embedding's lookups read from its output projection's
// quantized panels. One id reads one panel (16 columns) and keeps its lane of every block, so
// a lookup is one node of the graph instead of the ~20 MLX ops of gathers, shifts and masks
// that compute the same values (runner.native.quantized.columns without the module).

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "quantized.h"

namespace mtp_native {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[qpanel_columns] " + what);
}

// Column `col`'s scale (which 0) or bias (1) in a block's header, as float32.
float header_at(const uint8_t* blk, bool half, int which, int col) {
  const int64_t at = which * qpanels::kPanel + col;
  if (half) {
    uint16_t h;
    std::memcpy(&h, blk + 2 * at, 2);
    return qpanels::half_to_float(h);
  }
  float f;
  std::memcpy(&f, blk + 4 * at, 4);
  return f;
}

// Column `col` (0..15) of panel `panel`, every input, to `out` [K].
void read_column(const uint8_t* panel, const qpanels::Shape& sh, int col, float* out) {
  const int per = qpanels::unit_inputs(sh.bits);
  const uint32_t mask = (1u << sh.bits) - 1;
  for (int64_t gi = 0; gi < sh.groups(); ++gi) {
    const uint8_t* blk = panel + gi * sh.block();
    const float s = header_at(blk, sh.half, 0, col), b = header_at(blk, sh.half, 1, col);
    const uint8_t* values = blk + qpanels::header_bytes(sh.half);
    float* dst = out + gi * sh.group;
    for (int k = 0; k < sh.group; ++k) {
      uint32_t lane;
      std::memcpy(&lane, values + static_cast<int64_t>(k / per) * qpanels::kUnit + 4 * col, 4);
      const float q = static_cast<float>((lane >> ((k % per) * sh.bits)) & mask);
      const float sq = q * s; // two roundings, as the dequantized weight has them
      dst[k] = sq + b;
    }
  }
}

} // namespace

mx::array qpanel_columns(const mx::array& panels, const mx::array& ids, mx::StreamOrDevice s) {
  if (panels.dtype() != mx::uint8 || panels.ndim() != 4)
    fail("panels must be uint8 [NB, K / group, header rows + group, 2 bits] (to_qpanels)");
  if (ids.ndim() != 1) fail("ids must have one dimension");
  if (ids.dtype() != mx::int32 && ids.dtype() != mx::uint32) fail("ids must be int32 or uint32");
  const auto sh = qpanel_layout(panels, static_cast<int>(panels.shape(0)) * qpanels::kPanel);
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) fail("runs on a CPU stream only");
  return mx::array(
      mx::Shape{ids.shape(0), sh.K}, mx::float32, std::make_shared<QPanelColumns>(stream),
      {panels, ids});
}

void QPanelColumns::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& p = inputs[0];
  const auto& ids = inputs[1];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const auto sh = qpanel_layout(p, static_cast<int>(p.shape(0)) * qpanels::kPanel);
  if (!p.flags().row_contiguous) fail("panels must be row-contiguous");
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(p);
  encoder.set_input_array(ids);
  encoder.set_output_array(out);
  encoder.dispatch([p_ptr = p.data<uint8_t>(),
                    id_ptr = ids.data<uint8_t>(),
                    id_stride = static_cast<int64_t>(ids.strides()[0]) * 4,
                    signed_ids = ids.dtype() == mx::int32,
                    count = static_cast<int64_t>(ids.shape(0)),
                    y = out.data<float>(),
                    sh]() {
    for (int64_t t = 0; t < count; ++t) {
      int64_t id;
      if (signed_ids) {
        int32_t v;
        std::memcpy(&v, id_ptr + t * id_stride, 4);
        id = v;
      } else {
        uint32_t v;
        std::memcpy(&v, id_ptr + t * id_stride, 4);
        id = v;
      }
      float* row = y + t * sh.K;
      if (id < 0 || id >= sh.NB * qpanels::kPanel) {
        std::memset(row, 0, sizeof(float) * sh.K);
        continue;
      }
      read_column(p_ptr + (id / qpanels::kPanel) * sh.panel_bytes(), sh,
                  static_cast<int>(id % qpanels::kPanel), row);
    }
  });
}

std::vector<mx::Shape> QPanelColumns::output_shapes(const std::vector<mx::array>& inputs) {
  const auto sh = qpanel_layout(inputs[0], static_cast<int>(inputs[0].shape(0)) * qpanels::kPanel);
  return {mx::Shape{inputs[1].shape(0), sh.K}};
}

} // namespace mtp_native
