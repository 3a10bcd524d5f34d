// Few-row products y[M, N] = x[M, K] @ W[K, N] over quantized column panels: 4- or 8-bit
// unsigned values with a float32 scale and bias per group of `group` inputs of a column,
// w[k][n] = float32(s * q) + b (see runner/quantized.py: every stored format is this, exactly).
//
// Layout: panels [NB][K / group] blocks, block (p, gi) holding columns [16 p, 16 p + 16) of
// inputs [gi group, (gi + 1) group):
//   scales[16], biases[16] (float32, or float16 where every scale and bias is a float16 value,
//   as GGUF's Q4_0/Q4_1/Q8_0 ones are: a sixth fewer bytes to read at 4 bits), then
//   group * 16 values in lanes: lane j (the 32-bit
//   word at byte 4 j of each 64-byte unit) holds column j's values of consecutive inputs,
//   least significant first: 8 inputs of 4 bits, or 4 inputs of 8 bits, per unit.
// One lane per column makes both products cheap: the exact path shifts a lane's value down
// and converts it to float; the fast path hands a unit of lanes straight to the integer dot
// product of 4 bytes per lane (vpdpbusd), 4-bit units split into their low and high nibbles.
//
// Two products share the layout:
// - exact (`qpanel_matmul_exact`): each panel group is widened to float32 panels in a small
//   buffer (w = s * q, then + b: the value the dequantized weight has) and multiplied by
//   kernels.h, so the result is bit-for-bit the float32 panel product of the dequantized
//   weight, for every M (kernels.h's FMA order does not depend on M).
// - fast (`qpanel_matmul_fast`): each row of x is quantized by itself to int8 per block of
//   32 inputs (or the group, when smaller), d = max|x| / 127; per block the integer sums of
//   q * xq are exact, and each column's accumulator takes, in k order,
//     acc = fma(float(isum), s * d, acc) per block, acc = fma(b, sum(d * xq over group), acc)
//   per group (the quantized inputs' sum, so that their rounding errors cancel between the
//   two terms). Every row's result depends only on that row, so row i of an M-row product is
//   the one-row product of row i, and every build (AVX-512 with or without VNNI, portable)
//   computes the same integers and the same float operations: the same bits.
//
// No MLX dependency (a standalone benchmark can include it).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

#if !defined(SMALLROW_PORTABLE) && defined(__AVX512F__) && defined(__AVX512BW__)
#define QPANELS_AVX512 1
#include <immintrin.h>
#endif

namespace qpanels {

constexpr int kPanel = 16; // columns per panel: 16 32-bit lanes
static_assert(kPanel == smallrow::kPanel || smallrow::kPanel % kPanel == 0, "panel widths");
constexpr int kUnit = 64;               // bytes of values per lane unit (16 lanes of 4 bytes)
constexpr int kActBlock = 32;           // inputs per activation scale (fast path)
// Int8 levels per input (fast path): 1 quantizes each input to int8 (llama.cpp's scheme);
// 2 adds the int8 quantization of what the first level left, for about 15 bits of each input
// at twice the integer products (still cheap beside the weights' read at decode sizes).
#ifndef QPANELS_LEVELS
#define QPANELS_LEVELS 2
#endif
constexpr int kLevels = QPANELS_LEVELS;
static_assert(kLevels == 1 || kLevels == 2, "one or two int8 levels");
#ifndef QPANELS_PREFETCH_BLOCKS
#define QPANELS_PREFETCH_BLOCKS 4
#endif
constexpr int kPrefetchBlocks = QPANELS_PREFETCH_BLOCKS; // blocks ahead (0: none)

inline int header_bytes(bool half) {
  return 2 * kPanel * (half ? 2 : 4); // scales and biases
}
inline int64_t block_bytes(int group, int bits, bool half) {
  return header_bytes(half) + static_cast<int64_t>(group) * kPanel * bits / 8;
}

// float16 bits to float32 (exact; the header's values are float16 numbers).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else { // subnormal: normalise
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while (!(man & 0x400u));
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A block's scales and biases as float32.
inline void read_header(const uint8_t* blk, bool half, float* s, float* b) {
  if (!half) {
    std::memcpy(s, blk, kPanel * 4);
    std::memcpy(b, blk + kPanel * 4, kPanel * 4);
    return;
  }
  for (int j = 0; j < kPanel; ++j) {
    uint16_t hs, hb;
    std::memcpy(&hs, blk + 2 * j, 2);
    std::memcpy(&hb, blk + 2 * (kPanel + j), 2);
    s[j] = half_to_float(hs);
    b[j] = half_to_float(hb);
  }
}
inline int unit_inputs(int bits) {
  return 32 / bits; // inputs per unit: 8 at 4 bits, 4 at 8 bits
}
inline int act_block(int group) {
  return group < kActBlock ? group : kActBlock;
}

struct Shape {
  int K;      // inputs
  int group;  // inputs per scale
  int bits;   // 4 or 8
  bool half;  // float16 scales and biases
  int64_t NB; // panels
  int64_t n;  // output columns (16 (NB - 1) < n <= 16 NB)
  int64_t groups() const { return K / group; }
  int64_t block() const { return block_bytes(group, bits, half); }
  int64_t panel_bytes() const { return groups() * block(); }
};

// The value of input k (within its group) of column j in a block's value area.
inline uint32_t value_at(const uint8_t* values, int bits, int k, int j) {
  const int per = unit_inputs(bits);
  uint32_t lane;
  std::memcpy(&lane, values + static_cast<int64_t>(k / per) * kUnit + 4 * j, 4);
  return (lane >> ((k % per) * bits)) & ((1u << bits) - 1);
}

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

// Exact product for panels [p0, p1): widened a few panels at a time (the buffer stays in
// L2), then kernels.h's panel product, which groups panels side by side for few rows.
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

// Rows of x quantized for the fast path: per row, K int8 values (4-bit panels: each unit's
// 8 inputs stored as inputs 0 2 4 6 1 3 5 7, the order of the low and high nibbles of a
// lane's bytes), a scale per activation block, and per group the sum of the quantized inputs
// times their scales.
struct QuantRows {
  std::vector<int8_t> q;  // per row: kLevels runs of K values
  std::vector<float> d;   // per row: kLevels runs of a scale per block
  std::vector<float> sx;
  int64_t K = 0, blocks = 0, groups = 0;
  const int8_t* row_q(int64_t m, int level = 0) const { return q.data() + (m * kLevels + level) * K; }
  const float* row_d(int64_t m, int level = 0) const {
    return d.data() + (m * kLevels + level) * blocks;
  }
  const float* row_sx(int64_t m) const { return sx.data() + m * groups; }
};

// Where input k sits in a row's quantized values: 4-bit panels pair each unit's 8 inputs as
// 0 2 4 6 1 3 5 7 (the low and high nibbles of a lane's bytes).
inline int64_t packed_at(int64_t k, int bits) {
  if (bits != 4) return k;
  const int64_t u = k & 7;
  return (k & ~int64_t{7}) + (u & 1) * 4 + (u >> 1);
}

// One level: the block's values (`r`, ab of them) as int8 q with scale d = max|r| / 127; `r`
// keeps what the level leaves, r - d q (float32 ops).
inline float quantize_level(float* r, int ab, int8_t* q, int bits, int64_t k0) {
  float amax = 0.0f;
  for (int i = 0; i < ab; ++i) amax = std::max(amax, std::fabs(r[i]));
  const float d = amax / 127.0f;
  const float inv = d > 0.0f ? 1.0f / d : 0.0f;
  for (int i = 0; i < ab; ++i) {
    float v = std::nearbyint(r[i] * inv);
    v = std::min(127.0f, std::max(-127.0f, v));
    q[packed_at(k0 + i, bits) - k0] = static_cast<int8_t>(v);
    const float dv = d * v;
    r[i] = r[i] - dv;
  }
  return d;
}

inline void quantize_rows(const float* x, int64_t ldx, int64_t M, const Shape& sh, QuantRows& out) {
  const int ab = act_block(sh.group);
  out.K = sh.K;
  out.blocks = sh.K / ab;
  out.groups = sh.groups();
  out.q.assign(static_cast<size_t>(M) * kLevels * sh.K, 0);
  out.d.assign(static_cast<size_t>(M) * kLevels * out.blocks, 0.0f);
  out.sx.assign(static_cast<size_t>(M) * out.groups, 0.0f);
  float r[kActBlock];
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    for (int64_t a = 0; a < out.blocks; ++a) {
      const int64_t k0 = a * ab;
      std::memcpy(r, xr + k0, ab * sizeof(float));
      for (int l = 0; l < kLevels; ++l) {
        int8_t* q = out.q.data() + (m * kLevels + l) * sh.K + k0;
        out.d[(m * kLevels + l) * out.blocks + a] = quantize_level(r, ab, q, sh.bits, k0);
      }
    }
    // The bias term takes the sum of the quantized inputs, not of x: with it the rounding
    // errors of the inputs cancel against those of the value term (w = s q + b has a large
    // b = -s (midpoint) for most formats, so an exact sum here leaves s (q - mid) times them
    // uncancelled: several times the error).
    const int per_group = sh.group / ab;
    for (int64_t gi = 0; gi < out.groups; ++gi) {
      float s = 0.0f;
      for (int a = 0; a < per_group; ++a) {
        const int64_t blk = gi * per_group + a;
        for (int l = 0; l < kLevels; ++l) {
          const int8_t* q = out.q.data() + (m * kLevels + l) * sh.K + blk * ab;
          int32_t isum = 0;
          for (int i = 0; i < ab; ++i) isum += q[i];
          s = std::fma(out.d[(m * kLevels + l) * out.blocks + blk], static_cast<float>(isum), s);
        }
      }
      out.sx[m * out.groups + gi] = s;
    }
  }
}

// Portable fast product of rows [r0, r0 + M) over panels [p0, p1): the same integers and
// float operations as the vector kernel, one column at a time.
inline void matmul_fast_portable(
    const QuantRows& qr,
    int64_t r0,
    int64_t M,
    const uint8_t* panels,
    const Shape& sh,
    float* y,
    int64_t ldy,
    int64_t p0,
    int64_t p1) {
  const int ab = act_block(sh.group);
  const int64_t bb = sh.block();
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* panel = panels + p * sh.panel_bytes();
    for (int64_t m = r0; m < r0 + M; ++m) {
      float acc[kPanel] = {};
      for (int64_t gi = 0; gi < sh.groups(); ++gi) {
        const uint8_t* blk = panel + gi * bb;
        float s[kPanel], b[kPanel];
        read_header(blk, sh.half, s, b);
        const uint8_t* values = blk + header_bytes(sh.half);
        for (int a = 0; a < sh.group / ab; ++a) {
          const int64_t k0 = gi * sh.group + a * ab;
          for (int j = 0; j < kPanel; ++j) {
            for (int l = 0; l < kLevels; ++l) {
              const int8_t* xq = qr.row_q(m, l);
              int32_t isum = 0;
              for (int i = 0; i < ab; ++i) {
                const int k = a * ab + i; // within the group
                isum += static_cast<int32_t>(value_at(values, sh.bits, k, j)) *
                    xq[packed_at(k0 + i, sh.bits)];
              }
              const float sd = s[j] * qr.row_d(m, l)[k0 / ab];
              acc[j] = std::fma(static_cast<float>(isum), sd, acc[j]);
            }
          }
        }
        const float sx = qr.row_sx(m)[gi];
        for (int j = 0; j < kPanel; ++j) acc[j] = std::fma(b[j], sx, acc[j]);
      }
      const int64_t col0 = p * kPanel;
      const int64_t width = std::min<int64_t>(kPanel, sh.n - col0);
      std::memcpy(y + (m - r0) * ldy + col0, acc, width * sizeof(float));
    }
  }
}

#if defined(QPANELS_AVX512)

// 4 bytes per lane of u8 weights times 4 broadcast s8 activations, added to isum: vpdpbusd
// where the CPU has it; otherwise pairs to int16 (maddubs: exact, |15 * 127 * 2| < 2^15) and
// to int32 (madd with ones). 8-bit weights split into nibbles first so that no pair sum
// saturates. Both give the exact integer sum.
template <int BITS>
static inline __m512i dot4(__m512i isum, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(isum, w, x);
#else
  const __m512i ones = _mm512_set1_epi16(1);
  if constexpr (BITS == 4) {
    return _mm512_add_epi32(isum, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), ones));
  } else {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    const __m512i lo = _mm512_and_si512(w, nib);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);
    const __m512i slo = _mm512_madd_epi16(_mm512_maddubs_epi16(lo, x), ones);
    const __m512i shi = _mm512_madd_epi16(_mm512_maddubs_epi16(hi, x), ones);
    return _mm512_add_epi32(isum, _mm512_add_epi32(slo, _mm512_slli_epi32(shi, 4)));
  }
#endif
}

// Rows [r0, r0 + M) times G panels, `gap` panels apart from `panel` on, all of K; results to
// y (row m at y + (m - r0) ldy; panel g's columns from col0 + 16 g gap, cut at column `width`,
// the product's column count: the last panel may be partial). AB: inputs per activation block (32, or 16 for groups of 16). The loops
// over rows and panels unroll fully, so the accumulators live in registers.
// A block's 16 scales (at 0) or biases (at 1) as float32.
template <bool HALF>
static inline __m512 header_vec(const uint8_t* blk, int which) {
  if constexpr (HALF)
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + which * kPanel * 2)));
  else
    return _mm512_loadu_ps(reinterpret_cast<const float*>(blk) + which * kPanel);
}

template <int BITS, int AB, bool HALF, int M, int G>
static void fast_block(
    const QuantRows& qr,
    int64_t r0,
    const uint8_t* panel,
    const Shape& sh,
    int64_t gap,
    float* y,
    int64_t ldy,
    int64_t col0,
    int64_t width) {
  constexpr int kPer = 32 / BITS;   // inputs per unit
  constexpr int kUnits = AB / kPer; // units per activation block
  const int64_t bb = block_bytes(sh.group, BITS, HALF);
  const int64_t pstride = sh.panel_bytes() * gap;
  const uint8_t* end = panel + (G - 1) * pstride + sh.panel_bytes();
  const int blocks_per_group = sh.group / AB;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512 acc[G][M];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[g][m] = _mm512_setzero_ps();
  const int8_t* xq[kLevels][M];
  const float* dx[kLevels][M];
  const float* sx[M];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    for (int l = 0; l < kLevels; ++l) {
      xq[l][m] = qr.row_q(r0 + m, l);
      dx[l][m] = qr.row_d(r0 + m, l);
    }
    sx[m] = qr.row_sx(r0 + m);
  }
  const int64_t groups = sh.groups();
  for (int64_t gi = 0; gi < groups; ++gi) {
    const uint8_t* blk = panel + gi * bb;
    // The blocks kPrefetchBlocks ahead in each panel: the loads of one row block leave the
    // hardware prefetcher too few misses in flight to reach the memory's rate.
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const uint8_t* ahead = blk + g * pstride + kPrefetchBlocks * bb;
      if (ahead + bb <= end)
        for (int64_t l = 0; l < bb; l += 64) __builtin_prefetch(ahead + l, 0, 0);
    }
    for (int a = 0; a < blocks_per_group; ++a) {
      const int64_t k0 = gi * sh.group + a * AB;
      const uint8_t* units =
          blk + header_bytes(HALF) + static_cast<int64_t>(a) * kUnits * kUnit;
      __m512i isum[kLevels][G][M];
#pragma GCC unroll 2
      for (int l = 0; l < kLevels; ++l)
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) isum[l][g][m] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int u = 0; u < kUnits; ++u) {
        const int64_t k = k0 + u * kPer;
        if constexpr (BITS == 4) {
          __m512i lo[G], hi[G];
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g) {
            const __m512i v = _mm512_loadu_si512(units + g * pstride + u * kUnit);
            lo[g] = _mm512_and_si512(v, nib);
            hi[g] = _mm512_and_si512(_mm512_srli_epi32(v, 4), nib);
          }
#pragma GCC unroll 2
          for (int l = 0; l < kLevels; ++l)
#pragma GCC unroll 8
            for (int m = 0; m < M; ++m) {
              int32_t xl, xh;
              std::memcpy(&xl, xq[l][m] + k, 4);
              std::memcpy(&xh, xq[l][m] + k + 4, 4);
              const __m512i bl = _mm512_set1_epi32(xl), bh = _mm512_set1_epi32(xh);
#pragma GCC unroll 8
              for (int g = 0; g < G; ++g) {
                isum[l][g][m] = dot4<4>(isum[l][g][m], lo[g], bl);
                isum[l][g][m] = dot4<4>(isum[l][g][m], hi[g], bh);
              }
            }
        } else {
          __m512i v[G];
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g) v[g] = _mm512_loadu_si512(units + g * pstride + u * kUnit);
#pragma GCC unroll 2
          for (int l = 0; l < kLevels; ++l)
#pragma GCC unroll 8
            for (int m = 0; m < M; ++m) {
              int32_t xv;
              std::memcpy(&xv, xq[l][m] + k, 4);
              const __m512i bx = _mm512_set1_epi32(xv);
#pragma GCC unroll 8
              for (int g = 0; g < G; ++g) isum[l][g][m] = dot4<8>(isum[l][g][m], v[g], bx);
            }
        }
      }
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const __m512 s = header_vec<HALF>(blk + g * pstride, 0);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m)
#pragma GCC unroll 2
          for (int l = 0; l < kLevels; ++l) {
            const __m512 d = _mm512_set1_ps(dx[l][m][k0 / AB]);
            acc[g][m] = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(isum[l][g][m]), _mm512_mul_ps(s, d), acc[g][m]);
          }
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m512 b = header_vec<HALF>(blk + g * pstride, 1);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m)
        acc[g][m] = _mm512_fmadd_ps(b, _mm512_set1_ps(sx[m][gi]), acc[g][m]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    const int64_t c0 = col0 + g * gap * kPanel;
    const int64_t left = std::min<int64_t>(width - c0, kPanel);
    const __mmask16 mask = left >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + m * ldy + c0, mask, acc[g][m]);
  }
}

// Panels read side by side by a block of m rows: several sequential streams for the fewest
// rows (memory-bound), one for more (their accumulators fill the registers).
constexpr int fast_group(int m) {
  return m <= 1 ? 4 : (m <= 4 ? 2 : 1);
}

using FastFn = void (*)(
    const QuantRows&,
    int64_t,
    const uint8_t*,
    const Shape&,
    int64_t,
    float*,
    int64_t,
    int64_t,
    int64_t);

template <int BITS, int AB, bool HALF, int M>
constexpr FastFn fast_fn_m(bool grouped) {
  return grouped ? &fast_block<BITS, AB, HALF, M, fast_group(M)>
                 : &fast_block<BITS, AB, HALF, M, 1>;
}

template <int BITS, int AB, bool HALF>
inline FastFn fast_fn_ab(int m, bool grouped) {
  switch (m) {
    case 1: return fast_fn_m<BITS, AB, HALF, 1>(grouped);
    case 2: return fast_fn_m<BITS, AB, HALF, 2>(grouped);
    case 3: return fast_fn_m<BITS, AB, HALF, 3>(grouped);
    case 4: return fast_fn_m<BITS, AB, HALF, 4>(grouped);
    case 5: return fast_fn_m<BITS, AB, HALF, 5>(grouped);
    case 6: return fast_fn_m<BITS, AB, HALF, 6>(grouped);
    case 7: return fast_fn_m<BITS, AB, HALF, 7>(grouped);
    default: return fast_fn_m<BITS, AB, HALF, 8>(grouped);
  }
}

template <bool HALF>
inline FastFn fast_fn_h(int bits, int group, int m, bool grouped) {
  const bool wide = act_block(group) == kActBlock;
  if (bits == 4)
    return wide ? fast_fn_ab<4, 32, HALF>(m, grouped) : fast_fn_ab<4, 16, HALF>(m, grouped);
  return wide ? fast_fn_ab<8, 32, HALF>(m, grouped) : fast_fn_ab<8, 16, HALF>(m, grouped);
}

inline FastFn fast_fn(const Shape& sh, int m, bool grouped) {
  return sh.half ? fast_fn_h<true>(sh.bits, sh.group, m, grouped)
                 : fast_fn_h<false>(sh.bits, sh.group, m, grouped);
}

// Row blocks as kernels.h splits rows (smallrow::block_size); fast_fn serves up to 8 rows.
static_assert(smallrow::kMaxBlock <= 8, "row blocks of at most 8 rows");

#endif // QPANELS_AVX512

// Fast product of every row of `qr` (M rows) over panels [p0, p1).
inline void matmul_fast(
    const QuantRows& qr,
    int64_t M,
    const uint8_t* panels,
    const Shape& sh,
    float* y,
    int64_t ldy,
    int64_t p0,
    int64_t p1) {
#if defined(QPANELS_AVX512)
  // Rows in blocks as the float kernel splits them (evenly: 9 rows run as 5 + 4). The fewest
  // rows read G panels at once, spaced a G-th of the range apart (G long sequential streams,
  // which the memory serves faster than G adjacent panels); every row block uses the panels
  // while in L1.
  int group = 1;
  for (int64_t r = 0; r < M; r += smallrow::block_size(M, r))
    group = std::max(group, fast_group(smallrow::block_size(M, r)));
  const int64_t span = (p1 - p0) / group; // panels per stream
  auto run = [&](int64_t p, int g, int64_t gap) {
    for (int64_t r = 0; r < M;) {
      const int mb = smallrow::block_size(M, r);
      const int gb = g > 1 ? fast_group(mb) : 1; // divides g (powers of two)
      const FastFn fn = fast_fn(sh, mb, gb > 1);
      const int64_t step = gap * (g / gb); // panels between a sub-group's panels
      for (int sub = 0; sub < g / gb; ++sub) {
        const int64_t first = p + sub * gap;
        fn(qr, r, panels + first * sh.panel_bytes(), sh, step, y + r * ldy, ldy,
           first * kPanel, sh.n);
      }
      r += mb;
    }
  };
  for (int64_t i = 0; i < span; ++i) run(p0 + i, group, span);
  for (int64_t p = p0 + span * group; p < p1; ++p) run(p, 1, 1);
#else
  matmul_fast_portable(qr, 0, M, panels, sh, y, ldy, p0, p1);
#endif
}

inline const char* fast_isa() {
#if defined(QPANELS_AVX512) && defined(__AVX512VNNI__)
  return "avx512-vnni";
#elif defined(QPANELS_AVX512)
  return "avx512bw";
#else
  return "portable";
#endif
}

} // namespace qpanels
