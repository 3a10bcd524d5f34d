"""Lazy KV snapshots: free until an append overwrites them, bit-identical when restored."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cache.kv import KVCache, KVSnapshot, concat_snapshots
from runner.loader import load_model

HEADS, DIM = 2, 4
SLOT_BYTES = HEADS * DIM * 4  # one position of keys (float32)


def rows(first: int, count: int, sign: float = 1.0) -> np.ndarray:
    """Distinct, recognisable contents for positions ``first .. first + count``."""
    base = np.arange(first, first + count, dtype=np.float32)[None, None, :, None]
    grid = base + 0.001 * np.arange(HEADS * DIM, dtype=np.float32).reshape(1, HEADS, 1, DIM)
    return sign * grid


def append(cache: KVCache, data: np.ndarray) -> None:
    keys = mx.array(data)
    cache.update_and_fetch(keys, -keys)
    mx.eval(cache.state)


def held(cache: KVCache, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    return np.array(cache.keys[..., start:end, :]), np.array(cache.values[..., start:end, :])


def filled(count: int) -> tuple[KVCache, np.ndarray]:
    cache = KVCache()
    data = rows(0, count)
    append(cache, data)
    return cache, data


class Hook:
    def __init__(self) -> None:
        self.deltas: list[int] = []

    def __call__(self, delta: int) -> None:
        self.deltas.append(delta)


def test_snapshot_is_lazy_until_an_append_overwrites_its_range():
    cache, data = filled(10)
    snap = cache.snapshot(2, 6)
    hook = Hook()
    snap.on_resize = hook
    assert snap.lazy and snap.nbytes == 0 and snap.keys is None

    append(cache, rows(10, 5, -1))  # past the range
    cache.rewind(8)
    append(cache, rows(8, 3, -1))  # overwrites slots 8..10, not the range
    cache.rewind(6)
    append(cache, rows(6, 1, -1))  # slot 6 is just past the range
    assert snap.lazy and hook.deltas == []

    cache.rewind(5)
    assert snap.lazy  # a rewind alone copies nothing
    append(cache, rows(5, 1, -1))  # overwrites slot 5, the last slot of [2, 6)
    assert not snap.lazy
    assert snap.nbytes == 2 * 4 * SLOT_BYTES and hook.deltas == [snap.nbytes]
    np.testing.assert_array_equal(np.array(snap.keys), data[..., 2:6, :])
    np.testing.assert_array_equal(np.array(snap.values), -data[..., 2:6, :])


def test_one_append_copies_out_every_snapshot_it_overwrites():
    cache, data = filled(12)
    snaps = [cache.snapshot(a, b) for a, b in [(0, 3), (3, 6), (6, 9), (9, 12)]]
    cache.rewind(1)
    append(cache, rows(1, 7, -1))  # writes [1, 8): overlaps the first three ranges
    assert [s.lazy for s in snaps] == [False, False, False, True]
    for snap in snaps[:3]:
        np.testing.assert_array_equal(np.array(snap.keys), data[..., snap.start : snap.end, :])
    cache.restore(snaps[2])  # a copy: written back at 6
    cache.restore(snaps[3])  # still lazy: its slots were never written
    assert cache.offset == 12
    np.testing.assert_array_equal(held(cache, 6, 12)[0], data[..., 6:12, :])


def test_restoring_a_lazy_snapshot_moves_the_offset_even_forward():
    cache, data = filled(10)
    snap = cache.snapshot(4, 10)
    cache.rewind(4)
    cache.restore(snap, 7)
    assert cache.offset == 7 and snap.lazy
    cache.restore(snap)
    assert cache.offset == 10
    keys, values = held(cache, 0, 10)
    np.testing.assert_array_equal(keys, data)
    np.testing.assert_array_equal(values, -data)


def test_restoring_a_copy_writes_it_back_bit_identically():
    cache, data = filled(10)
    snap = cache.snapshot(4, 10)
    hook = Hook()
    snap.on_resize = hook
    cache.rewind(4)
    append(cache, rows(100, 9, -1))  # another branch: the range is copied out first
    assert not snap.lazy and cache.offset == 13

    cache.restore(snap, 8)  # partial: the copy is still needed for [8, 10)
    assert cache.offset == 8 and not snap.lazy
    np.testing.assert_array_equal(held(cache, 0, 8)[0], data[..., :8, :])

    cache.restore(snap)
    assert cache.offset == 10
    keys, values = held(cache, 0, 10)
    np.testing.assert_array_equal(keys, data)
    np.testing.assert_array_equal(values, -data)
    # Written back whole, the live buffer holds it again: the copy is dropped.
    assert snap.lazy and snap.nbytes == 0 and sum(hook.deltas) == 0


def test_restore_needs_the_prefix_in_place():
    cache, _ = filled(10)
    snap = cache.snapshot(4, 10)
    cache.rewind(2)
    with pytest.raises(ValueError, match="behind"):
        cache.restore(snap)
    other, _ = filled(10)
    with pytest.raises(ValueError, match="belongs"):
        other.restore(snap)


def test_reset_copies_out_lazy_snapshots_and_they_restore_into_fresh_buffers():
    cache, data = filled(20)
    head, tail = cache.snapshot(0, 8), cache.snapshot(8, 20)
    cache.reset()
    assert cache.keys is None and not head.lazy and not tail.lazy
    cache.restore(head)
    cache.restore(tail)
    assert cache.offset == 20
    np.testing.assert_array_equal(held(cache, 0, 20)[0], data)


def test_buffer_growth_keeps_lazy_ranges_below_the_offset():
    cache, data = filled(250)
    snap = cache.snapshot(0, 250)
    append(cache, rows(250, 20))  # grows the buffer from 256 to 512 slots
    assert cache.keys.shape[2] == 512 and snap.lazy
    cache.rewind(0)
    cache.restore(snap)
    np.testing.assert_array_equal(held(cache, 0, 250)[0], data)


def test_growing_write_copies_out_a_range_past_the_offset():
    cache, data = filled(250)
    snap = cache.snapshot(200, 250)
    cache.rewind(100)
    append(cache, rows(1000, 300, -1))  # [100, 400): overwrites the range and grows
    assert not snap.lazy
    np.testing.assert_array_equal(np.array(snap.keys), data[..., 200:250, :])


def test_split_and_concat_of_lazy_ranges_stay_lazy():
    cache, data = filled(12)
    snap = cache.snapshot(2, 12)
    head, tail = snap.split(5)
    assert (head.start, head.end, tail.start, tail.end) == (2, 5, 5, 12)
    assert head.lazy and tail.lazy and not snap.lazy and snap.nbytes == 0
    merged = concat_snapshots(head, tail)
    assert merged.lazy and (merged.start, merged.end) == (2, 12)
    cache.rewind(0)
    append(cache, rows(0, 3, -1))  # overwrites [0, 3): the merged range is copied out
    np.testing.assert_array_equal(np.array(merged.keys), data[..., 2:12, :])


def test_split_and_concat_of_copies_keep_the_data():
    cache, data = filled(12)
    lazy_part = cache.snapshot(0, 4)
    copied = cache.snapshot(4, 12)
    copied.materialise()
    head, tail = copied.split(7)
    np.testing.assert_array_equal(np.array(head.keys), data[..., 4:7, :])
    np.testing.assert_array_equal(np.array(tail.values), -data[..., 7:12, :])
    assert head.nbytes + tail.nbytes == 8 * SLOT_BYTES * 2
    merged = concat_snapshots(lazy_part, head)  # mixed: becomes one copy
    assert not merged.lazy and (merged.start, merged.end) == (0, 7)
    np.testing.assert_array_equal(np.array(merged.keys), data[..., 0:7, :])
    assert not cache._lazy  # nothing left protecting the buffer


def test_closed_and_dropped_snapshots_stop_protecting_the_buffer():
    cache, _ = filled(10)
    closed = cache.snapshot(0, 5)
    closed.close()
    dropped = cache.snapshot(5, 10)
    del dropped
    cache.rewind(0)
    append(cache, rows(0, 10, -1))
    assert closed.keys is None and not cache._lazy


def test_snapshot_range_must_be_inside_the_cache():
    cache, _ = filled(5)
    with pytest.raises(ValueError):
        cache.snapshot(3, 6)
    empty = cache.snapshot(5)
    assert isinstance(empty, KVSnapshot) and empty.nbytes == 0 and not empty.lazy


def test_model_branch_switch_through_snapshots_matches_a_fresh_forward(tiny_checkpoint):
    """Real forwards: a branch overwrites a snapshotted prefix; restoring it is exact."""
    model = load_model(tiny_checkpoint).model
    caches = model.make_caches()
    trunk, branch_a, branch_b = [5, 9, 17, 33, 2, 8], [40, 41, 42], [50, 51]
    model.forward(mx.array([trunk + branch_a]), caches)
    mx.eval([c.state for c in caches])
    saved = [c.snapshot(len(trunk)) for c in caches]  # branch_a's positions
    for c in caches:
        c.rewind(len(trunk))
    model.forward(mx.array([branch_b]), caches)
    mx.eval([c.state for c in caches])
    assert all(not s.lazy for s in saved)
    for c, snap in zip(caches, saved, strict=True):
        c.rewind(len(trunk))
        c.restore(snap)
    logits, _ = model.forward(mx.array([[7]]), caches)

    fresh = model.make_caches()
    expected, _ = model.forward(mx.array([trunk + branch_a + [7]]), fresh)
    np.testing.assert_allclose(np.array(logits[0, -1]), np.array(expected[0, -1]), atol=1e-4)


def test_keep_rows_leaves_the_chosen_rows_and_whole_snapshots():
    """A batch whose finished rows leave: the buffers keep rows [2, 0] in that order, appends
    continue at the same offset, and a lazy snapshot taken before still holds all three."""
    cache = KVCache()
    data = np.concatenate([rows(0, 5, sign) for sign in (1.0, 2.0, 3.0)])  # 3 batch rows
    append(cache, data)
    snap = cache.snapshot(0, 5)
    cache.keep_rows(mx.array([2, 0]))
    assert cache.offset == 5 and cache.keys.shape[0] == 2
    keys, values = held(cache, 0, 5)
    np.testing.assert_array_equal(keys, data[[2, 0]])
    np.testing.assert_array_equal(values, -data[[2, 0]])
    more = rows(5, 2)
    append(cache, np.concatenate([more, more]))
    assert cache.offset == 7
    assert not snap.lazy and snap.keys.shape[0] == 3
    np.testing.assert_array_equal(np.array(snap.keys), data)
