// The sampler's row selections as MLX primitives.
//
// TopKIds: a row's k largest rank keys kept in a min-heap while the row is read once. A value
// enters only when it beats the heap's smallest key, which after the first few hundred values
// of a row of logits is rare; a contiguous row is scanned a vector at a time for the next value
// that can enter (one integer compare per lane), so the pass runs at the speed the row is
// read (argpartition moves every value of the row; a row sorted ascending is this pass's worst
// case, a heap update per value).
//
// ArgmaxIds: a row's first maximum (its first NaN if it has one), mx.argmax's answer, from two
// vector passes (the maximum, then where it first occurs) instead of a compare chain per value.
//
// PenaliseRows: the sampler's penalties as one copy of each row with its window's distinct
// tokens rewritten (the MLX ops build a count row and a padded copy of every row and scatter
// into it: several passes over the vocabulary per row). Scalar float32 arithmetic in the MLX
// path's order, so every build gives its bits.

#include "sampling.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#if !defined(SMALLROW_PORTABLE) && (defined(__AVX512F__) || defined(__AVX2__))
#include <immintrin.h>
#endif

namespace mtp_native {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[top_k_ids] " + what);
}

// The float's bits (after + 0.0, so -0.0 ranks as 0.0) made order-preserving as an int32: the
// high half of the rank key.
inline int32_t ordered_bits(float v) {
  const float f = v + 0.0f;
  int32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits < 0 ? bits ^ 0x7FFFFFFF : bits;
}

// runner.sampler._rank_key: the ordered bits above the id counted down, so equal values rank
// lower id first.
inline int64_t rank_key(float v, int64_t id) {
  return static_cast<int64_t>(ordered_bits(v)) * (int64_t{1} << 32) + ((int64_t{1} << 32) - 1 - id);
}

// The first i in [start, V) whose ordered bits exceed `floor`, else V. Every id the heap holds
// is below start, so a value whose ordered bits only equal the floor's ranks below it: the
// strict compare of the high halves decides exactly what the full keys would.
int64_t next_above(const float* row, int64_t stride, int64_t start, int64_t V, int32_t floor) {
  int64_t i = start;
#if !defined(SMALLROW_PORTABLE) && defined(__AVX512F__)
  if (stride == 1) {
    const __m512i limit = _mm512_set1_epi32(floor);
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512 zero = _mm512_setzero_ps();
    for (; i + 16 <= V; i += 16) {
      const __m512i bits = _mm512_castps_si512(_mm512_add_ps(_mm512_loadu_ps(row + i), zero));
      const __m512i ordered =
          _mm512_xor_si512(bits, _mm512_and_si512(_mm512_srai_epi32(bits, 31), magnitude));
      const __mmask16 above = _mm512_cmpgt_epi32_mask(ordered, limit);
      if (above) return i + __builtin_ctz(above);
    }
  }
#elif !defined(SMALLROW_PORTABLE) && defined(__AVX2__)
  if (stride == 1) {
    const __m256i limit = _mm256_set1_epi32(floor);
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256 zero = _mm256_setzero_ps();
    for (; i + 8 <= V; i += 8) {
      const __m256i bits = _mm256_castps_si256(_mm256_add_ps(_mm256_loadu_ps(row + i), zero));
      const __m256i ordered =
          _mm256_xor_si256(bits, _mm256_and_si256(_mm256_srai_epi32(bits, 31), magnitude));
      const int above = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(ordered, limit)));
      if (above) return i + __builtin_ctz(above);
    }
  }
#endif
  for (; i < V; ++i)
    if (ordered_bits(row[i * stride]) > floor) return i;
  return V;
}

void top_k_row(const float* row, int64_t stride, int64_t V, int k, uint32_t* out) {
  std::vector<int64_t> heap(k);
  for (int i = 0; i < k; ++i) heap[i] = rank_key(row[i * stride], i);
  std::make_heap(heap.begin(), heap.end(), std::greater<int64_t>());
  for (int64_t i = next_above(row, stride, k, V, static_cast<int32_t>(heap.front() >> 32)); i < V;
       i = next_above(row, stride, i + 1, V, static_cast<int32_t>(heap.front() >> 32))) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<int64_t>());
    heap.back() = rank_key(row[i * stride], i);
    std::push_heap(heap.begin(), heap.end(), std::greater<int64_t>());
  }
  for (int i = 0; i < k; ++i)
    out[i] = static_cast<uint32_t>((int64_t{1} << 32) - 1 - (heap[i] & 0xFFFFFFFFll));
  std::sort(out, out + k);
}

// The first j in [0, V) where row[j] is NaN (`nan`) or equals `value`, else V.
int64_t first_match(const float* row, int64_t stride, int64_t V, bool nan, float value) {
  int64_t j = 0;
#if !defined(SMALLROW_PORTABLE) && defined(__AVX512F__)
  if (stride == 1) {
    const __m512 target = _mm512_set1_ps(value);
    for (; j + 16 <= V; j += 16) {
      const __m512 v = _mm512_loadu_ps(row + j);
      const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
      if (hit) return j + __builtin_ctz(hit);
    }
  }
#elif !defined(SMALLROW_PORTABLE) && defined(__AVX2__)
  if (stride == 1) {
    const __m256 target = _mm256_set1_ps(value);
    for (; j + 8 <= V; j += 8) {
      const __m256 v = _mm256_loadu_ps(row + j);
      const int hit = _mm256_movemask_ps(
          nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
      if (hit) return j + __builtin_ctz(hit);
    }
  }
#endif
  for (; j < V; ++j) {
    const float v = row[j * stride];
    if (nan ? std::isnan(v) : v == value) return j;
  }
  return V;
}

// mx.argmax over a row: the first NaN when there is one (a NaN wins every compare), else the
// first value equal to the maximum (-0.0 equals 0.0, so the first zero of either sign). The
// maximum is taken in four independent vector chains, so the pass is not bound by the
// latency of one compare after another.
int32_t argmax_row(const float* row, int64_t stride, int64_t V) {
  int64_t i = 0;
  float best = row[0];
  bool nan = false;
#if !defined(SMALLROW_PORTABLE) && defined(__AVX512F__)
  if (stride == 1 && V >= 64) {
    __m512 m[4];
    __mmask16 unordered = 0;
    for (int c = 0; c < 4; ++c) {
      m[c] = _mm512_loadu_ps(row + 16 * c);
      unordered |= _mm512_cmp_ps_mask(m[c], m[c], _CMP_UNORD_Q);
    }
    for (i = 64; i + 64 <= V; i += 64)
      for (int c = 0; c < 4; ++c) {
        const __m512 v = _mm512_loadu_ps(row + i + 16 * c);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m[c] = _mm512_max_ps(m[c], v);
      }
    nan = unordered != 0;
    best = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
  }
#elif !defined(SMALLROW_PORTABLE) && defined(__AVX2__)
  if (stride == 1 && V >= 32) {
    __m256 m[4];
    __m256 unordered = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      m[c] = _mm256_loadu_ps(row + 8 * c);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(m[c], m[c], _CMP_UNORD_Q));
    }
    for (i = 32; i + 32 <= V; i += 32)
      for (int c = 0; c < 4; ++c) {
        const __m256 v = _mm256_loadu_ps(row + i + 8 * c);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m[c] = _mm256_max_ps(m[c], v);
      }
    nan = _mm256_movemask_ps(unordered) != 0;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
    best = lanes[0];
    for (int l = 1; l < 8; ++l) best = std::max(best, lanes[l]);
  }
#endif
  for (; i < V; ++i) {
    const float v = row[i * stride];
    nan |= std::isnan(v);
    best = std::max(best, v);
  }
  const int64_t j = first_match(row, stride, V, nan, best);
  return static_cast<int32_t>(j < V ? j : 0);
}

// The checks every row operation makes of its float32 [R, V] logits; the CPU stream it runs on.
mx::Stream rows_stream(const mx::array& logits, mx::StreamOrDevice s, const std::string& op) {
  if (logits.dtype() != mx::float32) throw std::invalid_argument("[" + op + "] logits must be float32");
  if (logits.ndim() != 2) throw std::invalid_argument("[" + op + "] logits must have shape [R, V]");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) throw std::invalid_argument("[" + op + "] runs on a CPU stream only");
  return stream;
}

// Allocates `out` and runs per_row(row, column stride, V, r, out) for every row r of `x` on
// the stream (the other inputs, when there are any, registered by the caller's `inputs`).
template <typename PerRow>
void for_each_row(
    const mx::Stream& stream,
    const std::vector<mx::array>& inputs,
    mx::array& out,
    PerRow per_row) {
  const auto& x = inputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& input : inputs) encoder.set_input_array(input);
  encoder.set_output_array(out);
  encoder.dispatch([src = x.data<float>(),
                    rows = static_cast<int64_t>(x.shape(0)),
                    V = static_cast<int64_t>(x.shape(1)),
                    row_stride = static_cast<int64_t>(x.strides()[0]),
                    col_stride = static_cast<int64_t>(x.strides()[1]),
                    out_data = out.data<void>(),
                    per_row]() {
    for (int64_t r = 0; r < rows; ++r) per_row(src + r * row_stride, col_stride, V, r, out_data);
  });
}

} // namespace

mx::array top_k_ids(const mx::array& logits, int k, mx::StreamOrDevice s) {
  auto stream = rows_stream(logits, s, "top_k_ids");
  const int64_t V = logits.shape(1);
  if (k < 1 || k >= V)
    fail("k = " + std::to_string(k) + " must be in [1, V) for V = " + std::to_string(V));
  return mx::array(
      mx::Shape{logits.shape(0), k}, mx::uint32, std::make_shared<TopKIds>(stream, k), {logits});
}

void TopKIds::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  for_each_row(stream(), inputs, out, [k = k_](const float* row, int64_t stride, int64_t V, int64_t r, void* dst) {
    top_k_row(row, stride, V, k, static_cast<uint32_t*>(dst) + r * k);
  });
}

mx::array argmax_ids(const mx::array& logits, mx::StreamOrDevice s) {
  auto stream = rows_stream(logits, s, "argmax_ids");
  if (logits.shape(1) < 1) throw std::invalid_argument("[argmax_ids] logits must have shape [R, V], V >= 1");
  return mx::array(
      mx::Shape{logits.shape(0)}, mx::int32, std::make_shared<ArgmaxIds>(stream), {logits});
}

void ArgmaxIds::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  for_each_row(stream(), inputs, out, [](const float* row, int64_t stride, int64_t V, int64_t r, void* dst) {
    static_cast<int32_t*>(dst)[r] = argmax_row(row, stride, V);
  });
}

std::vector<mx::Shape> ArgmaxIds::output_shapes(const std::vector<mx::array>& inputs) {
  return {mx::Shape{inputs[0].shape(0)}};
}

mx::array penalise_rows(
    const mx::array& logits,
    const mx::array& windows,
    float repeat,
    float presence,
    float frequency,
    mx::StreamOrDevice s) {
  auto stream = rows_stream(logits, s, "penalise_rows");
  if (windows.dtype() != mx::int32 || windows.ndim() != 2)
    throw std::invalid_argument("[penalise_rows] windows must be int32 [R, W] or [1, W]");
  if (windows.shape(0) != logits.shape(0) && windows.shape(0) != 1)
    throw std::invalid_argument(
        "[penalise_rows] " + std::to_string(windows.shape(0)) + " windows for " +
        std::to_string(logits.shape(0)) + " rows");
  return mx::array(
      logits.shape(),
      mx::float32,
      std::make_shared<PenaliseRows>(stream, repeat, presence, frequency),
      {logits, windows});
}

void PenaliseRows::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& w = inputs[1];
  for_each_row(
      stream(),
      inputs,
      out,
      [ids = w.data<int32_t>(),
       window_rows = static_cast<int64_t>(w.shape(0)),
       W = static_cast<int64_t>(w.shape(1)),
       window_stride = static_cast<int64_t>(w.strides()[0]),
       id_stride = static_cast<int64_t>(w.strides()[1]),
       repeat = repeat_,
       presence = presence_,
       frequency = frequency_](const float* row, int64_t stride, int64_t V, int64_t r, void* dst) {
        float* target = static_cast<float*>(dst) + r * V;
        if (stride == 1)
          std::memcpy(target, row, static_cast<size_t>(V) * sizeof(float));
        else
          for (int64_t i = 0; i < V; ++i) target[i] = row[i * stride];
        const int32_t* window = ids + (window_rows == 1 ? 0 : r) * window_stride;
        std::vector<int32_t> tokens;
        tokens.reserve(static_cast<size_t>(W));
        for (int64_t j = 0; j < W; ++j) {
          const int32_t t = window[j * id_stride];
          if (t >= 0 && t < V) tokens.push_back(t);
        }
        std::sort(tokens.begin(), tokens.end());
        for (size_t j = 0; j < tokens.size();) {  // each distinct token once, with its count
          size_t end = j + 1;
          while (end < tokens.size() && tokens[end] == tokens[j]) ++end;
          const int32_t t = tokens[j];
          const float old = target[t];
          float v = old;
          if (repeat != 1.0f) v = old > 0.0f ? old / repeat : old * repeat;
          if (presence != 0.0f) v = v - presence;
          if (frequency != 0.0f) v = v - frequency * static_cast<float>(end - j);
          target[t] = v;
          j = end;
        }
      });
}

bool PenaliseRows::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PenaliseRows&>(other);
  return repeat_ == o.repeat_ && presence_ == o.presence_ && frequency_ == o.frequency_;
}

std::vector<mx::Shape> PenaliseRows::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

bool TopKIds::is_equivalent(const mx::Primitive& other) const {
  return k_ == static_cast<const TopKIds&>(other).k_;
}

std::vector<mx::Shape> TopKIds::output_shapes(const std::vector<mx::array>& inputs) {
  return {mx::Shape{inputs[0].shape(0), k_}};
}

} // namespace mtp_native
