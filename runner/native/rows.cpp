// The RowAttention primitive: per query row, scores over its key prefix, a softmax and the
// weighted values, in vectors of 16 lanes along the head dimension (every row the same code
// and order: rows are independent of their batch).

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

// Vectors of 16 floats in the compiler's generic vector type: one AVX-512 register, two AVX2
// ones, or plain loops, the same arithmetic (and bits) on each.
typedef float V16 __attribute__((vector_size(64)));

[[gnu::always_inline]] inline V16 load16(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Lanes [0, w) of each half of an (x, y) pair of vectors summed with lanes [w, 2w): 2w-lane
// groups of x and y become w-lane groups. Four stages (w = 8, 4, 2, 1) turn 16 vectors of 16
// partial sums into one vector of 16 totals, key r in lane r, each total summed in the same
// order whatever its lane.
[[gnu::always_inline]] inline V16 fold8(V16 x, V16 y) {
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
[[gnu::always_inline]] inline V16 fold4(V16 x, V16 y) {
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
[[gnu::always_inline]] inline V16 fold2(V16 x, V16 y) {
  return __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
[[gnu::always_inline]] inline V16 fold1(V16 x, V16 y) {
  return __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

typedef int32_t I16 __attribute__((vector_size(64)));

// 2**d lane-wise for d <= 0, 0 from -126.5 down (and for -inf): the scalar
// flash::exp2_nonpositive's steps, rounding to nearest by the 1.5 * 2**23 shift.
[[gnu::always_inline]] inline V16 exp2_nonpositive(V16 d) {
  constexpr float kShift = 12582912.0f;
  d = d > -127.0f ? d : V16{} - 127.0f;
  const V16 r = (d + kShift) - kShift, f = d - r;
  V16 p = V16{} + flash::kP[6];
  for (int c = 5; c >= 0; --c) p = p * f + flash::kP[c];
  const I16 bits = (__builtin_convertvector(r, I16) + 127) << 23;
  V16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Scores of keys [j, j + 16), times scale, key r in lane r (rows past n - 1 read the last
// key again). C = D / 16 chunks of the head dimension, lane-wise products summed over the
// chunks, then the folds: a key's score is the same bits in any block and at any lane.
template <int C>
[[gnu::always_inline]] inline V16 score_block(
    const V16* qv, const float* k, int64_t ks, int64_t j, int64_t n, float scale) {
  V16 a[16];
  for (int r = 0; r < 16; ++r) {
    const float* kr = k + std::min<int64_t>(j + r, n - 1) * ks;
    V16 acc = qv[0] * load16(kr);
    for (int c = 1; c < C; ++c) acc += qv[c] * load16(kr + 16 * c);
    a[r] = acc;
  }
  V16 b[8], c4[4], d2[2];
  for (int i = 0; i < 8; ++i) b[i] = fold8(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 4; ++i) c4[i] = fold4(b[2 * i], b[2 * i + 1]);
  for (int i = 0; i < 2; ++i) d2[i] = fold2(c4[2 * i], c4[2 * i + 1]);
  return fold1(d2[0], d2[1]) * scale;
}

// One query row against keys [0, n) of one group, D = 16 * C: out[D] = softmax(scale q k^T) v.
// The weighted sum runs two accumulator sets (even and odd keys) so consecutive keys do not
// wait on one another's additions; they are added once at the end.
template <int C>
void attend_row_vec(
    const float* q, const float* k, int64_t ks, const float* v, int64_t vs, int64_t n, float scale,
    float* scores, float* out) {
  V16 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = load16(q + 16 * c);
  V16 top = V16{} - INFINITY;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const V16 s = score_block<C>(qv, k, ks, j, n, scale);
    std::memcpy(scores + j, &s, sizeof s);
    top = top > s ? top : s;
  }
  float best = -INFINITY;
  for (int r = 0; r < 16; ++r) best = std::max(best, top[r]);
  if (j < n) {
    const V16 s = score_block<C>(qv, k, ks, j, n, scale);
    for (int64_t r = 0; r < n - j; ++r) {
      scores[j + r] = s[r];
      best = std::max(best, s[r]);
    }
  }
  int64_t e = 0;
  for (; e + 16 <= n; e += 16) {
    const V16 x = exp2_nonpositive(load16(scores + e) - best);
    std::memcpy(scores + e, &x, sizeof x);
  }
  for (; e < n; ++e) scores[e] = flash::exp2_nonpositive(scores[e] - best);
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) total += scores[i];
  V16 even[C], odd[C];
  for (int c = 0; c < C; ++c) even[c] = odd[c] = V16{};
  j = 0;
  for (; j + 2 <= n; j += 2) {
    const float p0 = scores[j], p1 = scores[j + 1];
    const float* v0 = v + j * vs;
    const float* v1 = v0 + vs;
    for (int c = 0; c < C; ++c) {
      even[c] += p0 * load16(v0 + 16 * c);
      odd[c] += p1 * load16(v1 + 16 * c);
    }
  }
  if (j < n)
    for (int c = 0; c < C; ++c) even[c] += scores[j] * load16(v + j * vs + 16 * c);
  const float inv = 1.0f / total;
  for (int c = 0; c < C; ++c) {
    const V16 r = (even[c] + odd[c]) * inv;
    std::memcpy(out + 16 * c, &r, sizeof r);
  }
}

// Head dimensions that are not a multiple of 16: the same steps in scalar loops.
void attend_row_scalar(
    const float* q, const float* k, int64_t ks, const float* v, int64_t vs, int64_t n, int D,
    float scale, float* scores, float* out) {
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

// One query row against keys [0, n) (scores in log2 units: e**x is 2**(x log2 e)).
void attend_row(
    const float* q, const float* k, int64_t ks, const float* v, int64_t vs, int64_t n, int D,
    float scale, float* scores, float* out) {
  switch (D) {
    case 16:
      return attend_row_vec<1>(q, k, ks, v, vs, n, scale, scores, out);
    case 32:
      return attend_row_vec<2>(q, k, ks, v, vs, n, scale, scores, out);
    case 64:
      return attend_row_vec<4>(q, k, ks, v, vs, n, scale, scores, out);
    case 80:
      return attend_row_vec<5>(q, k, ks, v, vs, n, scale, scores, out);
    case 96:
      return attend_row_vec<6>(q, k, ks, v, vs, n, scale, scores, out);
    case 128:
      return attend_row_vec<8>(q, k, ks, v, vs, n, scale, scores, out);
    case 256:
      return attend_row_vec<16>(q, k, ks, v, vs, n, scale, scores, out);
    default:
      return attend_row_scalar(q, k, ks, v, vs, n, D, scale, scores, out);
  }
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
