"""Routed experts' checkpoint layouts, all read into the one ``runner.models.moe`` loads.

:func:`stack_experts`, run by the family's ``prepare_weights``, reads three layouts: per
expert (``mlp.experts.{i}.{gate,up,down}_proj.weight``, what transformers 5.24 writes), stacked
and fused as transformers 5 holds them in memory and Qwen3.6 ships them (``mlp.experts.
gate_up_proj`` ``[E, 2I, D]``, gate rows first, and ``mlp.experts.down_proj`` ``[E, D, I]``),
or mlx-lm's ``mlp.switch_mlp.*`` (plain or quantized): all end as ``switch_mlp``, the
``[E, out, in]`` stacks per projection that ``runner.models.moe.SwitchGLU`` multiplies.

A set of experts that is incomplete, indexed past ``num_experts``, stacked in an unexpected
shape or stored in two layouts at once is refused naming the tensor (``CorruptModelFile`` /
``MissingTensor``): a partial stack would route rows to experts that hold nothing.
"""

from __future__ import annotations

import re

import mlx.core as mx

from protocol.errors import CorruptModelFile, MissingTensor

_PER_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
_FUSED = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)(\.weight)?$")


def stack_experts(
    weights: dict[str, mx.array], sources: dict[str, str], num_experts: int
) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Every layout of routed experts (module docstring) as ``<mlp>.switch_mlp.<proj>.*``, for
    every layer that has them (an inline MTP layer too). An incomplete or malformed set of
    experts is a ``CorruptModelFile`` / ``MissingTensor`` naming the tensor."""
    out: dict[str, mx.array] = {}
    where: dict[str, str] = dict(sources)
    groups: dict[tuple[str, str, str], dict[int, str]] = {}
    for name, value in weights.items():
        per, fused = _PER_EXPERT.match(name), _FUSED.match(name)
        if per:
            mlp, index, proj, part = per.groups()
            groups.setdefault((mlp, proj, part), {})[int(index)] = name
        elif fused:
            mlp, kind, _ = fused.groups()
            src = sources.get(name)
            if value.ndim != 3 or value.shape[0] != num_experts:
                raise CorruptModelFile(
                    f"expected [{num_experts}, out, in] stacked experts, found "
                    f"{tuple(value.shape)}",
                    path=src,
                    tensor=name,
                )
            if kind == "down_proj":
                _put(out, where, f"{mlp}.switch_mlp.down_proj.weight", value, src)
                continue
            if value.shape[1] % 2:
                raise CorruptModelFile("gate_up_proj rows are not two halves", src, name)
            half = value.shape[1] // 2
            _put(out, where, f"{mlp}.switch_mlp.gate_proj.weight", value[:, :half], src)
            _put(out, where, f"{mlp}.switch_mlp.up_proj.weight", value[:, half:], src)
        else:
            out[name] = value
    for (mlp, proj, part), names in groups.items():
        missing = [i for i in range(num_experts) if i not in names]
        if missing:
            tensor = f"{mlp}.experts.{missing[0]}.{proj}.{part}"
            raise MissingTensor(
                f"expert {missing[0]} of {num_experts} is missing",
                path=sources.get(names[min(names)]),
                tensor=tensor,
            )
        extra = sorted(i for i in names if i >= num_experts)
        if extra:
            raise CorruptModelFile(
                f"expert {extra[0]} beyond num_experts {num_experts}",
                path=sources.get(names[extra[0]]),
                tensor=names[extra[0]],
            )
        stacked = mx.stack([weights[names[i]] for i in range(num_experts)])
        _put(out, where, f"{mlp}.switch_mlp.{proj}.{part}", stacked, sources.get(names[0]))
    return out, where


def _put(out: dict, where: dict, name: str, value: mx.array, source: str | None) -> None:
    if name in out:
        raise CorruptModelFile("experts stored in two layouts at once", path=source, tensor=name)
    out[name] = value
    if source is not None:
        where[name] = source
