// The RowAttention primitive: per query row, scores over its key prefix, a softmax and the
// weighted values, in vectors of 16 lanes along the head dimension (every row the same code
// and order: rows are independent of their batch).

#include "rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "flash.h"
#include "vec16.h"
#if defined(__AVX512F__) && !defined(SMALLROW_PORTABLE)
#include <immintrin.h>
#endif
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mtp_native {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[row_attention] " + what);
}

// Rows of float32 keys or values: chunk c (lanes 16c .. 16c + 15) of row j.
struct FloatRows {
  const float* p;
  int64_t s;
  [[gnu::always_inline]] inline V16 load(int64_t j, int c) const {
    return load16(p + j * s + 16 * c);
  }
};

// Rows packed by cache.kv_quantized: D * Bits / 8 bytes of unsigned integers (mx.quantize's
// order: value i in byte i at 8 bits, in the low nibble of byte i / 2 for even i at 4 bits),
// then D / group float32 scales and D / group biases. A chunk lies inside one group (16
// divides the group), and is dequantized as scale * q + bias (two roundings, as MLX's
// dequantize): the float row the cache's dequantize gives.
template <int Bits>
struct QuantRows {
  const uint8_t* p;
  int64_t s;  // bytes between rows
  int qbytes;  // D * Bits / 8
  int groups;  // D / group
  int group_shift;  // log2(group / 16): chunk c is in group c >> group_shift
  [[gnu::always_inline]] inline V16 load(int64_t j, int c) const {
    const uint8_t* r = p + j * s;
    const int g = c >> group_shift;
    float scale, bias;
    std::memcpy(&scale, r + qbytes + 4 * g, 4);
    std::memcpy(&bias, r + qbytes + 4 * (groups + g), 4);
    return widen(r, c) * scale + bias;
  }

  // The 16 integers of chunk c as floats (exact: they are below 256).
  [[gnu::always_inline]] static inline V16 widen(const uint8_t* r, int c) {
#if defined(__AVX512F__) && !defined(SMALLROW_PORTABLE)
    // GCC lowers the generic conversion lane by lane; the intrinsics are one widening and
    // one conversion (the same values).
    __m128i u;
    if constexpr (Bits == 8) {
      u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 16 * c));
    } else {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + 8 * c));
      const __m128i nib = _mm_set1_epi8(15);
      u = _mm_unpacklo_epi8(_mm_and_si128(b, nib), _mm_and_si128(_mm_srli_epi16(b, 4), nib));
    }
    V16 x;
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u));
    std::memcpy(&x, &f, sizeof x);
    return x;
#else
    uint8_t u[16];
    if constexpr (Bits == 8) {
      std::memcpy(u, r + 16 * c, 16);
    } else {
      for (int i = 0; i < 8; ++i) {
        u[2 * i] = r[8 * c + i] & 15;
        u[2 * i + 1] = r[8 * c + i] >> 4;
      }
    }
    return bytes_to_floats(u);
#endif
  }
};

// Scores of keys [j, j + 16), times scale, key r in lane r (rows past n - 1 read the last
// key again). C = D / 16 chunks of the head dimension, lane-wise multiply-adds (fused) over the
// chunks, then the folds: a key's score is the same bits in any block and at any lane.
template <int C, typename K>
[[gnu::always_inline]] inline V16 score_block(
    const V16* qv, const K& k, int64_t j, int64_t n, float scale) {
  auto key = [&](int r) {
    const int64_t row = std::min<int64_t>(j + r, n - 1);
    V16 acc = qv[0] * k.load(row, 0);
    for (int c = 1; c < C; ++c) acc = fma16(qv[c], k.load(row, c), acc);
    return acc;
  };
  // Each fold as soon as its two operands exist (the same tree), so that at most a few
  // partial vectors are live at once instead of all 16 keys' (which spill).
  V16 c4[4], d2[2];
  for (int i = 0; i < 4; ++i) {
    const V16 b0 = fold8(key(4 * i), key(4 * i + 1));
    const V16 b1 = fold8(key(4 * i + 2), key(4 * i + 3));
    c4[i] = fold4(b0, b1);
  }
  for (int i = 0; i < 2; ++i) d2[i] = fold2(c4[2 * i], c4[2 * i + 1]);
  return fold1(d2[0], d2[1]) * scale;
}

// Query rows attended together: up to kTile rows over one group's keys and values, each
// block of keys read from memory once for all of them (then from L1): attended alone, each
// row streams its group's whole key and value prefix from L2, and a verify feed's rows and a
// group's heads would read it once per row. Every row keeps its own operations and their
// order (the block structure below), so a row's bits do not depend on the rows beside it.
constexpr int kTile = 16;
constexpr int64_t kValueKeys = 64; // keys per pass of the weighted sum (even: whole pairs)

struct TileRow {
  const float* q; // D features
  int64_t n; // keys [0, n)
  float* scores; // n floats of scratch
  float* out; // D features
};

// Rows of one group, D = 16 * C: out[D] = softmax(scale q k^T) v over each row's keys.
// Per row: scores of whole blocks of 16 keys (their lane-wise maximum kept), then the last
// partial block (whose lanes past n are not used); the maximum of the kept lanes, then of the
// partial block's scores in order; the exponentials, summed lane-wise over whole blocks, then
// the 16 lanes in order, then the partial block's in key order; the weighted sum in two
// accumulator sets (even and odd keys, so consecutive keys do not wait on one another's
// additions), added once at the end.
template <int C, typename K>
void attend_tile_vec(const TileRow* rows, int count, const K& k, const K& v, float scale) {
  V16 top[kTile];
  int64_t most = 0;
  for (int t = 0; t < count; ++t) {
    top[t] = splat16(-INFINITY);
    most = std::max(most, rows[t].n);
  }
  for (int64_t j = 0; j < most; j += 16) {
    for (int t = 0; t < count; ++t) {
      const TileRow& r = rows[t];
      if (j >= r.n) continue;
      V16 qv[C];
      for (int c = 0; c < C; ++c) qv[c] = load16(r.q + 16 * c);
      const V16 s = score_block<C>(qv, k, j, r.n, scale);
      if (j + 16 <= r.n) {
        std::memcpy(r.scores + j, &s, sizeof s);
        top[t] = greater_of(top[t], s);
      } else {
        for (int64_t i = 0; i < r.n - j; ++i) r.scores[j + i] = s[i];
      }
    }
  }
  float total[kTile];
  for (int t = 0; t < count; ++t) {
    const TileRow& r = rows[t];
    float* scores = r.scores;
    const int64_t n = r.n;
    float best = -INFINITY;
    for (int i = 0; i < 16; ++i) best = std::max(best, top[t][i]);
    for (int64_t i = n - n % 16; i < n; ++i) best = std::max(best, scores[i]);
    // A sum key by key would wait on each addition: lane-wise first (the order above).
    V16 lanes = splat16(0.0f);
    int64_t e = 0;
    for (; e + 16 <= n; e += 16) {
      const V16 x = exp2_nonpositive(load16(scores + e) - best);
      std::memcpy(scores + e, &x, sizeof x);
      lanes += x;
    }
    float sum = 0.0f;
    for (int i = 0; i < 16; ++i) sum += lanes[i];
    for (; e < n; ++e) {
      scores[e] = flash::exp2_nonpositive(scores[e] - best);
      sum += scores[e];
    }
    total[t] = sum;
  }
  V16 even[kTile][C], odd[kTile][C];
  for (int t = 0; t < count; ++t)
    for (int c = 0; c < C; ++c) even[t][c] = odd[t][c] = splat16(0.0f);
  for (int64_t j0 = 0; j0 < most; j0 += kValueKeys) {
    for (int t = 0; t < count; ++t) {
      const TileRow& r = rows[t];
      const int64_t end = std::min(j0 + kValueKeys, r.n - r.n % 2); // whole pairs
      if (j0 >= end) continue;
      V16 ev[C], od[C];
      for (int c = 0; c < C; ++c) {
        ev[c] = even[t][c];
        od[c] = odd[t][c];
      }
      for (int64_t j = j0; j < end; j += 2) {
        const float p0 = r.scores[j], p1 = r.scores[j + 1];
        const V16 w0 = splat16(p0), w1 = splat16(p1);
        for (int c = 0; c < C; ++c) {
          ev[c] = fma16(w0, v.load(j, c), ev[c]);
          od[c] = fma16(w1, v.load(j + 1, c), od[c]);
        }
      }
      for (int c = 0; c < C; ++c) {
        even[t][c] = ev[c];
        odd[t][c] = od[c];
      }
    }
  }
  for (int t = 0; t < count; ++t) {
    const TileRow& r = rows[t];
    if (r.n % 2)
      for (int c = 0; c < C; ++c)
        even[t][c] = fma16(splat16(r.scores[r.n - 1]), v.load(r.n - 1, c), even[t][c]);
    const float inv = 1.0f / total[t];
    for (int c = 0; c < C; ++c) {
      const V16 o = (even[t][c] + odd[t][c]) * inv;
      std::memcpy(r.out + 16 * c, &o, sizeof o);
    }
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

// A tile of rows (scores in log2 units: e**x is 2**(x log2 e)): attend_tile_vec for
// D = 16 * C where a vector kernel exists (keys and values as float rows or packed quantized
// rows); false for any other D.
template <typename K>
bool attend_tile_any(const TileRow* rows, int count, const K& k, const K& v, int D, float scale) {
  switch (D) {
    case 16:
      return attend_tile_vec<1>(rows, count, k, v, scale), true;
    case 32:
      return attend_tile_vec<2>(rows, count, k, v, scale), true;
    case 64:
      return attend_tile_vec<4>(rows, count, k, v, scale), true;
    case 80:
      return attend_tile_vec<5>(rows, count, k, v, scale), true;
    case 96:
      return attend_tile_vec<6>(rows, count, k, v, scale), true;
    case 128:
      return attend_tile_vec<8>(rows, count, k, v, scale), true;
    case 256:
      return attend_tile_vec<16>(rows, count, k, v, scale), true;
    default:
      return false;
  }
}

// A tile over float rows: the vector kernel, else the scalar one row by row (any D).
void attend_tile(
    const TileRow* rows, int count, const FloatRows& k, const FloatRows& v, int D, float scale) {
  if (attend_tile_any(rows, count, k, v, D, scale)) return;
  for (int t = 0; t < count; ++t)
    attend_row_scalar(rows[t].q, k.p, k.s, v.p, v.s, rows[t].n, D, scale, rows[t].scores,
                      rows[t].out);
}

// A tile over packed quantized rows (D one of the vector sizes, checked by the op).
template <int Bits>
void attend_tile(
    const TileRow* rows, int count, const QuantRows<Bits>& k, const QuantRows<Bits>& v, int D,
    float scale) {
  attend_tile_any(rows, count, k, v, D, scale);
}

// Every query row of q [B, H, L, D] (the last L positions of T keys, each row over the keys up
// to its own) against its group's keys and values, ``rows(b, g)`` giving them as a pair. The
// B * H * L rows are items split in contiguous runs over up to `threads` parts, each run in
// tiles of consecutive items of one group (a group's heads and rows are consecutive items);
// a row's bits do not depend on its tile, so neither the split nor the tiles change them. A
// split wakes the pool's workers, which pays only past kSplitWork multiply-adds (a few
// microseconds' work).
constexpr int64_t kSplitWork = 1 << 16;

template <typename RowsOf>
void attend_rows(
    const Rows4& qo, float* y, int B, int H, int L, int D, int G, int64_t T, float log2_scale,
    int threads, RowsOf rows, int64_t y_head = 0) {
  // Row i of head h (of batch row b) goes to y + (b H + h) y_head + i D: y_head = L D for an
  // output of these rows alone, more for one sequence's rows in a wider output.
  if (y_head == 0) y_head = static_cast<int64_t>(L) * D;
  const int per_group = H / G;
  const int64_t items = static_cast<int64_t>(B) * H * L;
  const int64_t work = items * T * D; // at most: rows see up to T keys
  const int64_t parts =
      work < kSplitWork ? 1 : std::max<int64_t>(1, std::min<int64_t>(threads, items));
  // Every part's scores allocated here: a part (on a worker) must not allocate or throw. A
  // tile holds at most one group's rows, and every score a row reads it wrote first, so the
  // buffer is neither larger than that nor cleared (a long context's decode step would pay
  // for both on every call).
  const int64_t tile_rows = std::min<int64_t>(kTile, static_cast<int64_t>(per_group) * L);
  std::unique_ptr<float[]> scores(new float[static_cast<size_t>(parts * tile_rows * T)]);
  run_parts(parts, [&](int64_t t) {
    float* own = scores.get() + t * tile_rows * T;
    const int64_t last = items * (t + 1) / parts;
    for (int64_t item = items * t / parts; item < last;) {
      const int64_t bg = item / L / per_group; // b * G + g
      TileRow tile[kTile];
      int count = 0;
      for (; count < tile_rows && item < last && item / L / per_group == bg; ++item, ++count) {
        const int i = static_cast<int>(item % L);
        const int h = static_cast<int>(item / L % H);
        const int b = static_cast<int>(item / L / H);
        tile[count] = {qo.data + b * qo.s0 + h * qo.s1 + i * qo.s2, T - L + i + 1,
                       own + count * T, y + (int64_t(b) * H + h) * y_head + int64_t(i) * D};
      }
      const auto [kr, vr] = rows(static_cast<int>(bg / G), static_cast<int>(bg % G));
      attend_tile(tile, count, kr, vr, D, log2_scale);
    }
  });
}

} // namespace

mx::array row_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    int threads,
    mx::StreamOrDevice s) {
  if (threads < 1) fail("threads must be >= 1");
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
      q.shape(), mx::float32, std::make_shared<RowAttention>(stream, scale, threads), {q, k, v});
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
                    T, scale = scale_, threads = threads_]() {
    std::vector<float> qbuf, kbuf, vbuf;
    const Rows4 qo = rows4(qp, qsh, qst, qbuf);
    const Rows4 ko = rows4(kp, ksh, kst, kbuf);
    const Rows4 vo = rows4(vp, ksh, vst, vbuf);
    const float log2_scale = scale * 1.4426950408889634f; // scores in log2 units
    attend_rows(qo, y, B, H, L, D, G, T, log2_scale, threads, [&](int b, int g) {
      return std::pair{
          FloatRows{ko.data + b * ko.s0 + g * ko.s1, ko.s2},
          FloatRows{vo.data + b * vo.s0 + g * vo.s1, vo.s2}};
    });
  });
}

mx::array rows_attention(
    const mx::array& q,
    const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values,
    const std::vector<int>& lengths,
    const std::vector<int>& counts,
    float scale,
    int threads,
    mx::StreamOrDevice s) {
  if (threads < 1) fail("threads must be >= 1");
  const size_t n = keys.size();
  if (n == 0 || values.size() != n || lengths.size() != n || counts.size() != n)
    fail("one key buffer, value buffer, length and row count per sequence");
  if (q.dtype() != mx::float32 || q.ndim() != 4 || q.shape(0) != 1)
    fail("q must be float32 [1, H, R, D]");
  int64_t rows = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto &k = keys[i], &v = values[i];
    if (k.dtype() != mx::float32 || v.dtype() != mx::float32 || k.ndim() != 4 ||
        k.shape() != v.shape())
      fail("every key and value buffer must be float32 [1, G, capacity, D], alike");
    if (k.shape(0) != 1 || k.shape(3) != q.shape(3) || k.shape(1) == 0 ||
        q.shape(1) % k.shape(1) || k.shape(1) != keys[0].shape(1))
      fail("q [1, H, R, D] and a key buffer [1, G, capacity, D] do not match");
    if (counts[i] < 1 || counts[i] > lengths[i] || lengths[i] > k.shape(2))
      fail("each sequence needs 1 <= rows <= length <= its buffer's capacity");
    rows += counts[i];
  }
  if (rows != q.shape(2)) fail("the sequences' rows do not add up to q's");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) fail("runs on a CPU stream only");
  std::vector<mx::array> inputs{q};
  for (size_t i = 0; i < n; ++i) {
    inputs.push_back(keys[i]);
    inputs.push_back(values[i]);
  }
  return mx::array(
      q.shape(), mx::float32,
      std::make_shared<RowsAttention>(stream, scale, threads, lengths, counts), inputs);
}

void RowsAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& q = inputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  struct Buffer {
    const float* p;
    mx::Shape shape;
    mx::Strides strides;
  };
  std::vector<Buffer> buffers;
  for (size_t i = 1; i < inputs.size(); ++i)
    buffers.push_back({inputs[i].data<float>(), inputs[i].shape(), inputs[i].strides()});
  encoder.dispatch([qp = q.data<float>(), qsh = q.shape(), qst = q.strides(),
                    buffers = std::move(buffers), y = out.data<float>(), lengths = lengths_,
                    counts = counts_, scale = scale_, threads = threads_]() {
    std::vector<float> qbuf, kbuf, vbuf;
    const Rows4 qo = rows4(qp, qsh, qst, qbuf);
    const int H = qsh[1], R = qsh[2], D = qsh[3];
    const float log2_scale = scale * 1.4426950408889634f; // scores in log2 units
    int64_t start = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
      // Sequence i: its rows of q against the first lengths[i] positions of its buffers,
      // the very call RowAttention makes over a cache fetched up to that length.
      const Buffer &kb = buffers[2 * i], &vb = buffers[2 * i + 1];
      const Rows4 ko = rows4(kb.p, kb.shape, kb.strides, kbuf);
      const Rows4 vo = rows4(vb.p, kb.shape, vb.strides, vbuf);
      Rows4 qi = qo;
      qi.data = qo.data + start * qo.s2;
      attend_rows(qi, y + start * D, 1, H, counts[i], D, kb.shape[1], lengths[i], log2_scale,
                  threads, [&](int, int g) {
                    return std::pair{FloatRows{ko.data + g * ko.s1, ko.s2},
                                     FloatRows{vo.data + g * vo.s1, vo.s2}};
                  }, int64_t(R) * D);
      start += counts[i];
    }
  });
}

bool RowsAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const RowsAttention&>(other);
  return scale_ == o.scale_ && threads_ == o.threads_ && lengths_ == o.lengths_ &&
      counts_ == o.counts_;
}

std::vector<mx::Shape> RowsAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

bool RowAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const RowAttention&>(other);
  return scale_ == o.scale_ && threads_ == o.threads_;
}

std::vector<mx::Shape> RowAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}


namespace {

// A [B, G, T, W] uint32 operand as a byte pointer and the byte strides of its first three dims
// (rows of W contiguous words), copied dense into `buf` when its rows are not contiguous.
struct Bytes4 {
  const uint8_t* data;
  int64_t s0, s1, s2;
};

Bytes4 bytes4(
    const uint32_t* ptr, const mx::Shape& shape, const mx::Strides& st,
    std::vector<uint32_t>& buf) {
  if (shape[3] <= 1 || st[3] == 1)
    return {reinterpret_cast<const uint8_t*>(ptr), 4 * st[0], 4 * st[1], 4 * st[2]};
  const int64_t W = shape[3], T = shape[2], G = shape[1];
  buf.resize(static_cast<size_t>(shape[0] * G * T * W));
  uint32_t* d = buf.data();
  for (int64_t b = 0; b < shape[0]; ++b)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t w = 0; w < W; ++w)
          *d++ = ptr[b * st[0] + g * st[1] + t * st[2] + w * st[3]];
  return {reinterpret_cast<const uint8_t*>(buf.data()), 4 * G * T * W, 4 * T * W, 4 * W};
}

template <int Bits>
void run_quantized(
    const Rows4& qo, const Bytes4& ko, const Bytes4& vo, float* y, int B, int H, int L, int D,
    int G, int64_t T, int group, float log2_scale, int threads) {
  int shift = 0;
  while ((16 << shift) < group) ++shift;
  const int qbytes = D * Bits / 8, groups = D / group;
  attend_rows(qo, y, B, H, L, D, G, T, log2_scale, threads, [&](int b, int g) {
    return std::pair{
        QuantRows<Bits>{ko.data + b * ko.s0 + g * ko.s1, ko.s2, qbytes, groups, shift},
        QuantRows<Bits>{vo.data + b * vo.s0 + g * vo.s1, vo.s2, qbytes, groups, shift}};
  });
}

} // namespace

mx::array row_attention_quantized(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    int bits,
    int group,
    int threads,
    mx::StreamOrDevice s) {
  if (threads < 1) fail("threads must be >= 1");
  if (q.dtype() != mx::float32 || q.ndim() != 4) fail("q must be a float32 4-D array");
  for (const auto* a : {&k, &v})
    if (a->dtype() != mx::uint32 || a->ndim() != 4) fail("k and v must be uint32 4-D arrays");
  if (k.shape() != v.shape()) fail("k and v must have one shape");
  if (bits != 4 && bits != 8) fail("bits must be 4 or 8");
  if (group != 32 && group != 64 && group != 128) fail("group must be 32, 64 or 128");
  const int D = q.shape(3);
  if (D % 16 || D > 256 || D / 16 == 3 || D / 16 == 7 || (D / 16 > 8 && D != 256))
    fail("the head dimension must be 16, 32, 64, 80, 96, 128 or 256");
  if (D % group) fail("the head dimension must be a multiple of the group");
  if (k.shape(3) != D * bits / 32 + 2 * (D / group)) fail("packed rows do not match D, bits, group");
  const int H = q.shape(1), G = k.shape(1);
  if (q.shape(0) != k.shape(0) || G == 0 || H % G) fail("q [B, H, L, D] and k [B, G, T, W] do not match");
  if (q.shape(2) > k.shape(2)) fail("more query rows than keys");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) fail("runs on a CPU stream only");
  return mx::array(
      q.shape(), mx::float32,
      std::make_shared<QuantizedRowAttention>(stream, scale, bits, group, threads), {q, k, v});
}

void QuantizedRowAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
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
                    kp = k.data<uint32_t>(), ksh = k.shape(), kst = k.strides(),
                    vp = v.data<uint32_t>(), vst = v.strides(), y = out.data<float>(), B, H, L,
                    D, G, T, scale = scale_, bits = bits_, group = group_, threads = threads_]() {
    std::vector<float> qbuf;
    std::vector<uint32_t> kbuf, vbuf;
    const Rows4 qo = rows4(qp, qsh, qst, qbuf);
    const Bytes4 ko = bytes4(kp, ksh, kst, kbuf);
    const Bytes4 vo = bytes4(vp, ksh, vst, vbuf);
    const float log2_scale = scale * 1.4426950408889634f; // scores in log2 units
    if (bits == 8)
      run_quantized<8>(qo, ko, vo, y, B, H, L, D, G, T, group, log2_scale, threads);
    else
      run_quantized<4>(qo, ko, vo, y, B, H, L, D, G, T, group, log2_scale, threads);
  });
}

bool QuantizedRowAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedRowAttention&>(other);
  return scale_ == o.scale_ && bits_ == o.bits_ && group_ == o.group_ && threads_ == o.threads_;
}

std::vector<mx::Shape> QuantizedRowAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

} // namespace mtp_native
