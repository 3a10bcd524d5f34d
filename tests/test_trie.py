"""The compressed prefix trie: matching, splitting, accounting and eviction order."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cache.kv import KVCache
from cache.trie import PrefixTrie

HEADS, DIM = 1, 2
SLOT_BYTES = 2 * HEADS * DIM * 4  # keys + values of one position, float32


def live_cache(count: int, salt: float = 0.0) -> tuple[KVCache, np.ndarray]:
    cache = KVCache()
    data = np.arange(count * HEADS * DIM, dtype=np.float32).reshape(1, HEADS, count, DIM) + salt
    cache.update_and_fetch(mx.array(data), mx.array(-data))
    mx.eval(cache.state)
    return cache, data


def overwrite_all(cache: KVCache) -> None:
    """Write over every slot, as a request on another branch would: copies everything out."""
    count = cache.offset
    cache.rewind(0)
    junk = mx.full((1, HEADS, count, DIM), -7.0)
    cache.update_and_fetch(junk, junk)
    mx.eval(cache.state)


def grow(trie: PrefixTrie, cache: KVCache, keys: list[int], frontier=None):
    frontier = frontier or trie.root
    return trie.extend(frontier, keys, len(keys), lambda a, b: [cache.snapshot(a, b)])


def shape(node) -> dict:
    """The subtree below ``node`` as nested {tuple(edge keys): subtree}."""
    return {tuple(c.keys): shape(c) for c in node.children.values()}


def test_match_takes_whole_edges_and_stops_inside_a_partial_one():
    cache, _ = live_cache(8)
    trie = PrefixTrie()
    grow(trie, cache, [1, 2, 3, 4, 5, 6])
    path, matched = trie.match([1, 2, 3, 9])
    assert matched == 3 and len(path) == 2 and path[1].end == 6  # partial: ends past the match
    path, matched = trie.match([1, 2, 3, 4, 5, 6, 7])
    assert matched == 6 and path[-1].end == 6
    assert trie.match([9, 1]) == ([trie.root], 0)
    assert trie.match([]) == ([trie.root], 0)


def test_extend_splits_a_partly_matching_edge_and_adds_one_new_child():
    cache, _ = live_cache(8)
    trie = PrefixTrie()
    (first,) = grow(trie, cache, [1, 2, 3, 4, 5, 6])
    first.user = True
    walked = grow(trie, cache, [1, 2, 3, 9, 9])
    assert shape(trie.root) == {(1, 2, 3): {(4, 5, 6): {}, (9, 9): {}}}
    head, new = walked
    assert (head.start, head.end, new.start, new.end) == (0, 3, 3, 5)
    assert first.start == 3 and first.parent is head and first.user and not head.user
    for node in trie.nodes():
        assert [(s.start, s.end) for s in node.snapshots] == [(node.start, node.end)]
    assert trie.entries == 3
    path, matched = trie.match([1, 2, 3, 9, 9, 9])
    assert matched == 5 and path == [trie.root, head, new]


def test_walked_nodes_get_fresh_lazy_snapshots():
    cache, _ = live_cache(8)
    trie = PrefixTrie()
    (node,) = grow(trie, cache, [1, 2, 3, 4])
    overwrite_all(cache)  # the same positions recomputed, as a repeat request does
    assert trie.nbytes == 4 * SLOT_BYTES == trie.recount()
    assert grow(trie, cache, [1, 2, 3, 4, 5])[0] is node
    assert trie.nbytes == 0 == trie.recount()
    assert node.snapshots[0].lazy


def test_byte_accounting_follows_copies_splits_merges_and_removals():
    cache, data = live_cache(10)
    trie = PrefixTrie()
    (node,) = grow(trie, cache, list(range(10)))
    assert trie.nbytes == 0
    overwrite_all(cache)
    assert trie.nbytes == 10 * SLOT_BYTES == trie.recount()
    head = trie.split(node, 4)
    assert trie.nbytes == 10 * SLOT_BYTES == trie.recount()
    np.testing.assert_array_equal(np.array(head.snapshots[0].keys), data[..., :4, :])
    merged = trie.merge_into_child(head)
    assert merged is node and node.keys == list(range(10)) and trie.entries == 1
    assert trie.nbytes == 10 * SLOT_BYTES == trie.recount()
    np.testing.assert_array_equal(np.array(node.snapshots[0].values), -data)
    trie.remove_leaf(node)
    assert trie.nbytes == 0 and trie.entries == 0 and trie.root.children == {}


def test_eviction_takes_the_oldest_then_the_deepest_then_the_largest():
    cache, _ = live_cache(12)
    trie = PrefixTrie()
    grow(trie, cache, [1, 2, 3, 4, 5, 6])
    grow(trie, cache, [1, 2, 7, 8, 9, 10, 11, 12])
    (solo,) = grow(trie, cache, [20, 21, 22])
    mid = trie.match([1, 2])[0][1]
    short = trie.match([1, 2, 3])[0][2]
    long = trie.match([1, 2, 7])[0][2]
    overwrite_all(cache)
    for node in (mid, short, long, solo):
        node.last_used = 1
    solo.last_used = 0
    total = trie.nbytes
    assert total == (2 + 4 + 6 + 3) * SLOT_BYTES

    assert trie.evict(total - 1, keep=[trie.root]) == 1
    assert solo.keys[0] not in trie.root.children  # the oldest went first
    assert trie.evict(trie.nbytes - 1, keep=[trie.root]) == 1
    assert shape(trie.root) == {(1, 2): {(3, 4, 5, 6): {}}}  # tie on age: the deeper one went
    assert trie.nbytes == trie.recount() == 6 * SLOT_BYTES


def test_eviction_tie_on_age_and_depth_takes_the_largest():
    cache, _ = live_cache(8)
    trie = PrefixTrie()
    grow(trie, cache, [1, 2, 3, 4, 5])  # [0, 3) becomes a branch point below
    small = grow(trie, cache, [1, 2, 3, 6, 7])[-1]  # [3, 5): 2 slots
    (big,) = grow(trie, cache, [9, 9, 9, 9, 9])  # [0, 5): 5 slots, same end
    other = trie.match([1, 2, 3, 4])[0][-1]
    overwrite_all(cache)
    for node in trie.nodes():
        node.last_used = 5
    small.last_used = big.last_used = 1
    assert small.end == big.end and big.nbytes > small.nbytes
    assert trie.evict(trie.nbytes - 1, keep=[trie.root]) == 1
    assert shape(trie.root) == {(1, 2, 3): {(4, 5): {}, (6, 7): {}}}
    assert other.parent.children[6] is small


def test_eviction_never_touches_branch_points_or_the_kept_path():
    cache, _ = live_cache(12)
    trie = PrefixTrie()
    for tail in ([3, 4], [5, 6], [7, 8]):
        grow(trie, cache, [1, 2, *tail])
    kept = grow(trie, cache, [9, 9, 9])
    overwrite_all(cache)
    branch = trie.root.children[1]
    for node in trie.nodes():
        node.last_used = 10 + node.keys[0]  # leaves 13, 15, 17
    branch.last_used = kept[0].last_used = 0  # the oldest, but protected
    assert trie.evict(trie.nbytes - 1, keep=[trie.root, *kept]) == 1
    assert shape(trie.root) == {(1, 2): {(5, 6): {}, (7, 8): {}}, (9, 9, 9): {}}
    assert trie.evict(trie.nbytes - 1, keep=[trie.root, *kept]) == 1
    assert shape(trie.root) == {(1, 2): {(7, 8): {}}, (9, 9, 9): {}}
    # Down to one child, the old branch point is an ordinary single-child node: it folds
    # into its child (freeing nothing), then the merged leaf goes.
    assert trie.evict(trie.nbytes - 1, keep=[trie.root, *kept]) == 2
    assert shape(trie.root) == {(9, 9, 9): {}}
    assert trie.entries == 1 and trie.nbytes == trie.recount() == 3 * SLOT_BYTES


def test_evicting_a_single_child_interior_node_folds_it_into_its_child():
    cache, data = live_cache(7)
    trie = PrefixTrie()
    (upper,) = grow(trie, cache, [1, 2, 3])
    (lower,) = grow(trie, cache, [1, 2, 3, 4, 5, 6, 7], frontier=upper)
    overwrite_all(cache)
    upper.last_used, lower.last_used = 1, 2
    before = trie.nbytes
    assert trie.evict(before - 1, keep=[lower]) == 1  # the merge frees no KV bytes
    assert shape(trie.root) == {(1, 2, 3, 4, 5, 6, 7): {}}
    assert lower.start == 0 and lower.last_used == 2 and trie.nbytes == before
    np.testing.assert_array_equal(np.array(lower.snapshots[0].keys), data)


def test_clear_releases_every_lazy_range():
    cache, _ = live_cache(6)
    trie = PrefixTrie()
    grow(trie, cache, [1, 2, 3])
    grow(trie, cache, [1, 2, 3, 4, 5, 6])
    trie.clear()
    assert trie.entries == 0 and trie.nbytes == 0 and trie.match([1, 2]) == ([trie.root], 0)
    overwrite_all(cache)
    assert not cache._lazy and trie.nbytes == 0


def test_split_rejects_offsets_outside_the_edge():
    cache, _ = live_cache(4)
    trie = PrefixTrie()
    (node,) = grow(trie, cache, [1, 2, 3, 4])
    for at in (0, 4, 5):
        with pytest.raises(ValueError):
            trie.split(node, at)
