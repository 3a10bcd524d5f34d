"""The latency of MLX's ring ``all_sum`` between ranks on this machine: what tensor
parallelism would pay per partial-row sum (two a layer), against a decode step.

Run plainly, it starts itself as ``--ranks`` ranks under ``mlx.launch`` (ring backend on
loopback); each rank sums a float32 vector of each size ``--reps`` times after a warm-up, and
rank 0 prints the median microseconds per call. Usage:

    python scripts/bench/all_sum.py [--ranks 2] [--reps 300] [--sizes 576 4096 2880 20480]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

CHILD = "MTP_RUNNER_ALL_SUM_CHILD"


def measure(sizes: list[int], reps: int) -> dict[int, float]:
    import mlx.core as mx

    group = mx.distributed.init(backend="ring")
    out = {}
    for size in sizes:
        x = mx.ones((size,), dtype=mx.float32)
        for _ in range(20):
            mx.eval(mx.distributed.all_sum(x, group=group))
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            mx.eval(mx.distributed.all_sum(x, group=group))
            times.append(time.perf_counter() - start)
        out[size] = round(statistics.median(times) * 1e6, 1)
    return out if group.rank() == 0 else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--sizes", type=int, nargs="+", default=[576, 4096, 2880, 20480])
    args = parser.parse_args()
    if os.environ.get(CHILD):
        result = measure(args.sizes, args.reps)
        if result:
            print(json.dumps({"us_per_all_sum": result, "ranks": args.ranks}))
        return 0
    from runner.distributed import ranks

    launcher = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    cmd = [launcher, "--backend", "ring", "--hosts", ranks.LOOPBACK, "-n", str(args.ranks)]
    cmd += ["--python", sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
    return subprocess.run(cmd, env={**os.environ, CHILD: "1"}, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
