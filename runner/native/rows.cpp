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

#include "flash.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mtp_native {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[row_attention] " + what);
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
    s *= scale; // log2 units: e**x is 2**(x log2 e)
    scores[j] = s;
    best = std::max(best, s);
  }
  float total = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = flash::exp2_nonpositive(scores[j] - best);
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
    const Rows4 qo = rows4(qp, qsh, qst, qbuf);
    const Rows4 ko = rows4(kp, ksh, kst, kbuf);
    const Rows4 vo = rows4(vp, ksh, vst, vbuf);
    std::vector<float> scores(static_cast<size_t>(T));
    const float log2_scale = scale * 1.4426950408889634f; // scores in log2 units
    const int per_group = H / G;
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h) {
        const int g = h / per_group;
        const float* kb = ko.data + b * ko.s0 + g * ko.s1;
        const float* vb = vo.data + b * vo.s0 + g * vo.s1;
        for (int i = 0; i < L; ++i) {
          const float* qi = qo.data + b * qo.s0 + h * qo.s1 + i * qo.s2;
          float* yi = y + ((static_cast<int64_t>(b) * H + h) * L + i) * D;
          attend_row(qi, kb, ko.s2, vb, vo.s2, T - L + i + 1, D, log2_scale, scores.data(), yi);
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
