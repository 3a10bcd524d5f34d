"""One multi-token-prediction (MTP) head: predicts token t+2 from token t+1 and the target's
hidden at t.

    e = norm_e(embed(token))            # the target's shared embedding
    h = norm_h(hidden)                  # target hidden at t (post-final-norm by default)
    x = fc(concat(e, h))                # MiMo concatenates (h, e)
                                        # a fused-feature head: h = norm_h(fuse(streams))
    x = layer(x, own KV cache)          # one decoder layer of the target's family
    y = norm(x)                         # returned: the head's next-step hidden and logit input
    logits = unembed(y)                 # the target's shared output head (or a vocab subset)

Parameter names follow the Qwen3-Next checkpoint layout (``fc``, ``pre_fc_norm_embedding``,
``pre_fc_norm_hidden``, ``layers.0``, ``norm``) without the ``mtp.`` prefix; the loaders in
``drafting.load`` map the other naming schemes onto them. The head never imports ``runner``:
the caller hands in the decoder layer, the embedding function and the output matrix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from drafting.columns import Columns


@dataclass
class HeadConfig:
    hidden_size: int
    rms_norm_eps: float = 1e-6
    # MiMo feeds concat(hidden, embedding); everyone else concat(embedding, hidden).
    hidden_first: bool = False
    # Condition on the target's pre-final-norm hidden instead of the post-norm one.
    prenorm_hidden: bool = False
    # Token ids the head drafts over (a reduced vocabulary); None = the full vocabulary.
    draft_vocab: list[int] | None = None
    # Residual streams (k: after k target layers) fused with the final hidden into the
    # head's hidden input (a low and a middle one, EAGLE-3 style); empty = the final only.
    feature_layers: list[int] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


class FeatureFusion(nn.Module):
    """The target streams a fused-feature head reads, ``[..., S * D]`` (the feature layers'
    streams, then the final hidden), each RMS-normed with its own gain, projected to ``D``.

    Initialised to pass the final hidden through (the projection's last block the identity),
    so a new fused head starts as the final-hidden head it extends."""

    def __init__(self, streams: int, dim: int, eps: float, linear: type[nn.Linear]) -> None:
        super().__init__()
        self.norms = [nn.RMSNorm(dim, eps=eps) for _ in range(streams)]
        self.proj = linear(streams * dim, dim, bias=False)
        eye = mx.eye(dim)
        self.proj.weight = mx.concatenate([mx.zeros((dim, (streams - 1) * dim)), eye], axis=1)

    def __call__(self, streams: mx.array) -> mx.array:
        parts = mx.split(streams, len(self.norms), axis=-1)
        return self.proj(
            mx.concatenate([n(p) for n, p in zip(self.norms, parts, strict=True)], axis=-1)
        )


class MTPHead(nn.Module):
    def __init__(
        self,
        config: HeadConfig,
        layer: nn.Module,
        embed: Callable[[mx.array], mx.array],
        output_weight: Callable[[], mx.array],
        linear: type[nn.Linear] = nn.Linear,
    ) -> None:
        """``layer`` is a fresh decoder layer of the target's family, called as
        ``layer(x, mask, cache)``; ``embed`` maps ids to embeddings; ``output_weight`` returns
        the target's ``[V, D]`` output matrix (only read when a draft vocabulary is set);
        ``linear`` builds ``fc`` (the target family's linear layer, so device tuning lays it
        out like the target's)."""
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.pre_fc_norm_embedding = nn.RMSNorm(d, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(d, eps=eps)
        self.fc = linear(2 * d, d, bias=False)
        if config.feature_layers:
            self.fuse = FeatureFusion(len(config.feature_layers) + 1, d, eps, linear)
        self.layers = [layer]
        self.norm = nn.RMSNorm(d, eps=eps)
        self._embed = embed
        self._output_weight = output_weight
        self._linear = linear
        self.set_draft_vocab(config.draft_vocab)

    def set_draft_vocab(self, ids: list[int] | None) -> None:
        """Draft over ``ids`` only (logits column j is token ``ids[j]``), or the full vocab."""
        self.config.draft_vocab = list(ids) if ids is not None else None
        if ids is None:
            self._vocab_ids = None
            self._draft_out = None
            self._vocab_size = None
            self._columns = None
            return
        weight = self._output_weight()
        self._vocab_size = int(weight.shape[0])
        self._vocab_ids = mx.array(ids, dtype=mx.int32)
        try:  # a sampler draws from the draft vocabulary's columns as they are
            self._columns = Columns(ids, self._vocab_size)
        except ValueError:  # repeated ids: drafts draw from the scattered full row
            self._columns = None
        # A product of the head's own linear type (not a parameter: it is the target's rows),
        # so device tuning lays it out, and quantizes it, like the head's other products.
        out = self._linear(weight.shape[1], len(ids), bias=False)
        out.weight = mx.contiguous(weight[self._vocab_ids])
        self._draft_out = out

    @property
    def draft_out_t(self) -> mx.array | None:
        """The draft vocabulary's ``[D, Vd]`` projection of a head as built (the trainer's;
        device tuning re-lays it out), or None without a draft vocabulary."""
        return None if self._draft_out is None else self._draft_out.weight.T

    @property
    def draft_vocab_ids(self) -> mx.array | None:
        return self._vocab_ids

    @property
    def draft_columns(self) -> Columns | None:
        """The draft vocabulary as the sampler's :class:`drafting.columns.Columns` (the logits of
        :meth:`logits` drawn without scattering them into the vocabulary), or None."""
        return self._columns

    def __call__(
        self,
        tokens: mx.array,
        hidden: mx.array,
        cache,
        mask: mx.array | str | None = None,
    ) -> mx.array:
        """Run the head over ``tokens`` ``[B, L]`` paired with target hiddens ``[B, L, D]``.

        Writes L entries into ``cache`` at its offset; returns the normed outputs ``[B, L, D]``.
        A request with images (the cache's ``layout``) embeds an image's pad row as its
        feature row: the pair at slot S reads row S + 1, as the target embedded it.
        """
        if mask is None and tokens.shape[1] > 1:
            mask = "causal"
        embedded = self._embed(tokens)
        if cache.layout is not None:
            embedded = cache.layout.overlay(embedded, cache.offset + 1, "draft")
        x = self.layers[0](self.input(tokens, hidden, embedded), mask, cache)
        return self.norm(x)

    @property
    def feature_width(self) -> int:
        """The width of the target rows the head reads: ``D`` times the streams it fuses."""
        return self.config.hidden_size * (len(self.config.feature_layers) + 1)

    def input(
        self, tokens: mx.array, hidden: mx.array, embedded: mx.array | None = None
    ) -> mx.array:
        """The block's input ``fc(concat(e, h))``. ``hidden`` is a target row (the fused
        streams for a fused-feature head) or, in a chained draft step, the head's own output
        ``[..., D]``, which takes the place of the fused streams; ``embedded``, the tokens'
        embeddings when the caller has them (image rows), else ``embed(tokens)``."""
        width = hidden.shape[-1]
        if width not in (self.config.hidden_size, self.feature_width):
            raise ValueError(f"rows of width {width}; the head reads {self.feature_width}")
        if width != self.config.hidden_size:
            hidden = self.fuse(hidden)
        e = self.pre_fc_norm_embedding(self._embed(tokens) if embedded is None else embedded)
        h = self.pre_fc_norm_hidden(hidden)
        return self.fc(mx.concatenate([h, e] if self.config.hidden_first else [e, h], axis=-1))

    def logits(self, y: mx.array, unembed: Callable[[mx.array], mx.array]) -> mx.array:
        """Logits over the draft vocabulary (``[..., Vd]``) or, without one, ``unembed(y)``."""
        if self._draft_out is not None:
            return self._draft_out(y)
        return unembed(y)

    def draft_logits(self, y: mx.array, unembed: Callable[[mx.array], mx.array]) -> mx.array:
        """Logits over the FULL vocabulary ``[..., V]``: with a draft vocabulary the ``Vd``
        computed columns are scattered into a row of -inf, so a sampler sees no other token."""
        logits = self.logits(y, unembed)
        if self._vocab_ids is None:
            return logits
        full = mx.full((*logits.shape[:-1], self._vocab_size), -mx.inf, dtype=logits.dtype)
        ids = mx.broadcast_to(self._vocab_ids, logits.shape)
        return mx.put_along_axis(full, ids, logits, axis=-1)
