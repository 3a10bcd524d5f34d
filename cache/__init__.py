"""Per-layer KV caches with rewind and snapshots, the prefix trie and the per-request session."""

from cache.kv import KVCache, KVSnapshot, RotatingKVCache, WindowSnapshot
from cache.session import CacheDesyncError, CacheSession, PrefixCache, trie_keys
from cache.trie import PrefixTrie

__all__ = [
    "CacheDesyncError",
    "CacheSession",
    "KVCache",
    "KVSnapshot",
    "PrefixCache",
    "PrefixTrie",
    "RotatingKVCache",
    "WindowSnapshot",
    "trie_keys",
]
