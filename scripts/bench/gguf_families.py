"""Greedy tokens and tokenization of the runner and of llama.cpp on the GGUF files the tests
write: Gemma 2 / Gemma 3 / Phi-3 / Qwen3-MoE (``tests/test_gguf_families.py``), the Qwen3.5
hybrids, Qwen3-Next and GLM-4.5 (``tests/test_gguf_hybrid.py``), llama.cpp's ``deepseek2``
(DeepSeek-V3, GLM-4.7-Flash; ``tests/test_gguf_mla.py``).

Each family's tiny random checkpoint (Q4_K / Q6_K tensors, F32 norms, a SentencePiece BPE
vocabulary) is loaded by the runner kept quantized with exact products, and by llama.cpp
(``llama-cpp-python`` in ``.venv-llamacpp``, see ``scripts/bench/llamacpp.py``), which is fed
the same prompt ids and then its own argmax. Reported per family: greedy tokens agreeing
before the first difference, the largest difference of the last prompt position's logits,
and how many of a few hundred varied strings both tokenizers split identically. Random
weights leave small margins between the top logits, so llama.cpp's int8 activations may flip
a close pick. Phi-3's file has no sliding window here: llama.cpp turns Phi-3's window off,
while the runner (as transformers) applies it.

Both load the very same file (the hybrids' with the MTP block the converter writes, which the
runner skips and llama.cpp does not run in the main pass); a file llama.cpp refuses gets its
load error in the table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from scripts.bench.gguf_agreement import agreed  # noqa: E402
from scripts.bench.llamacpp import ensure_llama_venv  # noqa: E402

# Runs in llama.cpp's environment: argv[1] is {"path", "prompt", "tokens", "texts"}; prints
# the greedy ids, the last prompt position's logits and the tokenization of every text.
# llama.cpp's log (its load errors) goes to stderr.
LLAMA_CHILD = """
import json, sys
import numpy as np
from llama_cpp import Llama
job = json.loads(sys.argv[1])
m = Llama(model_path=job["path"], n_ctx=128, n_threads=1, verbose=True, logits_all=True)
texts = [m.tokenize(t.encode(), add_bos=False, special=True) for t in job["texts"]]
m.eval(job["prompt"])
first = np.array(m.scores[m.n_tokens - 1]).tolist()
ids = []
for _ in range(job["tokens"]):
    ids.append(int(np.argmax(m.scores[m.n_tokens - 1])))
    m.eval([ids[-1]])
print(json.dumps({"ids": ids, "logits": first, "texts": texts}))
"""


def run_llama(python: str, job: dict) -> tuple[dict | None, str]:
    """(llama.cpp's answer, or None and its error line)."""
    done = subprocess.run(
        [python, "-c", LLAMA_CHILD, json.dumps(job)], capture_output=True, text=True
    )
    if not done.returncode:
        return json.loads(done.stdout.strip().splitlines()[-1]), ""
    lines = [line.strip() for line in done.stderr.strip().splitlines()] or ["(no output)"]
    errors = [line for line in lines if "error loading model" in line]
    errors += [line for line in lines if "error" in line.lower() and line not in errors]
    return None, (errors or lines[-1:])[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--texts", type=int, default=300)
    parser.add_argument("--skip-build", action="store_true", help="fail if llama.cpp is not built")
    args = parser.parse_args()
    import numpy as np

    from runner.models.layers import set_exact_products
    from tests import test_gguf_hybrid as hybrid
    from tests import test_gguf_mla as mla
    from tests.test_gguf_families import FAMILIES, PROMPT, varied_strings, write_pair
    from tests.test_gguf_models import greedy, logits, tuned

    # family -> the GGUF file both load, written into a folder
    writers = {
        arch: lambda d, a=arch: write_pair(
            d, a, {"phi3.attention.sliding_window": 0} if a == "phi3" else None
        )[1]
        for arch in FAMILIES
    }
    writers |= {case: lambda d, c=case: hybrid.write_pair(d, c)[1] for case in hybrid.CASES}
    writers["glm4moe"] = lambda d: hybrid.write_glm_pair(d)[1]
    writers |= {f"deepseek2 {c}": lambda d, c=c: mla.write_pair(d, c)[1] for c in mla.CASES}

    python = ensure_llama_venv(args.skip_build)
    set_exact_products(True)
    texts = [t for t in varied_strings(args.texts, seed=1) if t.strip()]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for arch, write in writers.items():
            path = write(pathlib.Path(folder))
            loaded = tuned(path)
            prompt = loaded.tokenizer.encode(PROMPT)
            ours = greedy(loaded.model, prompt, args.tokens)
            ref = logits(loaded.model, prompt)[-1]
            job = {"path": path, "prompt": prompt, "tokens": args.tokens, "texts": texts}
            theirs, error = run_llama(python, job)
            if theirs is None:
                rows.append(f"| {arch} | llama.cpp failed: {error} | | |")
                continue
            diff = float(np.abs(np.array(theirs["logits"]) - ref).max())
            same = sum(
                loaded.tokenizer.encode(t, add_bos=False) == ids
                for t, ids in zip(texts, theirs["texts"], strict=True)
            )
            rows.append(
                f"| {arch} | {agreed(theirs['ids'], ours)}/{args.tokens} | "
                f"{diff:.4f} (span {ref.max() - ref.min():.2f}) | {same}/{len(texts)} |"
            )
    print("| family | greedy agreement | last-prompt logit diff | tokenization agreement |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
