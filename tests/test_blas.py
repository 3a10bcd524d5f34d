"""BLAS selection and MKL's thread policy, each in a fresh interpreter (the choice is made once,
before mlx loads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from runner import blas

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Loads the BLAS, checks a float32 product against NumPy, reports what was loaded and MKL's
# thread counts before, inside and after `wide()`.
PROBE = r"""
import ctypes, json, os
import runner
from runner import blas
import mlx.core as mx
import numpy as np
rng = np.random.default_rng(0)
a = rng.standard_normal((37, 300), dtype=np.float32)
b = rng.standard_normal((300, 53), dtype=np.float32)
err = float(np.abs(np.array(mx.array(a) @ mx.array(b)) - a @ b).max())
threads = None
if blas.blas_in_use().startswith("mkl"):
    path = blas.blas_in_use().split("(", 1)[1].split(",", 1)[0]
    get = ctypes.CDLL(path).MKL_Get_Max_Threads
    before = get()
    with blas.wide():
        inside = get()
    threads = [before, inside, get()]
print(json.dumps({"name": blas.blas_in_use(), "err": err, "threads": threads,
                  "counts": blas.thread_counts(), "row_layout": blas.row_layout_pays()}))
"""


def probe(**env: str) -> dict:
    # The runner's BLAS switches and MKL's own settings come only from ``env``.
    ours = (
        "MTP_RUNNER_BLAS",
        "MTP_RUNNER_NO_OPENBLAS",
        "MTP_RUNNER_MKL",
        "MTP_RUNNER_OPENBLAS",
        "MTP_RUNNER_DECODE_THREADS",
    )
    full = {k: v for k, v in os.environ.items() if k not in ours and not k.startswith("MKL_")}
    full.update(env)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=full, cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def openblas_present() -> bool:
    return any(os.path.exists(p) for p in blas._CANDIDATES)


def mkl_usable() -> bool:
    return blas.find_mkl() is not None and blas._has_gnu_openmp()


def test_choice_reads_the_environment(monkeypatch):
    monkeypatch.delenv("MTP_RUNNER_NO_OPENBLAS", raising=False)
    monkeypatch.delenv("MTP_RUNNER_BLAS", raising=False)
    assert blas.choice() == "auto"
    monkeypatch.setenv("MTP_RUNNER_BLAS", " MKL ")
    assert blas.choice() == "mkl"
    monkeypatch.setenv("MTP_RUNNER_BLAS", "atlas")
    assert blas.choice() == "auto"
    monkeypatch.setenv("MTP_RUNNER_NO_OPENBLAS", "1")  # the older switch still wins
    assert blas.choice() == "bundled"


def test_mkl_override_must_exist(monkeypatch, tmp_path):
    monkeypatch.setenv("MTP_RUNNER_MKL", str(tmp_path / "libmkl_rt.so.3"))
    assert blas.find_mkl() is None
    (tmp_path / "libmkl_rt.so.3").write_bytes(b"")
    assert blas.find_mkl() == str(tmp_path / "libmkl_rt.so.3")


def test_bundled_blas_is_used_when_asked():
    got = probe(MTP_RUNNER_BLAS="bundled")
    assert got["name"] == "bundled" and got["err"] < 1e-3 and got["counts"] is None
    assert got["row_layout"]


@pytest.mark.skipif(not openblas_present(), reason="no system OpenBLAS")
def test_openblas_when_asked():
    got = probe(MTP_RUNNER_BLAS="openblas")
    assert got["name"].startswith("openblas") and got["err"] < 1e-3
    assert got["counts"] is None  # OpenBLAS keeps its own thread count
    assert got["row_layout"]  # verify rows run faster as W @ x.T here


@pytest.mark.skipif(not mkl_usable(), reason="no mkl wheel in this environment, or no libgomp")
def test_auto_prefers_mkl_and_narrows_decode_threads():
    got = probe()
    assert got["name"].startswith("mkl") and "gnu" in got["name"] and got["err"] < 1e-3
    narrow, wide = got["counts"]
    cores = len(os.sched_getaffinity(0))
    assert (narrow, wide) == (max(1, cores - 1), cores)
    assert got["threads"] == [narrow, wide, narrow]  # prefill widens, decode narrows again
    assert not got["row_layout"]  # MKL's x @ Wt beats W @ x.T for verify rows


@pytest.mark.skipif(not mkl_usable(), reason="no mkl wheel in this environment, or no libgomp")
def test_mkl_thread_settings_of_the_user_win():
    got = probe(MKL_NUM_THREADS="1")
    assert got["name"].startswith("mkl") and got["counts"] is None
    assert got["threads"] == [1, 1, 1]
    got = probe(MTP_RUNNER_DECODE_THREADS="2")
    assert got["counts"][0] == 2 and got["threads"][0] == 2


def test_decode_thread_override_is_validated(monkeypatch):
    monkeypatch.delenv("MTP_RUNNER_DECODE_THREADS", raising=False)
    assert blas._decode_threads(4) == 3 and blas._decode_threads(1) == 1
    monkeypatch.setenv("MTP_RUNNER_DECODE_THREADS", "2")
    assert blas._decode_threads(4) == 2
    for bad in ("two", "0", "-1", ""):
        monkeypatch.setenv("MTP_RUNNER_DECODE_THREADS", bad)
        assert blas._decode_threads(4) == 3  # a typo must not stop the runner from starting


def test_a_broken_mkl_install_falls_back(tmp_path):
    # libmkl_rt without libmkl_core beside it would exit the process at the first product.
    import shutil

    real = blas.find_mkl()
    if real is None:
        pytest.skip("no mkl wheel in this environment")
    shutil.copy(real, tmp_path / os.path.basename(real))
    got = probe(MTP_RUNNER_MKL=str(tmp_path / os.path.basename(real)))
    assert not got["name"].startswith("mkl") and got["err"] < 1e-3
