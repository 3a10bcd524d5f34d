"""GGUF files of the Qwen3.5 hybrids (``qwen35`` dense, ``qwen35moe``) and Qwen3-Next
(``qwen3next``), as the runner's Hugging Face config dicts and tensor names (``runner.gguf``
reads the file and the common keys).

What llama.cpp's converter changed, and what is undone here:

- **Names.** Gated DeltaNet layers: ``attn_qkv`` (``in_proj_qkv``), ``attn_gate``
  (``in_proj_z``), ``ssm_beta`` / ``ssm_alpha`` (``in_proj_b`` / ``in_proj_a``),
  ``ssm_conv1d``, ``ssm_a``, ``ssm_dt.bias`` (``dt_bias``), ``ssm_norm`` (the gated norm) and
  ``ssm_out`` (``out_proj``); attention layers keep llama's names (``attn_q`` emits query and
  gate per head, as ``q_proj`` does); ``post_attention_norm`` is the pre-MLP norm. MoE
  layers: ``ffn_gate_inp`` (router), stacked ``ffn_{gate,up,down}_exps`` or fused
  ``ffn_gate_up_exps`` (gate rows first), ``ffn_*_shexp`` and ``ffn_gate_inp_shexp`` (the
  shared expert and its gate).
- **Zero-centred gains** (layer, final and q/k norms) are stored as ``1 + w``, the layout
  ``runner.models.qwen3_5`` loads when the conv weight is ``[C, K, 1]`` (it then leaves the
  gains alone), so they are handed over as stored; the gated norm (``ssm_norm``) is plain.
- **The conv** is stored squeezed, ``[C, K]``: handed over as ``[C, K, 1]``.
- **``A_log``** is stored as ``ssm_a = -exp(A_log)``: ``A_log = log(-ssm_a)`` (float32; the
  round trip is within an ulp of the decay the model computes).
- **Value heads** (Qwen3.5 files, where the key and value head counts differ) are reordered
  from grouped by key head (``[k0: v0..v(r-1), k1: ...]``, the
  order the recurrence's key sharing assumes) to tiled (``[v0 of k0, v0 of k1, ..., v1 of
  k0, ...]``) in every tensor indexed by value head: the V rows of ``in_proj_qkv`` and the V
  channels of the conv, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``A_log``, ``dt_bias``
  and the columns of ``out_proj``. Rows are put back lazily (a quantized row is whole
  blocks); ``out_proj``'s columns move in runs of one value head, whole affine groups but
  not whole K-quant blocks, so a quantized ``out_proj`` is wrapped to permute its unpacked
  columns (:class:`ColumnPermuted`: still exact, still kept quantized; a head narrower than
  an affine group would leave it float32).
- **MTP.** A file with ``nextn_predict_layers`` counts the MTP layers in ``block_count``
  and stores them as the last blocks (``blk.{N}.*``, ``blk.{N}.nextn.*``); they are dropped
  here (logged): the target loads without its MTP head.
- **RoPE.** The file's ``rope.dimension_sections`` are Qwen3.5's interleaved multimodal
  RoPE sections; a text position is the same on every section, which is plain partial RoPE
  over ``rope.dimension_count`` dims, so the sections are read and do not matter here.

**Qwen3-Next runs on the Qwen3.5 model code.** Its Hugging Face checkpoints fuse the Gated
DeltaNet input projections (``in_proj_qkvz``, ``in_proj_ba``, rows interleaved per key-head
group), which ``runner.models.qwen3_5`` regroups by reshaping dense arrays at load; the
converter already splits ``in_proj_qkvz`` into ``attn_qkv`` (all q, all k, all v) and
``attn_gate`` (all z), exactly Qwen3.5's ``in_proj_qkv`` / ``in_proj_z``. So a ``qwen3next``
file is configured as ``qwen3_5_moe_text`` (``qwen3_5_text`` without experts): the same
computation, with every quantized projection kept quantized instead of regrouped in float32:
the file has no key for a per-layer MoE schedule or for skipping the top-k renormalisation (the
released Qwen3-Next models make every layer sparse and renormalise, as Qwen3.5-MoE always does;
a layer stored dense would fail the load naming its missing router; ``expert_weights_norm``
false is refused), and a text position gives the same RoPE. ``ssm_ba`` (kept fused, interleaved
``[b, a]`` per group) and an older file's unsplit ``ssm_in`` (interleaved ``[q, k, v, z]``) are
split here by rows, lazily. Qwen3-Next files carry no value-head reorder.

Every ``{arch}.*`` key is either read or refused by name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from runner.gguf_families import ATTENTION_NAMES, dense_stack, hyper_int, refuse_unmapped
from runner.gguf_families import COMMON_KEYS as COMMON_FAMILY_KEYS
from runner.gguf_tensors import GGUFQuantized
from runner.models.config import malformed, refuse
from runner.quantized import affine_dense

log = logging.getLogger("mtp_runner.gguf")

ARCHS = ("qwen35", "qwen35moe", "qwen3next")
COMMON_KEYS = COMMON_FAMILY_KEYS | frozenset(
    {
        "rope.dimension_sections",
        "ssm.conv_kernel",
        "ssm.state_size",
        "ssm.group_count",
        "ssm.time_step_rank",
        "ssm.inner_size",
        "full_attention_interval",
        "nextn_predict_layers",
    }
)
_MOE_KEYS = frozenset(
    {
        "expert_count",
        "expert_used_count",
        "expert_feed_forward_length",
        "expert_shared_feed_forward_length",
        "expert_weights_norm",
        "expert_gating_func",
    }
)
_KEYS = {
    "qwen35": COMMON_KEYS,
    "qwen35moe": COMMON_KEYS | _MOE_KEYS,
    "qwen3next": COMMON_KEYS | _MOE_KEYS,
}
_SOFTMAX_GATING = 1  # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid
_DEFAULT_INTERVAL = 4  # llama.cpp's full_attention_interval when the key is absent

_LAYER = ATTENTION_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt": "linear_attn.dt_bias",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Parameters without a ``.weight`` / ``.bias`` leaf in the Hugging Face names.
_BARE = {"ssm_a", "ssm_dt"}
# Tensors the model reads as plain arrays, never as quantized products.
_VECTORS = {"ssm_conv1d", "ssm_a", "ssm_dt", "ssm_norm", "ffn_gate_inp_shexp"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
Get = Callable[..., object]


def refuse_unknown_keys(arch: str, meta: dict, path: str) -> None:
    refuse_unmapped(arch, meta, _KEYS[arch], path)


def _int(arch: str, key: str, get: Get, path: str, default: int | None = None) -> int:
    return hyper_int(arch, get, key, path, default, minimum=1)


def family_config(arch: str, config: dict, get: Get, path: str) -> dict:
    """``config`` (the common keys, read by ``runner.gguf.gguf_config``) completed with the
    hybrid's own keys, as the runner's ``qwen3_5_text`` / ``qwen3_5_moe_text`` config."""
    sparse = arch == "qwen35moe" or (arch == "qwen3next" and bool(get("expert_count")))
    config["model_type"] = "qwen3_5_moe_text" if sparse else "qwen3_5_text"
    blocks = config["num_hidden_layers"]
    mtp = get("nextn_predict_layers") or 0
    if not isinstance(mtp, int) or not 0 <= mtp < blocks:
        raise malformed(f"{arch}.nextn_predict_layers", f"{mtp!r} of {blocks} blocks", path)
    config["num_hidden_layers"] = blocks - mtp  # the MTP blocks are counted in block_count
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    config["head_dim"] = head_dim
    values = get("attention.value_length")
    if values is not None and int(values) != head_dim:
        why = f"values as wide as keys ({head_dim})"
        raise refuse(f"{arch}.attention.value_length", values, why, path)
    # llama.cpp rotates the whole head when the count is absent.
    rotated = _int(arch, "rope.dimension_count", get, path, head_dim)
    if rotated > head_dim or rotated % 2:
        raise malformed(f"{arch}.rope.dimension_count", f"{rotated} of head {head_dim}", path)
    config["partial_rotary_factor"] = rotated / head_dim
    inner = _int(arch, "ssm.inner_size", get, path)
    value_heads = _int(arch, "ssm.time_step_rank", get, path)
    key_heads = _int(arch, "ssm.group_count", get, path)
    if inner % value_heads or value_heads % key_heads:
        why = f"inner {inner}, {value_heads} value heads, {key_heads} key heads"
        raise malformed(f"{arch}.ssm.inner_size", why, path)
    config["linear_conv_kernel_dim"] = _int(arch, "ssm.conv_kernel", get, path)
    config["linear_key_head_dim"] = _int(arch, "ssm.state_size", get, path)
    config["linear_num_key_heads"] = key_heads
    config["linear_num_value_heads"] = value_heads
    config["linear_value_head_dim"] = inner // value_heads
    # llama.cpp's schedule: layer i is full attention when (i + 1) % interval == 0.
    config["full_attention_interval"] = _int(
        arch, "full_attention_interval", get, path, _DEFAULT_INTERVAL
    )
    if sparse:
        _moe(arch, config, get, path)
    return config


def _moe(arch: str, config: dict, get: Get, path: str) -> None:
    config["num_experts"] = _int(arch, "expert_count", get, path)
    config["num_experts_per_tok"] = _int(arch, "expert_used_count", get, path)
    config["moe_intermediate_size"] = _int(arch, "expert_feed_forward_length", get, path)
    # No shared-expert width: no shared expert (its tensors would then be refused unused).
    config["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length", 0))
    gating = get("expert_gating_func")
    if gating is not None and int(gating) != _SOFTMAX_GATING:
        raise refuse(f"{arch}.expert_gating_func", gating, "these hybrids route by softmax", path)
    norm = get("expert_weights_norm")
    if norm is not None and not norm:
        why = "these hybrids always renormalise the top-k weights"
        raise refuse(f"{arch}.expert_weights_norm", norm, why, path)


# --- tensors


def value_head_order(key_heads: int, value_heads: int) -> np.ndarray:
    """``order[h]``: the file position of value head ``h`` (grouped order), the converter
    having stored head ``k * r + j`` (key head k's j-th of r) at ``j * key_heads + k``."""
    per = value_heads // key_heads
    return np.arange(value_heads).reshape(per, key_heads).T.reshape(-1)


def _expand(heads: np.ndarray, width: int, offset: int = 0) -> np.ndarray:
    """Head order -> element order, ``width`` elements per head, after ``offset`` leading
    elements that stay in place."""
    inner = (heads[:, None] * width + np.arange(width)).reshape(-1)
    return np.concatenate([np.arange(offset), offset + inner])


@dataclass(frozen=True, eq=False)
class ColumnPermuted:
    """A quantized ``[N, K]`` tensor with its columns taken in ``order`` (``new[:, i] =
    old[:, order[i]]``) once unpacked: ``order`` moves whole affine groups, so values, scales
    and biases permute alike and the tensor stays exact and quantized
    (``runner.quantized.QuantizedTensor``)."""

    base: GGUFQuantized
    order: np.ndarray = field(repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        return self.base.shape

    @property
    def group(self) -> int:
        return self.base.group

    @property
    def bits(self) -> int:
        return self.base.bits

    @property
    def kind(self) -> str:
        return self.base.kind

    @property
    def nbytes(self) -> int:
        return self.base.nbytes

    def unpack(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        values, scales, biases = self.base.unpack()
        groups = self.order[:: self.group] // self.group
        return values[:, self.order], scales[:, groups], biases[:, groups]


def _rows(w, order: np.ndarray):
    if isinstance(w, GGUFQuantized):
        return w.take_rows(order)
    return w[mx.array(order)]


def _some_rows(w, rows: np.ndarray):
    """The ``rows`` of ``w`` (any subset): a quantized tensor's blocks of those rows."""
    if not isinstance(w, GGUFQuantized):
        return w[mx.array(rows)]
    taken = rows if w.rows is None else w.rows[rows]
    return GGUFQuantized(w.kind, (len(rows), w.shape[1]), w.blocks[taken])


def _split_fused(part: str, w, config: dict) -> dict[str, object]:
    """Qwen3-Next's fused rows, interleaved per key-head group (``ssm_in``: ``[q, k, v, z]``,
    ``ssm_ba``: ``[b, a]``), as Qwen3.5's separate projections, each in grouped order."""
    groups, per = config["linear_num_key_heads"], config["linear_num_value_heads"]
    per //= groups
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    if part == "ssm_ba":
        sizes, names = [per, per], ["in_proj_b", "in_proj_a"]
    else:
        sizes, names = [dk, dk, per * dv, per * dv], ["q", "k", "v", "z"]
    starts = np.cumsum([0] + sizes[:-1])
    width = sum(sizes)
    pieces = [
        (np.arange(groups)[:, None] * width + start + np.arange(size)).reshape(-1)
        for start, size in zip(starts, sizes, strict=True)
    ]
    if part == "ssm_ba":
        return {name: _some_rows(w, rows) for name, rows in zip(names, pieces, strict=True)}
    qkv, z = np.concatenate(pieces[:3]), pieces[3]
    return {"in_proj_qkv": _some_rows(w, qkv), "in_proj_z": _some_rows(w, z)}


def _columns(w, order: np.ndarray, width: int):
    """``w`` with its columns in ``order`` (runs of ``width``, one value head each)."""
    if not isinstance(w, GGUFQuantized):
        return w[:, mx.array(order)]
    if width % w.group == 0:
        return ColumnPermuted(w, order)
    # Runs that split an affine group: no exact quantized form, so float32.
    return mx.array(affine_dense(*w.unpack())[:, order])


def _undo_value_order(part: str, w, config: dict):
    """Put a tensor indexed by value head back in grouped order (module docstring)."""
    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    heads = value_head_order(key_heads, value_heads)
    dv = config["linear_value_head_dim"]
    keys = 2 * key_heads * config["linear_key_head_dim"]
    if part in ("attn_qkv", "ssm_conv1d"):
        return _rows(w, _expand(heads, dv, keys))
    if part == "attn_gate":
        return _rows(w, _expand(heads, dv))
    if part in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt"):
        return _rows(w, heads)
    if part == "ssm_out":
        return _columns(w, _expand(heads, dv), dv)
    return w


def map_hybrid_tensors(arch: str, weights: dict, config: dict) -> dict:
    """Rename a hybrid's GGUF tensors to the runner's Hugging Face names and undo the
    converter's transforms (module docstring); MTP blocks are dropped, unknown tensors stay
    under their GGUF names (surfacing as extras, never silently used)."""
    layers = config["num_hidden_layers"]
    out: dict = {}
    dropped = []
    for name, w in weights.items():
        stem, _, suffix = name.rpartition(".")
        if suffix not in ("weight", "bias"):  # the converter writes ssm_a bare: blk.N.ssm_a
            stem, suffix = name, ""
        if not stem.startswith("blk."):
            out[f"{_TOP[stem]}.{suffix}" if stem in _TOP else name] = w
            continue
        _, idx, part = stem.split(".", 2)
        if int(idx) >= layers:
            dropped.append(name)
            continue
        layer = f"model.layers.{idx}"
        if part == "ffn_gate_up_exps":  # fused by the converter: gate rows, then up rows
            gate, up = (
                f"{layer}.mlp.switch_mlp.gate_proj.weight",
                f"{layer}.mlp.switch_mlp.up_proj.weight",
            )
            if isinstance(w, list):  # quantized: each expert's halves as views of its rows
                half = w[0].shape[0] // 2
                out[gate] = [q.take_rows(np.arange(half)) for q in w]
                out[up] = [q.take_rows(np.arange(half, 2 * half)) for q in w]
                continue
            stack = dense_stack(w)
            half = stack.shape[1] // 2
            out[gate], out[up] = stack[:, :half], stack[:, half:]
            continue
        if part in ("ssm_in", "ssm_ba") and arch == "qwen3next":
            for leaf, split in _split_fused(part, w, config).items():
                out[f"{layer}.linear_attn.{leaf}.{suffix}"] = split
            continue
        mapped = _LAYER.get(part)
        if mapped is None:
            out[name] = w
            continue
        if isinstance(w, GGUFQuantized) and part in _VECTORS:
            w = mx.array(affine_dense(*w.unpack()))  # the converter keeps these float
        if arch != "qwen3next":  # Qwen3-Next files keep the grouped order
            w = _undo_value_order(part, w, config)
        if part == "ssm_a":
            w = mx.log(-w.astype(mx.float32))
        elif part == "ssm_conv1d":
            w = w.reshape(*w.shape, 1)  # [C, K] -> MLX's [C, K, 1]
        elif part == "ffn_gate_inp_shexp":
            w = w.reshape(1, -1)  # [1, D], whether stored 1-D or not
        elif part.endswith("_exps") and not isinstance(w, list):
            w = dense_stack(w)  # a quantized stack stays one matrix per expert (the loader's)
        out[f"{layer}.{mapped}" if part in _BARE else f"{layer}.{mapped}.{suffix}"] = w
    if dropped:
        log.info(
            "skipping %d MTP tensors of %s (%s, ...): the GGUF's MTP layers are not loaded",
            len(dropped),
            arch,
            dropped[0],
        )
    return out
