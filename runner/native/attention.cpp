// The FlashAttention primitive: graph construction, checks, and the CPU evaluation that runs
// flash.h's blocks on the stream's thread and its helpers through MLX's CPU command encoder.

#include "attention.h"

#include <atomic>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "flash.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mtp_native {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[flash_attention] " + what);
}

std::string dims(const mx::array& a) {
  std::ostringstream out;
  out << "[";
  for (int i = 0; i < a.ndim(); ++i) out << (i ? ", " : "") << a.shape(i);
  out << "]";
  return out.str();
}

} // namespace

const char* attention_isa() {
  return flash::isa();
}

mx::array flash_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    bool causal,
    int threads,
    mx::StreamOrDevice s) {
  if (q.dtype() != mx::float32 || k.dtype() != mx::float32 || v.dtype() != mx::float32)
    fail("q, k and v must be float32");
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4)
    fail("q must be [B, H, L, D] and k, v [B, G, T, D]");
  if (k.shape() != v.shape() || k.shape(0) != q.shape(0) || k.shape(3) != q.shape(3) ||
      k.shape(1) < 1 || q.shape(1) % k.shape(1) != 0)
    fail("q " + dims(q) + ", k " + dims(k) + " and v " + dims(v) + " do not match");
  if (k.shape(2) < 1) fail("no keys");
  if (causal && q.shape(2) > k.shape(2))
    fail("causal attention needs at least as many keys as queries (" + dims(q) + ", " +
         dims(k) + ")");
  if (threads < 1) fail("threads must be >= 1");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) fail("runs on a CPU stream only");
  return mx::array(
      q.shape(),
      mx::float32,
      std::make_shared<FlashAttention>(stream, scale, causal, threads),
      {q, k, v});
}

mx::array flash_attention_quantized(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    bool causal,
    int bits,
    int group,
    int threads,
    mx::StreamOrDevice s) {
  if (q.dtype() != mx::float32 || k.dtype() != mx::uint32 || v.dtype() != mx::uint32)
    fail("q must be float32, k and v packed uint32 rows");
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4)
    fail("q must be [B, H, L, D] and k, v [B, G, T, W]");
  if (bits != 4 && bits != 8) fail("bits must be 4 or 8");
  if (group != 32 && group != 64 && group != 128) fail("group must be 32, 64 or 128");
  const int D = q.shape(3);
  if (D % group) fail("the head dimension must be a multiple of the group");
  if (k.shape() != v.shape() || k.shape(0) != q.shape(0) ||
      k.shape(3) != D * bits / 32 + 2 * (D / group) || k.shape(1) < 1 ||
      q.shape(1) % k.shape(1) != 0)
    fail("q " + dims(q) + ", k " + dims(k) + " and v " + dims(v) + " do not match");
  if (k.shape(2) < 1) fail("no keys");
  if (causal && q.shape(2) > k.shape(2)) fail("causal attention needs at least L keys");
  if (threads < 1) fail("threads must be >= 1");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) fail("runs on a CPU stream only");
  return mx::array(
      q.shape(),
      mx::float32,
      std::make_shared<FlashAttention>(stream, scale, causal, threads, bits, group),
      {q, k, v});
}

void FlashAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  out.set_data(mx::allocator::malloc(out.nbytes()));

  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(q);
  encoder.set_input_array(k);
  encoder.set_input_array(v);
  encoder.set_output_array(out);
  encoder.dispatch([q_ptr = q.data<float>(),
                    q_shape = q.shape(),
                    q_strides = q.strides(),
                    // Packed uint32 rows (bits_ != 0) pass as 4-byte words: only their
                    // addresses are taken here, flash.h reads them as bytes.
                    k_ptr = reinterpret_cast<const float*>(k.data<uint32_t>()),
                    k_shape = k.shape(),
                    k_strides = k.strides(),
                    v_ptr = reinterpret_cast<const float*>(v.data<uint32_t>()),
                    v_strides = v.strides(),
                    y = out.data<float>(),
                    scale = scale_,
                    causal = causal_,
                    threads = threads_,
                    bits = bits_,
                    group = group_]() {
    const int B = q_shape[0], H = q_shape[1], L = q_shape[2], D = q_shape[3];
    const int G = k_shape[1], T = k_shape[2];
    if (int64_t(B) * H * L * D == 0) return;
    std::vector<float> qb, kb, vb;
    const Rows4 qv = rows4(q_ptr, q_shape, q_strides, qb);
    const Rows4 kv = rows4(k_ptr, k_shape, k_strides, kb);
    const Rows4 vv = rows4(v_ptr, k_shape, v_strides, vb);
    const flash::Problem p{
        qv.data, qv.s0, qv.s1, qv.s2, kv.data, kv.s0, kv.s1, kv.s2, vv.data, vv.s0, vv.s1,
        vv.s2, y, B, H, G, L, T, D, scale, causal, bits, group};
    // Blocks are taken in turn from a shared counter, the last query blocks (the most keys
    // under a causal mask) first, so the threads finish together.
    const int blocks = (L + flash::kRows - 1) / flash::kRows;
    const int64_t tasks = int64_t(B) * H * blocks;
    std::atomic<int64_t> next{0};
    auto work = [&](int64_t) {
      flash::Scratch scratch(D, bits != 0);
      for (int64_t t = next++; t < tasks; t = next++) {
        const int blk = blocks - 1 - static_cast<int>(t / (int64_t(B) * H));
        const int64_t bh = t % (int64_t(B) * H);
        flash::block(p, static_cast<int>(bh / H), static_cast<int>(bh % H), blk * flash::kRows,
                     scratch);
      }
    };
    run_parts(std::min<int64_t>(threads, tasks), work);
  });
}

bool FlashAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const FlashAttention&>(other);
  return scale_ == o.scale_ && causal_ == o.causal_ && threads_ == o.threads_ &&
      bits_ == o.bits_ && group_ == o.group_;
}

std::vector<mx::Shape> FlashAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

} // namespace mtp_native
