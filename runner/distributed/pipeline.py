"""Rank 0's model: its own stage, with the other ranks' layers behind ``hidden``.

``PipelineModel`` is rank 0's llama-family stage (embedding, its first layers, final norm,
output projection; ``pipeline_class`` makes it for a family built on the llama one) whose
``hidden`` runs its layers, hands the rows down the ranks and takes the last rank's output
rows back, so the engine, the prefill and the decoders use it as they use a whole model.
Its caches are its own layers' caches followed by the other ranks' caches of the same set
(``runner.distributed.remote``: one ``RemoteCaches``, or that and a ``RemoteStates`` for
their recurrent layers), whose offsets rank 0 mirrors and whose rewinds, resets, snapshots
and restores are commands to those ranks.
Every exchange is synchronous and bounded by the watchdog; the pipelined decoder's overlap
of host work with the forward is lost across ranks for now. A speculative verify is one
multi-row forward like a prefill chunk, and its rejected rows one rewind. A shared forward
(``hidden_rows``) is one exchange too: a row per sequence, each after its own set of the
other ranks' caches (``Link.forward_rows``). A draft head that
fuses residual streams (``use_draft_features``) is served where every stream it reads is
one of rank 0's layers: rank 0 keeps them and joins them to the final rows that come back;
a stream held by another rank is refused by name (it would cross the link every forward).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import mlx.core as mx

from protocol.errors import DraftHeadError
from runner.distributed.remote import Link
from runner.models.llama import LayerHook, Mask, Model


class PipelineModel(Model):
    """Rank 0's stage of a llama-family model; see the module docstring. ``link`` is set
    once the ranks are connected."""

    takes_layer_hook = False  # a chunk runs whole: the other ranks' layers are one exchange
    ragged_rows = 0  # the other ranks take one row per sequence
    link: Link | None = None
    later_refusal: str | None = None  # why the other ranks' layers cannot share forwards

    def make_caches(self) -> list:
        return [*super().make_caches(), *self.link.new_set()]

    def use_draft_features(self, layers: tuple[int, ...]) -> None:
        """A fused head's streams (k: after k layers of the whole model), each after one of
        rank 0's layers (module docstring)."""
        own = len(self.layers)
        if any(k > own for k in layers):
            raise DraftHeadError(
                f"the head fuses the streams after layers {list(layers)}; across ranks only "
                f"those after rank 0's layers (1..{own}) are served: fewer ranks, or a head "
                "fusing earlier layers"
            )
        if list(layers) != sorted(set(layers)) or any(k < 1 for k in layers):
            raise ValueError(f"feature layers must increase strictly from 1: {layers}")
        object.__setattr__(self, "draft_features", tuple(layers))
        object.__setattr__(self, "draft_stream_layers", frozenset(k - 1 for k in layers))

    def hidden(
        self,
        tokens: mx.array,
        caches: Sequence,
        mask: Mask = None,
        prenorm: bool = False,
        on_layer: LayerHook | None = None,
    ) -> mx.array:
        if mask is not None or on_layer is not None:
            raise NotImplementedError("masks and layer hooks across ranks")
        parts = self.link.parts
        own, remote = caches[:-parts], caches[-parts:]
        layers = self.draft_features
        if self.serves_draft_features:
            rows, streams = self._stack(tokens, own, None, None, layers)
        else:  # a family with a loop of its own (the hybrids): its layers, before the norm
            rows, streams = super().hidden(tokens, own, prenorm=True), []
        rows = self.link.forward(rows, remote)
        if layers:
            return (
                mx.concatenate([*streams, rows], axis=-1)
                if prenorm
                else self.draft_rows(rows, streams)
            )
        return rows if prenorm else self.model.norm(rows)

    def rows_refusal(self) -> str | None:
        """Shared forwards as one process serves them, where the other ranks' layers can be
        batched too (``later_refusal``, set when the ranks are linked)."""
        return super().rows_refusal() or self.later_refusal

    def hidden_rows(self, tokens: mx.array, caches: list, counts: list | None = None) -> mx.array:
        """A shared forward (``Model.hidden_rows``): rank 0's layers over one row per
        sequence, then the other ranks' in one exchange, each row after its own set (one row
        each: ``ragged_rows`` is 0)."""
        if counts is not None and any(n != 1 for n in counts):
            raise ValueError("a model split over ranks takes one row per sequence")
        if tokens.shape[0] != len(caches):
            raise ValueError(f"{tokens.shape[0]} rows for {len(caches)} cache lists")
        parts = self.link.parts
        own = [c[:-parts] for c in caches]
        ids = tokens.reshape(1, -1)
        rows, streams = self.layer_rows(self.embed(ids), own, ids=ids)
        rows = self.link.forward_rows(rows, [c[-parts:] for c in caches])
        return self.draft_rows(rows, streams)[0]


@functools.cache
def pipeline_class(base: type[Model]) -> type[PipelineModel]:
    """Rank 0's model class for a family whose model class is ``base`` (a llama-family
    subclass: its blocks, ``PipelineModel``'s forward across the ranks)."""
    if base is Model:
        return PipelineModel
    return type(f"Pipeline{base.__module__.rpartition('.')[2]}", (PipelineModel, base), {})
