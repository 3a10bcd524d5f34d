"""Images: vision-tower encode time and time to first token, this runner against mlx-vlm on the
same random weights of the released Qwen3.5-0.8B's shape.

The checkpoint is made once (kept in ``--dir``), in the Hugging Face
``Qwen3_5ForConditionalGeneration`` layout and float32 (the runner's CPU default; both sides
compute in float32): the text model of scripts/bench/hybrid.py (0.8B shape, vocabulary cut to
32k), written by that script; the 0.8B's vision tower (``VISION``: depth 12, hidden 768, 12
heads, FFN 3072, out_hidden_size 1024, patch 16, merge 2, temporal 2, a 48x48 position table,
no deepstack) with random weights under ``model.visual.*``; the released
``preprocessor_config.json`` values; the test fixture's tokenizer
(``tests/fixtures/reference/vision/qwen3_5_vision``), whose vision special tokens are the
config's image token ids. Images: a smooth random PNG of 448x448 (28x28 patches, 196 tokens)
and of 1024x768 (64x48 patches, 768 tokens), sides multiples of 32, so neither is resized.

Each side is a process loaded once: the runner's Engine (prefix cache off) as configured by
default; the same with ``MKL_NUM_THREADS=1`` (its BLAS on one core in prefill too; the native
panels and attention still on every core): on a machine another process keeps busy, the
default's two-thread BLAS calls each wait for the other core (see docs/PERFORMANCE.md,
"Images"); and mlx-vlm in its own venv, ``.venv-vlm`` (made on first use, never a project
dependency; it multiplies with the runner's MKL on every core, as the other reference
benchmarks do). After one untimed warm-up round, rounds rotate which side goes first:

- encode: the tower alone on the same patch rows (the runner's preprocessing, which equals the
  processor's), float32 numpy rows to evaluated features: ``engine.vision.encode`` after the
  engine's CPU tuning, run on every core as inside a prefill chunk; mlx-vlm's
  ``model.vision_tower``. The runner also encodes once with attention left out, for its share;
- first token: a short prompt with the image, greedy, one token. Runner: ``engine.prepare``
  (base64 and PNG decode, resize, patchify, tokenize: the preparation thread's work) then
  ``engine.run``, whose ``prompt_eval_ns`` is the model's part. mlx-vlm: ``stream_generate``
  from the call to its first result (its processor included); ``prompt_tokens / prompt_tps``
  is the model's part. Each side prefills with its default chunks (512 / 2,048 rows).

The warm-up checks that both towers give the same features. Ratios: mlx-vlm's time over the
runner's, paired by round (above 1: the runner is faster). Usage:

    .venv/bin/python scripts/bench/vision.py [--reps 3] [--dir DIR] [--out vision.json]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as bc  # noqa: E402
import hybrid  # noqa: E402

VLM_VENV = os.path.join(bc.ROOT, ".venv-vlm")
VLM_PYTHON = os.path.join(VLM_VENV, "bin", "python")
VLM_SPEC = "mlx-vlm==0.7.10"
DEFAULT_DIR = os.path.join(bc.RESULTS_DIR, "vision-0.8b-random")
FIXTURE = os.path.join(bc.ROOT, "tests", "fixtures", "reference", "vision", "qwen3_5_vision")
VISION = {  # the released Qwen3.5-0.8B's vision_config
    "model_type": "qwen3_5",
    "depth": 12,
    "hidden_size": 768,
    "num_heads": 12,
    "intermediate_size": 3072,
    "out_hidden_size": hybrid.SHAPE["hidden_size"],
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "in_channels": 3,
    "num_position_embeddings": 2304,
    "hidden_act": "gelu_pytorch_tanh",
    "deepstack_visual_indexes": [],
}
TOKENS = {"vision_start_token_id": 320, "vision_end_token_id": 321, "image_token_id": 322}
PREPROCESSOR = {  # the released preprocessor_config.json's values
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen3VLProcessor",
}
SIZES = ((448, 448), (1024, 768))  # width x height
RUNNER, NARROW, VLM = "runner", "runner, MKL 1", "mlx-vlm"
SIDES = (RUNNER, NARROW, VLM)
CHAT = "<|im_start|>user\n{}Describe this image in one sentence.<|im_end|>\n<|im_start|>assistant\n"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


# ----------------------------------------------------------------------------- checkpoint
def checkpoint_config() -> dict:
    config = hybrid.checkpoint_config()
    config.update(TOKENS, video_token_id=323, vision_config=VISION, bench_vision=2)
    return config


def make_checkpoint(directory: str) -> str:
    """The random multimodal checkpoint in ``directory`` (kept; remade when the generator
    changes), and one PNG per size under ``images/``."""
    config = checkpoint_config()
    path = os.path.join(directory, "config.json")
    if os.path.exists(path) and os.path.exists(os.path.join(directory, "model-visual.safetensors")):
        with open(path, encoding="utf-8") as f:
            if json.load(f) == config:
                return directory
    hybrid.make_checkpoint(directory)  # the text model (and hybrid's config, replaced below)
    sys.path.insert(0, bc.ROOT)
    import shutil

    import mlx.core as mx

    from runner.vision.tower import VisionTower

    print(f"writing a random 0.8B-shaped vision tower to {directory} ...", file=sys.stderr)
    mx.random.seed(1)
    weights = {}
    for name, shape in VisionTower(VISION).expected_shapes().items():  # the HF names, shapes
        gain = "norm" in name and name.endswith(".weight")  # LayerNorm gains around 1
        value = (1.0 if gain else 0.0) + (0.1 if gain else 0.02) * mx.random.normal(shape)
        weights[f"model.visual.{name}"] = value.astype(mx.float32)
    mx.eval(weights)
    mx.save_safetensors(os.path.join(directory, "model-visual.safetensors"), weights)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(FIXTURE, name), os.path.join(directory, name))
    with open(os.path.join(directory, "preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump(PREPROCESSOR, f, indent=2)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return directory


def make_images(directory: str) -> dict[str, str]:
    """A smooth random RGB PNG per size (noise upsampled), name "WxH" -> path."""
    import numpy as np
    from PIL import Image

    os.makedirs(os.path.join(directory, "images"), exist_ok=True)
    rng = np.random.default_rng(5)
    out = {}
    for w, h in SIZES:
        path = os.path.join(directory, "images", f"{w}x{h}.png")
        if not os.path.exists(path):
            coarse = rng.integers(0, 256, (h // 32, w // 32, 3), dtype=np.uint8)
            Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC).save(path)
        out[f"{w}x{h}"] = path
    return out


# ----------------------------------------------------------------------------- runner side
def runner_worker(directory: str) -> None:
    """This runner's Engine in process (prefix cache off, no head)."""
    sys.path.insert(0, bc.ROOT)
    import mlx.core as mx
    import numpy as np

    import runner
    from protocol import frames as pf
    from protocol.requests import Completion, Options
    from runner.engine import Engine, EngineOptions
    from runner.vision import tower as tower_module
    from runner.vision.preprocess import prepare_image

    attention = tower_module.blocked_attention
    stub = lambda q, k, v, **_: v  # noqa: E731
    engine = Engine(EngineOptions(model_path=directory, use_draft=False, prefix_cache=False))
    vision = engine.vision
    settings = vision.prompts.settings

    def encode(command: dict) -> dict:
        """Preprocess and encode; with ``split``, once more with attention left out (each
        block's attention returns its values), for the share attention takes."""
        with open(command["png"], "rb") as f:
            data = f.read()
        t0 = time.perf_counter()
        image = prepare_image(data, settings, 0)
        reply = {"preprocess_s": time.perf_counter() - t0, "grid": list(image.grid)}
        for key in ("encode_s", "no_attention_s") if command.get("split") else ("encode_s",):
            tower_module.blocked_attention = stub if key == "no_attention_s" else attention
            t0 = time.perf_counter()
            with runner.blas.wide():  # as in a prefill chunk, where the engine encodes
                features = vision.encode(image)
                mx.eval(features)
            reply[key] = time.perf_counter() - t0
            tower_module.blocked_attention = attention
            if command.get("save") and key == "encode_s":
                np.save(command["save"] + "-pixels.npy", image.pixels)
                np.save(command["save"] + "-runner.npy", np.array(features))
        return reply

    def first_token(command: dict) -> dict:
        with open(command["png"], "rb") as f:
            b64 = base64.b64encode(f.read()).decode()
        options = Options(temperature=0, repeat_penalty=1.0, num_predict=1)
        request = Completion(id="v", prompt=CHAT.format("[img-0]"), images=[b64], options=options)
        done, first = {}, []
        t0 = time.perf_counter()

        def emit(frame) -> None:
            if isinstance(frame, pf.Token) and not first:
                first.append(time.perf_counter() - t0)
            elif isinstance(frame, pf.Done):
                done.update(prompt_eval_s=frame.prompt_eval_ns / 1e9, tokens=frame.prompt_tokens)

        prepared = engine.prepare(request)
        prepare_s = time.perf_counter() - t0
        engine.run(prepared, emit, lambda: False)
        total = first[0] if first else time.perf_counter() - t0
        return {
            "prepare_s": prepare_s,
            "model_s": done["prompt_eval_s"],
            "total_s": total,
            "prompt_tokens": done["tokens"],
        }

    info = {"blas": runner.blas.blas_in_use(), "tuning": engine.tuning.describe()}
    bc.serve_worker(info, lambda c: encode(c) if c["op"] == "encode" else first_token(c))


# ----------------------------------------------------------------------------- mlx-vlm side
def ensure_vlm_venv() -> str:
    """The python of .venv-vlm with mlx-vlm and the project's mlx; made when missing."""
    import importlib.metadata

    probe = [VLM_PYTHON, "-c", "import mlx_vlm, mlx.core"]
    if os.path.exists(VLM_PYTHON) and subprocess.run(probe, capture_output=True).returncode == 0:
        return VLM_PYTHON
    mlx_version = importlib.metadata.version("mlx")
    spec = f"mlx[cpu]=={mlx_version}" if sys.platform.startswith("linux") else f"mlx=={mlx_version}"
    print(f"creating {VLM_VENV} with {spec} and {VLM_SPEC} ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", VLM_VENV], check=True)
    subprocess.run([VLM_PYTHON, "-m", "pip", "install", "-q", spec, VLM_SPEC], check=True)
    return VLM_PYTHON


def vlm_worker(directory: str) -> None:
    """Runs inside .venv-vlm: mlx-vlm's own model, processor and generate loop."""
    blas = bc.preload_runner_blas(threads=os.cpu_count() or 1)
    import importlib.metadata

    import mlx.core as mx
    import numpy as np
    from mlx_vlm import load, stream_generate

    model, processor = load(directory)
    tower = model.vision_tower
    words = len(processor.tokenizer)  # the model's vocabulary is larger than the tokenizer's

    def greedy(logprobs: mx.array) -> mx.array:
        return mx.argmax(logprobs[..., :words], axis=-1)

    dtype = tower.patch_embed.proj.weight.dtype

    def encode(command: dict) -> dict:
        pixels = np.load(command["pixels"])
        gh, gw = command["grid"]
        t0 = time.perf_counter()
        features, _ = tower(mx.array(pixels).astype(dtype), mx.array([[1, gh, gw]]))
        mx.eval(features)
        encode_s = time.perf_counter() - t0
        if command.get("save"):
            np.save(command["save"], np.array(features))
        return {"encode_s": encode_s}

    def first_token(command: dict) -> dict:
        prompt = CHAT.format(IMAGE)
        first, last = None, None
        t0 = time.perf_counter()
        for response in stream_generate(
            model, processor, prompt, image=[command["png"]], max_tokens=1, sampler=greedy
        ):
            if first is None:
                first = time.perf_counter() - t0
            last = response
        return {
            "model_s": last.prompt_tokens / last.prompt_tps,
            "total_s": first,
            "prompt_tokens": last.prompt_tokens,
        }

    info = {
        "blas": f"{blas.blas_in_use()}, MKL_NUM_THREADS={os.environ['MKL_NUM_THREADS']}",
        "mlx": mx.__version__,
        "mlx_vlm": importlib.metadata.version("mlx-vlm"),
    }
    bc.serve_worker(info, lambda c: encode(c) if c["op"] == "encode" else first_token(c))


# ----------------------------------------------------------------------------- main
def start(directory: str, vlm_python: str) -> dict:
    """The three sides' workers: the runner as configured by default, the runner with MKL on
    one thread (``MKL_NUM_THREADS=1``: its prefill products on one core, the native panels
    and attention still on every core), mlx-vlm."""
    here, env = os.path.abspath(__file__), dict(os.environ, PYTHONPATH=bc.ROOT)
    env.pop("MKL_NUM_THREADS", None)
    runner_argv = [sys.executable, here, "--runner-worker", directory]
    return {
        RUNNER: bc.Worker(runner_argv, "vision-runner.log", env=env),
        NARROW: bc.Worker(
            runner_argv, "vision-runner-mkl1.log", env={**env, "MKL_NUM_THREADS": "1"}
        ),
        VLM: bc.Worker([vlm_python, here, "--vlm-worker", directory], "vision-vlm.log", env=env),
    }


def warm_up(sides: dict, images: dict[str, str], scratch: str) -> dict:
    """One untimed pass of everything; per image, the command that gives mlx-vlm's tower the
    runner's patch rows, and how far apart the two towers' features are."""
    import numpy as np

    checks = {}
    for name, png in images.items():
        base = os.path.join(scratch, name)
        enc = sides[RUNNER].call({"op": "encode", "png": png, "save": base, "split": True})
        sides[NARROW].call({"op": "encode", "png": png})
        command = {"op": "encode", "pixels": base + "-pixels.npy", "grid": enc["grid"]}
        sides[VLM].call({**command, "save": base + "-mlx-vlm.npy"})
        ours, theirs = np.load(base + "-runner.npy"), np.load(base + "-mlx-vlm.npy")
        tokens = {s: sides[s].call({"op": "first", "png": png})["prompt_tokens"] for s in SIDES}
        checks[name] = {
            "grid": enc["grid"],
            "image_tokens": ours.shape[0],
            "features_max_diff": float(np.abs(ours - theirs).max()),
            "features_max_abs": float(np.abs(theirs).max()),
            "prompt_tokens": tokens,
            "vlm_encode": command,
        }
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="timed rounds per side and size")
    parser.add_argument("--dir", default=DEFAULT_DIR, help="where the checkpoint is kept")
    parser.add_argument("--out", default="vision.json", help="file name under bench-results/")
    parser.add_argument("--runner-worker", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--vlm-worker", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.runner_worker or args.vlm_worker:
        (runner_worker if args.runner_worker else vlm_worker)(args.runner_worker or args.vlm_worker)
        return 0

    started = time.perf_counter()
    directory = make_checkpoint(os.path.abspath(args.dir))
    images = make_images(directory)
    scratch = os.path.join(directory, "scratch")
    os.makedirs(scratch, exist_ok=True)
    sides = start(directory, ensure_vlm_venv())
    runs = {n: {s: {"encode": [], "first": []} for s in SIDES} for n in images}
    loads = []
    try:
        checks = warm_up(sides, images, scratch)
        for rep in range(args.reps):
            order = SIDES[rep % 3 :] + SIDES[: rep % 3]  # each side leads in turn
            for name, png in images.items():
                for op in ("encode", "first"):
                    for side in order:
                        command = {"op": op, "png": png, "split": op == "encode"}
                        if op == "encode" and side == VLM:
                            command = checks[name]["vlm_encode"]
                        reply = sides[side].call(command)
                        runs[name][side][op].append(reply)
                        loads.append(bc.machine_load())
                        print(f"rep {rep} {name} {op} {side}: {reply}", file=sys.stderr)
        info = {side: sides[side].info for side in SIDES}
    finally:
        for worker in sides.values():
            worker.close()
    report(args, directory, checks, runs, info, loads, time.perf_counter() - started)
    return 0


def summarize(check: dict, by_side: dict) -> dict:
    """Per side: medians of each time; per runner side, mlx-vlm's time over its time paired
    by round (above 1: the runner is faster), and the share attention takes of its encode."""
    out = {k: check[k] for k in ("grid", "image_tokens", "prompt_tokens", "features_max_diff")}
    fields = {"encode": ("encode_s", "no_attention_s", "preprocess_s")}
    fields["first"] = ("total_s", "model_s", "prepare_s")
    for side, ops in by_side.items():
        s = out[side] = {}
        for op, names in fields.items():
            for field in names:
                if field in ops[op][0]:
                    s[f"{op}.{field}"] = bc.median([x[field] for x in ops[op]])
        if side == VLM:
            continue
        s["attention_share"] = bc.median(
            [1 - x["no_attention_s"] / x["encode_s"] for x in ops["encode"]]
        )
        for op, field in (("encode", "encode_s"), ("first", "total_s"), ("first", "model_s")):
            pairs = zip(ops[op], by_side[VLM][op], strict=True)
            s[f"ratio.{op}.{field}"] = bc.median([b[field] / a[field] for a, b in pairs])
    return out


def report(args, directory, checks, runs, info, loads, elapsed) -> None:
    summary = {n: summarize(checks[n], runs[n]) for n in runs}
    rows = []
    for name, s in summary.items():
        gh, gw = s["grid"]
        for side in SIDES:
            t = s[side]
            rows.append(
                [
                    f"{name}, {gh}x{gw} = {gh * gw} / {s['image_tokens']}",
                    side,
                    f"{t['encode.encode_s'] * 1e3:.0f}",
                    f"{t['ratio.encode.encode_s']:.2f}x" if side != VLM else "",
                    f"{t['first.total_s'] * 1e3:.0f}",
                    f"{t['ratio.first.total_s']:.2f}x" if side != VLM else "",
                    f"{t['first.model_s'] * 1e3:.0f}",
                    f"{t['attention_share']:.0%}" if side != VLM else "",
                ]
            )
    headers = [
        "image, patches / tokens",
        "side",
        "encode ms",
        "mlx-vlm / it",
        "first token ms",
        "mlx-vlm / it",
        "model part ms",
        "attention",
    ]
    print()
    print(bc.markdown_table(headers, rows))
    print()
    print(bc.describe_load(loads))
    print(
        f"runner: {info[RUNNER]['tuning']}; BLAS {info[RUNNER]['blas']}; mlx-vlm "
        f"{info[VLM]['blas']}; mlx {info[VLM]['mlx']}, mlx-vlm {info[VLM]['mlx_vlm']}; "
        f"medians of {args.reps} rounds; {elapsed:.0f} s in all"
    )
    for name, s in summary.items():
        print(
            f"{name}: features max diff {s['features_max_diff']:.1e}; prompt tokens "
            f"{s['prompt_tokens']}; runner preprocessing "
            f"{s[RUNNER]['encode.preprocess_s'] * 1e3:.0f} ms, prepare "
            f"{s[RUNNER]['first.prepare_s'] * 1e3:.0f} ms"
        )
    path = bc.write_json(
        args.out,
        {
            "checkpoint": directory,
            "vision_config": VISION,
            "text_shape": hybrid.SHAPE,
            "reps": args.reps,
            "environment": bc.environment(),
            "summary": summary,
            "checks": checks,
            "info": info,
            "runs": runs,
            "loads": loads,
            "elapsed_s": elapsed,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
