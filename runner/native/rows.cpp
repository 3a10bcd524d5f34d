// The RowAttention primitive: per query row, scores over its key prefix, a softmax and the
// weighted values, in plain loops the compiler vectorises along the head dimension (every
// row the same code and order: rows are independent of their batch).

#include "rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mtp_native {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[row_attention] " + what);
}

// e^x for x <= 0 (scores minus their maximum): 2^(x log2 e) split into an integer power
// (built in the exponent bits) and a degree-6 polynomial of the fraction; relative error
// about 2e-7, the same bits on every build.
inline float exp_nonpositive(float x) {
  const float t = std::max(x * 1.44269504f, -126.0f);
  const float fl = std::floor(t);
  const float f = t - fl;
  float p = 1.5403530e-4f;
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fl) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

struct Operand {
  const float* data;
  int64_t s0, s1, s2; // strides of the first three dims (the last is 1)
};

// A [B, X, N, D] array as a pointer and strides, densified into `buf` when D is not unit-stride.
Operand operand(const float* ptr, const mx::Shape& shape, const mx::Strides& st, std::vector<float>& buf) {
  if (shape[3] <= 1 || st[3] == 1) return {ptr, st[0], st[1], st[2]};
  buf.resize(static_cast<size_t>(shape[0]) * shape[1] * shape[2] * shape[3]);
  densify(ptr, shape, st, buf.data());
  return {buf.data(), int64_t{shape[1]} * shape[2] * shape[3], int64_t{shape[2]} * shape[3], shape[3]};
}

// One query row against keys [0, n) of one group: out[D] = softmax(scale q k^T) v.
void attend_row(
    const float* q,
    const float* k,
    int64_t ks,
    const float* v,
    int64_t vs,
    int64_t n,
    int D,
    float scale,
    float* scores,
    float* out) {
  float best = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = k + j * ks;
    float s = 0.0f;
    for (int d = 0; d < D; ++d) s += q[d] * kj[d];
    s *= scale;
    scores[j] = s;
    best = std::max(best, s);
  }
  float total = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = exp_nonpositive(scores[j] - best);
    total += scores[j];
  }
  for (int d = 0; d < D; ++d) out[d] = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + j * vs;
    const float p = scores[j];
    for (int d = 0; d < D; ++d) out[d] += p * vj[d];
  }
  const float inv = 1.0f / total;
  for (int d = 0; d < D; ++d) out[d] *= inv;
}

} // namespace

mx::array row_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    mx::StreamOrDevice s) {
  for (const auto* a : {&q, &k, &v})
    if (a->dtype() != mx::float32 || a->ndim() != 4) fail("q, k and v must be float32 4-D arrays");
  if (k.shape() != v.shape()) fail("k and v must have one shape");
  const int H = q.shape(1), G = k.shape(1);
  if (q.shape(0) != k.shape(0) || q.shape(3) != k.shape(3) || G == 0 || H % G)
    fail("q [B, H, L, D] and k [B, G, T, D] do not match");
  if (q.shape(2) > k.shape(2)) fail("more query rows than keys");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) fail("runs on a CPU stream only");
  return mx::array(
      q.shape(), mx::float32, std::make_shared<RowAttention>(stream, scale), {q, k, v});
}

void RowAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : {q, k, v}) encoder.set_input_array(a);
  encoder.set_output_array(out);
  const int B = q.shape(0), H = q.shape(1), L = q.shape(2), D = q.shape(3);
  const int G = k.shape(1);
  const int64_t T = k.shape(2);
  encoder.dispatch([qp = q.data<float>(), qsh = q.shape(), qst = q.strides(),
                    kp = k.data<float>(), ksh = k.shape(), kst = k.strides(),
                    vp = v.data<float>(), vst = v.strides(), y = out.data<float>(), B, H, L, D, G,
                    T, scale = scale_]() {
    std::vector<float> qbuf, kbuf, vbuf;
    const Operand qo = operand(qp, qsh, qst, qbuf);
    const Operand ko = operand(kp, ksh, kst, kbuf);
    const Operand vo = operand(vp, ksh, vst, vbuf);
    std::vector<float> scores(static_cast<size_t>(T));
    const int per_group = H / G;
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h) {
        const int g = h / per_group;
        const float* kb = ko.data + b * ko.s0 + g * ko.s1;
        const float* vb = vo.data + b * vo.s0 + g * vo.s1;
        for (int i = 0; i < L; ++i) {
          const float* qi = qo.data + b * qo.s0 + h * qo.s1 + i * qo.s2;
          float* yi = y + ((static_cast<int64_t>(b) * H + h) * L + i) * D;
          attend_row(qi, kb, ko.s2, vb, vo.s2, T - L + i + 1, D, scale, scores.data(), yi);
        }
      }
  });
}

bool RowAttention::is_equivalent(const mx::Primitive& other) const {
  return scale_ == static_cast<const RowAttention&>(other).scale_;
}

std::vector<mx::Shape> RowAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

} // namespace mtp_native
