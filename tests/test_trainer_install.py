"""The trainer as the installed product: ``pip install .`` into a fresh venv (no checkout on
its path), then ``mtp-runner train-head --help`` and a short run on a small random target
with the bundled prompt set; the head it writes loads and drafts losslessly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from protocol.requests import Completion, Options
from runner.engine import Engine, EngineOptions
from runner.heads import load_draft_head
from runner.loader import load_model

ROOT = Path(__file__).resolve().parent.parent
# Runtime dependencies (and pip) shared from this environment by path, so the install needs
# no download but setuptools for the build.
SHARED = (
    "mlx",
    "mlx_cpu.libs",
    "numpy",
    "numpy.libs",
    "tokenizers",
    "msgspec",
    "jinja2",
    "markupsafe",
    "llguidance",
    "pip",
)


def run(cmd: list, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{cmd[:3]}: {proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with this repository installed from a source copy by pip."""
    base = tmp_path_factory.mktemp("install")
    venv = base / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=base)
    deps = base / "deps"
    deps.mkdir()
    site = Path(mx.__file__).resolve().parents[1]
    for name in SHARED:
        if (site / name).exists():
            (deps / name).symlink_to(site / name)
    (site_packages,) = (venv / "lib").glob("python3*/site-packages")
    (site_packages / "shared-deps.pth").write_text(f"{deps}\n")
    run(
        [venv / "bin" / "python", "-m", "pip", "install", "--no-deps", "--quiet", ROOT],
        cwd=base,
        timeout=600,
    )
    return venv


@pytest.mark.slow
def test_the_installed_command_trains_a_head_that_loads_and_drafts(
    installed, tiny_checkpoint, tmp_path
):
    venv = installed
    code = "import runner, drafting.training.config as c; print(runner.__file__, c.PROMPT_DIR)"
    where = run([venv / "bin" / "python", "-c", code], cwd=tmp_path).stdout.split()
    assert all(str(venv) in path for path in where), where  # the installed copy, not the checkout
    assert any(Path(where[1]).glob("templates_*.json"))  # the prompt set is package data
    helped = run([venv / "bin" / "mtp-runner", "train-head", "--help"], cwd=tmp_path).stdout
    assert helped.startswith("usage: mtp-runner train-head") and "--out" in helped

    out, work = tmp_path / "head", tmp_path / "work"
    proc = run(
        [
            venv / "bin" / "mtp-runner",
            "train-head",
            tiny_checkpoint,
            "--out",
            out,
            "--work-dir",
            work,
            "--template",
            "chatml",
            "--max-prompts",
            "8",
            "--max-heldout",
            "2",
            "--max-new-tokens",
            "16",
            "--gen-batch",
            "4",
            "--draft-vocab",
            "48",
            "--batch",
            "256",
            "--steps",
            "24",
            "--warmup",
            "2",
            "--eval-every",
            "8",
        ],
        cwd=tmp_path,
    )
    assert "generate [" in proc.stderr and "train [" in proc.stderr  # progress bars, on stderr
    assert proc.stdout == ""
    record = json.loads((out / "config.json").read_text())["training"]
    assert record["prompts"] == 8 and record["final_loss"] < 0.8 * record["first_loss"], record

    loaded = load_model(tiny_checkpoint)
    head, description = load_draft_head(loaded, str(out))
    assert "draft vocab 48" in description

    def greedy(engine: Engine, tokens: list[int]) -> list[int]:
        frames: list = []
        options = Options(num_predict=24, temperature=0, repeat_penalty=1.0)
        engine.run(
            engine.prepare(Completion(id="r", tokens=tokens, options=options)),
            frames.append,
            lambda: False,
        )
        return [t for f in frames if type(f).__name__ == "Token" for t in f.tokens]

    plain = Engine(EngineOptions(model_path=tiny_checkpoint, use_draft=False))
    spec = Engine(EngineOptions(model_path=tiny_checkpoint, draft_path=str(out), draft_depth=2))
    tokens = loaded.tokenizer.encode("<|im_start|>user\nhello there<|im_end|>\n")
    assert greedy(spec, tokens) == greedy(plain, tokens)
