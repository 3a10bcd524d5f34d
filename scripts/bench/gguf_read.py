"""Reading a GGUF file's header: the ``gguf`` package's own reader against the runner's
(``runner.gguf_tensors``: the same reader with its metadata read in one pass by
``runner.gguf_metadata``), interleaved, and the time a runner takes to be ready on the file.

Each round parses the file both ways (A B A B ...: the library reader over a plain ndarray
view of the map, then the runner's) and checks they give the same metadata; then the runner
is started ``--starts`` times to its ``ready`` frame. Usage:

    python scripts/bench/gguf_read.py [--model FILE] [--reps 5] [--starts 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as bc  # noqa: E402

sys.path.insert(0, bc.ROOT)


def library_metadata(path: str) -> dict:
    """The metadata as ``gguf.GGUFReader`` parses it (over the same ndarray view of the map
    as the runner's reader, so only the metadata parse differs)."""
    from runner.gguf_tensors import gguf_reader

    reader = gguf_reader(path, one_pass=False)
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def runner_metadata(path: str) -> dict:
    from runner.gguf_tensors import open_gguf

    return open_gguf(path)[1]


def time_to_ready(path: str) -> float:
    """Seconds from starting ``python -m runner --model path`` to its ``ready`` frame."""
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "runner", "--model", path]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    for line in proc.stdout:
        if json.loads(line).get("type") == "ready":
            elapsed = time.perf_counter() - start
            proc.stdin.write('{"type": "shutdown"}\n')
            proc.stdin.flush()
            break
    proc.wait(timeout=60)
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--starts", type=int, default=3)
    args = parser.parse_args()
    path = args.model or bc.default_model_path()
    load = [bc.machine_load()]
    library, runner = [], []
    for _ in range(args.reps):
        start = time.perf_counter()
        expected = library_metadata(path)
        library.append(time.perf_counter() - start)
        start = time.perf_counter()
        got = runner_metadata(path)
        runner.append(time.perf_counter() - start)
        if got != expected:
            raise SystemExit("the two readers disagree on the metadata")
    ready = [time_to_ready(path) for _ in range(args.starts)]
    load.append(bc.machine_load())
    result = {
        "model": os.path.basename(path),
        "library_s": round(statistics.median(library), 3),
        "runner_s": round(statistics.median(runner), 3),
        "ratio": round(statistics.median(library) / statistics.median(runner), 1),
        "ready_s": round(statistics.median(ready), 2),
        "load": bc.describe_load(load),
    }
    print(json.dumps(result))
    bc.write_json("gguf_read", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
