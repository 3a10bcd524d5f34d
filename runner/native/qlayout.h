// The quantized panel layout shared by the few-row products (qkernels.h: the fast product;
// qexact.h: the exact one): 4- or 8-bit unsigned values with a float32 scale and bias per
// group of `group` inputs of a column, w[k][n] = float32(s * q) + b (see runner/quantized.py:
// every stored format is this, exactly), and the activations' int8 quantization.
//
// Layout: panels [NB][K / group] blocks, block (p, gi) holding columns [16 p, 16 p + 16) of
// inputs [gi group, (gi + 1) group):
//   scales[16], biases[16] (float32, or float16 where every scale and bias is a float16 value,
//   as GGUF's Q4_0/Q4_1/Q8_0 ones are: a sixth fewer bytes to read at 4 bits), then
//   group * 16 values in lanes: lane j (the 32-bit word at byte 4 j of each 64-byte unit)
//   holds column j's values of consecutive inputs, least significant first: 8 inputs of 4
//   bits, or 4 inputs of 8 bits, per unit.
// One lane per column makes both products cheap: the exact path shifts a lane's value down
// and converts it to float; the fast path hands a unit of lanes straight to the integer dot
// product of 4 bytes per lane, 4-bit units split into their low and high nibbles.
//
// No MLX dependency (a standalone benchmark can include it).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

#if !defined(SMALLROW_PORTABLE) && defined(__AVX2__)
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
// keeps what the level leaves, r - d q (float32 ops); `isum` gets the sum of the q. Vector
// builds compute 16 (AVX-512) or 8 (AVX2) values at a time with the same operations (the
// maximum is exact in any order; rounding to nearest-even as nearbyint does in the default
// mode; the clamps as std::min / std::max order them; integer sums exact): the same bits as
// the scalar loop, which portable builds run.
inline float quantize_level(float* r, int ab, int8_t* q, int bits, int64_t k0, int32_t& isum) {
#if !defined(SMALLROW_PORTABLE) && defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 vmax = _mm512_setzero_ps();
  for (int i = 0; i < ab; i += 16)
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(r + i)));
  const float vd = _mm512_reduce_max_ps(vmax) / 127.0f;
  const __m512 d16 = _mm512_set1_ps(vd), inv16 = _mm512_set1_ps(vd > 0.0f ? 1.0f / vd : 0.0f);
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  // 4-bit panels take each 8 inputs as 0 2 4 6 1 3 5 7 (packed_at)
  const __m512i order =
      bits == 4 ? _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15)
                : _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i sums = _mm512_setzero_si512();
  for (int i = 0; i < ab; i += 16) {
    const __m512 x = _mm512_loadu_ps(r + i);
    __m512 v = _mm512_roundscale_ps(
        _mm512_mul_ps(x, inv16), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    const __m512i vi = _mm512_cvtps_epi32(v);
    sums = _mm512_add_epi32(sums, vi);
    _mm_storeu_si128(
        reinterpret_cast<__m128i*>(q + i),
        _mm512_cvtepi32_epi8(_mm512_permutexvar_epi32(order, vi)));
    _mm512_storeu_ps(r + i, _mm512_sub_ps(x, _mm512_mul_ps(d16, v)));
  }
  isum = _mm512_reduce_add_epi32(sums);
  (void)k0;
  return vd;
#elif !defined(SMALLROW_PORTABLE) && defined(__AVX2__)
  __m256 vmax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < ab; i += 8)
    vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(r + i)));
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  float vamax = 0.0f;
  for (float lane : lanes) vamax = std::max(vamax, lane);
  const float vd = vamax / 127.0f;
  const __m256 d8 = _mm256_set1_ps(vd), inv8 = _mm256_set1_ps(vd > 0.0f ? 1.0f / vd : 0.0f);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  // 4-bit panels take each 8 inputs as 0 2 4 6 1 3 5 7 (packed_at)
  const __m256i order = bits == 4 ? _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)
                                  : _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i sums = _mm256_setzero_si256();
  for (int i = 0; i < ab; i += 8) {
    const __m256 x = _mm256_loadu_ps(r + i);
    __m256 v = _mm256_round_ps(
        _mm256_mul_ps(x, inv8), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
    const __m256i vi = _mm256_permutevar8x32_epi32(_mm256_cvtps_epi32(v), order);
    sums = _mm256_add_epi32(sums, vi);
    const __m128i w16 =
        _mm_packs_epi32(_mm256_castsi256_si128(vi), _mm256_extracti128_si256(vi, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(w16, w16));
    _mm256_storeu_ps(r + i, _mm256_sub_ps(x, _mm256_mul_ps(d8, v)));
  }
  int32_t parts[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(parts), sums);
  isum = 0;
  for (int32_t part : parts) isum += part;
  (void)k0;
  return vd;
#else
  float amax = 0.0f;
  for (int i = 0; i < ab; ++i) amax = std::max(amax, std::fabs(r[i]));
  const float d = amax / 127.0f;
  const float inv = d > 0.0f ? 1.0f / d : 0.0f;
  isum = 0;
  for (int i = 0; i < ab; ++i) {
    float v = std::nearbyint(r[i] * inv);
    v = std::min(127.0f, std::max(-127.0f, v));
    q[packed_at(k0 + i, bits) - k0] = static_cast<int8_t>(v);
    isum += static_cast<int32_t>(v);
    const float dv = d * v;
    r[i] = r[i] - dv;
  }
  return d;
#endif
}

inline void quantize_rows(const float* x, int64_t ldx, int64_t M, const Shape& sh, QuantRows& out) {
  const int ab = act_block(sh.group);
  out.K = sh.K;
  out.blocks = sh.K / ab;
  out.groups = sh.groups();
  // Every value, scale and sum below is written: no need to clear what a reused row held.
  out.q.resize(static_cast<size_t>(M) * kLevels * sh.K);
  out.d.resize(static_cast<size_t>(M) * kLevels * out.blocks);
  out.sx.resize(static_cast<size_t>(M) * out.groups);
  std::vector<int32_t> isums(static_cast<size_t>(out.blocks) * kLevels);
  float r[kActBlock];
  const int per_group = sh.group / ab;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    for (int64_t a = 0; a < out.blocks; ++a) {
      const int64_t k0 = a * ab;
      std::memcpy(r, xr + k0, ab * sizeof(float));
      for (int l = 0; l < kLevels; ++l) {
        int8_t* q = out.q.data() + (m * kLevels + l) * sh.K + k0;
        out.d[(m * kLevels + l) * out.blocks + a] =
            quantize_level(r, ab, q, sh.bits, k0, isums[a * kLevels + l]);
      }
    }
    // The bias term takes the sum of the quantized inputs, not of x: with it the rounding
    // errors of the inputs cancel against those of the value term (w = s q + b has a large
    // b = -s (midpoint) for most formats, so an exact sum here leaves s (q - mid) times them
    // uncancelled: several times the error).
    for (int64_t gi = 0; gi < out.groups; ++gi) {
      float s = 0.0f;
      for (int a = 0; a < per_group; ++a) {
        const int64_t blk = gi * per_group + a;
        for (int l = 0; l < kLevels; ++l)
          s = std::fma(out.d[(m * kLevels + l) * out.blocks + blk],
                       static_cast<float>(isums[blk * kLevels + l]), s);
      }
      out.sx[m * out.groups + gi] = s;
    }
  }
}

} // namespace qpanels
