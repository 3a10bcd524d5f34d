"""The quantized products compute the same bits in every build.

The fast product's contract (``runner/native/qkernels.h``) is that every build (AVX-512 with
or without VNNI, AVX2, portable) computes the same integers and the same float operations, so
a model's output does not depend on the CPU that runs it; the exact product's is that its
result is the float32 panel product of the dequantized weight in the same build. The
extension holds one build, so this compiles a small program over the product headers for
this CPU (``-march=native``) and portable (and, on a CPU with AVX-512, for AVX2 as well:
``-march=native`` would not compile that kernel there; its fast product is compared), runs
them on the same seeded panels and rows (4 and 8 bits, groups 16 to 128, float16 and
float32 headers, 1 to 20 rows, a partial last panel, two panel ranges as threads split them),
among them all-255 values against the rows with the largest integer sums: all +1 and all -1
(every first-level value +127 or -127), and rows whose second level is +127 on 31 of every
32 inputs), and compares the printed floats.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

NATIVE_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "runner", "native")

PROGRAM = r"""
#include "qkernels.h"
#include <cstdio>
#include <random>
int main() {
  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  for (int bits : {4, 8}) for (int group : {16, 32, 64, 128}) for (int half : {0, 1})
  for (int extreme : {0, 1, 2, 3}) {
    const int K = 256, n = 16 * 5 + 3, NB = (n + 15) / 16;
    qpanels::Shape sh{K, group, bits, half != 0, NB, n};
    std::vector<uint8_t> p(NB * sh.panel_bytes());
    for (auto& b : p) b = extreme ? 0xFF : rng() & 0xFF;  // extreme: the largest sums
    for (int64_t pi = 0; pi < NB; ++pi) for (int gi = 0; gi < K / group; ++gi) {
      uint8_t* blk = p.data() + pi * sh.panel_bytes() + gi * sh.block();
      for (int j = 0; j < 32; ++j) {  // scales (j < 16) > 0, biases < 0
        if (half) {
          uint16_t h = 0x2000 + (rng() % 0x800) + (j >= 16 ? 0x8000 : 0);
          std::memcpy(blk + 2 * j, &h, 2);
        } else {
          float v = (j < 16 ? 0.01f : -0.1f) * (1.0f + (rng() % 100) / 100.0f);
          std::memcpy(blk + 4 * j, &v, 4);
        }
      }
    }
    for (int M : {1, 2, 3, 5, 6, 8, 12, 13, 20}) {
      std::vector<float> x(M * K), fast(M * n), exact(M * n), widened(M * n);
      // 1, 2: every first level +127 or -127; 3: first levels -127 once and -64 for the
      // rest of each 32 inputs, second levels +127 there (what -64 leaves is 0.2 / 127)
      for (int i = 0; i < M * K; ++i)
        x[i] = extreme == 0 ? normal(rng) : extreme == 1 ? 1.0f : extreme == 2 ? -1.0f
            : i % 32 == 0 ? -1.0f : -(0.5f + 0.3f / 127.0f);
      qpanels::QuantRows rows;
      qpanels::quantize_rows(x.data(), K, M, sh, rows);
      // in two panel ranges, as threads split a product
      for (auto [p0, p1] : {std::pair<int64_t, int64_t>{0, 2}, {2, NB}}) {
        qpanels::matmul_fast(rows, M, p.data(), sh, fast.data(), n, p0, p1);
        qpanels::matmul_exact(x.data(), K, M, p.data(), sh, exact.data(), n, p0, p1);
      }
      qpanels::matmul_exact_widened(x.data(), K, M, p.data(), sh, widened.data(), n, 0, NB);
      for (int i = 0; i < M * n; ++i) std::printf("%a %a %a\n", fast[i], exact[i], widened[i]);
    }
  }
  std::fprintf(stderr, "%s\n", qpanels::fast_isa());
}
"""


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as info:
            return any(line.startswith("flags") and flag in line.split() for line in info)
    except OSError:
        return False


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


pytestmark = pytest.mark.skipif(_compiler() is None, reason="no C++ compiler")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[list[str]], str]]:
    tmp = tmp_path_factory.mktemp("builds")
    source = tmp / "bits.cpp"
    source.write_text(PROGRAM)
    builds = {"native": ["-march=native"], "portable": ["-march=native", "-DSMALLROW_PORTABLE"]}
    if _cpu_has("avx512bw") and _cpu_has("avx2"):  # the AVX2 kernel, which native skips here
        builds["avx2"] = ["-mavx2", "-mfma", "-mf16c"]
    # The extension's flags: no contraction of separate multiplies and adds (CMakeLists.txt).
    common = ["-std=c++17", "-O2", "-ffp-contract=off", f"-I{NATIVE_DIR}"]
    procs = {
        name: subprocess.Popen(
            [_compiler(), *common, *flags, str(source), "-o", str(tmp / name)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, flags in builds.items()
    }
    result = {}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name} build failed:\n{err[-2000:]}"
        run = subprocess.run([str(tmp / name)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        result[name] = ([line.split() for line in run.stdout.splitlines()], run.stderr.strip())
    return result


def test_fast_product_bits_do_not_depend_on_the_build(outputs):
    native, isa = outputs["native"]
    portable, portable_isa = outputs["portable"]
    assert portable_isa == "portable"
    assert len(native) == len(portable) > 100000
    differ = sum(a[0] != b[0] for a, b in zip(native, portable, strict=True))
    assert differ == 0, f"{differ} fast-product values differ between {isa} and portable"
    if "avx2" in outputs:
        avx2, avx2_isa = outputs["avx2"]
        assert avx2_isa == "avx2"
        differ = sum(a[0] != b[0] for a, b in zip(avx2, portable, strict=True))
        assert differ == 0, f"{differ} fast-product values differ between avx2 and portable"


@pytest.mark.parametrize("build", ["native", "portable"])
def test_exact_product_is_the_widened_float_product(outputs, build: str):
    lines, _ = outputs[build]
    differ = sum(line[1] != line[2] for line in lines)
    assert differ == 0, f"{differ} exact values differ from the widened panels' product"
    # The two products are different computations: the fast one is not the exact one.
    assert sum(line[0] != line[1] for line in lines) > len(lines) // 4
