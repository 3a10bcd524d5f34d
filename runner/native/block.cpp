// The BlockFront and BlockBack primitives (block.h): graph construction with shape checks, and
// the CPU evaluation, every step of a row in one task on the stream's thread (the products
// split over spec.threads).

#include "block.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "flash.h"
#include "kernels.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "quantized.h"

namespace mtp_native {

namespace {

[[noreturn]] void fail(const char* op, const std::string& what) {
  throw std::invalid_argument(std::string("[") + op + "] " + what);
}

// One product's weight: quantized panels (q) or float32 panels (f), K inputs, n outputs.
struct Weight {
  const uint8_t* q = nullptr;
  qpanels::Shape qs{};
  const float* f = nullptr;
  int64_t K = 0, n = 0, NB = 0;
};

// The weight of `panels` with `n` outputs (every panel full), its pointers unset.
Weight describe(const mx::array& panels, int64_t n, const char* op, const char* what) {
  Weight w;
  const int64_t NB = panels.ndim() > 0 ? panels.shape(0) : 0;
  if (NB * qpanels::kPanel != n) {
    std::ostringstream msg;
    msg << what << " has " << NB << " panels of " << qpanels::kPanel << " columns, not the "
        << n << " outputs the block needs";
    fail(op, msg.str());
  }
  w.n = n;
  w.NB = NB;
  if (panels.dtype() == mx::uint8 && panels.ndim() == 4) {
    w.qs = qpanel_layout(panels, static_cast<int>(n));
    w.K = w.qs.K;
  } else if (panels.dtype() == mx::float32 && panels.ndim() == 3 &&
             panels.shape(2) == smallrow::kPanel) {
    w.K = panels.shape(1);
  } else {
    fail(op, std::string(what) + " must be quantized (uint8 4-D) or float32 [NB, K, 16] panels");
  }
  return w;
}

Weight bind(Weight w, const mx::array& panels, const char* op) {
  if (!panels.flags().row_contiguous) fail(op, "weights must be row-contiguous");
  if (panels.dtype() == mx::uint8)
    w.q = panels.data<uint8_t>();
  else
    w.f = panels.data<float>();
  return w;
}

// y[M, n] = x[M, K] @ W (rows dense), the panels split over `threads`.
void product(
    const float* x,
    int64_t M,
    const Weight& w,
    float* y,
    bool exact,
    int threads,
    qpanels::QuantRows& rows) {
  if (w.f != nullptr) {
    run_panel_ranges(threads, w.NB, [&](int64_t p0, int64_t p1) {
      smallrow::panel_matmul(x, w.K, M, w.f, static_cast<int>(w.K), w.n, y, w.n, p0, p1);
    });
  } else if (exact || qpanels::fast_as_exact(M)) {
    run_panel_ranges(threads, w.NB, [&](int64_t p0, int64_t p1) {
      qpanels::matmul_exact(x, w.K, M, w.q, w.qs, y, w.n, p0, p1);
    });
  } else {
    qpanels::quantize_rows(x, w.K, M, w.qs, rows);
    run_panel_ranges(threads, w.NB, [&](int64_t p0, int64_t p1) {
      qpanels::matmul_fast(rows, M, w.q, w.qs, y, w.n, p0, p1);
    });
  }
}

// out = x * (1 / sqrt(mean(x^2) + eps)) * w over one row of n (the sum of squares in double:
// one fixed order per row).
void rms_norm(const float* x, const float* w, int64_t n, float eps, float* out) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * inv) * w[i];
}

// x (one head, D features) rotated in place: x cos + rot(x) sin, rot turning each pair of
// the first `rotary` features (the two halves, or adjacent ones) by a quarter turn.
void rotate(float* x, const float* cos, const float* sin, int D, int rotary, bool traditional) {
  float r[512];
  for (int j = 0; j < D; ++j) r[j] = 0.0f;
  if (traditional) {
    for (int j = 0; j + 1 < rotary; j += 2) {
      r[j] = -x[j + 1];
      r[j + 1] = x[j];
    }
  } else {
    const int half = rotary / 2;
    for (int j = 0; j < half; ++j) {
      r[j] = -x[j + half];
      r[j + half] = x[j];
    }
  }
  for (int j = 0; j < D; ++j) x[j] = x[j] * cos[j] + r[j] * sin[j];
}

// silu(g) * u through 2**(-|g| log2 e) (flash.h's exponential: never overflows).
void silu_mul(const float* g, const float* u, int64_t n, float* out) {
  constexpr float kLog2e = 1.4426950408889634f;
  for (int64_t i = 0; i < n; ++i) {
    const float e = flash::exp2_nonpositive(-std::fabs(g[i]) * kLog2e);
    const float num = g[i] >= 0.0f ? 1.0f : e;
    out[i] = (g[i] * u[i]) * (num / (1.0f + e));
  }
}

// An input read inside the dispatched task (its values exist only then): a pointer, and
// the shape and strides to densify it with when its rows are not contiguous.
struct Operand {
  const float* data;
  bool dense;
  mx::Shape shape;
  mx::Strides strides;
  explicit Operand(const mx::array& a)
      : data(a.data<float>()),
        dense(a.flags().row_contiguous),
        shape(a.shape()),
        strides(a.strides()) {}
  // The rows as dense [M, n], copied into buf when strided.
  const float* rows(std::vector<float>& buf) const {
    if (dense) return data;
    int64_t count = 1;
    for (auto d : shape) count *= d;
    buf.resize(count);
    densify(data, shape, strides, buf.data());
    return buf.data();
  }
};

bool same(const BlockSpec& a, const BlockSpec& b) {
  return a.heads == b.heads && a.kv_heads == b.kv_heads && a.head_dim == b.head_dim &&
      a.rotary == b.rotary && a.traditional == b.traditional && a.eps == b.eps &&
      a.qk_eps == b.qk_eps && a.bias == b.bias && a.qk_norm == b.qk_norm &&
      a.exact == b.exact && a.threads == b.threads;
}

void check_vector(const mx::array& a, int64_t n, const char* op, const char* what) {
  if (a.dtype() != mx::float32 || a.ndim() != 1 || a.shape(0) != n) {
    std::ostringstream msg;
    msg << what << " must be float32 [" << n << "]";
    fail(op, msg.str());
  }
}

void check_spec(const BlockSpec& sp, const char* op) {
  if (sp.heads <= 0 || sp.kv_heads <= 0 || sp.heads % sp.kv_heads)
    fail(op, "heads must be a positive multiple of kv_heads");
  if (sp.head_dim <= 0 || sp.head_dim > 512) fail(op, "head_dim must lie in 1..512");
  if (sp.rotary < 0 || sp.rotary > sp.head_dim || sp.rotary % 2)
    fail(op, "rotary must be an even count <= head_dim");
  if (sp.threads < 1) fail(op, "threads must be >= 1");
}

mx::Stream cpu_stream(mx::StreamOrDevice s, const char* op) {
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) fail(op, "runs on a CPU stream only");
  return stream;
}

} // namespace

std::vector<mx::array> block_front(
    const mx::array& x,
    const mx::array& norm,
    const mx::array& qkv,
    const std::optional<mx::array>& bias,
    const std::optional<mx::array>& q_norm,
    const std::optional<mx::array>& k_norm,
    const mx::array& cos,
    const mx::array& sin,
    const BlockSpec& spec,
    mx::StreamOrDevice s) {
  constexpr const char* op = "block_front";
  check_spec(spec, op);
  if (x.dtype() != mx::float32 || x.ndim() != 3) fail(op, "x must be float32 [B, L, dim]");
  const int B = x.shape(0), L = x.shape(1), dim = x.shape(2);
  const int H = spec.heads, G = spec.kv_heads, D = spec.head_dim;
  check_vector(norm, dim, op, "norm");
  const Weight w = describe(qkv, static_cast<int64_t>(H + 2 * G) * D, op, "qkv");
  if (w.K != dim) fail(op, "qkv's inputs do not match x's width");
  if (spec.bias != bias.has_value()) fail(op, "bias given without spec.bias or missing");
  if (spec.qk_norm != (q_norm.has_value() && k_norm.has_value()))
    fail(op, "q_norm and k_norm go together with spec.qk_norm");
  std::vector<mx::array> inputs = {x, norm, qkv, cos, sin};
  if (bias) {
    check_vector(*bias, static_cast<int64_t>(H + 2 * G) * D, op, "bias");
    inputs.push_back(*bias);
  }
  if (spec.qk_norm) {
    check_vector(*q_norm, D, op, "q_norm");
    check_vector(*k_norm, D, op, "k_norm");
    inputs.push_back(*q_norm);
    inputs.push_back(*k_norm);
  }
  for (const auto* t : {&cos, &sin})
    if (t->dtype() != mx::float32 || t->ndim() != 2 || t->shape(0) != L || t->shape(1) != D)
      fail(op, "cos and sin must be float32 [L, head_dim]");
  auto stream = cpu_stream(s, op);
  return mx::array::make_arrays(
      {{B, H, L, D}, {B, G, L, D}, {B, G, L, D}},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<BlockFront>(stream, spec),
      inputs);
}

void BlockFront::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[BlockFront] has no GPU implementation; use a CPU stream.");
}

bool BlockFront::is_equivalent(const mx::Primitive& other) const {
  return same(static_cast<const BlockFront&>(other).spec_, spec_);
}

void BlockFront::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  constexpr const char* op = "block_front";
  const auto& x = inputs[0];
  const BlockSpec sp = spec_;
  const int H = sp.heads, G = sp.kv_heads, D = sp.head_dim;
  const int64_t B = x.shape(0), L = x.shape(1), dim = x.shape(2), M = B * L;
  const int64_t width = static_cast<int64_t>(H + 2 * G) * D;
  const Weight w = bind(describe(inputs[2], width, op, "qkv"), inputs[2], op);
  for (auto& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  for (auto& a : outputs) encoder.set_output_array(a);
  const int extra = 5;
  const float* bias = sp.bias ? inputs[extra].data<float>() : nullptr;
  const int qk_at = extra + (sp.bias ? 1 : 0);
  const float* qn = sp.qk_norm ? inputs[qk_at].data<float>() : nullptr;
  const float* kn = sp.qk_norm ? inputs[qk_at + 1].data<float>() : nullptr;
  encoder.dispatch([xin = Operand(x),
                    norm = inputs[1].data<float>(),
                    cos_in = Operand(inputs[3]),
                    sin_in = Operand(inputs[4]),
                    bias,
                    qn,
                    kn,
                    w,
                    sp,
                    M,
                    L,
                    dim,
                    width,
                    outq = outputs[0].data<float>(),
                    outk = outputs[1].data<float>(),
                    outv = outputs[2].data<float>()]() {
    std::vector<float> cos_buf, sin_buf;
    const float* cos = cos_in.rows(cos_buf);
    const float* sin = sin_in.rows(sin_buf);
    const int H = sp.heads, G = sp.kv_heads, D = sp.head_dim;
    std::vector<float> x_buf;
    const float* xrows = xin.rows(x_buf);
    std::vector<float> normed(static_cast<size_t>(M) * dim), y(static_cast<size_t>(M) * width);
    for (int64_t m = 0; m < M; ++m)
      rms_norm(xrows + m * dim, norm, dim, sp.eps, normed.data() + m * dim);
    qpanels::QuantRows rows;
    product(normed.data(), M, w, y.data(), sp.exact, sp.threads, rows);
    for (int64_t m = 0; m < M; ++m) {
      const int64_t b = m / L, l = m % L;
      float* yr = y.data() + m * width;
      if (bias != nullptr)
        for (int64_t i = 0; i < width; ++i) yr[i] += bias[i];
      const float* c = cos + l * D;
      const float* s = sin + l * D;
      for (int h = 0; h < H + 2 * G; ++h) {
        float* head = yr + static_cast<int64_t>(h) * D;
        const bool is_q = h < H, is_k = !is_q && h < H + G;
        if (qn != nullptr && (is_q || is_k)) rms_norm(head, is_q ? qn : kn, D, sp.qk_eps, head);
        if (is_q || is_k) rotate(head, c, s, D, sp.rotary, sp.traditional);
        float* dst;
        if (is_q)
          dst = outq + ((b * H + h) * L + l) * D;
        else if (is_k)
          dst = outk + ((b * G + (h - H)) * L + l) * D;
        else
          dst = outv + ((b * G + (h - H - G)) * L + l) * D;
        std::memcpy(dst, head, sizeof(float) * D);
      }
    }
  });
}

mx::array block_back(
    const mx::array& x,
    const mx::array& attended,
    const mx::array& o,
    const mx::array& norm,
    const mx::array& gate_up,
    const mx::array& down,
    const BlockSpec& spec,
    mx::StreamOrDevice s) {
  constexpr const char* op = "block_back";
  check_spec(spec, op);
  if (x.dtype() != mx::float32 || x.ndim() != 3) fail(op, "x must be float32 [B, L, dim]");
  const int B = x.shape(0), L = x.shape(1), dim = x.shape(2);
  const int H = spec.heads, D = spec.head_dim;
  if (attended.dtype() != mx::float32 || attended.shape() != mx::Shape{B, H, L, D})
    fail(op, "attended must be float32 [B, heads, L, head_dim] matching x");
  check_vector(norm, dim, op, "norm");
  if (describe(o, dim, op, "o").K != static_cast<int64_t>(H) * D)
    fail(op, "o's inputs are not heads * head_dim");
  const int64_t both = gate_up.ndim() > 0 ? gate_up.shape(0) * qpanels::kPanel : 0;
  if (both % 2) fail(op, "gate_up must hold an even number of outputs");
  if (describe(gate_up, both, op, "gate_up").K != dim) fail(op, "gate_up's inputs are not dim");
  if (describe(down, dim, op, "down").K != both / 2)
    fail(op, "down's inputs are not gate_up's outputs / 2");
  auto stream = cpu_stream(s, op);
  return mx::array(
      x.shape(),
      mx::float32,
      std::make_shared<BlockBack>(stream, spec),
      {x, attended, o, norm, gate_up, down});
}

void BlockBack::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  constexpr const char* op = "block_back";
  const auto& x = inputs[0];
  const auto& att = inputs[1];
  const BlockSpec sp = spec_;
  const int64_t B = x.shape(0), L = x.shape(1), dim = x.shape(2), M = B * L;
  const int H = sp.heads, D = sp.head_dim;
  const int64_t both = inputs[4].shape(0) * qpanels::kPanel, F = both / 2;
  const Weight wo = bind(describe(inputs[2], dim, op, "o"), inputs[2], op);
  const Weight wgu = bind(describe(inputs[4], both, op, "gate_up"), inputs[4], op);
  const Weight wd = bind(describe(inputs[5], dim, op, "down"), inputs[5], op);
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([xin = Operand(x),
                    att_ptr = att.data<float>(),
                    att_strides = att.strides(),
                    norm = inputs[3].data<float>(),
                    wo,
                    wgu,
                    wd,
                    sp,
                    B,
                    L,
                    dim,
                    F,
                    H,
                    D,
                    M,
                    y = out.data<float>()]() {
    std::vector<float> x_buf;
    const float* xrows = xin.rows(x_buf);
    const int64_t HD = static_cast<int64_t>(H) * D;
    // The attended heads of each row side by side: [M, H D].
    std::vector<float> a(static_cast<size_t>(M) * HD);
    for (int64_t b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int64_t l = 0; l < L; ++l) {
          const float* src = att_ptr + b * att_strides[0] + h * att_strides[1] + l * att_strides[2];
          float* dst = a.data() + (b * L + l) * HD + static_cast<int64_t>(h) * D;
          if (att_strides[3] == 1) {
            std::memcpy(dst, src, sizeof(float) * D);
          } else {
            for (int j = 0; j < D; ++j) dst[j] = src[j * att_strides[3]];
          }
        }
    qpanels::QuantRows rows;
    std::vector<float> h(static_cast<size_t>(M) * dim), normed(h.size());
    product(a.data(), M, wo, h.data(), sp.exact, sp.threads, rows);
    for (int64_t i = 0; i < M * dim; ++i) h[i] = xrows[i] + h[i];
    for (int64_t m = 0; m < M; ++m)
      rms_norm(h.data() + m * dim, norm, dim, sp.eps, normed.data() + m * dim);
    std::vector<float> gu(static_cast<size_t>(M) * 2 * F), act(static_cast<size_t>(M) * F);
    product(normed.data(), M, wgu, gu.data(), sp.exact, sp.threads, rows);
    for (int64_t m = 0; m < M; ++m) {
      const float* g = gu.data() + m * 2 * F;
      silu_mul(g, g + F, F, act.data() + m * F);
    }
    product(act.data(), M, wd, y, sp.exact, sp.threads, rows);
    for (int64_t i = 0; i < M * dim; ++i) y[i] = h[i] + y[i];
  });
}

bool BlockBack::is_equivalent(const mx::Primitive& other) const {
  return same(static_cast<const BlockBack&>(other).spec_, spec_);
}

std::vector<mx::Shape> BlockBack::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

} // namespace mtp_native
