// The GatherPanelMatmul primitive: graph construction, checks, and the CPU evaluation that
// groups (row, expert) pairs by expert and runs kernels.h's panel product once per selected
// expert, on the stream's thread through MLX's CPU command encoder.

#include "gathered.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"
#include "mlx/allocator.h"
#include "quantized.h"
#include "mlx/backend/cpu/encoder.h"

namespace mtp_native {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[gather_panel_matmul] " + what);
}

// Every expert's [NB, K, P] block contiguous (the experts may lie any stride apart).
bool experts_dense(const mx::array& p) {
  if (p.flags().row_contiguous) return true;
  const auto& st = p.strides();
  const int64_t K = p.shape(2), NB = p.shape(1);
  return st[3] == 1 && (K == 1 || st[2] == smallrow::kPanel) &&
      (NB == 1 || st[1] == K * smallrow::kPanel);
}

// The shared shape checks of x [T, 1 or k, K] and indices [T, k] against K.
void check_rows(const mx::array& x, const mx::array& indices, int64_t K) {
  if (x.dtype() != mx::float32) fail("x must be float32");
  if (indices.dtype() != mx::int32 && indices.dtype() != mx::uint32)
    fail("indices must be int32 or uint32");
  if (x.ndim() != 3) fail("x must have shape [T, 1 or k, K]");
  if (indices.ndim() != 2) fail("indices must have shape [T, k]");
  const int T = indices.shape(0), k = indices.shape(1);
  if (x.shape(0) != T || (x.shape(1) != 1 && x.shape(1) != k) || x.shape(2) != K) {
    std::ostringstream msg;
    msg << "x " << x.shape(0) << "x" << x.shape(1) << "x" << x.shape(2) << " does not match "
        << "indices " << T << "x" << k << " and panels with K = " << K;
    fail(msg.str());
  }
}

void check_width(int n, int64_t NB, int threads) {
  if (n <= 0 || n > NB * smallrow::kPanel || n <= (NB - 1) * smallrow::kPanel) {
    std::ostringstream msg;
    msg << "n = " << n << " does not fit " << NB << " panels of " << smallrow::kPanel
        << " columns";
    fail(msg.str());
  }
  if (threads < 1) fail("threads must be >= 1");
}

// Expert panels as one expert's qpanel_matmul panels [NB, groups, rows, 2 bits].
qpanels::Shape expert_layout(const mx::array& panels, int n) {
  if (panels.dtype() != mx::uint8 || panels.ndim() != 5)
    fail("quantized expert panels must be uint8 [E, NB, K / group, rows, 2 bits]");
  return qpanel_layout(panels.shape(1), panels.shape(2), panels.shape(3), panels.shape(4), n);
}

} // namespace

mx::array gather_panel_matmul(
    const mx::array& x,
    const mx::array& panels,
    const mx::array& indices,
    int n,
    int threads,
    mx::StreamOrDevice s) {
  if (panels.dtype() != mx::float32) fail("x and panels must be float32");
  if (panels.ndim() != 4 || panels.shape(3) != smallrow::kPanel)
    fail("panels must have shape [E, NB, K, " + std::to_string(smallrow::kPanel) + "]");
  check_rows(x, indices, panels.shape(2));
  check_width(n, panels.shape(1), threads);
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) fail("runs on a CPU stream only");
  return mx::array(
      mx::Shape{indices.shape(0), indices.shape(1), n},
      mx::float32,
      std::make_shared<GatherPanelMatmul>(stream, n, threads),
      {x, panels, indices});
}

mx::array gather_qpanel_matmul(
    const mx::array& x,
    const mx::array& panels,
    const mx::array& indices,
    int n,
    bool exact,
    int threads,
    mx::StreamOrDevice s) {
  const auto sh = expert_layout(panels, n);
  check_rows(x, indices, sh.K);
  check_width(n, sh.NB, threads);
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) fail("runs on a CPU stream only");
  return mx::array(
      mx::Shape{indices.shape(0), indices.shape(1), n},
      mx::float32,
      std::make_shared<GatherPanelMatmul>(stream, n, threads, true, exact),
      {x, panels, indices});
}

void GatherPanelMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  const auto& p = inputs[1];
  const auto& idx = inputs[2];
  out.set_data(mx::allocator::malloc(out.nbytes()));

  const int64_t T = idx.shape(0), k = idx.shape(1);
  const int64_t X = x.shape(1);
  const int64_t NB = p.shape(1), E = p.shape(0);
  qpanels::Shape qs{};
  if (quantized_) {
    qs = expert_layout(p, n_);
    if (!p.flags().row_contiguous) fail("quantized expert panels must be row-contiguous");
  }
  const int K = quantized_ ? qs.K : p.shape(2);
  const bool x_dense = x.flags().row_contiguous;
  const bool p_dense = quantized_ || experts_dense(p);

  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_input_array(p);
  encoder.set_input_array(idx);
  encoder.set_output_array(out);
  encoder.dispatch([x_ptr = x.data<float>(),
                    x_shape = x_dense ? mx::Shape{} : x.shape(),
                    x_strides = x_dense ? mx::Strides{} : x.strides(),
                    x_dense,
                    p_ptr = quantized_ ? nullptr : p.data<float>(),
                    q_ptr = quantized_ ? p.data<uint8_t>() : nullptr,
                    qs,
                    exact = exact_,
                    p_shape = p_dense ? mx::Shape{} : p.shape(),
                    p_strides = p.strides(),
                    p_dense,
                    i_ptr = idx.data<uint32_t>(),
                    i0 = idx.strides()[0],
                    i1 = idx.strides()[1],
                    y = out.data<float>(),
                    T,
                    k,
                    X,
                    K,
                    NB,
                    E,
                    n = static_cast<int64_t>(n_),
                    threads = threads_]() {
    const int64_t pairs = T * k;
    if (pairs == 0) return;
    if (K == 0) {
      std::memset(y, 0, sizeof(float) * pairs * n);
      return;
    }
    std::vector<float> x_buf, p_buf;
    const float* xs = x_ptr;
    if (!x_dense) {
      x_buf.resize(static_cast<size_t>(T) * X * K);
      densify(x_ptr, x_shape, x_strides, x_buf.data());
      xs = x_buf.data();
    }
    const int64_t panel_floats = NB * K * smallrow::kPanel; // one expert
    const float* ps = p_ptr;
    int64_t expert_stride = q_ptr != nullptr ? NB * qs.panel_bytes()
        : (p_dense ? p_strides[0] : panel_floats);
    if (!p_dense) {
      p_buf.resize(static_cast<size_t>(E) * panel_floats);
      densify(p_ptr, p_shape, p_strides, p_buf.data());
      ps = p_buf.data();
    }

    // Pairs grouped by expert (a counting sort, stable: rows keep their order), so each
    // selected expert's panels are read once for all of its rows.
    std::vector<int64_t> start(E + 1, 0);
    std::vector<uint32_t> expert(pairs);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const uint32_t e = i_ptr[t * i0 + j * i1];
        expert[t * k + j] = e;
        if (e < E) {
          ++start[e + 1];
        } else {
          std::memset(y + (t * k + j) * n, 0, sizeof(float) * n);
        }
      }
    }
    std::vector<int64_t> active; // experts with at least one pair
    for (int64_t e = 0; e < E; ++e) {
      if (start[e + 1] > 0) active.push_back(e);
      start[e + 1] += start[e];
    }
    std::vector<int64_t> order(start[E]);
    {
      std::vector<int64_t> fill(start.begin(), start.end() - 1);
      for (int64_t q = 0; q < pairs; ++q)
        if (expert[q] < E) order[fill[expert[q]]++] = q;
    }
    auto x_row = [&](int64_t q) { return xs + ((q / k) * X + (X == 1 ? 0 : q % k)) * K; };

    // m rows of expert e: its float panels or its quantized ones.
    auto product = [&](int64_t e, const float* xr, int64_t m, float* yr, qpanels::QuantRows& qr) {
      if (q_ptr == nullptr) {
        smallrow::panel_matmul(xr, K, m, ps + e * expert_stride, K, n, yr, n, 0, NB);
      } else if (exact || qpanels::fast_as_exact(m)) {
        qpanels::matmul_exact(xr, K, m, q_ptr + e * expert_stride, qs, yr, n, 0, NB);
      } else {
        qpanels::quantize_rows(xr, K, m, qs, qr);
        qpanels::matmul_fast(qr, m, q_ptr + e * expert_stride, qs, yr, n, 0, NB);
      }
    };
    // Experts [a0, a1) of `active`: one product per expert over its rows (staged when several).
    auto run = [&](int64_t a0, int64_t a1) {
      std::vector<float> x_stage, y_stage;
      qpanels::QuantRows qr;
      for (int64_t a = a0; a < a1; ++a) {
        const int64_t e = active[a];
        const int64_t first = start[e], m = start[e + 1] - first;
        if (m == 1) {
          const int64_t q = order[first];
          product(e, x_row(q), 1, y + q * n, qr);
          continue;
        }
        x_stage.resize(static_cast<size_t>(m) * K);
        y_stage.resize(static_cast<size_t>(m) * n);
        for (int64_t r = 0; r < m; ++r)
          std::memcpy(x_stage.data() + r * K, x_row(order[first + r]), sizeof(float) * K);
        product(e, x_stage.data(), m, y_stage.data(), qr);
        for (int64_t r = 0; r < m; ++r)
          std::memcpy(y + order[first + r] * n, y_stage.data() + r * n, sizeof(float) * n);
      }
    };

    const int64_t count = static_cast<int64_t>(active.size());
    const int64_t parts = std::min<int64_t>(threads, count);
    if (parts <= 1) {
      run(0, count);
      return;
    }
    // Contiguous ranges of experts of about equal work: an expert's weight read (as much as
    // a register block of rows) plus its rows.
    std::vector<int64_t> cut(parts + 1, count);
    cut[0] = 0;
    {
      int64_t total = 0;
      for (auto e : active) total += smallrow::kMaxBlock + (start[e + 1] - start[e]);
      int64_t done = 0, part = 1;
      for (int64_t a = 0; a < count && part < parts; ++a) {
        const int64_t e = active[a];
        done += smallrow::kMaxBlock + (start[e + 1] - start[e]);
        if (done * parts >= total * part) cut[part++] = a + 1;
      }
    }
    run_parts(parts, [&](int64_t t) { run(cut[t], cut[t + 1]); });
  });
}

bool GatherPanelMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GatherPanelMatmul&>(other);
  return n_ == o.n_ && threads_ == o.threads_ && quantized_ == o.quantized_ &&
      exact_ == o.exact_;
}

std::vector<mx::Shape> GatherPanelMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  return {mx::Shape{inputs[2].shape(0), inputs[2].shape(1), n_}};
}

} // namespace mtp_native
