// DeltaStep (delta.h).

#include "delta.h"

#include <algorithm>
#include <cmath>
#include <cstring>
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

namespace {

float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}

// log(1 + exp(x)) without overflow.
float softplus(float x) {
  return x > 0.0f ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x));
}

// x * rsqrt(sum(x^2) + eps) * extra, in place over n values.
void l2_normalise(float* x, int n, float extra) {
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) sum += x[i] * x[i];
  const float f = 1.0f / std::sqrt(sum + 1e-6f);
  for (int i = 0; i < n; ++i) x[i] = x[i] * f * extra;
}

} // namespace

std::vector<mx::array> delta_row(
    const mx::array& qkv,
    const mx::array& conv,
    const mx::array& weight,
    const mx::array& b,
    const mx::array& a,
    const mx::array& a_log,
    const mx::array& dt_bias,
    const mx::array& state,
    int key_heads,
    int threads,
    mx::StreamOrDevice s) {
  if (threads < 1) fail("threads must be >= 1");
  for (const auto* x : {&qkv, &conv, &weight, &b, &a, &a_log, &dt_bias, &state})
    if (x->dtype() != mx::float32) fail("every operand must be float32");
  if (qkv.ndim() != 3 || qkv.shape(1) != 1 || conv.ndim() != 3 || state.ndim() != 4)
    fail("qkv [B, 1, C], conv [B, K - 1, C] and state [B, Hv, Dk, Dv] expected");
  const int B = qkv.shape(0), C = qkv.shape(2), Hv = state.shape(1), Dk = state.shape(2);
  const int Dv = state.shape(3), K = conv.shape(1) + 1;
  if (state.shape(0) != B || key_heads < 1 || Hv % key_heads ||
      C != 2 * key_heads * Dk + Hv * Dv)
    fail("qkv's channels are not 2 Hk Dk + Hv Dv for the state's heads");
  if (K < 2) fail("the conv needs a kernel of at least 2 (a conv row kept)");
  if (conv.shape(0) != B || conv.shape(2) != C || weight.shape() != mx::Shape{C, K, 1})
    fail("conv [B, K - 1, C] and weight [C, K, 1] do not match qkv");
  for (const auto* x : {&b, &a})
    if (x->shape() != mx::Shape{B, 1, Hv}) fail("b and a must be [B, 1, Hv]");
  if (a_log.shape() != mx::Shape{Hv} || dt_bias.shape() != mx::Shape{Hv})
    fail("a_log and dt_bias must be [Hv]");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) fail("runs on a CPU stream only");
  return mx::array::make_arrays(
      {mx::Shape{B, 1, Hv, Dv}, conv.shape(), state.shape()},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<DeltaRow>(stream, key_heads, threads),
      {qkv, conv, weight, b, a, a_log, dt_bias, state});
}

void DeltaRow::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  for (auto& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& x : inputs) encoder.set_input_array(x);
  for (auto& out : outputs) encoder.set_output_array(out);
  encoder.dispatch([inputs, yp = outputs[0].data<float>(), cp = outputs[1].data<float>(),
                    sp = outputs[2].data<float>(), Hk = key_heads_, threads = threads_]() {
    std::vector<float> bufs[8];
    const float* p[8];
    for (int i = 0; i < 8; ++i) p[i] = dense(inputs[i], bufs[i]);
    const float *qkv = p[0], *conv = p[1], *weight = p[2], *bp = p[3], *ap = p[4];
    const float *a_log = p[5], *dt_bias = p[6], *state = p[7];
    const int B = inputs[0].shape(0), C = inputs[0].shape(2), K = inputs[1].shape(1) + 1;
    const int Hv = inputs[7].shape(1), Dk = inputs[7].shape(2), Dv = inputs[7].shape(3);
    const int keys = Hk * Dk;
    // The conv, SiLU and norms for every sequence's row first (C values each), then the
    // heads' steps split over threads.
    std::vector<float> mixed(static_cast<size_t>(B) * C);
    for (int bi = 0; bi < B; ++bi) {
      const float* rows = conv + static_cast<int64_t>(bi) * (K - 1) * C;
      const float* row = qkv + static_cast<int64_t>(bi) * C;
      float* m = mixed.data() + static_cast<int64_t>(bi) * C;
      float* kept = cp + static_cast<int64_t>(bi) * (K - 1) * C;
      for (int c = 0; c < C; ++c) {
        const float* taps = weight + static_cast<int64_t>(c) * K;
        float sum = rows[c] * taps[0]; // the composed conv's order: row 0 first
        for (int i = 1; i < K - 1; ++i) sum = sum + rows[static_cast<int64_t>(i) * C + c] * taps[i];
        sum = sum + row[c] * taps[K - 1];
        m[c] = sum * sigmoid(sum);
      }
      for (int i = 0; i + 1 < K - 1; ++i)
        std::memcpy(kept + static_cast<int64_t>(i) * C, rows + static_cast<int64_t>(i + 1) * C,
                    sizeof(float) * C);
      std::memcpy(kept + static_cast<int64_t>(K - 2) * C, row, sizeof(float) * C);
      const float q_scale = 1.0f / std::sqrt(static_cast<float>(Dk));
      for (int h = 0; h < Hk; ++h) {
        l2_normalise(m + h * Dk, Dk, q_scale);
        l2_normalise(m + keys + h * Dk, Dk, 1.0f);
      }
    }
    const int64_t heads = static_cast<int64_t>(B) * Hv;
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, heads));
    const int per_key = Hv / Hk;
    run_parts(parts, [&](int64_t t) {
      std::vector<float> r(Dv);
      for (int64_t bh = heads * t / parts; bh < heads * (t + 1) / parts; ++bh) {
        const int64_t bi = bh / Hv;
        const int h = static_cast<int>(bh % Hv);
        const float* m = mixed.data() + bi * C;
        const float g = -std::exp(a_log[h]) * softplus(ap[bh] + dt_bias[h]);
        const int64_t state_at = bh * Dk * Dv;
        head_step(state + state_at, m + (h / per_key) * Dk, m + keys + (h / per_key) * Dk,
                  m + 2 * keys + h * Dv, g, sigmoid(bp[bh]), Dk, Dv, sp + state_at,
                  yp + bh * Dv, r.data());
      }
    });
  });
}

bool DeltaRow::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const DeltaRow&>(other);
  return key_heads_ == o.key_heads_ && threads_ == o.threads_;
}

std::vector<mx::Shape> DeltaRow::output_shapes(const std::vector<mx::array>& inputs) {
  const auto& st = inputs[7].shape();
  return {mx::Shape{st[0], 1, st[1], st[3]}, inputs[1].shape(), st};
}

bool DeltaStep::is_equivalent(const mx::Primitive& other) const {
  return threads_ == static_cast<const DeltaStep&>(other).threads_;
}

std::vector<mx::Shape> DeltaStep::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[2].shape(), inputs[5].shape()};
}

} // namespace mtp_native
