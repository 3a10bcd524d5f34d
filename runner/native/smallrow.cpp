// The PanelMatmul primitive: graph construction, checks, and the CPU evaluation that runs the
// kernels of kernels.h on the stream's thread through MLX's CPU command encoder.

#include "smallrow.h"

#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mtp_native {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[panel_matmul] " + what);
}

} // namespace

const char* isa() {
  return smallrow::Vec::name;
}

mx::array panel_matmul(
    const mx::array& x,
    const mx::array& panels,
    int n,
    int threads,
    mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32 || panels.dtype() != mx::float32)
    fail("x and panels must be float32");
  if (panels.ndim() != 3 || panels.shape(2) != smallrow::kPanel)
    fail("panels must have shape [NB, K, " + std::to_string(smallrow::kPanel) + "] (to_panels)");
  if (x.ndim() < 1) fail("x must have at least one dimension");
  const int K = panels.shape(1);
  if (x.shape(-1) != K) {
    std::ostringstream msg;
    msg << "x has " << x.shape(-1) << " columns but the panels have K = " << K;
    fail(msg.str());
  }
  const int64_t NB = panels.shape(0);
  if (n <= 0 || n > NB * smallrow::kPanel || n <= (NB - 1) * smallrow::kPanel) {
    std::ostringstream msg;
    msg << "n = " << n << " does not fit " << NB << " panels of " << smallrow::kPanel
        << " columns";
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
      std::make_shared<PanelMatmul>(stream, n, threads),
      {x, panels});
}

void PanelMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  const auto& p = inputs[1];
  out.set_data(mx::allocator::malloc(out.nbytes()));

  const int K = p.shape(1);
  const int64_t NB = p.shape(0);
  const int64_t n = n_;
  const int64_t M = static_cast<int64_t>(out.size()) / n; // the rows of x (n >= 1)

  // x as [M, K] rows ldx apart with unit inner stride, or gathered (small: M x K floats).
  int64_t ldx = K;
  bool x_dense = x.flags().row_contiguous;
  if (!x_dense && x.ndim() == 2 && x.strides()[1] == 1) {
    ldx = x.strides()[0];
    x_dense = true;
  }
  const bool p_dense = p.flags().row_contiguous;

  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_input_array(p);
  encoder.set_output_array(out);
  encoder.dispatch([x_ptr = x.data<float>(),
                    x_shape = x_dense ? mx::Shape{} : x.shape(),
                    x_strides = x_dense ? mx::Strides{} : x.strides(),
                    x_dense,
                    ldx,
                    p_ptr = p.data<float>(),
                    p_shape = p_dense ? mx::Shape{} : p.shape(),
                    p_strides = p_dense ? mx::Strides{} : p.strides(),
                    p_dense,
                    y = out.data<float>(),
                    M,
                    K,
                    NB,
                    n,
                    threads = threads_]() {
    if (M == 0) return;
    if (K == 0) {
      std::memset(y, 0, sizeof(float) * M * n);
      return;
    }
    std::vector<float> x_buf, p_buf;
    const float* xs = x_ptr;
    int64_t lx = ldx;
    if (!x_dense) {
      x_buf.resize(static_cast<size_t>(M) * K);
      densify(x_ptr, x_shape, x_strides, x_buf.data());
      xs = x_buf.data();
      lx = K;
    }
    const float* ps = p_ptr;
    if (!p_dense) {
      p_buf.resize(static_cast<size_t>(NB) * K * smallrow::kPanel);
      densify(p_ptr, p_shape, p_strides, p_buf.data());
      ps = p_buf.data();
    }
    // Panels split into contiguous ranges, one per thread; the calling thread takes the first.
    run_panel_ranges(threads, NB, [&](int64_t p0, int64_t p1) {
      smallrow::panel_matmul(xs, lx, M, ps, K, n, y, n, p0, p1);
    });
  });
}

bool PanelMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PanelMatmul&>(other);
  return n_ == o.n_ && threads_ == o.threads_;
}

std::vector<mx::Shape> PanelMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape shape = inputs[0].shape();
  shape.back() = n_;
  return {shape};
}

} // namespace mtp_native
