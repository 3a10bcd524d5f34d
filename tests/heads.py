"""Random MTP heads for tests, written as sidecar directories the runner loads."""

from __future__ import annotations

import mlx.core as mx

from drafting.head import MTPHead
from drafting.load import sidecar_target, write_sidecar
from tests.test_head import random_head


def write_head(directory: str, loaded, head: MTPHead | None = None) -> str:
    """Write ``head`` (default: a seeded random head) as a Qwen3-Next-named sidecar."""
    head = head if head is not None else random_head(loaded)
    return write_sidecar(
        directory, head, naming="qwen3_next", target=sidecar_target(loaded.model.args)
    )


def echo_head(loaded, seed: int = 9) -> MTPHead:
    """A head whose block adds nothing and whose fc keeps only the embedding half: it drafts
    the token it is given, so it is right exactly when the target repeats itself."""
    head = random_head(loaded, seed=seed)
    d = loaded.model.args.hidden_size
    head.fc.weight = mx.concatenate([mx.eye(d), mx.zeros((d, d))], axis=1)
    head.layers[0].self_attn.o_proj.weight = mx.zeros((d, d))
    head.layers[0].mlp.down_proj.weight = mx.zeros_like(head.layers[0].mlp.down_proj.weight)
    return head
