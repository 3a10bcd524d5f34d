// The TopKIds primitive: a row's k largest rank keys kept in a min-heap while the row is read
// once. A value enters only when it beats the heap's smallest key, which after the first few
// hundred values of a row of logits is rare, so the pass costs about a compare per value
// (argpartition moves every value of the row; a row sorted ascending is this pass's worst
// case, a heap update per value).

#include "topk.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mtp_native {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[top_k_ids] " + what);
}

// runner.sampler._rank_key: the float's bits (after + 0.0, so -0.0 ranks as 0.0) made
// order-preserving as an int32, above the id counted down, so equal values rank lower id first.
inline int64_t rank_key(float v, int64_t id) {
  const float f = v + 0.0f;
  int32_t bits;
  std::memcpy(&bits, &f, 4);
  const int32_t ordered = bits < 0 ? bits ^ 0x7FFFFFFF : bits;
  return static_cast<int64_t>(ordered) * (int64_t{1} << 32) + ((int64_t{1} << 32) - 1 - id);
}

void top_k_row(const float* row, int64_t stride, int64_t V, int k, uint32_t* out) {
  std::vector<int64_t> heap(k);
  for (int i = 0; i < k; ++i) heap[i] = rank_key(row[i * stride], i);
  std::make_heap(heap.begin(), heap.end(), std::greater<int64_t>());
  int64_t floor = heap.front();
  for (int64_t i = k; i < V; ++i) {
    const int64_t key = rank_key(row[i * stride], i);
    if (key <= floor) continue;
    std::pop_heap(heap.begin(), heap.end(), std::greater<int64_t>());
    heap.back() = key;
    std::push_heap(heap.begin(), heap.end(), std::greater<int64_t>());
    floor = heap.front();
  }
  for (int i = 0; i < k; ++i)
    out[i] = static_cast<uint32_t>((int64_t{1} << 32) - 1 - (heap[i] & 0xFFFFFFFFll));
  std::sort(out, out + k);
}

} // namespace

mx::array top_k_ids(const mx::array& logits, int k, mx::StreamOrDevice s) {
  if (logits.dtype() != mx::float32) fail("logits must be float32");
  if (logits.ndim() != 2) fail("logits must have shape [R, V]");
  const int64_t V = logits.shape(1);
  if (k < 1 || k >= V)
    fail("k = " + std::to_string(k) + " must be in [1, V) for V = " + std::to_string(V));
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) fail("runs on a CPU stream only");
  return mx::array(
      mx::Shape{logits.shape(0), k}, mx::uint32, std::make_shared<TopKIds>(stream, k), {logits});
}

void TopKIds::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_output_array(out);
  encoder.dispatch([src = x.data<float>(),
                    rows = static_cast<int64_t>(x.shape(0)),
                    V = static_cast<int64_t>(x.shape(1)),
                    row_stride = static_cast<int64_t>(x.strides()[0]),
                    col_stride = static_cast<int64_t>(x.strides()[1]),
                    dst = out.data<uint32_t>(),
                    k = k_]() {
    for (int64_t r = 0; r < rows; ++r)
      top_k_row(src + r * row_stride, col_stride, V, k, dst + r * k);
  });
}

bool TopKIds::is_equivalent(const mx::Primitive& other) const {
  return k_ == static_cast<const TopKIds&>(other).k_;
}

std::vector<mx::Shape> TopKIds::output_shapes(const std::vector<mx::array>& inputs) {
  return {mx::Shape{inputs[0].shape(0), k_}};
}

} // namespace mtp_native
