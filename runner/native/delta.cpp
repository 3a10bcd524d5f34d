// DeltaStep (delta.h).

#include "delta.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mtp_native {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[delta_step] " + what + ".");
}

// An operand's data, densified into `buf` unless it is row-contiguous already.
const float* dense(const mx::array& a, std::vector<float>& buf) {
  if (a.flags().row_contiguous) return a.data<float>();
  buf.resize(a.size());
  densify(a.data<float>(), a.shape(), a.strides(), buf.data());
  return buf.data();
}

// One head: S (Dk x Dv, dense) to `out`, y (Dv) from q, k (Dk), v (Dv), g, beta. `r` is
// scratch of Dv floats.
void head_step(
    const float* __restrict S,
    const float* __restrict q,
    const float* __restrict k,
    const float* __restrict v,
    float g,
    float beta,
    int Dk,
    int Dv,
    float* __restrict out,
    float* __restrict y,
    float* __restrict r) {
  const float decay = std::exp(g);
  for (int j = 0; j < Dv; ++j) r[j] = 0.0f;
  for (int i = 0; i < Dk; ++i) {
    const float ki = k[i];
    const float* row = S + static_cast<int64_t>(i) * Dv;
    for (int j = 0; j < Dv; ++j) r[j] += ki * (row[j] * decay);
  }
  for (int j = 0; j < Dv; ++j) {
    r[j] = (v[j] - r[j]) * beta; // delta
    y[j] = 0.0f;
  }
  for (int i = 0; i < Dk; ++i) {
    const float ki = k[i], qi = q[i];
    const float* row = S + static_cast<int64_t>(i) * Dv;
    float* orow = out + static_cast<int64_t>(i) * Dv;
    for (int j = 0; j < Dv; ++j) {
      const float s = row[j] * decay + ki * r[j];
      orow[j] = s;
      y[j] += qi * s;
    }
  }
}

} // namespace

std::vector<mx::array> delta_step(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& g,
    const mx::array& beta,
    const mx::array& state,
    int threads,
    mx::StreamOrDevice s) {
  if (threads < 1) fail("threads must be >= 1");
  for (const auto* a : {&q, &k, &v, &g, &beta, &state})
    if (a->dtype() != mx::float32) fail("every operand must be float32");
  if (q.ndim() != 3 || k.shape() != q.shape() || v.ndim() != 3 || state.ndim() != 4)
    fail("q, k [B, H, Dk], v [B, H, Dv] and state [B, H, Dk, Dv] expected");
  const int B = q.shape(0), H = q.shape(1), Dk = q.shape(2), Dv = v.shape(2);
  if (v.shape(0) != B || v.shape(1) != H || state.shape() != mx::Shape{B, H, Dk, Dv})
    fail("v and state do not match q's batch, heads and key width");
  if (g.shape() != mx::Shape{B, H} || beta.shape() != mx::Shape{B, H})
    fail("g and beta must be [B, H]");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) fail("runs on a CPU stream only");
  return mx::array::make_arrays(
      {v.shape(), state.shape()},
      {mx::float32, mx::float32},
      std::make_shared<DeltaStep>(stream, threads),
      {q, k, v, g, beta, state});
}

void DeltaStep::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& y = outputs[0];
  auto& out = outputs[1];
  y.set_data(mx::allocator::malloc(y.nbytes()));
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(y);
  encoder.set_output_array(out);
  encoder.dispatch([inputs, yp = y.data<float>(), op = out.data<float>(), threads = threads_]() {
    std::vector<float> bufs[6];
    const float* p[6];
    for (int i = 0; i < 6; ++i) p[i] = dense(inputs[i], bufs[i]);
    const int B = inputs[0].shape(0), H = inputs[0].shape(1), Dk = inputs[0].shape(2);
    const int Dv = inputs[2].shape(2);
    const int64_t heads = static_cast<int64_t>(B) * H;
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, heads));
    run_parts(parts, [&](int64_t t) {
      std::vector<float> r(Dv);
      for (int64_t bh = heads * t / parts; bh < heads * (t + 1) / parts; ++bh) {
        const int64_t state_at = bh * Dk * Dv;
        head_step(p[5] + state_at, p[0] + bh * Dk, p[1] + bh * Dk, p[2] + bh * Dv, p[3][bh],
                  p[4][bh], Dk, Dv, op + state_at, yp + bh * Dv, r.data());
      }
    });
  });
}

bool DeltaStep::is_equivalent(const mx::Primitive& other) const {
  return threads_ == static_cast<const DeltaStep&>(other).threads_;
}

std::vector<mx::Shape> DeltaStep::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[2].shape(), inputs[5].shape()};
}

} // namespace mtp_native
