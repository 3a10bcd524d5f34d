// Fused attention for prefill chunks: softmax(scale q k^T + causal mask) v, one query block at
// a time, with the scores, their exponentials and the weighted values kept in small tiles.
//
// Layout: everything a block computes runs across its query rows, which sit in the vector
// lanes. The block's queries are packed transposed once (QT[d][i], scaled into log2 units);
// a score tile is ST[j][i] = sum_d K[j][d] QT[d][i] (key rows broadcast from the cache as they
// lie, no packing of keys), so a row's maximum and sum over keys are lane-wise maxima and sums
// down the tile; the value product OT[d][i] += sum_j V[j][d] ST[j][i] broadcasts value
// entries the same way. The online softmax keeps a running maximum m[i] and sum l[i] per row
// and rescales OT by 2**(m_old - m_new) when a tile raises the maximum, so a block reads the
// keys and values once, and no score leaves the cache.
//
// Causal blocks visit only the keys up to their last row; a tile crossing the diagonal masks
// its upper part to -inf. The first tile visited (key 0) has a visible key for every row, so
// the running maximum is finite from then on and a masked entry's weight is exactly 0.
//
// exp2 is 2**round(d) (exponent bits) times a degree-6 polynomial on [-0.5, 0.5] (the Cephes
// coefficients MLX's exp uses), relative error ~2e-7: the weights match a float32 softmax.
//
// This header has no MLX dependency.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if !defined(SMALLROW_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FLASH_AVX2 1
#endif

namespace flash {

constexpr int kRows = 64; // query rows per block (a multiple of 16: two vectors per pass)
constexpr int kKeys = 64; // keys per score tile
constexpr int kJ = 6;     // keys (scores) or value dims per register block: 6 x 2 accumulators

// One call's operands. Strides are in floats; every row (the last dim) is contiguous.
struct Problem {
  const float* q; // [B, H, L, D]
  int64_t q_b, q_h, q_l;
  const float* k; // [B, G, T, D]
  int64_t k_b, k_g, k_t;
  const float* v; // [B, G, T, D]
  int64_t v_b, v_g, v_t;
  float* out; // [B, H, L, D], dense
  int B, H, G, L, T, D;
  float scale; // applied to q k^T (natural units)
  bool causal; // row i sits at position T - L + i and sees keys up to it
  // 0: k and v are float rows. 4 or 8: they are packed quantized rows (cache.kv_quantized:
  // D * bits / 8 bytes of integers, D / group float32 scales, D / group biases; strides
  // still in 4-byte words), each key tile dequantized into the scratch before its use.
  int bits = 0, group = 0;
};

// Per-thread buffers for one block.
struct Scratch {
  std::vector<float> qt, st, ot, m, l, alpha, kt, vt;
  explicit Scratch(int D, bool quantized = false)
      : qt(size_t(D) * kRows), st(size_t(kKeys) * kRows), ot(size_t(D) * kRows), m(kRows),
        l(kRows), alpha(kRows), kt(quantized ? size_t(kKeys) * D : 0),
        vt(quantized ? size_t(kKeys) * D : 0) {}
};

// Rows [0, w) of packed quantized rows (row stride `words` 4-byte words) as float rows
// out[w][D]: scale * q + bias per group, MLX's dequantize (two roundings).
inline void dequantize_rows(
    const float* rows, int64_t words, int w, int D, int bits, int group, float* out) {
  const int groups = D / group, qbytes = D * bits / 8;
  for (int j = 0; j < w; ++j) {
    const uint8_t* r = reinterpret_cast<const uint8_t*>(rows + j * words);
    float* o = out + int64_t(j) * D;
    for (int g = 0; g < groups; ++g) {
      float scale, bias;
      std::memcpy(&scale, r + qbytes + 4 * g, 4);
      std::memcpy(&bias, r + qbytes + 4 * (groups + g), 4);
      const int d0 = g * group;
      if (bits == 8) {
        for (int i = 0; i < group; ++i) o[d0 + i] = float(r[d0 + i]) * scale + bias;
      } else {
        const uint8_t* b = r + d0 / 2;
        for (int i = 0; i < group / 2; ++i) {
          o[d0 + 2 * i] = float(b[i] & 15) * scale + bias;
          o[d0 + 2 * i + 1] = float(b[i] >> 4) * scale + bias;
        }
      }
    }
  }
}

constexpr float kP[7] = {
    1.0f,
    6.931472028550421e-1f,
    2.402264791363012e-1f,
    5.550332471162809e-2f,
    9.618437357674640e-3f,
    1.339887440266574e-3f,
    1.535336188319500e-4f};

// 2**d for one d <= 0 (0 from -126.5 down, and for -inf and NaN): the portable blocks' and the
// row kernel's (rows.cpp) exponential.
inline float exp2_nonpositive(float d) {
  if (!(d > -126.5f)) return 0.0f;
  const float r = std::nearbyint(d), f = d - r;
  float p = kP[6];
  for (int c = 5; c >= 0; --c) p = p * f + kP[c];
  const int32_t bits = (static_cast<int32_t>(r) + 127) << 23; // 2**r, r in [-126, 0]
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#ifdef FLASH_AVX2
using V8 = __m256;

// 2**d for d <= 0 (0 from -127 down; -inf and NaN give 0: max_ps returns its second operand
// for a NaN first one).
inline V8 exp2_nonpositive(V8 d) {
  d = _mm256_max_ps(d, _mm256_set1_ps(-127.0f));
  const V8 r = _mm256_round_ps(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const V8 f = _mm256_sub_ps(d, r);
  V8 p = _mm256_set1_ps(kP[6]);
  for (int c = 5; c >= 0; --c) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kP[c]));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(r), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// ST[j][0..16) (rows c..c+16 of the block) for R keys: sum over d of K[j][d] QT[d][c..].
template <int R>
inline void score_block(const float* k, int64_t k_t, const float* qt, float* st, int D) {
  V8 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const V8 q0 = _mm256_loadu_ps(qt + d * kRows), q1 = _mm256_loadu_ps(qt + d * kRows + 8);
    for (int r = 0; r < R; ++r) {
      const V8 kv = _mm256_broadcast_ss(k + r * k_t + d);
      acc[r][0] = _mm256_fmadd_ps(kv, q0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(kv, q1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(st + r * kRows, acc[r][0]);
    _mm256_storeu_ps(st + r * kRows + 8, acc[r][1]);
  }
}

// OT[d0 + r][c..c+16) += sum over the tile's w keys of V[j][d0 + r] ST[j][c..], r < R.
template <int R>
inline void value_block(const float* v, int64_t v_t, int w, const float* st, float* ot) {
  V8 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm256_loadu_ps(ot + r * kRows);
    acc[r][1] = _mm256_loadu_ps(ot + r * kRows + 8);
  }
  for (int j = 0; j < w; ++j) {
    const V8 p0 = _mm256_loadu_ps(st + j * kRows), p1 = _mm256_loadu_ps(st + j * kRows + 8);
    for (int r = 0; r < R; ++r) {
      const V8 vv = _mm256_broadcast_ss(v + j * v_t + r);
      acc[r][0] = _mm256_fmadd_ps(vv, p0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(vv, p1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(ot + r * kRows, acc[r][0]);
    _mm256_storeu_ps(ot + r * kRows + 8, acc[r][1]);
  }
}

// Runs f<R>() for a block of R = n (1..kJ) at compile time.
template <typename F>
inline void by_count(int n, F&& f) {
  switch (n) {
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// ST = K[lo, lo + w) QT for the whole block (w <= kKeys keys).
inline void scores(const float* k, int64_t k_t, int w, const float* qt, float* st, int D) {
  for (int c = 0; c < kRows; c += 16) {
    for (int j = 0; j < w; j += kJ) {
      by_count(std::min(kJ, w - j), [&](auto n) {
        score_block<decltype(n)::value>(k + j * k_t, k_t, qt + c, st + j * kRows + c, D);
      });
    }
  }
}

// OT += V[lo, lo + w)^T ST.
inline void values(const float* v, int64_t v_t, int w, const float* st, float* ot, int D) {
  for (int c = 0; c < kRows; c += 16) {
    for (int d = 0; d < D; d += kJ) {
      by_count(std::min(kJ, D - d), [&](auto n) {
        value_block<decltype(n)::value>(v + d, v_t, w, st + c, ot + d * kRows + c);
      });
    }
  }
}

// Turns the scores ST[j < w] into weights 2**(s - m_new) and updates the running maximum m,
// the sum l and the rescale factors alpha = 2**(m_old - m_new).
inline void softmax_tile(float* st, int w, float* m, float* l, float* alpha) {
  for (int c = 0; c < kRows; c += 8) {
    V8 top = _mm256_loadu_ps(st + c);
    for (int j = 1; j < w; ++j) top = _mm256_max_ps(top, _mm256_loadu_ps(st + j * kRows + c));
    const V8 old = _mm256_loadu_ps(m + c);
    const V8 now = _mm256_max_ps(old, top);
    const V8 a = exp2_nonpositive(_mm256_sub_ps(old, now));
    V8 sum = _mm256_setzero_ps();
    for (int j = 0; j < w; ++j) {
      const V8 e = exp2_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(st + j * kRows + c), now));
      _mm256_storeu_ps(st + j * kRows + c, e);
      sum = _mm256_add_ps(sum, e);
    }
    _mm256_storeu_ps(m + c, now);
    _mm256_storeu_ps(alpha + c, a);
    _mm256_storeu_ps(l + c, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(l + c), a), sum));
  }
}

inline void rescale(float* ot, const float* alpha, int D) {
  for (int d = 0; d < D; ++d)
    for (int c = 0; c < kRows; c += 8)
      _mm256_storeu_ps(
          ot + d * kRows + c,
          _mm256_mul_ps(_mm256_loadu_ps(ot + d * kRows + c), _mm256_loadu_ps(alpha + c)));
}

inline const char* isa() {
  return "avx2";
}

#else // portable: the same arithmetic in plain loops

inline void scores(const float* k, int64_t k_t, int w, const float* qt, float* st, int D) {
  for (int j = 0; j < w; ++j) {
    float* row = st + j * kRows;
    std::fill(row, row + kRows, 0.0f);
    for (int d = 0; d < D; ++d) {
      const float kv = k[j * k_t + d];
      for (int i = 0; i < kRows; ++i) row[i] += kv * qt[d * kRows + i];
    }
  }
}

inline void values(const float* v, int64_t v_t, int w, const float* st, float* ot, int D) {
  for (int j = 0; j < w; ++j)
    for (int d = 0; d < D; ++d) {
      const float vv = v[j * v_t + d];
      for (int i = 0; i < kRows; ++i) ot[d * kRows + i] += vv * st[j * kRows + i];
    }
}

inline void softmax_tile(float* st, int w, float* m, float* l, float* alpha) {
  for (int i = 0; i < kRows; ++i) {
    float top = st[i];
    for (int j = 1; j < w; ++j) top = std::max(top, st[j * kRows + i]);
    const float now = std::max(m[i], top);
    alpha[i] = exp2_nonpositive(m[i] - now);
    float sum = 0.0f;
    for (int j = 0; j < w; ++j) {
      const float e = exp2_nonpositive(st[j * kRows + i] - now);
      st[j * kRows + i] = e;
      sum += e;
    }
    m[i] = now;
    l[i] = l[i] * alpha[i] + sum;
  }
}

inline void rescale(float* ot, const float* alpha, int D) {
  for (int d = 0; d < D; ++d)
    for (int i = 0; i < kRows; ++i) ot[d * kRows + i] *= alpha[i];
}

inline const char* isa() {
  return "portable";
}

#endif

// Block (b, h, rows r0 .. r0 + kRows) of the problem, into p.out.
inline void block(const Problem& p, int b, int h, int r0, Scratch& s) {
  const int D = p.D, rows = std::min(kRows, p.L - r0);
  const int g = h / (p.H / p.G);
  const float* q = p.q + b * p.q_b + h * p.q_h + int64_t(r0) * p.q_l;
  const float* k = p.k + b * p.k_b + g * p.k_g;
  const float* v = p.v + b * p.v_b + g * p.v_g;
  const float scale = p.scale * 1.4426950408889634f; // log2 units: 2**s for e**s
  float *qt = s.qt.data(), *st = s.st.data(), *ot = s.ot.data();
  for (int d = 0; d < D; ++d)
    for (int i = 0; i < kRows; ++i) qt[d * kRows + i] = i < rows ? q[i * p.q_l + d] * scale : 0.f;
  std::fill(s.m.begin(), s.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.end(), 0.0f);
  std::fill(s.ot.begin(), s.ot.end(), 0.0f);
  const int64_t first = int64_t(p.T) - p.L + r0; // position of the block's row 0
  const int64_t end = p.causal ? std::min<int64_t>(p.T, first + rows) : p.T;
  for (int64_t lo = 0; lo < end; lo += kKeys) {
    const int w = static_cast<int>(std::min<int64_t>(kKeys, end - lo));
    const float *kl = k + lo * p.k_t, *vl = v + lo * p.v_t;
    int64_t k_t = p.k_t, v_t = p.v_t;
    if (p.bits) {
      dequantize_rows(kl, k_t, w, D, p.bits, p.group, s.kt.data());
      dequantize_rows(vl, v_t, w, D, p.bits, p.group, s.vt.data());
      kl = s.kt.data(), vl = s.vt.data(), k_t = v_t = D;
    }
    scores(kl, k_t, w, qt, st, D);
    if (p.causal && lo + w - 1 > first) {
      // Key lo + j is hidden from rows i < lo + j - first.
      for (int j = 0; j < w; ++j) {
        const int64_t hidden = std::min<int64_t>(kRows, lo + j - first);
        for (int64_t i = 0; i < hidden; ++i)
          st[j * kRows + i] = -std::numeric_limits<float>::infinity();
      }
    }
    softmax_tile(st, w, s.m.data(), s.l.data(), s.alpha.data());
    if (lo > 0) rescale(ot, s.alpha.data(), D);
    values(vl, v_t, w, st, ot, D);
  }
  float* out = p.out + ((int64_t(b) * p.H + h) * p.L + r0) * D;
  for (int i = 0; i < rows; ++i) {
    const float inv = 1.0f / s.l[i];
    for (int d = 0; d < D; ++d) out[i * D + d] = ot[d * kRows + i] * inv;
  }
}

} // namespace flash
