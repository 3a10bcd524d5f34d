"""Greedy tokens of the runner and of llama.cpp on the same small K-quant GGUF files.

The files are the tests' (``tests/test_gguf_models.py``): a tiny llama with random weights in
the tensor types of a ``Q4_K_M`` file (Q4_K, Q6_K) and in the older 32-element types (Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0). The runner loads each kept quantized, with its exact products and
with its default ones; llama.cpp (``llama-cpp-python`` in ``.venv-llamacpp``, built by
``scripts/bench/llamacpp.py``) evaluates the same prompt ids and feeds its own argmax. Reported:
how many greedy tokens agree before the first difference, and the largest difference of the
last prompt position's logits against the runner's exact path. Random weights leave small
margins between the top logits, so llama.cpp's int8 activations may flip a close pick.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from scripts.bench.llamacpp import ensure_llama_venv  # noqa: E402

PROMPT = [1, 40, 41, 42, 43, 50, 60]

# Runs in llama.cpp's environment: argv[1] is {"path", "prompt", "tokens"}; prints the greedy
# ids and the last prompt position's logits.
LLAMA_CHILD = """
import json, sys
import numpy as np
from llama_cpp import Llama
job = json.loads(sys.argv[1])
m = Llama(model_path=job["path"], n_ctx=128, n_threads=1, verbose=False, logits_all=True)
m.eval(job["prompt"])
first = np.array(m.scores[m.n_tokens - 1]).tolist()
ids = []
for _ in range(job["tokens"]):
    ids.append(int(np.argmax(m.scores[m.n_tokens - 1])))
    m.eval([ids[-1]])
print(json.dumps({"ids": ids, "logits": first}))
"""


def runner_side(path: str, tokens: int) -> dict:
    """The runner's greedy ids (exact and default products) and its exact last-prompt logits."""
    from tests.test_gguf_models import greedy, logits, tuned

    exact = tuned(path, exact=True).model
    out = {"exact": greedy(exact, PROMPT, tokens), "logits": logits(exact, PROMPT)[-1].tolist()}
    out["default"] = greedy(tuned(path, exact=False).model, PROMPT, tokens)
    return out


def agreed(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--skip-build", action="store_true", help="fail if llama.cpp is not built")
    args = parser.parse_args()
    import numpy as np

    from tests.test_gguf_models import RECIPES, write_model

    python = ensure_llama_venv(args.skip_build)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, recipe in RECIPES.items():
            path = write_model(os.path.join(folder, f"{name}.gguf"), recipe)
            ours = runner_side(path, args.tokens)
            job = json.dumps({"path": path, "prompt": PROMPT, "tokens": args.tokens})
            done = subprocess.run(
                [python, "-c", LLAMA_CHILD, job], capture_output=True, text=True, check=True
            )
            theirs = json.loads(done.stdout.strip().splitlines()[-1])
            ref = np.array(ours["logits"])
            diff = float(np.abs(np.array(theirs["logits"]) - ref).max())
            rows.append(
                f"| {name} | {agreed(theirs['ids'], ours['exact'])}/{args.tokens} | "
                f"{agreed(theirs['ids'], ours['default'])}/{args.tokens} | "
                f"{agreed(ours['default'], ours['exact'])}/{args.tokens} | "
                f"{diff:.3f} (span {ref.max() - ref.min():.2f}) |"
            )
    print("| file | llama.cpp = exact | llama.cpp = default | default = exact | logit diff |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
