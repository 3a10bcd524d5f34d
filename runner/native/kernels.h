// Few-row float32 products y[M, N] = x[M, K] @ W[K, N] over a column-panel weight layout.
//
// Layout: P[NB][K][16], panel b holding columns [16 b, 16 b + 16) of W, each panel contiguous,
// N padded with zero columns up to 16 NB. Every row of x is multiplied with one read of each
// panel, so a product with a few rows costs about one read of the weight. Panels are narrow so
// that one- to four-row products can read several panels side by side (several sequential
// streams, which the memory system serves faster than one) with all of a panel row's
// columns in registers: a single pass over each panel whatever M.
//
// Batch invariance: every output element is one accumulator that starts at zero and takes
// acc = fma(x[m][k], W[k][n], acc) for k = 0, 1, ..., K - 1, whatever M, the row block, the
// panel group, the column tile, the K block or the thread split. Row i of an M-row product is
// therefore bit-identical to the one-row product of row i. (The portable path uses a separate
// multiply and add instead of the fused one, the same way everywhere; the file is built with
// -ffp-contract=off so the compiler cannot fuse some of them and not others.)
//
// This header has no MLX dependency (a standalone benchmark can include it).

#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if !defined(SMALLROW_PORTABLE) && (defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)))
#include <immintrin.h>
#endif

namespace smallrow {

// Columns per panel: the layout, the same for every ISA path (to_panels does not depend on
// the build).
#ifndef SMALLROW_PANEL
#define SMALLROW_PANEL 16
#endif
constexpr int kPanel = SMALLROW_PANEL;

#if !defined(SMALLROW_PORTABLE) && defined(__AVX512F__)
struct Vec {
  using T = __m512;
  static constexpr int W = 16;
  static constexpr int kRegs = 32;
  static constexpr const char* name = "avx512";
  static inline T zero() { return _mm512_setzero_ps(); }
  static inline T load(const float* p) { return _mm512_loadu_ps(p); }
  static inline T bcast(const float* p) { return _mm512_set1_ps(*p); }
  static inline T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static inline void store(float* p, T v) { _mm512_storeu_ps(p, v); }
};
#elif !defined(SMALLROW_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
struct Vec {
  using T = __m256;
  static constexpr int W = 8;
  static constexpr int kRegs = 16;
  static constexpr const char* name = "avx2";
  static inline T zero() { return _mm256_setzero_ps(); }
  static inline T load(const float* p) { return _mm256_loadu_ps(p); }
  static inline T bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static inline T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static inline void store(float* p, T v) { _mm256_storeu_ps(p, v); }
};
#else
// Plain C++ over 8-float groups; the compiler vectorises it for whatever -march allows.
struct Vec {
  struct T {
    float v[8];
  };
  static constexpr int W = 8;
  static constexpr int kRegs = 16;
  static constexpr const char* name = "portable";
  static inline T zero() {
    T r;
    for (int i = 0; i < 8; ++i) r.v[i] = 0.0f;
    return r;
  }
  static inline T load(const float* p) {
    T r;
    std::memcpy(r.v, p, sizeof(r.v));
    return r;
  }
  static inline T bcast(const float* p) {
    T r;
    for (int i = 0; i < 8; ++i) r.v[i] = *p;
    return r;
  }
  static inline T fma(T a, T b, T c) {
    T r;
    for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];
    return r;
  }
  static inline void store(float* p, T v) { std::memcpy(p, v.v, sizeof(v.v)); }
};
#endif

constexpr int kVecs = kPanel / Vec::W; // vectors per panel row
static_assert(kVecs >= 1 && kPanel % Vec::W == 0, "a panel row is whole vectors");
// Rows per register block: AVX2's 16 registers hold 6 x 2 accumulators and the operands.
#ifndef SMALLROW_MAX_BLOCK
#define SMALLROW_MAX_BLOCK (Vec::kRegs >= 32 ? 8 : 6)
#endif
constexpr int kMaxBlock = SMALLROW_MAX_BLOCK;
constexpr int kMaxBlockLimit = 8; // block functions exist for 1..8 rows
static_assert(kMaxBlock >= 1 && kMaxBlock <= kMaxBlockLimit, "row block size");

// Column vectors per pass for an M-row block over G panels at once: the largest divisor of
// kVecs whose G x M x C accumulators plus the live weights or broadcasts (whichever set is
// smaller) and one more register fit the register file. Fewer columns per pass mean more
// passes over a K block (the later ones hit L1).
constexpr int tile_cols(int m, int g = 1) {
  for (int c = kVecs; c > 1; c /= 2) {
    if (g * m * c + (m < g * c ? m : g * c) + 1 <= Vec::kRegs) return c;
  }
  return 1;
}

// Panels read side by side (a group) by a row block of m rows, m = 1..8. One panel is one
// sequential read; a single stream leaves DRAM bandwidth unused and the fewest rows have no
// compute to hide misses behind, so they read several panels at once (that many streams).
// Groups must be powers of two (a block's group divides the largest one).
#ifndef SMALLROW_GROUPS
#if defined(__AVX512F__) && !defined(SMALLROW_PORTABLE)
#define SMALLROW_GROUPS 4, 4, 4, 2, 2, 2, 2, 2
#else
#define SMALLROW_GROUPS 4, 4, 2, 2, 1, 1, 1, 1
#endif
#endif
constexpr int kGroups[kMaxBlockLimit] = {SMALLROW_GROUPS};
constexpr int group_panels(int64_t m) {
  return m >= 1 && m <= kMaxBlock ? kGroups[m - 1] : 1;
}

// Software prefetch distance in panel rows (0: none), for ungrouped row blocks of at least
// kPrefetchMinRows rows. Their compute leaves gaps in the miss stream that the hardware
// prefetcher does not fill, so each pass prefetches its share of the lines of row
// k + kPrefetchRows (further on in the panel, then the next panel, which follows in memory).
// Fewer rows are memory-bound: there the prefetch instructions only compete with the hardware
// prefetcher.
#ifndef SMALLROW_PREFETCH_ROWS
#define SMALLROW_PREFETCH_ROWS 32
#endif
#ifndef SMALLROW_PREFETCH_MIN_ROWS
#define SMALLROW_PREFETCH_MIN_ROWS 3
#endif
constexpr int kPrefetchRows = SMALLROW_PREFETCH_ROWS;
constexpr int kPrefetchMinRows = SMALLROW_PREFETCH_MIN_ROWS;
constexpr int kRowLines = kPanel * 4 / 64; // cache lines per panel row

// Panel rows per K block, for products with a row block whose accumulators need more than one
// pass over the columns of a panel row (large groups): the passes of one K block run back to
// back, so only the first reads the block from memory and the others find it in L1. Between
// K blocks the accumulators go through `out` (exact: the FMA order is unchanged). Products
// whose blocks all take a single pass run each block over all of K at once: the per-block
// accumulator reloads and calls cost more than the L1 reuse saves.
#ifndef SMALLROW_KBLOCK
#define SMALLROW_KBLOCK 32
#endif
constexpr int kBlockRows = SMALLROW_KBLOCK;

// One pass: columns [col, col + C W) of K panel rows, for M rows and G adjacent panels
// (`rows` is the first panel's block, the others follow `pstride` floats apart), accumulating
// into out (zeroed first when `init`). x rows are ldx floats apart, out rows ldo floats apart;
// out points at this pass's first column of the first panel; panel g's columns follow kPanel g
// later.
template <int M, int C, int G>
static inline void panel_pass(
    const float* __restrict x,
    int64_t ldx,
    const float* __restrict rows,
    int64_t pstride,
    int K,
    int col,
    float* __restrict out,
    int64_t ldo,
    bool init,
    int pf_line,
    const float* prefetch_end) {
  using T = typename Vec::T;
  // Lines of each row this pass prefetches: the passes of a block share the row's lines.
  constexpr int kLines = (kRowLines * C) / kVecs > 0 ? (kRowLines * C) / kVecs : 1;
  const bool pf = G == 1 && M >= kPrefetchMinRows && kPrefetchRows > 0 && pf_line < kRowLines;
  T acc[G][M][C];
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c)
        acc[g][m][c] =
            init ? Vec::zero() : Vec::load(out + m * ldo + g * kPanel + c * Vec::W);

  const float* row = rows + col;
  for (int k = 0; k < K; ++k, row += kPanel) {
    if (pf) {
      const char* ahead =
          reinterpret_cast<const char*>(row - col + kPrefetchRows * kPanel) + pf_line * 64;
      if (ahead < reinterpret_cast<const char*>(prefetch_end)) {
#pragma GCC unroll 4
        for (int l = 0; l < kLines; ++l) __builtin_prefetch(ahead + l * 64, 0, 3);
      }
    }
    // Keep whichever of the weights (G C) or the broadcasts (M) is the smaller set live in
    // registers and stream the other.
    if constexpr (G * C <= M) {
      T w[G][C];
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) {
          w[g][c] = Vec::load(row + g * pstride + c * Vec::W);
#if defined(__GNUC__) && !defined(SMALLROW_PORTABLE)
          __asm__("" : "+x"(w[g][c])); // a register, not a reload as each FMA's operand
#endif
        }
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        const T b = Vec::bcast(x + m * ldx + k);
#pragma GCC unroll 16
        for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
          for (int c = 0; c < C; ++c) acc[g][m][c] = Vec::fma(b, w[g][c], acc[g][m][c]);
      }
    } else {
      T b[M];
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) b[m] = Vec::bcast(x + m * ldx + k);
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) {
          T w = Vec::load(row + g * pstride + c * Vec::W);
#if defined(__GNUC__) && !defined(SMALLROW_PORTABLE)
          __asm__("" : "+x"(w));
#endif
#pragma GCC unroll 16
          for (int m = 0; m < M; ++m) acc[g][m][c] = Vec::fma(b[m], w, acc[g][m][c]);
        }
    }
  }
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c)
        Vec::store(out + m * ldo + g * kPanel + c * Vec::W, acc[g][m][c]);
}

// All columns of a K block of G adjacent panels for an M-row block, accumulating into out
// (M rows, ldo apart, kPanel G wide; zeroed first when `init`). Only the first row block of
// a chunk prefetches (`pf`).
template <int M, int G, int C = tile_cols(M, G)>
static void block_pass(
    const float* x,
    int64_t ldx,
    const float* rows,
    int64_t pstride,
    int K,
    float* out,
    int64_t ldo,
    bool init,
    bool pf,
    const float* prefetch_end) {
  static_assert(kVecs % C == 0, "tile must divide the panel");
  constexpr int kLines = (kRowLines * C) / kVecs > 0 ? (kRowLines * C) / kVecs : 1;
  for (int t = 0; t < kVecs / C; ++t) {
    const int col = t * C * Vec::W;
    panel_pass<M, C, G>(
        x, ldx, rows, pstride, K, col, out + col, ldo, init, pf ? t * kLines : kRowLines,
        prefetch_end);
  }
}

// Passes over a panel row's columns for an m-row block over g panels.
constexpr int passes(int m, int g) {
  return kVecs / tile_cols(m, g);
}

using BlockFn = void (*)(
    const float*, int64_t, const float*, int64_t, int, float*, int64_t, bool, bool, const float*);

// The block function for m rows over group_panels(m) panels (`grouped`) or over one.
template <int M>
constexpr BlockFn block_fn_m(bool grouped) {
  return grouped ? &block_pass<M, group_panels(M)> : &block_pass<M, 1>;
}

inline BlockFn block_fn(int m, bool grouped) {
  switch (m) {
    case 1: return block_fn_m<1>(grouped);
    case 2: return block_fn_m<2>(grouped);
    case 3: return block_fn_m<3>(grouped);
    case 4: return block_fn_m<4>(grouped);
    case 5: return block_fn_m<5>(grouped);
    case 6: return block_fn_m<6>(grouped);
    case 7: return block_fn_m<7>(grouped);
    default: return block_fn_m<8>(grouped);
  }
}

// Rows of M split into register blocks: as even as possible, at most kMaxBlock each
// (9 rows run as 5 + 4, not 8 + 1).
inline int block_size(int64_t M, int64_t done) {
  const int64_t left = M - done;
  const int64_t blocks = (left + kMaxBlock - 1) / kMaxBlock;
  return static_cast<int>((left + blocks - 1) / blocks);
}

// y[M][n] (rows ldy apart) = x[M][K] (rows ldx apart, unit stride) @ panels [NB][K][kPanel],
// for panels [p0, p1). Panels go in groups of the largest group any row block wants; each K
// block of a group (kBlockRows rows of each panel) is read from memory once and then serves
// every row block (over sub-groups of its own size) and column tile from L1.
inline void panel_matmul(
    const float* x,
    int64_t ldx,
    int64_t M,
    const float* panels,
    int K,
    int64_t n,
    float* y,
    int64_t ldy,
    int64_t p0,
    int64_t p1) {
  const int64_t panel_size = static_cast<int64_t>(K) * kPanel;
  const float* pf_end = panels + p1 * panel_size;
  const int64_t full_end = std::min(p1, n / kPanel); // panels [p0, full_end) are full width
  // Rows go in chunks of kChunk (the staging buffer's height), each split into row blocks;
  // a panel group serves every chunk while it is in L2.
#ifndef SMALLROW_CHUNK
#define SMALLROW_CHUNK 48
#endif
  constexpr int kChunk = SMALLROW_CHUNK;
  alignas(64) float stage[kChunk * kPanel];
  int group = 1;
  bool multipass = false;
  for (int64_t r0 = 0; r0 < M; r0 += kChunk) {
    const int64_t rows = std::min<int64_t>(kChunk, M - r0);
    for (int64_t r = 0; r < rows; r += block_size(rows, r)) {
      const int mb = block_size(rows, r);
      group = std::max(group, group_panels(mb));
      multipass = multipass || passes(mb, group_panels(mb)) > 1 || passes(mb, 1) > 1;
    }
  }
  const int kb = multipass ? kBlockRows : K;
  for (int64_t p = p0; p < p1;) {
    // A group of full panels writes y directly; a lone panel (the tail of the range, or the
    // partial last panel, which accumulates in `stage`) takes one at a time.
    const int g = p + group <= full_end ? group : 1;
    const float* panel = panels + p * panel_size;
    const int64_t col0 = p * kPanel;
    const int width = static_cast<int>(std::min<int64_t>(kPanel, n - col0));
    for (int64_t r0 = 0; r0 < M; r0 += kChunk) {
      const int64_t rows = std::min<int64_t>(kChunk, M - r0);
      float* out = width == kPanel ? y + r0 * ldy + col0 : stage;
      const int64_t ldo = width == kPanel ? ldy : kPanel;
      for (int k0 = 0; k0 < K; k0 += kb) {
        const int kn = std::min(kb, K - k0);
        const float* blk = panel + static_cast<int64_t>(k0) * kPanel;
        for (int64_t r = 0; r < rows;) {
          const int mb = block_size(rows, r);
          const int gb = g > 1 ? group_panels(mb) : 1; // divides g (powers of two)
          const BlockFn fn = block_fn(mb, gb > 1);
          for (int sub = 0; sub < g; sub += gb)
            fn(x + (r0 + r) * ldx + k0, ldx, blk + sub * panel_size, panel_size, kn,
               out + r * ldo + sub * kPanel, ldo, k0 == 0, r == 0, pf_end);
          r += mb;
        }
      }
      if (width != kPanel) {
        for (int64_t i = 0; i < rows; ++i)
          std::memcpy(y + (r0 + i) * ldy + col0, stage + i * kPanel, width * sizeof(float));
      }
    }
    p += g;
  }
}

} // namespace smallrow
