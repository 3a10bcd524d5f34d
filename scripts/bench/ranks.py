"""One model in one process against the same model split over ``--ranks N`` on this machine.

Each round starts every side in turn (``--ranks`` sides start their ranks as children), runs
one untimed warm-up and one timed request on it and stops it (A B C A B C ...): greedy,
without speculation or the prefix cache so every side does the same work. ``--env NAME=VALUE``
adds a side: the ``--ranks`` sides again with that environment (e.g. thread counts), so a
change of the ranks' threading is measured against the current default in one run.
``--verify K ...`` adds sides that speculate from the text (``--draft-sources suffix
--draft-depth K``, the prompt repeated so drafts are found): each round is one verify feed of
up to K + 1 rows, and one process and the ranks feed the same rows (their outputs, and so
their drafts, are the same), so their milliseconds per forward compare the feeds' cost.
Usage:

    python scripts/bench/ranks.py --model HF_DIR [--ranks 2 3] [--reps 5] [--decode 64]
        [--repeat 1] [--env MTP_RUNNER_CORES=2] [--verify 1 2 4]

Reported per side: the median decode rate (tokens after the first over the time between the
first and the last token's arrival), the median time to the first token, and the median
milliseconds per target forward (``eval_ns`` over ``eval_tokens - accepted``) with the rows
a forward fed on average (1 + drafted / forwards).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as bc  # noqa: E402

PROMPT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
    "lantern, a thermos of tea and a notebook in which he recorded the weather, the ships "
    "that passed and the birds that rested on the railing. Over forty years the notebooks "
    "filled three shelves of his small cottage, and when the historians came, they found"
)


class Side(bc.PipeRunner):
    """A runner started with extra arguments and environment."""

    def __init__(self, args: list[str], log_name: str, env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", "runner", "--log-level", "warning", *args]
        self._log = bc.log_file(log_name)
        self.proc = subprocess.Popen(
            cmd,
            cwd=bc.ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, **env},
        )
        self.ready = {}


def sides(
    model: str, counts: list[int], envs: list[dict[str, str]], depths: list[int]
) -> dict[str, tuple]:
    """Each side's name: its arguments, environment and whether it speculates."""
    plain = ["--model", model, "--no-draft", "--no-prefix-cache"]
    out = {"1 process": (plain, {}, False)}
    for env in [{}, *envs]:
        label = " ".join(f"{k}={v}" for k, v in env.items())
        for count in counts:
            name = f"--ranks {count}" + (f" {label}" if label else "")
            out[name] = ([*plain, "--ranks", str(count)], env, False)
    for depth in depths:
        verify = ["--model", model, "--no-prefix-cache", "--draft-sources", "suffix"]
        verify += ["--draft-depth", str(depth)]
        out[f"1 process, verify {depth}"] = (verify, {}, True)
        for count in counts:
            out[f"--ranks {count}, verify {depth}"] = ([*verify, "--ranks", str(count)], {}, True)
    return out


def forward_cost(done: dict) -> tuple[float, float]:
    """Milliseconds per target forward and rows fed per forward, from a done frame."""
    spec = done.get("speculation") or {}
    forwards = max(1, done["eval_tokens"] - spec.get("accepted", 0))
    return done["eval_ns"] / 1e6 / forwards, 1.0 + spec.get("drafted", 0) / forwards


def request(tag: str, decode: int, repeat: int = 1) -> dict:
    options = {"temperature": 0, "num_predict": decode}
    return {"id": tag, "prompt": " ".join([PROMPT] * repeat), "options": options}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a llama-family Hugging Face directory")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE[,NAME=VALUE]")
    parser.add_argument("--repeat", type=int, default=1, help="the prompt this many times")
    parser.add_argument("--verify", type=int, nargs="*", default=[], help="draft depths")
    args = parser.parse_args()
    envs = [dict(pair.split("=", 1) for pair in spec.split(",")) for spec in args.env]
    runners = sides(args.model, args.ranks, envs, args.verify)
    rates: dict[str, list[float]] = {name: [] for name in runners}
    firsts: dict[str, list[float]] = {name: [] for name in runners}
    costs: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    ids: dict[str, list[int]] = {}
    loads = []
    # One side runs at a time, started afresh each round: a waiting rank polls its socket,
    # so ranks of an idle side left running would take cores from the side measured.
    for rep in range(args.reps):
        for index, (name, (argv, env, speculates)) in enumerate(runners.items()):
            side = Side(argv, f"ranks-{index}.log", env)
            repeat = max(args.repeat, 3) if speculates else args.repeat
            try:
                side.wait_ready()
                side.complete(request("warm", 8))
                reply = side.complete(request(f"r{rep}", args.decode, repeat))
            finally:
                side.close()
            costs[name].append(forward_cost(reply["done"]))
            rates[name].append(bc.interval_rate(reply["tokens"]))
            firsts[name].append(reply["tokens"][0][0] if reply["tokens"] else float("nan"))
            ids.setdefault(name, bc.flatten_ids(reply["tokens"]))
            loads.append(bc.machine_load())
    rows = []
    for name in runners:
        reference = ids[
            "1 process" + (name[name.index(", verify") :] if ", verify" in name else "")
        ]
        rows.append(
            [
                name,
                f"{bc.median(rates[name]):.1f}",
                f"{bc.median(firsts[name]) * 1000:.0f}",
                f"{bc.median([c[0] for c in costs[name]]):.2f}",
                f"{bc.median([c[1] for c in costs[name]]):.2f}",
                "yes" if ids[name] == reference else "NO",
            ]
        )
    heads = ["side", "decode tok/s", "first token ms", "ms per forward", "rows per forward"]
    print(bc.markdown_table([*heads, "same ids"], rows))
    print(bc.describe_load(loads))
    result = {"rates": rates, "firsts": firsts, "costs": costs}
    result |= {"env": bc.environment(), "args": vars(args)}
    print(bc.write_json("ranks.json", result))


if __name__ == "__main__":
    main()
