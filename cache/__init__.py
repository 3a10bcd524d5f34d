"""Per-layer KV caches with rewind and snapshots, the prefix trie and the per-request session."""

from cache.kv import KVCache

__all__ = ["KVCache"]
