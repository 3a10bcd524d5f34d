"""What the trainer needs from its target model, provided by the caller.

``drafting`` never imports the runner: the caller (``runner.training_target``) loads the
target with the runner's own model code and hands it over as an object with this shape, so
the hiddens a head is trained on are the ones the runner drafts from, for every family the
runner serves.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from protocol.errors import DraftHeadError

from .config import TrainingError


class Target(Protocol):
    path: str  # the model's path, as the generation plan records it
    model: Any  # the model: embed, hidden, unembed, output_weight, make_caches, args
    tokenizer: Any  # encode(text) -> ids, eos_ids

    def new_cache(self, batch: int, capacity: int) -> list:
        """Per-layer caches for a batch of ``batch`` rows (``capacity`` a hint)."""

    def hidden(self, tokens: np.ndarray, cache: list, offset: int, mask: np.ndarray) -> np.ndarray:
        """Post-final-norm hiddens ``[B, L, D]`` (float32) for ``tokens`` ``[B, L]`` written at
        ``offset``; ``mask`` additive ``[B, L, offset + L]`` (left padding hidden)."""

    def hidden_features(
        self, tokens: np.ndarray, cache: list, offset: int, mask: np.ndarray, layers: tuple
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """:meth:`hidden` and, for ``layers`` (k: the residual stream after k decoder layers),
        those streams concatenated ``[B, L, len(layers) * D]`` (None when ``layers`` is empty)."""

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """The target's logits ``[N, V]`` (float32) for hiddens ``[N, D]``."""

    def keep_rows(self, cache: list, rows: np.ndarray) -> None:
        """Keep only the batch rows ``rows`` of every cache (finished sequences leave)."""

    def chat_prompt(self, text: str) -> str | None:
        """``text`` as one user turn through the target's own chat template, with the
        assistant's header after it; None when the target has no template."""

    def head_layer(self) -> nn.Module:
        """A fresh decoder layer for a new head, holding the target's last layer's weights
        (a mixture-of-experts layer's MLP from its first expert: the head stays dense)."""

    def numpy_layer(self, layer: nn.Module) -> dict[str, np.ndarray]:
        """A head layer's weights as float32 NumPy (``nphead``'s keys and layout)."""

    def embedding_table(self) -> np.ndarray:
        """The ``[V, D]`` input embedding (float32, dequantized)."""

    def last_layer_input_rms(self, tokens: list[int]) -> float:
        """Median RMS of the residual stream entering the target's last decoder layer."""

    def load_head(self, path: str) -> tuple[Any, str]:
        """A written sidecar loaded as the runner loads it, and its description."""

    def training_threads(self) -> AbstractContextManager:
        """A context in which the MLX training step's products use every core (the
        runner's own BLAS threading)."""

    def time_steps(self, head: Any, reps: int) -> dict:
        """One target decode step against one draft step (batch 1), in milliseconds."""


# load_target(path, tune=True): tune lays the model out for serving speed at once; False
# leaves that to the first load_head (evaluation times the head as the runner runs it).
LoadTarget = Callable[..., Target]


def load_head(target: Target, path: str) -> tuple[Any, str]:
    """A written head through the target's loader; one that cannot be loaded is a
    ``TrainingError`` naming it (no traceback for a mistyped path)."""
    try:
        return target.load_head(path)
    except DraftHeadError as exc:
        raise TrainingError(f"cannot load the head {path}: {exc}") from exc


def as_numpy(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float32, copy=True)
