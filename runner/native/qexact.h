// The exact quantized product: y = x @ W for W in quantized panels (qlayout.h), bit-for-bit
// the float32 panel product (kernels.h) of the dequantized weight, for every row count.
//
// kernels.h gives each output column one accumulator that takes fma(x[k], w[k], acc) for
// k = 0 .. K - 1 in order, whatever the row count; w[k] is the dequantized value
// float32(s * q) + b (one multiply, one add, each rounded). The vector kernel here keeps that
// contract while reading the 4- or 8-bit values: each lane unit is loaded once, every input's
// values are shifted out, converted to float32, scaled and offset in registers (the same two
// roundings), and fed to the same FMA chain. The weight is computed once per panel row and
// used by every row of the block, so more rows cost only their FMAs. Without a vector ISA
// (portable builds) the panels are widened to float32 a few at a time and multiplied by
// kernels.h, which computes the same bits.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "qlayout.h"

#if !defined(SMALLROW_PORTABLE) && defined(__AVX512F__) && defined(__AVX512BW__)
#define QEXACT_AVX512 1
#include <immintrin.h>
#elif !defined(SMALLROW_PORTABLE) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QEXACT_AVX2 1
#include <immintrin.h>
#endif

namespace qpanels {

// Panels [p0, p1) widened to float32 panels [p1 - p0][K][16] (kernels.h's layout): w = s * q,
// then + b, each rounded (one multiply, one add: the dequantized weight's value).
inline void widen(const uint8_t* panels, const Shape& sh, int64_t p0, int64_t p1, float* out) {
  const int64_t bb = sh.block();
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* panel = panels + p * sh.panel_bytes();
    float* dst = out + (p - p0) * static_cast<int64_t>(sh.K) * kPanel;
    for (int64_t gi = 0; gi < sh.groups(); ++gi) {
      const uint8_t* blk = panel + gi * bb;
      float s[kPanel], b[kPanel];
      read_header(blk, sh.half, s, b);
      const uint8_t* values = blk + header_bytes(sh.half);
      for (int k = 0; k < sh.group; ++k) {
        float* row = dst + (gi * sh.group + k) * kPanel;
        for (int j = 0; j < kPanel; ++j) {
          const float q = static_cast<float>(value_at(values, sh.bits, k, j));
          const float sq = q * s[j];
          row[j] = sq + b[j];
        }
      }
    }
  }
}

// Exact product through widened panels (portable builds): a few panels at a time (the buffer
// stays in L2), then kernels.h's panel product.
inline void matmul_exact_widened(
    const float* x,
    int64_t ldx,
    int64_t M,
    const uint8_t* panels,
    const Shape& sh,
    float* y,
    int64_t ldy,
    int64_t p0,
    int64_t p1) {
  constexpr int64_t kBudget = 512 * 1024; // bytes of widened panels per step
  const int64_t per = std::max<int64_t>(
      1, std::min<int64_t>(4, kBudget / (static_cast<int64_t>(sh.K) * kPanel * 4)));
  std::vector<float> buf(static_cast<size_t>(per) * sh.K * kPanel);
  for (int64_t p = p0; p < p1; p += per) {
    const int64_t q1 = std::min(p1, p + per);
    widen(panels, sh, p, q1, buf.data());
    const int64_t col0 = p * kPanel;
    const int64_t width = std::min<int64_t>(sh.n - col0, (q1 - p) * kPanel);
    smallrow::panel_matmul(x, ldx, M, buf.data(), sh.K, width, y + col0, ldy, 0, q1 - p);
  }
}

#if defined(QEXACT_AVX512) || defined(QEXACT_AVX2)

#if defined(QEXACT_AVX512)
struct ExactVec {
  using F = __m512;
  using I = __m512i;
  static constexpr int W = 16;
  static inline I load_i(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static inline I shift(I v, int bits) { return _mm512_srli_epi32(v, bits); }
  static inline I mask(I v, int m) { return _mm512_and_si512(v, _mm512_set1_epi32(m)); }
  static inline F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static inline F add(F a, F b) { return _mm512_add_ps(a, b); }
  static inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static inline F bcast(const float* p) { return _mm512_set1_ps(*p); }
  static inline F zero() { return _mm512_setzero_ps(); }
  static inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  // scales (which 0) or biases (1) of columns [W h, W h + W)
  template <bool HALF>
  static inline F header(const uint8_t* blk, int which, int /*h*/) {
    if constexpr (HALF)
      return _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + which * kPanel * 2)));
    else
      return _mm512_loadu_ps(reinterpret_cast<const float*>(blk) + which * kPanel);
  }
};
#else
struct ExactVec {
  using F = __m256;
  using I = __m256i;
  static constexpr int W = 8;
  static inline I load_i(const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static inline I shift(I v, int bits) { return _mm256_srli_epi32(v, bits); }
  static inline I mask(I v, int m) { return _mm256_and_si256(v, _mm256_set1_epi32(m)); }
  static inline F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static inline F add(F a, F b) { return _mm256_add_ps(a, b); }
  static inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static inline F bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static inline F zero() { return _mm256_setzero_ps(); }
  static inline void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  template <bool HALF>
  static inline F header(const uint8_t* blk, int which, int h) {
    if constexpr (HALF)
      return _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + which * kPanel * 2 + 16 * h)));
    else
      return _mm256_loadu_ps(reinterpret_cast<const float*>(blk) + which * kPanel + 8 * h);
  }
};
#endif

// Rows [0, M) of x (rows ldx apart) times G adjacent panels from `panel`, all of K, to y
// (row m at y + m ldy, panel g's columns from col0 + 16 g, cut at column `width`).
template <int BITS, bool HALF, int M, int G>
static void exact_block(
    const float* x,
    int64_t ldx,
    const uint8_t* panel,
    const Shape& sh,
    float* y,
    int64_t ldy,
    int64_t col0,
    int64_t width) {
  using V = ExactVec;
  using F = V::F;
  constexpr int H = kPanel / V::W;  // vectors per panel row
  constexpr int kPer = 32 / BITS;   // inputs per unit
  constexpr int kMask = (1 << BITS) - 1;
  const int64_t bb = block_bytes(sh.group, BITS, HALF);
  const int64_t pstride = sh.panel_bytes();
  const uint8_t* end = panel + G * pstride;
  const int units = sh.group / kPer;
  F acc[G][H][M];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h)
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[g][h][m] = V::zero();
  const int64_t groups = sh.groups();
  for (int64_t gi = 0; gi < groups; ++gi) {
    const uint8_t* blk = panel + gi * bb;
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const uint8_t* ahead = blk + g * pstride + kPrefetchBlocks * bb;
      if (ahead + bb <= end)
        for (int64_t l = 0; l < bb; l += 64) __builtin_prefetch(ahead + l, 0, 0);
    }
    F s[G][H], b[G][H];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) {
        s[g][h] = V::template header<HALF>(blk + g * pstride, 0, h);
        b[g][h] = V::template header<HALF>(blk + g * pstride, 1, h);
      }
    const uint8_t* values = blk + header_bytes(HALF);
    const float* xk = x + gi * sh.group;
    for (int u = 0; u < units; ++u, xk += kPer) {
      typename V::I v[G][H];
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
        for (int h = 0; h < H; ++h)
          v[g][h] = V::load_i(values + g * pstride + u * kUnit + h * V::W * 4);
#pragma GCC unroll 8
      for (int t = 0; t < kPer; ++t) {
        F w[G][H];
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
          for (int h = 0; h < H; ++h) {
            typename V::I q = t == 0 ? v[g][h] : V::shift(v[g][h], BITS * t);
            if (t + 1 < kPer) q = V::mask(q, kMask);
            w[g][h] = V::add(V::mul(V::to_float(q), s[g][h]), b[g][h]);
          }
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          const F xb = V::bcast(xk + m * ldx + t);
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
            for (int h = 0; h < H; ++h) acc[g][h][m] = V::fma(xb, w[g][h], acc[g][h][m]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    const int64_t c0 = col0 + g * kPanel;
    const int64_t left = std::min<int64_t>(width - c0, kPanel);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      float out[kPanel];
      float* dst = left >= kPanel ? y + m * ldy + c0 : out;
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) V::store(dst + h * V::W, acc[g][h][m]);
      if (left < kPanel) std::memcpy(y + m * ldy + c0, out, left * sizeof(float));
    }
  }
}

using ExactFn =
    void (*)(const float*, int64_t, const uint8_t*, const Shape&, float*, int64_t, int64_t, int64_t);

// Panels side by side: two for a single row (two read streams), one for more (their
// accumulators fill the registers).
constexpr int exact_group(int m) {
  return m <= 1 ? 2 : 1;
}

template <int BITS, bool HALF, int M>
constexpr ExactFn exact_fn_m(bool grouped) {
  return grouped ? &exact_block<BITS, HALF, M, exact_group(M)> : &exact_block<BITS, HALF, M, 1>;
}

template <int BITS, bool HALF>
inline ExactFn exact_fn_bh(int m, bool grouped) {
  switch (m) {
    case 1: return exact_fn_m<BITS, HALF, 1>(grouped);
    case 2: return exact_fn_m<BITS, HALF, 2>(grouped);
    case 3: return exact_fn_m<BITS, HALF, 3>(grouped);
    case 4: return exact_fn_m<BITS, HALF, 4>(grouped);
    case 5: return exact_fn_m<BITS, HALF, 5>(grouped);
    case 6: return exact_fn_m<BITS, HALF, 6>(grouped);
    case 7: return exact_fn_m<BITS, HALF, 7>(grouped);
    default: return exact_fn_m<BITS, HALF, 8>(grouped);
  }
}

inline ExactFn exact_fn(const Shape& sh, int m, bool grouped) {
  if (sh.bits == 4)
    return sh.half ? exact_fn_bh<4, true>(m, grouped) : exact_fn_bh<4, false>(m, grouped);
  return sh.half ? exact_fn_bh<8, true>(m, grouped) : exact_fn_bh<8, false>(m, grouped);
}

#endif // QEXACT_AVX512 || QEXACT_AVX2

// Rows from which the exact product widens panels to float32 first (same bits).
constexpr int64_t kWidenRows = 16;

// Exact product of M rows of x over panels [p0, p1): bit-for-bit kernels.h's panel product of
// the dequantized weight. Row blocks as kernels.h splits rows; each panel (a few KiB at
// decode widths) serves every row block from L1.
inline void matmul_exact(
    const float* x,
    int64_t ldx,
    int64_t M,
    const uint8_t* panels,
    const Shape& sh,
    float* y,
    int64_t ldy,
    int64_t p0,
    int64_t p1) {
#if defined(QEXACT_AVX512) || defined(QEXACT_AVX2)
  // Many rows (prefill chunks): widen once, then only FMAs; the in-register kernel would
  // convert every weight again for each row block.
  if (M >= kWidenRows) {
    matmul_exact_widened(x, ldx, M, panels, sh, y, ldy, p0, p1);
    return;
  }
  int group = 1;
  for (int64_t r = 0; r < M; r += smallrow::block_size(M, r))
    group = std::max(group, exact_group(smallrow::block_size(M, r)));
  for (int64_t p = p0; p < p1;) {
    const int g = p + group <= p1 ? group : 1;
    for (int64_t r = 0; r < M;) {
      const int mb = smallrow::block_size(M, r);
      const int gb = g > 1 ? exact_group(mb) : 1; // divides g (powers of two)
      const ExactFn fn = exact_fn(sh, mb, gb > 1);
      for (int sub = 0; sub < g; sub += gb) {
        const int64_t first = p + sub;
        fn(x + r * ldx, ldx, panels + first * sh.panel_bytes(), sh, y + r * ldy, ldy,
           first * kPanel, sh.n);
      }
      r += mb;
    }
    p += g;
  }
#else
  matmul_exact_widened(x, ldx, M, panels, sh, y, ldy, p0, p1);
#endif
}

} // namespace qpanels
