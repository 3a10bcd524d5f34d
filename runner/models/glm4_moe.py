"""GLM-4.5 / GLM-4.6 / GLM-4.5-Air (``glm4_moe``) on the llama family's pieces, with the MTP
layer those checkpoints ship.

What differs from ``runner.models.llama`` (transformers 5.24's ``modeling_glm4_moe``):

- attention: ``attention_bias`` puts biases on q, k and v (never on o); per-head RMS q/k norms
  before RoPE when ``use_qk_norm``; RoPE rotates the first ``partial_rotary_factor`` of each
  head (rotate-half pairs; default 0.5, as transformers sets it when the config has none; a
  ``rope_parameters`` entry wins over a top-level key);
- MLP: the first ``first_k_dense_replace`` layers dense (``intermediate_size``), the rest
  ``runner.models.moe.SparseMoE`` with sigmoid routing, ``e_score_correction_bias`` for the
  choice, group-limited top-k (``n_group`` / ``topk_group``), ``norm_topk_prob``,
  ``routed_scaling_factor`` and ``n_shared_experts`` plain shared experts of
  ``n_shared_experts * moe_intermediate_size``.

**The MTP layer.** GLM-4.5 stores its next-token-prediction module as ``model.layers.{N}``
(N = ``num_hidden_layers``) in DeepSeek-V3's naming: ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm`` and a whole decoder layer, whose MLP is a MoE block (N >=
``first_k_dense_replace``). transformers builds no such module; the loader keeps those
tensors aside (its experts stacked like the target's by ``prepare_weights``) and
``runner.heads`` builds the head from them with :func:`head_layer`, this family's MoE layer,
so the head computes what the checkpoint's MTP layer computes (vLLM's and SGLang's
``Glm4MoeMTP``: ``eh_proj(concat(enorm(embed(t+1)), hnorm(h_t)))``, the layer,
``shared_head.norm``, the shared output head; ``h_t`` the target's post-final-norm hidden).

Refused by name: a ``scoring_func`` other than sigmoid or a ``topk_method`` other than
``noaux_tc`` (DeepSeek keys: another routing), ``n_group`` not dividing the experts or groups
of fewer than two, ``topk_group`` > ``n_group``, activations other than SiLU,
``rope_traditional``, and the llama family's foreign keys. Ignored: ``num_nextn_predict_layers``
(the tensors decide whether a head is there), ``output_router_logits``, training keys.
"""

from __future__ import annotations

import runner.models.config as cfgs
from protocol.errors import UnsupportedArchitecture
from runner.models.llama import Attention, Linear, ModelArgs
from runner.models.moe import MoEDecoderLayer, MoEModel, MoESettings, MoEStack, read_field
from runner.models.rope import RoPE
from runner.models.rope_config import read_rope

FAMILIES = ("glm4_moe",)
# transformers 5.24's Glm4MoeConfig defaults.
_DEFAULTS = {
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "partial_rotary_factor": 0.5,
}
_FOREIGN = {k: v for k, v in cfgs.FOREIGN_KEYS.items() if k != "use_qk_norm"}


def _read_moe(cfg: dict, layers: int, prefix: str, path: str | None) -> MoESettings:
    def field(key, default, kind, minimum=None, aliases=()):
        return read_field(cfg, key, default, kind, prefix, path, minimum=minimum, aliases=aliases)

    experts = field("n_routed_experts", 128, int, 1, ("num_local_experts",))
    top_k = field("num_experts_per_tok", 8, int, 1)
    groups = field("n_group", 1, int, 1)
    keep = field("topk_group", 1, int, 1)
    dense = field("first_k_dense_replace", 1, int, 0)
    shared = field("n_shared_experts", 1, int, 0)
    width = field("moe_intermediate_size", 1408, int, 1)
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if cfg.get(key) not in (None, want):
            raise cfgs.refuse(prefix + key, cfg[key], f"glm4_moe routes with {want}", path)
    if experts % groups or (groups > 1 and experts // groups < 2):
        raise cfgs.refuse(
            prefix + "n_group", groups, f"{experts} experts in groups of at least two", path
        )
    if keep > groups:
        raise cfgs.malformed(prefix + "topk_group", f"{keep} > n_group {groups}", path)
    if top_k > keep * (experts // groups):
        raise cfgs.malformed(
            prefix + "num_experts_per_tok", f"{top_k} > the experts of {keep} groups", path
        )
    return MoESettings(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=width,
        scoring="sigmoid",
        norm_topk_prob=field("norm_topk_prob", True, bool),
        sparse_layers=tuple(i >= dense for i in range(layers)),
        routed_scaling_factor=field("routed_scaling_factor", 1.0, float, 0.0),
        n_group=groups,
        topk_group=keep,
        correction_bias=True,
        shared="plain" if shared else None,
        shared_intermediate_size=shared * width,
    )


def model_args(config: dict, path: str | None = None) -> ModelArgs:
    """``ModelArgs`` for a ``glm4_moe`` config (either layout, flat or nested); keys that
    change the math and are not implemented are refused by name."""
    cfg, prefix = cfgs.text_config(config)
    kind = cfg.get("model_type")
    if kind not in FAMILIES:
        raise UnsupportedArchitecture(f"unsupported model_type {kind!r}", path=path)
    required = cfgs.positive_ints(cfg, cfgs.SHAPE_KEYS, path, prefix)
    heads, hidden = required["num_attention_heads"], required["hidden_size"]

    def get(key):
        value = cfg.get(key)
        return _DEFAULTS.get(key) if value is None else value

    kv = read_field(
        cfg, "num_key_value_heads", _DEFAULTS["num_key_value_heads"], int, prefix, path, minimum=1
    )
    if heads % kv:
        raise cfgs.malformed(
            prefix + "num_key_value_heads", f"{kv} does not divide the heads", path
        )
    head_dim = read_field(cfg, "head_dim", hidden // heads, int, prefix, path, minimum=1)
    act = cfg.get("hidden_act", "silu")
    if act not in cfgs.ACTIVATIONS:
        raise cfgs.refuse(
            prefix + "hidden_act", act, "only silu (swish) MLPs are implemented", path
        )
    if cfg.get("rope_traditional"):
        raise cfgs.refuse(prefix + "rope_traditional", True, "glm4_moe rotates halves", path)
    cfgs.refuse_foreign(cfg, "glm4_moe", prefix, path, _FOREIGN)
    max_pos = int(get("max_position_embeddings"))
    rope_cfg = dict(cfg)
    rope_cfg["partial_rotary_factor"] = get("partial_rotary_factor")
    rope = read_rope(
        rope_cfg, head_dim=head_dim, max_position_embeddings=max_pos, path=path, prefix=prefix
    )
    if isinstance(rope, dict):
        raise cfgs.refuse(prefix + "rope_parameters", sorted(rope), "glm4_moe has one RoPE", path)
    extra = {k: v for k, v in cfg.items() if k not in ModelArgs.__dataclass_fields__}
    extra["partial_rotary_factor"] = rope.partial_rotary_factor
    extra["moe"] = _read_moe(cfg, required["num_hidden_layers"], prefix, path)
    return ModelArgs(
        model_type="glm4_moe",
        **required,
        num_key_value_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=float(get("rms_norm_eps")),
        rope_theta=rope.theta,
        rope_scaling=rope.scaling,
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        attention_bias=read_field(cfg, "attention_bias", False, bool, prefix, path),
        qk_norm=read_field(cfg, "use_qk_norm", False, bool, prefix, path),
        max_position_embeddings=max_pos,
        extra=extra,
    )


class Glm4MoeAttention(Attention):
    """q/k/v biases with ``attention_bias`` but none on o; partial rotary."""

    def __init__(self, args: ModelArgs, layer_type: str = "full_attention") -> None:
        super().__init__(args, layer_type)
        self.o_proj = Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)

    def make_rope(self, args: ModelArgs, layer_type: str) -> RoPE:
        partial = float(args.extra.get("partial_rotary_factor", 1.0))
        return RoPE(
            int(self.head_dim * partial),
            base=args.rope_theta,
            scaling=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
            head_dim=self.head_dim,
        )


class Glm4MoeDecoderLayer(MoEDecoderLayer):
    attention = Glm4MoeAttention


class Glm4MoeStack(MoEStack):
    layer = Glm4MoeDecoderLayer


def head_layer(args: ModelArgs) -> Glm4MoeDecoderLayer:
    """The MTP layer's block: this family's MoE layer (``model.layers.{N}`` of GLM-4.5 is
    sparse), full attention with a plain ``KVCache``."""
    return Glm4MoeDecoderLayer(args, sparse=True)


class Model(MoEModel):
    """A GLM-4.5 causal LM with the llama family's interface."""

    inner = Glm4MoeStack
    takes_layer_hook: bool = True  # llama's ``hidden``, ``on_layer`` included
