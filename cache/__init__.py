"""Per-layer KV caches with rewind and snapshots, the prefix trie and the per-request session."""

from cache.base import BaseCache, BaseSnapshot
from cache.kv import KVCache, KVSnapshot
from cache.session import CacheDesyncError, CacheSession, PrefixCache, trie_keys
from cache.trie import PrefixTrie
from cache.window import RotatingKVCache, WindowSnapshot

__all__ = [
    "BaseCache",
    "BaseSnapshot",
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
