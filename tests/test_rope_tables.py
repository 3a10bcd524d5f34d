"""RoPE against transformers' own ``ROPE_INIT_FUNCTIONS``: the inverse frequencies and the
attention factor of every variant, for every sequence length a forward may end at
(``tests/fixtures/reference/rope_tables.json``, written by ``scripts/fixtures/rope_tables.py`` in
the reference environment), read through the config reader from both config layouts, and the
rotation both kernels apply with them."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from runner.models.config import read_llama_family
from runner.models.rope import RoPE

TABLES = Path(__file__).parent / "fixtures" / "reference" / "rope_tables.json"
DATA = json.loads(TABLES.read_text(encoding="utf-8"))
CASES = [(c["name"], layout) for c in DATA["cases"] for layout in c["configs"]]
BY_NAME = {c["name"]: c for c in DATA["cases"]}


def rope_of(config: dict) -> RoPE:
    """The RoPE a model built from ``config`` gets (the config reader, then the module)."""
    full = {"vocab_size": 320, "intermediate_size": 128, "num_hidden_layers": 1, **config}
    args = read_llama_family(full)
    return RoPE(
        args["head_dim"],
        base=args["rope_theta"],
        scaling=args["rope_scaling"],
        max_position_embeddings=args["max_position_embeddings"],
    )


def window(seq_len: int | None) -> tuple[int, int]:
    """A forward (offset, length) that ends at ``seq_len`` (None: a short one from 0)."""
    return (0, 5) if seq_len is None else (seq_len - 3, 3)


def test_every_variant_is_covered():
    kinds = {c["rope_type"] for c in DATA["cases"]}
    assert kinds == {"default", "linear", "dynamic", "llama3", "yarn", "longrope"}
    assert DATA["versions"]["transformers"].startswith("5.")


@pytest.mark.parametrize(("name", "layout"), CASES, ids=[f"{n}-{lay}" for n, lay in CASES])
def test_inverse_frequencies_and_attention_factor_match_transformers(name, layout):
    case = BY_NAME[name]
    rope = rope_of(case["configs"][layout])
    assert rope.kind == case["rope_type"]
    for table in case["tables"]:
        offset, length = window(table["seq_len"])
        got = rope.inv_freq(offset, length)
        want = np.array(table["inv_freq"], dtype=np.float64)
        np.testing.assert_allclose(got, want, rtol=2e-6, err_msg=f"seq_len {table['seq_len']}")
        assert rope.attention_factor == pytest.approx(table["attention_factor"], rel=1e-12)


def rotate_like_transformers(x: np.ndarray, positions: np.ndarray, inv_freq, factor) -> np.ndarray:
    """transformers' rotary embedding on ``x`` ``[..., L, D]``: float32 angles, cos and sin
    times the attention factor, ``x cos + rotate_half(x) sin``."""
    freqs = positions.astype(np.float32)[:, None] * np.array(inv_freq, dtype=np.float32)[None]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb) * factor, np.sin(emb) * factor
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("name", [c["name"] for c in DATA["cases"]])
@pytest.mark.parametrize("fast", [False, True], ids=["composed", "mx.fast"])
def test_both_kernels_rotate_as_transformers_does(name, fast):
    case = BY_NAME[name]
    rope = rope_of(next(iter(case["configs"].values())))
    rope.fast = fast
    for table in case["tables"]:
        if table["seq_len"] is not None and table["seq_len"] > 300:
            continue  # float32 angles that large differ between any two implementations
        offset, length = window(table["seq_len"])
        x = mx.random.normal((1, 2, length, rope.dims), key=mx.random.key(length + offset))
        got = np.array(rope.apply(x, rope.tables(offset, length)))
        want = rotate_like_transformers(
            np.array(x),
            np.arange(offset, offset + length),
            table["inv_freq"],
            table["attention_factor"],
        )
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_dynamic_base_follows_the_forward_and_leaves_earlier_periods_alone():
    rope = rope_of(BY_NAME["dynamic_2_max48"]["configs"]["new"])
    assert rope.depends_on_feed
    inside = np.array(rope.periods(0, 48))
    assert np.array_equal(inside, np.array(rope.periods(40, 1)))  # within the context: fixed
    past = [np.array(rope.periods(n - 1, 1)) for n in (49, 50, 60)]
    assert all((a[1:] < b[1:]).all() for a, b in zip([inside, *past], past, strict=False))
    # One forward over 60 positions uses the base of 60 for all of them.
    assert np.array_equal(np.array(rope.periods(0, 60)), past[-1])


def test_longrope_switches_factors_for_the_whole_forward():
    case = BY_NAME["longrope_phi3_fixture"]
    rope = rope_of(case["configs"]["old"])
    short, long = np.array(rope.periods(0, 32)), np.array(rope.periods(30, 3))
    assert not np.array_equal(short, long)
    assert np.array_equal(np.array(rope.periods(0, 33)), long)  # ends past 32: long, all rows
    assert np.array_equal(np.array(rope.periods(31, 1)), short)
