// The fast few-row product y[M, N] = x[M, K] @ W[K, N] over quantized panels (qlayout.h):
// each row of x is quantized by itself to int8 per block of 32 inputs (or the group, when
// smaller), d = max|x| / 127 (two levels: qlayout.h); per block the integer sums of q * xq
// are exact, and each column's accumulator takes, in k order,
//   acc = fma(float(isum), s * d, acc) per block, acc = fma(b, sum(d * xq over group), acc)
// per group (the quantized inputs' sum, so that their rounding errors cancel between the two
// terms). Every row's result depends only on that row, so row i of an M-row product is the
// one-row product of row i, and every build (AVX-512 with or without VNNI, AVX2, portable)
// computes the same integers and the same float operations: the same bits. The exact product
// is qexact.h's, included here for the callers of both.
//
// No MLX dependency (a standalone benchmark can include it).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "qexact.h"
#include "qlayout.h"

#if !defined(SMALLROW_PORTABLE) && defined(__AVX512F__) && defined(__AVX512BW__)
#define QPANELS_AVX512 1
#include <immintrin.h>
#elif !defined(SMALLROW_PORTABLE) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QPANELS_AVX2 1
#include <immintrin.h>
#endif

namespace qpanels {

// Rows from which the fast product is computed as the exact one (prefill chunks), where that
// is the faster of the two: AVX2 multiplies bytes on one port and floats on two, so once the
// weights' conversion is shared by enough rows the float32 FMAs win (and lose no precision).
// Fewer rows (decode, verify rows, shared forwards) keep the fast product's row invariance.
#if defined(QPANELS_AVX2)
constexpr int64_t kExactRows = 32;
#else
constexpr int64_t kExactRows = INT64_MAX;
#endif
inline bool fast_as_exact(int64_t M) {
  return M >= kExactRows;
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

#elif defined(QPANELS_AVX2)

// AVX2 has no 4-byte integer dot product: pairs of u8 weight times s8 input go to int16
// (maddubs; a 4-bit pair is at most 2 * 15 * 127, so an activation block's 8 pair sums of
// 4-bit units, or its 8 low- or high-nibble sums of 8-bit units, add up in int16 without
// saturating), then to int32 once per block (madd with ones). A 64-byte unit is two vectors:
// columns 0-7 and 8-15 of the panel. The integers are the exact sums the AVX-512 paths
// compute and the float operations are the same per column, in the same order: the same bits.
//
// Each unit is loaded and split into nibbles once for every level and row (the byte products
// run on one port on some AVX2 cores, so the unpacking's instructions are what the loop can
// shed), and a 4-bit unit's low and high nibble products share one int16 sum (at most
// 8 * 2 * 15 * 127 < 2^15 over a block).

// A block's 8 scales (at 0) or biases (at 1) of columns 8 h .. 8 h + 7 as float32.
template <bool HALF>
static inline __m256 header_vec(const uint8_t* blk, int which, int h) {
  if constexpr (HALF)
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + which * kPanel * 2 + 16 * h)));
  else
    return _mm256_loadu_ps(reinterpret_cast<const float*>(blk) + which * kPanel + 8 * h);
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
  constexpr int kPer = 32 / BITS;          // inputs per unit
  constexpr int kUnits = AB / kPer;        // units per activation block
  constexpr int kSums = BITS == 4 ? 1 : 2; // int16 sums per level, panel half and row
  static_assert((BITS == 4 ? 2 : 1) * kUnits <= 8, "int16 pair sums of a block stay below 2^15");
  const int64_t bb = block_bytes(sh.group, BITS, HALF);
  const int64_t pstride = sh.panel_bytes() * gap;
  const uint8_t* end = panel + (G - 1) * pstride + sh.panel_bytes();
  const int blocks_per_group = sh.group / AB;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[G][2][M];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
    for (int h = 0; h < 2; ++h)
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[g][h][m] = _mm256_setzero_ps();
  const int64_t groups = sh.groups();
  for (int64_t gi = 0; gi < groups; ++gi) {
    const uint8_t* blk = panel + gi * bb;
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
      __m256i sums[kLevels][G][2][M][kSums];
#pragma GCC unroll 2
      for (int l = 0; l < kLevels; ++l)
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g)
          for (int h = 0; h < 2; ++h)
#pragma GCC unroll 8
            for (int m = 0; m < M; ++m)
              for (int t = 0; t < kSums; ++t) sums[l][g][h][m][t] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int u = 0; u < kUnits; ++u) {
        const int64_t k = k0 + u * kPer;
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            const __m256i v = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(units + g * pstride + 32 * h + u * kUnit));
            const __m256i lo = _mm256_and_si256(v, nib);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
#pragma GCC unroll 2
            for (int l = 0; l < kLevels; ++l)
#pragma GCC unroll 8
              for (int m = 0; m < M; ++m) {
                const int8_t* xq = qr.row_q(r0 + m, l) + k;
                int32_t xl, xh;
                std::memcpy(&xl, xq, 4);
                if constexpr (BITS == 4) {
                  // lanes' low nibbles are inputs 0 2 4 6, high ones 1 3 5 7 (packed_at)
                  std::memcpy(&xh, xq + 4, 4);
                } else {
                  xh = xl;
                }
                const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl));
                const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh));
                // indexed in place (a pointer to the sums would keep them in memory)
                if constexpr (BITS == 4) {
                  sums[l][g][h][m][0] =
                      _mm256_add_epi16(sums[l][g][h][m][0], _mm256_add_epi16(pl, ph));
                } else {
                  sums[l][g][h][m][0] = _mm256_add_epi16(sums[l][g][h][m][0], pl);
                  sums[l][g][h][m][1] = _mm256_add_epi16(sums[l][g][h][m][1], ph);
                }
              }
          }
      }
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256 s = header_vec<HALF>(blk + g * pstride, 0, h);
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m)
#pragma GCC unroll 2
            for (int l = 0; l < kLevels; ++l) {
              __m256i isum;
              if constexpr (BITS == 4) {
                isum = _mm256_madd_epi16(sums[l][g][h][m][0], ones);
              } else {
                isum = _mm256_add_epi32(
                    _mm256_madd_epi16(sums[l][g][h][m][0], ones),
                    _mm256_slli_epi32(_mm256_madd_epi16(sums[l][g][h][m][1], ones), 4));
              }
              const __m256 d = _mm256_set1_ps(qr.row_d(r0 + m, l)[k0 / AB]);
              acc[g][h][m] = _mm256_fmadd_ps(
                  _mm256_cvtepi32_ps(isum), _mm256_mul_ps(s, d), acc[g][h][m]);
            }
        }
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256 b = header_vec<HALF>(blk + g * pstride, 1, h);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m)
          acc[g][h][m] =
              _mm256_fmadd_ps(b, _mm256_set1_ps(qr.row_sx(r0 + m)[gi]), acc[g][h][m]);
      }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    const int64_t c0 = col0 + g * gap * kPanel;
    const int64_t left = std::min<int64_t>(width - c0, kPanel);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      float* dst = y + m * ldy + c0;
      if (left >= kPanel) {
        _mm256_storeu_ps(dst, acc[g][0][m]);
        _mm256_storeu_ps(dst + 8, acc[g][1][m]);
      } else {
        float out[kPanel];
        _mm256_storeu_ps(out, acc[g][0][m]);
        _mm256_storeu_ps(out + 8, acc[g][1][m]);
        std::memcpy(dst, out, left * sizeof(float));
      }
    }
  }
}

// One panel at a time for any row count (see the AVX-512 version): a second panel doubles
// the sums held, which already outgrow 16 registers, and on cores that multiply bytes on one
// port the product is bound by those multiplies, not by how many streams the memory serves.
constexpr int fast_group(int) {
  return 1;
}

#endif // QPANELS_AVX512 / QPANELS_AVX2

#if defined(QPANELS_AVX512) || defined(QPANELS_AVX2)

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

#endif // QPANELS_AVX512 || QPANELS_AVX2

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
#if defined(QPANELS_AVX512) || defined(QPANELS_AVX2)
  // Rows in blocks as the float kernel splits them (evenly: 9 rows run as 5 + 4). Where
  // fast_group asks for it (AVX-512, the fewest rows), G panels are read at once, spaced a
  // G-th of the range apart (G long sequential streams, which the memory serves faster than
  // G adjacent panels); every row block uses the panels while in L1.
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
#elif defined(QPANELS_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

} // namespace qpanels
