// The QPanelMatmul primitive: graph construction, shape checks, and the CPU evaluation that
// runs qkernels.h on the stream's thread (and helpers for large M).

#include "quantized.h"

#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "qkernels.h"

namespace mtp_native {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[qpanel_matmul] " + what);
}

bool valid_group(int group) {
  return group == 16 || (group >= 32 && group % 32 == 0);
}

} // namespace

// The header rows are 64 / bits (float32 scales and biases) or 32 / bits (float16): one of
// the two leaves a valid group size.
qpanels::Shape qpanel_layout(const mx::array& panels, int n) {
  if (panels.dtype() != mx::uint8 || panels.ndim() != 4)
    fail("panels must be uint8 [NB, K / group, header rows + group, 2 bits] (to_qpanels)");
  return qpanel_layout(panels.shape(0), panels.shape(1), panels.shape(2), panels.shape(3), n);
}

qpanels::Shape qpanel_layout(int64_t NB, int groups, int rows, int two_bits, int n) {
  const int bits = two_bits / 2;
  if (bits != 4 && bits != 8) fail("panels hold 4- or 8-bit values, not " + std::to_string(bits));
  const bool half = !valid_group(rows - 64 / bits);
  const int group = rows - (half ? 32 : 64) / bits;
  if (!valid_group(group))
    fail("group size must be 16 or a multiple of 32 (panel rows " + std::to_string(rows) + ")");
  qpanels::Shape sh;
  sh.K = groups * group;
  sh.group = group;
  sh.bits = bits;
  sh.half = half;
  sh.NB = NB;
  sh.n = n;
  if (n <= 0 || n > sh.NB * qpanels::kPanel || n <= (sh.NB - 1) * qpanels::kPanel) {
    std::ostringstream msg;
    msg << "n = " << n << " does not fit " << sh.NB << " panels of " << qpanels::kPanel
        << " columns";
    fail(msg.str());
  }
  return sh;
}

const char* qpanel_isa() {
  return qpanels::fast_isa();
}

mx::array qpanel_matmul(
    const mx::array& x,
    const mx::array& panels,
    int n,
    bool exact,
    int threads,
    mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32) fail("x must be float32");
  if (x.ndim() < 1) fail("x must have at least one dimension");
  const auto sh = qpanel_layout(panels, n);
  if (x.shape(-1) != sh.K) {
    std::ostringstream msg;
    msg << "x has " << x.shape(-1) << " columns but the panels have K = " << sh.K;
    fail(msg.str());
  }
  if (threads < 1) fail("threads must be >= 1");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) fail("runs on a CPU stream only");
  mx::Shape out_shape = x.shape();
  out_shape.back() = n;
  return mx::array(
      std::move(out_shape),
      mx::float32,
      std::make_shared<QPanelMatmul>(stream, n, exact, threads),
      {x, panels});
}

void QPanelMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  const auto& p = inputs[1];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const auto sh = qpanel_layout(p, n_);
  const int64_t n = n_;
  const int64_t M = static_cast<int64_t>(out.size()) / n;

  int64_t ldx = sh.K;
  bool x_dense = x.flags().row_contiguous;
  if (!x_dense && x.ndim() == 2 && x.strides()[1] == 1) {
    ldx = x.strides()[0];
    x_dense = true;
  }
  if (!p.flags().row_contiguous) fail("panels must be row-contiguous");

  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_input_array(p);
  encoder.set_output_array(out);
  encoder.dispatch([x_ptr = x.data<float>(),
                    x_shape = x_dense ? mx::Shape{} : x.shape(),
                    x_strides = x_dense ? mx::Strides{} : x.strides(),
                    x_dense,
                    ldx,
                    p_ptr = p.data<uint8_t>(),
                    y = out.data<float>(),
                    M,
                    n,
                    sh,
                    exact = exact_,
                    threads = threads_]() {
    if (M == 0) return;
    std::vector<float> x_buf;
    const float* xs = x_ptr;
    int64_t lx = ldx;
    if (!x_dense) {
      x_buf.resize(static_cast<size_t>(M) * sh.K);
      densify(x_ptr, x_shape, x_strides, x_buf.data());
      xs = x_buf.data();
      lx = sh.K;
    }
    if (exact || qpanels::fast_as_exact(M)) {
      run_panel_ranges(threads, sh.NB, [&](int64_t p0, int64_t p1) {
        qpanels::matmul_exact(xs, lx, M, p_ptr, sh, y, n, p0, p1);
      });
      return;
    }
    qpanels::QuantRows rows;
    qpanels::quantize_rows(xs, lx, M, sh, rows);
    run_panel_ranges(threads, sh.NB, [&](int64_t p0, int64_t p1) {
      qpanels::matmul_fast(rows, M, p_ptr, sh, y, n, p0, p1);
    });
  });
}

bool QPanelMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QPanelMatmul&>(other);
  return n_ == o.n_ && exact_ == o.exact_ && threads_ == o.threads_;
}

std::vector<mx::Shape> QPanelMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape shape = inputs[0].shape();
  shape.back() = n_;
  return {shape};
}

} // namespace mtp_native
