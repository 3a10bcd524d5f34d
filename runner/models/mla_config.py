"""The config reader of the Multi-head Latent Attention families (``runner.models.mla``):
``deepseek_v3`` and ``glm4_moe_lite`` as transformers 5.24's configuration and modeling code
read them, or a typed refusal naming the key (the rule of ``runner.models.config``).

Read and implemented (each absent key takes the family's transformers default):

- the shape keys of every family (``hidden_size``, ``num_hidden_layers``,
  ``intermediate_size`` (the dense layers' MLP), ``num_attention_heads``, ``vocab_size``:
  required), ``rms_norm_eps`` (the blocks' norms; the two latent norms ``q_a_layernorm`` and
  ``kv_a_layernorm`` keep transformers' fixed 1e-6), ``max_position_embeddings``,
  ``tie_word_embeddings``, ``hidden_act`` (SiLU only);
- attention: ``q_lora_rank`` (null: one full-rank ``q_proj``), ``kv_lora_rank``,
  ``qk_nope_head_dim``, ``qk_rope_head_dim`` (glm4_moe_lite also spells it ``head_dim``:
  transformers aliases the two there), ``v_head_dim``, ``attention_bias`` (biases on
  ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``, never on ``q_proj``, ``q_b_proj`` or
  ``kv_b_proj``), ``rope_interleave`` (true: adjacent pairs rotate, as DeepSeek lays its
  rotary weights out; false: the two halves);
- RoPE (``runner.models.rope_config``, either layout) over the ``qk_rope_head_dim`` rotated
  dims, yarn included; transformers multiplies the softmax scale
  ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5`` by ``mscale(factor, mscale_all_dim) ** 2``
  (``0.1 * mscale_all_dim * ln(factor) + 1``, 1 for factor <= 1) whenever the RoPE type is
  not default and ``mscale_all_dim`` is set, and yarn's attention factor
  (``mscale / mscale_all_dim`` of the same formula) multiplies cos and sin;
- routing, the sparse MLP of ``runner.models.moe`` (``n_routed_experts`` or
  ``num_local_experts``, ``num_experts_per_tok``, ``n_group``, ``topk_group``,
  ``norm_topk_prob``, ``routed_scaling_factor``, ``n_shared_experts`` plain shared experts of
  ``n_shared_experts * moe_intermediate_size``; sigmoid scores, ``e_score_correction_bias``
  for the choice only), and which layers are sparse: deepseek_v3 from
  ``first_k_dense_replace`` (layer i sparse when i >= it), glm4_moe_lite from
  ``mlp_layer_types`` (``"dense"`` / ``"sparse"`` per layer; default the first dense).

Refused by name: ``num_key_value_heads`` other than ``num_attention_heads`` (the latent
expands to every head; transformers' attention then fails to broadcast), a ``head_dim``
that contradicts ``qk_rope_head_dim`` (transformers' rotary tables would not fit the rotated
part), ``partial_rotary_factor`` other than 1, per-layer-type RoPE, ``rope_traditional``
(mlx-lm's key; ``rope_interleave`` says it here), a ``scoring_func`` other than sigmoid or a
``topk_method`` other than ``noaux_tc`` (DeepSeek-V2's softmax or greedy routing: transformers
would route these checkpoints as V3 does), ``moe_layer_freq`` other than 1 (DeepSeek's own
code would make only every k-th layer sparse; transformers ignores the key), a glm4_moe_lite
``first_k_dense_replace`` that contradicts its ``mlp_layer_types`` (transformers reads only
the latter), expert groups that do not divide the experts or hold fewer than two, and the
llama family's foreign keys (``runner.models.config.FOREIGN_KEYS``). Ignored:
``num_nextn_predict_layers`` (the tensors decide whether an MTP layer is there),
``qk_head_dim`` (derived; transformers' attention recomputes it), ``ep_size``,
``aux_loss_alpha``, ``seq_aux``, ``output_router_logits`` (training and sharding only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import runner.models.config as cfgs
from protocol.errors import UnsupportedArchitecture
from runner.models.llama import ModelArgs
from runner.models.moe import MoESettings, read_field

FAMILIES = ("deepseek_v3", "glm4_moe_lite")
# transformers builds q_a_layernorm and kv_a_layernorm without the config's eps.
LATENT_NORM_EPS = 1e-6
# transformers 5.24's DeepseekV3Config / Glm4MoeLiteConfig defaults (None: num_attention_heads).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {
        "num_key_value_heads": None,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "n_shared_experts": 1,
        "moe_intermediate_size": 2048,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3,
    },
    "glm4_moe_lite": {
        "num_key_value_heads": 20,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 202752,
        "q_lora_rank": 768,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "n_routed_experts": 64,
        "num_experts_per_tok": 4,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "moe_intermediate_size": 1536,
        "routed_scaling_factor": 1.8,
    },
}
MLP_LAYER_TYPES = ("dense", "sparse")


@dataclass(frozen=True)
class MLASettings:
    """What an MLA config decides for the attention (kept in ``ModelArgs.extra["mla"]``)."""

    q_lora_rank: int | None  # None: a full-rank q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    scale: float  # the softmax scale, yarn's mscale included

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def settings(args: ModelArgs) -> MLASettings:
    found = args.extra.get("mla")
    if not isinstance(found, MLASettings):
        raise ValueError(f"{args.model_type} args carry no MLA settings (use model_args)")
    return found


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(cfg: dict, qk_head_dim: int, rope: cfgs.Rope, prefix: str, path) -> float:
    """transformers' ``yarn_apply_mscale`` on ``qk_head_dim ** -0.5`` (module docstring),
    reading the RoPE dict the way ``read_rope`` picks it."""
    scale = qk_head_dim**-0.5
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    params = cfg.get(key) or {}
    all_dim = params.get("mscale_all_dim")
    if rope.rope_type == "default" or not all_dim:
        return scale
    factor = (rope.scaling or {}).get("factor")
    if isinstance(all_dim, bool) or not isinstance(all_dim, int | float) or factor is None:
        raise cfgs.malformed(
            f"{prefix}{key}.mscale_all_dim", f"needs a number and a factor, found {all_dim!r}", path
        )
    return scale * _mscale(float(factor), float(all_dim)) ** 2


class _Reader:
    """A config's keys checked by ``runner.models.moe.read_field``, absent ones taking the
    family's default."""

    def __init__(self, cfg: dict, kind: str, prefix: str, path: str | None) -> None:
        self.cfg, self.kind, self.prefix, self.path = cfg, kind, prefix, path
        self.defaults = _DEFAULTS[kind]

    def num(self, key: str, kind: type, minimum: float, aliases: tuple[str, ...] = ()):
        return read_field(
            self.cfg,
            key,
            self.defaults[key],
            kind,
            self.prefix,
            self.path,
            minimum=minimum,
            aliases=aliases,
        )

    def flag(self, key: str, default: bool) -> bool:
        return read_field(self.cfg, key, default, bool, self.prefix, self.path)


def _sparse_layers(read: _Reader, layers: int) -> tuple[bool, ...]:
    cfg, prefix, path = read.cfg, read.prefix, read.path
    freq = cfg.get("moe_layer_freq")
    if freq not in (None, 1):
        raise cfgs.refuse(
            prefix + "moe_layer_freq",
            freq,
            "transformers makes every layer past the dense ones sparse",
            path,
        )
    if read.kind == "deepseek_v3":
        dense = read.num("first_k_dense_replace", int, 0)
        return tuple(i >= dense for i in range(layers))
    types = cfg.get("mlp_layer_types")
    if types is None:
        types = ["dense"] + ["sparse"] * (layers - 1)
    if (
        not isinstance(types, list)
        or len(types) != layers
        or any(t not in MLP_LAYER_TYPES for t in types)
    ):
        raise cfgs.malformed(
            prefix + "mlp_layer_types", f"expected {layers} of {MLP_LAYER_TYPES}", path
        )
    first = cfg.get("first_k_dense_replace")
    if first is not None:
        first = read_field(cfg, "first_k_dense_replace", 0, int, prefix, path, minimum=0)
    if first is not None and types != ["dense"] * first + ["sparse"] * (layers - first):
        raise cfgs.refuse(
            prefix + "first_k_dense_replace",
            first,
            f"contradicts mlp_layer_types {types} (transformers builds from mlp_layer_types)",
            path,
        )
    return tuple(t == "sparse" for t in types)


def _read_moe(read: _Reader, layers: int) -> MoESettings:
    cfg, kind, prefix, path = read.cfg, read.kind, read.prefix, read.path
    experts = read.num("n_routed_experts", int, 1, ("num_local_experts",))
    top_k = read.num("num_experts_per_tok", int, 1)
    groups = read.num("n_group", int, 1)
    keep = read.num("topk_group", int, 1)
    shared = read.num("n_shared_experts", int, 0)
    width = read.num("moe_intermediate_size", int, 1)
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if cfg.get(key) not in (None, want):
            raise cfgs.refuse(
                prefix + key, cfg[key], f"{kind} routes with {want} (transformers)", path
            )
    if experts % groups or experts // groups < 2:
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
        norm_topk_prob=read.flag("norm_topk_prob", True),
        sparse_layers=_sparse_layers(read, layers),
        routed_scaling_factor=read.num("routed_scaling_factor", float, 0.0),
        n_group=groups,
        topk_group=keep,
        correction_bias=True,
        shared="plain" if shared else None,
        shared_intermediate_size=shared * width,
    )


def _read_mla(read: _Reader, heads: int) -> tuple[dict, cfgs.Rope, int]:
    """(MLASettings fields less the scale, the RoPE, max_position_embeddings)."""
    cfg, kind, prefix, path = read.cfg, read.kind, read.prefix, read.path
    kv_heads = read_field(
        cfg,
        "num_key_value_heads",
        _DEFAULTS[kind]["num_key_value_heads"] or heads,
        int,
        prefix,
        path,
        minimum=1,
    )
    if kv_heads != heads:
        raise cfgs.refuse(
            prefix + "num_key_value_heads",
            kv_heads,
            f"MLA expands its latent to all {heads} heads (transformers cannot run fewer)",
            path,
        )
    explicit_none = "q_lora_rank" in cfg and cfg["q_lora_rank"] is None
    q_rank = None if explicit_none else read.num("q_lora_rank", int, 1)
    rope_dim = read.num("qk_rope_head_dim", int, 2)
    head_dim = cfg.get("head_dim")
    if head_dim is not None:
        if kind == "glm4_moe_lite" and "qk_rope_head_dim" not in cfg:
            rope_dim = read_field(cfg, "head_dim", rope_dim, int, prefix, path, minimum=2)
        elif head_dim != rope_dim:
            raise cfgs.refuse(
                prefix + "head_dim",
                head_dim,
                f"contradicts qk_rope_head_dim {rope_dim} (transformers would size its rotary "
                "tables by it)",
                path,
            )
    if cfg.get("rope_traditional"):
        raise cfgs.refuse(
            prefix + "rope_traditional", True, "rope_interleave chooses the pairs here", path
        )
    max_pos = read.num("max_position_embeddings", int, 1)
    rope = cfgs.read_rope(
        cfg, head_dim=rope_dim, max_position_embeddings=max_pos, path=path, prefix=prefix
    )
    if isinstance(rope, dict):
        raise cfgs.refuse(prefix + "rope_parameters", sorted(rope), f"{kind} has one RoPE", path)
    if rope.partial_rotary_factor != 1.0:
        raise cfgs.refuse(
            prefix + "partial_rotary_factor",
            rope.partial_rotary_factor,
            f"{kind} rotates all qk_rope_head_dim dims",
            path,
        )
    dims = dict(
        q_lora_rank=q_rank,
        kv_lora_rank=read.num("kv_lora_rank", int, 1),
        qk_nope_head_dim=read.num("qk_nope_head_dim", int, 1),
        qk_rope_head_dim=rope_dim,
        v_head_dim=read.num("v_head_dim", int, 1),
        rope_interleave=read.flag("rope_interleave", True),
    )
    return dims, rope, max_pos


def model_args(config: dict, path: str | None = None) -> ModelArgs:
    """``ModelArgs`` for a ``deepseek_v3`` or ``glm4_moe_lite`` config (either layout, flat or
    nested); keys that change the math and are not implemented are refused by name."""
    cfg, prefix = cfgs.text_config(config)
    kind = cfg.get("model_type")
    if kind not in FAMILIES:
        raise UnsupportedArchitecture(f"unsupported model_type {kind!r}", path=path)
    required = cfgs.positive_ints(cfg, cfgs.SHAPE_KEYS, path, prefix)
    read = _Reader(cfg, kind, prefix, path)
    act = cfg.get("hidden_act", "silu")
    if act not in cfgs.ACTIVATIONS:
        raise cfgs.refuse(
            prefix + "hidden_act", act, "only silu (swish) MLPs are implemented", path
        )
    cfgs.refuse_foreign(cfg, kind, prefix, path)
    dims, rope, max_pos = _read_mla(read, required["num_attention_heads"])
    qk = dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]
    mla = MLASettings(**dims, scale=softmax_scale(cfg, qk, rope, prefix, path))
    extra = {k: v for k, v in cfg.items() if k not in ModelArgs.__dataclass_fields__}
    extra["mla"] = mla
    extra["moe"] = _read_moe(read, required["num_hidden_layers"])
    return ModelArgs(
        model_type=kind,
        **required,
        num_key_value_heads=required["num_attention_heads"],
        head_dim=qk,
        rms_norm_eps=read.num("rms_norm_eps", float, 0.0),
        rope_theta=rope.theta,
        rope_traditional=dims["rope_interleave"],
        rope_scaling=rope.scaling,
        tie_word_embeddings=read.flag("tie_word_embeddings", False),
        attention_bias=read.flag("attention_bias", False),
        max_position_embeddings=max_pos,
        extra=extra,
    )
