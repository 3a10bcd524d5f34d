"""The sparse mixture-of-experts MLP shared by the MoE families (``qwen3_moe``, ``glm4_moe``
and the MoE layers of the Qwen3.5-MoE / Qwen3-Next hybrids in ``runner.models.qwen3_5``).

**Routing** (transformers 5.24's ``Qwen3MoeTopKRouter`` and ``Glm4MoeTopkRouter``):

- ``softmax`` (Qwen): router logits in the model's dtype, softmax in float32 over all
  experts, the top-k probabilities, divided by their sum when ``norm_topk_prob``, cast back to
  the logits' dtype;
- ``sigmoid`` (GLM, DeepSeek-V3's ``noaux_tc``): logits in float32 (a target's router weight
  and ``e_score_correction_bias`` stay float32 whatever the model's dtype, as transformers
  keeps them; an MTP head's take the model's dtype, as the head loader casts every float),
  scores ``sigmoid(logits)``; the bias is added for the *choice* only: with ``n_group``
  > 1 each group of ``E / n_group`` experts is rated by the sum of its two best biased scores
  and only the ``topk_group`` best groups stay candidates (the others -inf), then the top-k
  biased scores pick the experts; their weights are the *unbiased* scores, divided by
  ``sum + 1e-20`` when ``norm_topk_prob``, times ``routed_scaling_factor``.

**Experts** are stacked per projection as ``[E, out, in]`` (``switch_mlp.{gate,up,down}_proj``,
mlx-lm's names) and only the selected experts are computed, never the other experts' weights
and never a Python loop over experts. As loaded, one ``mx.gather_mm`` per projection reads the
k selected matrices of each row (experts kept quantized, mlx-lm's affine triples, use
``mx.gather_qmm`` the same way); on the CPU that is one BLAS product per (row, expert) pair, so
a verify row that shares an expert with another reads it again, and the down projection's
``[D, I]`` matrices, rows only ``I`` long, run well below the memory's rate. Device tuning
(:func:`lay_out_experts`, from ``runner.device.tune``) therefore re-lays them once:

- ``panels`` (the CPU default with ``runner.native``): every expert in the column panels of the
  native few-row product, gate and up fused, multiplied by its gathered product, which groups
  the (row, expert) pairs by expert and reads each selected expert once for all the rows that
  chose it (a verify feed pays for the union of its rows' experts, not for every pair), each
  pair bit for bit its one-row product (verify rows match plain decoding);
- ``packed`` (no native build): down stored ``[E, I, D]`` so the BLAS reads it along rows of
  length D (gate and up stay as loaded: their rows are D long already).

With ``gather_mm`` (as loaded, packed, or on a GPU) feeds of many (row, expert) pairs
(prefill chunks) are sorted by expert first, so each expert's rows are adjacent and MLX's
sorted gathered product (``sorted_indices``) can run them as one product per expert; below
``SORT_MIN_PAIRS`` (decode steps, short verify feeds) the sort is skipped: two argsorts and a
row gather per layer, for products of a handful of rows each. The panel product needs no sort.

**Shared expert**: ``plain`` (GLM ``shared_experts``, added) or ``gated`` (Qwen3-Next
``shared_expert`` scaled by ``sigmoid(shared_expert_gate(x))``); qwen3_moe has none.

**Checkpoint layouts**: per expert, stacked and fused, or mlx-lm's ``switch_mlp``; all end as
``switch_mlp`` (``runner.models.moe_weights.stack_experts``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

import runner.models.config as cfgs
from protocol.errors import UnsupportedArchitecture
from runner import native
from runner.models.layers import exact_products
from runner.models.llama import MLP, DecoderLayer, Linear, LlamaModel, ModelArgs
from runner.models.llama import Model as LlamaCausalLM
from runner.models.moe_weights import stack_experts
from runner.native import quantized as qpanels

SCORINGS = ("softmax", "sigmoid")
SHARED = (None, "plain", "gated")
# Feeds with at least this many (row, expert) pairs sort them by expert (see the docstring).
SORT_MIN_PAIRS = 64
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class MoESettings:
    """What a MoE config decides (kept in ``ModelArgs.extra["moe"]``)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per routed expert
    scoring: str  # one of SCORINGS
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per decoder layer: MoE (True) or dense MLP
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    correction_bias: bool = False  # e_score_correction_bias (sigmoid routing)
    shared: str | None = None  # one of SHARED
    shared_intermediate_size: int = 0


def settings(args: ModelArgs) -> MoESettings:
    found = args.extra.get("moe")
    if not isinstance(found, MoESettings):
        raise ValueError(f"{args.model_type} args carry no MoE settings (use model_args)")
    return found


# --- config fields


def read_field(
    cfg: dict,
    key: str,
    default: Any,
    kind: type,
    prefix: str,
    path: str | None,
    *,
    minimum: float | None = None,
    aliases: tuple[str, ...] = (),
) -> Any:
    """``cfg[key]`` (or the first alias present; ``default`` when absent or null) checked to
    be a ``kind`` (int, float or bool) no smaller than ``minimum``, else ``malformed``."""
    for name in (key, *aliases):
        if cfg.get(name) is not None:
            key, value = name, cfg[name]
            break
    else:
        value = default
    ok = (
        isinstance(value, bool)
        if kind is bool
        else (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and (kind is float or isinstance(value, int))
        )
    )
    if not ok or (minimum is not None and value < minimum):
        want = {bool: "true or false", int: "an integer", float: "a number"}[kind]
        bound = "" if minimum is None or kind is bool else f" >= {minimum}"
        raise cfgs.malformed(prefix + key, f"expected {want}{bound}, found {value!r}", path)
    return kind(value)


def qwen_sparse_layers(
    layers: int, num_experts: int, mlp_only_layers: list[int], decoder_sparse_step: int
) -> tuple[bool, ...]:
    """transformers' Qwen MoE schedule: layer i is sparse unless listed in ``mlp_only_layers``,
    when there are experts and ``(i + 1) % decoder_sparse_step == 0``."""
    return tuple(
        i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0
        for i in range(layers)
    )


# Qwen3MoeConfig's defaults (transformers 5.24); other Qwen MoE configs pass their own.
QWEN3_MOE_DEFAULTS = {
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
}


def read_qwen_moe(
    cfg: dict,
    layers: int,
    prefix: str,
    path: str | None,
    *,
    shared: bool,
    defaults: dict[str, Any] | None = None,
) -> MoESettings:
    """The MoE keys of the Qwen families (qwen3_moe; with ``shared`` the gated shared expert
    of qwen2_moe / qwen3_next / qwen3_5_moe, ``shared_expert_intermediate_size``), absent keys
    taking ``defaults`` (default :data:`QWEN3_MOE_DEFAULTS`)."""
    d = {**QWEN3_MOE_DEFAULTS, **(defaults or {})}
    experts = read_field(
        cfg,
        "num_experts",
        d["num_experts"],
        int,
        prefix,
        path,
        minimum=0,
        aliases=("num_local_experts",),
    )
    top_k = read_field(
        cfg, "num_experts_per_tok", d["num_experts_per_tok"], int, prefix, path, minimum=1
    )
    width = read_field(
        cfg, "moe_intermediate_size", d["moe_intermediate_size"], int, prefix, path, minimum=1
    )
    step = read_field(
        cfg, "decoder_sparse_step", d["decoder_sparse_step"], int, prefix, path, minimum=1
    )
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in only
    ):
        raise cfgs.malformed(prefix + "mlp_only_layers", f"expected layer indices: {only!r}", path)
    if experts and top_k > experts:
        raise cfgs.malformed(
            prefix + "num_experts_per_tok", f"{top_k} > num_experts {experts}", path
        )
    shared_width = read_field(
        cfg,
        "shared_expert_intermediate_size",
        d.get("shared_expert_intermediate_size", 0),
        int,
        prefix,
        path,
        minimum=0,
    )
    if shared_width and not shared:
        raise cfgs.refuse(
            prefix + "shared_expert_intermediate_size",
            shared_width,
            "this family has no shared expert (the checkpoint needs other model code)",
            path,
        )
    return MoESettings(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=width,
        scoring="softmax",
        norm_topk_prob=read_field(cfg, "norm_topk_prob", d["norm_topk_prob"], bool, prefix, path),
        sparse_layers=qwen_sparse_layers(layers, experts, only, step),
        shared="gated" if shared and shared_width else None,
        shared_intermediate_size=shared_width,
    )


# --- the block


class Router(Linear):
    """The router's ``[E, D]`` product (``gate``; the runner's ``Linear``, so device tuning
    packs it like any projection), with DeepSeek-V3 / GLM's ``e_score_correction_bias`` when
    the settings ask for it."""

    def __init__(self, dims: int, s: MoESettings) -> None:
        super().__init__(dims, s.num_experts, bias=False)
        if s.correction_bias:
            self.e_score_correction_bias = mx.zeros((s.num_experts,))

    def to_quantized(self, *args: Any, **kwargs: Any) -> nn.Module:
        if "e_score_correction_bias" in self:
            raise UnsupportedArchitecture(
                "a quantized MoE router with e_score_correction_bias (sigmoid routing keeps "
                "its router in float32; dequantize the checkpoint's mlp.gate)"
            )
        return super().to_quantized(*args, **kwargs)


def route(gate: nn.Module, x: mx.array, s: MoESettings) -> tuple[mx.array, mx.array]:
    """``(experts [T, k] int32, weights [T, k])`` for rows ``x`` ``[T, D]`` (module
    docstring); weights are float32 for sigmoid routing, the logits' dtype for softmax."""
    k = s.top_k
    if s.scoring == "softmax":
        logits = gate(x)
        probs = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
        experts = mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k]
        weights = mx.take_along_axis(probs, experts, axis=-1)
        if s.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return experts, weights.astype(logits.dtype)
    scores = mx.sigmoid(gate(x.astype(mx.float32)).astype(mx.float32))
    choice = scores
    if "e_score_correction_bias" in gate:
        choice = scores + gate.e_score_correction_bias.astype(mx.float32)
    if s.n_group > 1:
        rows = choice.shape[0]
        grouped = choice.reshape(rows, s.n_group, -1)
        rating = mx.topk(grouped, 2, axis=-1).sum(axis=-1)  # [T, G]
        dropped = s.n_group - s.topk_group
        if dropped:
            worst = mx.argpartition(rating, kth=dropped - 1, axis=-1)[..., :dropped]
            grouped = mx.put_along_axis(
                grouped, worst[..., None], mx.array(-mx.inf, mx.float32), axis=1
            )
        choice = grouped.reshape(rows, -1)
    experts = mx.argpartition(-choice, kth=k - 1, axis=-1)[..., :k]
    weights = mx.take_along_axis(scores, experts, axis=-1)
    if s.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return experts, weights * s.routed_scaling_factor


class SwitchLinear(nn.Module):
    """``E`` stacked ``[out, in]`` matrices; a call multiplies each row by its experts' only.

    Stored as loaded (``weight``) until device tuning (:func:`lay_out_experts`) moves it to a
    private array: ``_wt`` (``[E, in, out]`` contiguous) or ``_panels``
    (``runner.native.expert_panels``, a view of its block's fused gate/up panels for those
    two); :meth:`dense` reads either back."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int) -> None:
        super().__init__()
        self.weight = mx.zeros((num_experts, output_dims, input_dims))
        self.output_dims = output_dims  # kept up to date by lay_out (the weight may go)

    def __call__(self, x: mx.array, experts: mx.array, sorted_indices: bool) -> mx.array:
        return mx.gather_mm(x, self.operand(), rhs_indices=experts, sorted_indices=sorted_indices)

    def operand(self) -> mx.array:
        """The ``[E, in, out]`` right operand of ``gather_mm`` (a transposed view or ``_wt``)."""
        return self._wt if "_wt" in self else self.weight.swapaxes(-1, -2)

    def dense(self) -> mx.array:
        """The ``[E, out, in]`` experts, whatever the layout."""
        if "weight" in self:
            return self.weight
        if "_wt" in self:
            return self._wt.swapaxes(-1, -2)
        p = self._panels  # [E, NB, in, P] -> [E, NB * P, in], cut to out
        if p.dtype == mx.uint8:  # quantized: [E, NB, groups, rows, 2 bits]
            return mx.stack([qpanels.dense(p[e], self.output_dims).T for e in range(p.shape[0])])
        e, nb, k, width = p.shape
        return p.transpose(0, 1, 3, 2).reshape(e, nb * width, k)[:, : self.output_dims]

    def panel_product(self, x: mx.array, experts: mx.array) -> mx.array:
        """``[T, k, out]`` for ``x`` ``[T, 1 or k, in]``: over ``_panels`` (float or quantized:
        :func:`gathered`), or ``gather_mm`` over the weight as it is held."""
        if "_panels" not in self:
            y = mx.gather_mm(x[:, :, None, :], self.operand(), rhs_indices=experts)
            return y.squeeze(-2)
        return gathered(x, self._panels, experts, self.output_dims)

    def to_quantized(
        self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_: Any
    ) -> QuantizedSwitchLinear:
        """The quantized twin (``nn.quantize`` and the loader's ``quantize_model`` call it)."""
        experts, out, _ = self.weight.shape
        q = QuantizedSwitchLinear(experts, out, group_size, bits, mode)
        q.weight, q.scales, q.biases = mx.quantize(self.weight, group_size, bits, mode=mode)
        return q


class QuantizedSwitchLinear(nn.Module):
    """Affine-quantized stacked experts (mlx-lm's triples), multiplied with ``gather_qmm``."""

    def __init__(self, experts: int, out: int, group_size: int, bits: int, mode: str) -> None:
        super().__init__()
        if mode != "affine":
            raise UnsupportedArchitecture(f"quantization mode {mode!r} for MoE experts")
        self.group_size, self.bits = group_size, bits
        # Placeholders; the loader replaces them with the checkpoint's tensors.
        self.weight = mx.zeros((experts, out, 1), dtype=mx.uint32)
        self.scales = mx.zeros((experts, out, 1))
        self.biases = mx.zeros((experts, out, 1))

    def __call__(self, x: mx.array, experts: mx.array, sorted_indices: bool) -> mx.array:
        return mx.gather_qmm(
            x,
            self.weight,
            self.scales,
            self.biases,
            rhs_indices=experts,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            sorted_indices=sorted_indices,
        )

    def dequantized(self) -> mx.array:
        return mx.dequantize(self.weight, self.scales, self.biases, self.group_size, self.bits)


class SwitchGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` per selected expert.

    Three layouts (:func:`lay_out_experts`): as loaded, one ``gather_mm`` per projection;
    ``packed``, the same with down stored ``[E, I, D]``; ``panels``, ``runner.native``'s
    gathered product over each expert's column panels (gate and up fused as ``_gate_up_p``,
    one product for both, when ``I`` is a whole number of panels), which needs no sort at any
    size (it groups the pairs by expert itself)."""

    def __init__(self, dims: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.gate_proj = SwitchLinear(dims, hidden, num_experts)
        self.up_proj = SwitchLinear(dims, hidden, num_experts)
        self.down_proj = SwitchLinear(hidden, dims, num_experts)

    def _glu(self, x: mx.array, experts: mx.array, ordered: bool) -> mx.array:
        gate, up = self.gate_proj(x, experts, ordered), self.up_proj(x, experts, ordered)
        return self.down_proj(nn.silu(gate) * up, experts, ordered)

    def _panels(self, x: mx.array, experts: mx.array) -> mx.array:
        rows = x[:, None, :]  # [T, 1, D]: every expert of row t reads row t
        if "_gate_up_p" in self:
            fused = gathered(rows, self._gate_up_p, experts, 2 * self.hidden)
            gate, up = mx.split(fused, 2, axis=-1)
        else:
            gate = self.gate_proj.panel_product(rows, experts)
            up = self.up_proj.panel_product(rows, experts)
        return self.down_proj.panel_product(nn.silu(gate) * up, experts)

    def in_panels(self) -> bool:
        """Whether any projection is in (float or quantized) expert panels: a checkpoint's
        quantized experts are, from load on, beside float ones the layout has not moved."""
        return any("_panels" in p for p in (self.gate_proj, self.up_proj, self.down_proj))

    @property
    def hidden(self) -> int:
        return self.gate_proj.output_dims

    def __call__(self, x: mx.array, experts: mx.array) -> mx.array:
        """``[T, k, D]``: row t through each of its experts ``experts[t]``."""
        if self.in_panels():
            return self._panels(x, experts)
        rows, k = experts.shape
        if experts.size < SORT_MIN_PAIRS:
            return self._glu(x[:, None, None, :], experts, False).squeeze(-2)
        flat = experts.flatten()
        order = mx.argsort(flat)
        y = self._glu(x[order // k][:, None, :], flat[order], True)
        return y[mx.argsort(order)].reshape(rows, k, -1)

    def quantize_in_panels(self, bits: int, group: int = 64) -> bool:
        """Quantize the float experts into quantized expert panels (``bits`` 4 or 8, affine
        groups of ``group`` inputs, or of 32 or 16 where ``group`` does not divide a
        projection's inputs: ``--quantize`` on the CPU), gate and up fused when ``I`` is whole
        panels; False when they cannot (already laid out, outputs not whole panels)."""
        parts = (self.gate_proj, self.up_proj, self.down_proj)
        if not all(type(p) is SwitchLinear and "weight" in p for p in parts):
            return False
        if any(p.weight.shape[1] % native.PANEL for p in parts):
            return False
        groups = [_group_for(p.weight.shape[2], group) for p in parts]
        if None in groups:
            return False
        gate, up, down = (p.weight for p in parts)
        half = gate.shape[1] // native.PANEL
        fused = mx.concatenate([gate, up], axis=1)
        self._gate_up_p = native.expert_qpanels(fused, bits, groups[0])
        self.gate_proj._panels = self._gate_up_p[:, :half]
        self.up_proj._panels = self._gate_up_p[:, half:]
        self.gate_proj.fused = self.up_proj.fused = True  # views: held once
        self.down_proj._panels = native.expert_qpanels(down, bits, groups[2])
        for p in parts:
            p.output_dims = p.weight.shape[1]
            del p["weight"]
        return True

    def lay_out(self, layout: str) -> bool:
        """Store the experts in ``layout`` (see the class docstring; "hf" leaves them as
        loaded); False when they stay as they are (quantized, already laid out, "hf")."""
        parts = (self.gate_proj, self.up_proj, self.down_proj)
        if layout == "panels" and self.in_panels():
            # A checkpoint's quantized experts beside float ones: the float ones join them in
            # (float) expert panels, so the block runs one gathered product per projection.
            moved = [p for p in parts if "weight" in p]
            for p in moved:
                p._panels = native.expert_panels(p.weight)
                p.output_dims = p.weight.shape[1]
                del p["weight"]
                mx.eval(p._panels)
            return bool(moved)
        if layout == "hf" or not all(type(p) is SwitchLinear and "weight" in p for p in parts):
            return False
        gate, up, down = (p.weight for p in parts)
        hidden = gate.shape[1]
        fresh: list[mx.array] = []
        if layout == "packed":
            # gather_mm runs a BLAS product per (row, expert) pair over the [out, in] matrix
            # (the transposed operand): for gate and up its rows are D long and that is the
            # faster order, and fusing the two into one [2I, D] product is no faster there;
            # down's rows are only I long, and a one-row product over short rows runs well
            # below the memory's rate, so down goes [in, out] (rows of length D).
            self.down_proj._wt = mx.contiguous(down.swapaxes(-1, -2))
            fresh = [self.down_proj._wt]
            parts = (self.down_proj,)
        elif layout == "panels":
            if hidden % native.PANEL == 0:
                self._gate_up_p = native.expert_panels(mx.concatenate([gate, up], axis=1))
                half = hidden // native.PANEL
                self.gate_proj._panels = self._gate_up_p[:, :half]
                self.up_proj._panels = self._gate_up_p[:, half:]
                self.gate_proj.fused = self.up_proj.fused = True  # views: held once
                fresh = [self._gate_up_p]
            else:
                self.gate_proj._panels = native.expert_panels(gate)
                self.up_proj._panels = native.expert_panels(up)
                fresh = [self.gate_proj._panels, self.up_proj._panels]
            self.down_proj._panels = native.expert_panels(down)
            fresh.append(self.down_proj._panels)
        else:
            raise ValueError(f"unknown expert layout {layout!r}")
        for p in parts:
            p.output_dims = p.weight.shape[1]
            del p["weight"]
        mx.eval(fresh)  # one block at a time: the loaded copy goes as the new one is made
        return True


def _group_for(inputs: int, group: int) -> int | None:
    """``group`` if it divides ``inputs``, else the largest of 32 and 16 that does (quantized
    panels take groups of 16 or multiples of 32); None when none does."""
    for g in (group, 32, 16):
        if g <= group and inputs % g == 0:
            return g
    return None


def gathered(x: mx.array, panels: mx.array, experts: mx.array, n: int) -> mx.array:
    """The gathered product over expert panels, float32 or quantized (the process's exact or
    int8-activation choice, ``runner.models.layers.exact_products``)."""
    if panels.dtype == mx.uint8:
        return native.gather_qpanel_matmul(x, panels, experts, n, exact=exact_products())
    return native.gather_panel_matmul(x, panels, experts, n)


def quantize_experts(module: nn.Module, bits: int) -> int:
    """Every routed-expert block below ``module`` in quantized expert panels (see
    ``SwitchGLU.quantize_in_panels``); returns how many blocks. Needs the native build."""
    if not native.gathered_quantized_available():
        return 0
    return sum(
        child.quantize_in_panels(bits)
        for _, child in module.named_modules()
        if isinstance(child, SwitchGLU)
    )


def lay_out_experts(module: nn.Module, layout: str) -> int:
    """Every routed-expert block below ``module`` in ``layout`` ("hf", "packed" or "panels",
    as ``runner.device.tune`` names the model's layout; "panels" needs the gathered product
    in ``runner.native``, else the experts are packed); returns how many blocks moved. Run by
    device tuning only, before compiling (compiled blocks keep the weights they traced)."""
    if layout == "panels" and not native.gathered_available():
        layout = "packed"
    return sum(
        child.lay_out(layout) for _, child in module.named_modules() if isinstance(child, SwitchGLU)
    )


class SparseMoE(nn.Module):
    """The MoE MLP of one decoder layer (router, routed experts, optional shared expert)."""

    def __init__(self, args: ModelArgs, s: MoESettings) -> None:
        super().__init__()
        dim = args.hidden_size
        self.settings = s
        self.gate = Router(dim, s)
        self.switch_mlp = SwitchGLU(dim, s.intermediate_size, s.num_experts)
        if s.shared is not None:
            shared_args = dataclasses.replace(
                args, intermediate_size=s.shared_intermediate_size, mlp_bias=False
            )
            if s.shared == "plain":
                self.shared_experts = MLP(shared_args)
            else:
                self.shared_expert = MLP(shared_args)
                self.shared_expert_gate = Linear(dim, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        experts, weights = route(self.gate, rows, self.settings)
        y = self.switch_mlp(rows, experts)  # [T, k, D]
        y = (y.astype(mx.float32) * weights[..., None].astype(mx.float32)).sum(axis=1)
        y = y.astype(x.dtype).reshape(shape)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        elif "shared_expert" in self:
            y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


class MoEDecoderLayer(DecoderLayer):
    """A llama-family block whose MLP is a :class:`SparseMoE` when ``sparse``; families pass
    their attention class."""

    attention: type[nn.Module] | None = None

    def __init__(self, args: ModelArgs, sparse: bool) -> None:
        super().__init__(args)
        if self.attention is not None:
            self.self_attn = self.attention(args)
        if sparse:
            self.mlp = SparseMoE(args, settings(args))


class MoEStack(LlamaModel):
    layer = MoEDecoderLayer

    def __init__(self, args: ModelArgs) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [self.layer(args, sparse) for sparse in settings(args).sparse_layers]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class MoEModel(LlamaCausalLM):
    """A llama-family causal LM whose stack has MoE layers (``prepare_weights`` puts the
    experts in one layout; a sigmoid router stays float32)."""

    inner = MoEStack
    takes_layer_hook: bool = True  # llama's ``hidden``, ``on_layer`` included

    def prepare_weights(
        self, weights: dict[str, mx.array], sources: dict[str, str]
    ) -> tuple[dict[str, mx.array], dict[str, str]]:
        """Run by the loader before its checks (``runner.loader.load_model``)."""
        s = settings(self.args)
        weights, sources = stack_experts(weights, sources, s.num_experts)
        if s.scoring == "sigmoid":
            # transformers keeps these float32 (_keep_in_fp32_modules_strict); the loader
            # casts every float to the model's dtype, so load_weights puts them back.
            own = {
                f"model.layers.{i}.mlp.gate" for i, sparse in enumerate(s.sparse_layers) if sparse
            }
            keep = {
                name: value.astype(mx.float32)
                for name, value in weights.items()
                if name.rpartition(".")[0] in own and mx.issubdtype(value.dtype, mx.floating)
            }
            object.__setattr__(self, "_float32_router", keep)
        return weights, sources

    def load_weights(self, file_or_weights, strict: bool = True) -> nn.Module:
        keep = self.__dict__.pop("_float32_router", None)
        if keep and isinstance(file_or_weights, list):
            file_or_weights = [(n, keep.get(n, w)) for n, w in file_or_weights]
        return super().load_weights(file_or_weights, strict=strict)
