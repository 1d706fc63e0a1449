"""The snapshot cache: what is stored, where, and what leaves first. It knows tokens and bytes, never llama.cpp
or HTTP.

    radix.py      the radix tree over token ids: which stored prefix is deepest for a request
    policy.py     eviction order of the hot tier (least recently used, with a bonus for shared prefixes)
    tiers.py      the tier protocol and the RAM tier
    disk.py       the disk tier (diskcache): evicted snapshots kept across restarts
    snapshots.py  SnapshotCache: the index over the tiers (lookup, insert, spill, eviction)
"""

__all__ = ["CacheStats", "RestorePlan", "SnapshotCache"]


def __getattr__(name: str):
    """The public names, imported on first use: `orchestrator.state` imports `cache.radix`, and
    `cache.snapshots` imports `orchestrator.state`, so this package must not import `snapshots` eagerly."""
    if name in __all__:
        from . import snapshots
        return getattr(snapshots, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
