"""Speculative acceptance by coupled draws: a draft is accepted exactly when it is the token
the target itself draws at that slot.

Every sampled token is a Gumbel-max draw, ``argmax(log p + G)``, with noise ``G`` keyed only by
the request's seed, the slot the token will occupy and the token id (``runner.sampler``).
The head drafts slot ``s`` with the same noise over its own processed distribution ``q``, and
the verify forward computes the target's draw ``t_s`` for every slot of the feed in the same
sync. Draft ``d_s`` is accepted iff ``d_s == t_s``; at the first mismatch the next token is
``t_s`` (already computed); after full acceptance the bonus is the last row's draw. The output
is therefore token for token what plain decoding with the same seed gives, whatever the depth,
the parking, a head failure or what ran before (Daliri, Musco and Suresh, "Coupling without
communication and drafter-invariant speculative decoding"). Greedy is the same rule without
noise: every draw is the argmax of the penalised logits.

The coupling accepts with probability at least ``(1 - TV(p, q)) / (1 + TV(p, q))``, close to
rejection sampling's ``1 - TV`` when the distributions are peaked (docs/PERFORMANCE.md has
both measured on the shipped head).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import mlx.core as mx


class Decision(NamedTuple):
    """``accept[..., i]``: draft i+1 is the target's own draw at its slot; ``successors[..., i]``:
    the next token when exactly i drafts are accepted (the target's draw at that row)."""

    accept: mx.array  # [..., k] bool
    successors: mx.array  # [..., k+1] int32


def matched_decision(target: mx.array, drafts: mx.array) -> Decision:
    """The decision of one round from the target's draws ``[..., k+1]`` (row i: the token after
    the prefix and i drafts) and the drafts ``[..., k]``, lazily."""
    k = drafts.shape[-1]
    target = target.astype(mx.int32)
    return Decision(drafts.astype(mx.int32) == target[..., :k], target)


def accepted_count(accept: Sequence[bool]) -> int:
    """Length of the leading run of accepted drafts (host side, after the sync)."""
    count = 0
    for ok in accept:
        if not ok:
            break
        count += 1
    return count
