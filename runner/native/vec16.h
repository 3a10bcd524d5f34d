// V16: 16 float lanes for the row attention (rows.cpp), with the lane-wise arithmetic (a fused
// multiply-add among it: one rounding, the same bits in every build, and half the
// instructions of a product and a sum), the folds that sum lane groups, and the exponential
// it needs.
//
// With AVX-512 (or no vector ISA) V16 is the compiler's generic 64-byte vector: one register,
// or plain loops. On AVX2 GCC lowers a 64-byte generic vector through the stack, lane by lane
// (stores of each broadcast scalar, reloads of each half), several times slower than the
// arithmetic; there V16 is a pair of 32-byte vectors, which AVX2 holds in registers. Every
// operation is the same IEEE operation on the same lanes in both forms, so a build computes
// the same bits with either.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "flash.h"
#if (defined(__AVX2__) || defined(__AVX512F__)) && !defined(SMALLROW_PORTABLE)
#include <immintrin.h>
#endif

namespace mtp_native {

#if defined(__AVX2__) && !defined(__AVX512F__) && !defined(SMALLROW_PORTABLE)

typedef float V8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));
typedef uint8_t U8x8 __attribute__((vector_size(8)));

struct V16 {
  V8 lo, hi; // lanes 0-7, 8-15
  [[gnu::always_inline]] inline float operator[](int i) const { return i < 8 ? lo[i] : hi[i - 8]; }
};
static_assert(sizeof(V16) == 64, "two halves, no padding");

[[gnu::always_inline]] inline V16 operator+(V16 a, V16 b) { return {a.lo + b.lo, a.hi + b.hi}; }
[[gnu::always_inline]] inline V16 operator-(V16 a, V16 b) { return {a.lo - b.lo, a.hi - b.hi}; }
[[gnu::always_inline]] inline V16 operator*(V16 a, V16 b) { return {a.lo * b.lo, a.hi * b.hi}; }
[[gnu::always_inline]] inline V16 operator+(V16 a, float b) { return {a.lo + b, a.hi + b}; }
[[gnu::always_inline]] inline V16 operator-(V16 a, float b) { return {a.lo - b, a.hi - b}; }
[[gnu::always_inline]] inline V16 operator*(V16 a, float b) { return {a.lo * b, a.hi * b}; }
[[gnu::always_inline]] inline V16 operator*(float a, V16 b) { return {a * b.lo, a * b.hi}; }
[[gnu::always_inline]] inline V16& operator+=(V16& a, V16 b) {
  a.lo += b.lo;
  a.hi += b.hi;
  return a;
}

// a * b + c lane-wise with one rounding (fused multiply-add).
[[gnu::always_inline]] inline V16 fma16(V16 a, V16 b, V16 c) {
#if defined(__FMA__)
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
#else
  V16 r;
  for (int i = 0; i < 8; ++i) {
    r.lo[i] = std::fma(a.lo[i], b.lo[i], c.lo[i]);
    r.hi[i] = std::fma(a.hi[i], b.hi[i], c.hi[i]);
  }
  return r;
#endif
}

// Each half loaded as a whole: a copy of all 64 bytes goes through the stack in 16-byte
// pieces that a 32-byte read cannot forward from.
[[gnu::always_inline]] inline V16 load16(const float* p) {
  V16 v;
  std::memcpy(&v.lo, p, sizeof v.lo);
  std::memcpy(&v.hi, p + 8, sizeof v.hi);
  return v;
}

// a where a > b, else b, lane-wise (b where a is NaN).
[[gnu::always_inline]] inline V16 greater_of(V16 a, V16 b) {
  return {a.lo > b.lo ? a.lo : b.lo, a.hi > b.hi ? a.hi : b.hi};
}

// The 16 bytes as floats (exact).
[[gnu::always_inline]] inline V16 bytes_to_floats(const uint8_t* u) {
  U8x8 lo, hi;
  std::memcpy(&lo, u, 8);
  std::memcpy(&hi, u + 8, 8);
  return {__builtin_convertvector(lo, V8), __builtin_convertvector(hi, V8)};
}

// 2**r for integral r in [-127, 0] (the exponent bits of each lane).
[[gnu::always_inline]] inline V16 exp2_integral(V16 r) {
  const I8 lo = (__builtin_convertvector(r.lo, I8) + 127) << 23;
  const I8 hi = (__builtin_convertvector(r.hi, I8) + 127) << 23;
  V16 scale;
  std::memcpy(&scale.lo, &lo, sizeof lo);
  std::memcpy(&scale.hi, &hi, sizeof hi);
  return scale;
}

// Lanes [0, w) of each half of an (x, y) pair summed with lanes [w, 2w): see fold8 below.
[[gnu::always_inline]] inline V16 fold8(V16 x, V16 y) {
  return {x.lo + x.hi, y.lo + y.hi};
}
[[gnu::always_inline]] inline V8 fold4_half(V8 a, V8 b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}
[[gnu::always_inline]] inline V16 fold4(V16 x, V16 y) {
  return {fold4_half(x.lo, x.hi), fold4_half(y.lo, y.hi)};
}
[[gnu::always_inline]] inline V8 fold2_half(V8 a, V8 b) {
  return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13) +
         __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15);
}
[[gnu::always_inline]] inline V16 fold2(V16 x, V16 y) {
  return {fold2_half(x.lo, x.hi), fold2_half(y.lo, y.hi)};
}
[[gnu::always_inline]] inline V8 fold1_half(V8 a, V8 b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}
[[gnu::always_inline]] inline V16 fold1(V16 x, V16 y) {
  return {fold1_half(x.lo, x.hi), fold1_half(y.lo, y.hi)};
}

#else

typedef float V16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef uint8_t U8x16 __attribute__((vector_size(16)));

[[gnu::always_inline]] inline V16 load16(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

[[gnu::always_inline]] inline V16 greater_of(V16 a, V16 b) {
  return a > b ? a : b;
}

[[gnu::always_inline]] inline V16 fma16(V16 a, V16 b, V16 c) {
#if defined(__AVX512F__) && !defined(SMALLROW_PORTABLE)
  const __m512 r = _mm512_fmadd_ps(reinterpret_cast<__m512&>(a), reinterpret_cast<__m512&>(b),
                                   reinterpret_cast<__m512&>(c));
  V16 out;
  std::memcpy(&out, &r, sizeof out);
  return out;
#else
  V16 r;
  for (int i = 0; i < 16; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

[[gnu::always_inline]] inline V16 bytes_to_floats(const uint8_t* u) {
  U8x16 b;
  std::memcpy(&b, u, 16);
  return __builtin_convertvector(b, V16);
}

[[gnu::always_inline]] inline V16 exp2_integral(V16 r) {
  const I16 bits = (__builtin_convertvector(r, I16) + 127) << 23;
  V16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return scale;
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

#endif

[[gnu::always_inline]] inline V16 splat16(float x) {
  return V16{} + x;
}

// 2**d lane-wise for d <= 0, 0 from -126.5 down (and for -inf): the scalar
// flash::exp2_nonpositive's steps, rounding to nearest by the 1.5 * 2**23 shift.
[[gnu::always_inline]] inline V16 exp2_nonpositive(V16 d) {
  constexpr float kShift = 12582912.0f;
  d = greater_of(d, splat16(-127.0f));
  const V16 r = (d + kShift) - kShift, f = d - r;
  V16 p = splat16(flash::kP[6]);
  for (int c = 5; c >= 0; --c) p = p * f + flash::kP[c];
  return p * exp2_integral(r);
}

} // namespace mtp_native
