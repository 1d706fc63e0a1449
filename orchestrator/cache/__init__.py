"""The snapshot cache: what is stored, where, and what leaves first. It knows tokens and bytes, never llama.cpp
or HTTP.

    radix.py      the radix tree over token ids: which stored prefix is deepest for a request
    rules.py      how deep stored entries restore and what a new KV entry supersedes, by the kinds' capabilities
    policy.py     eviction order of the hot tier (least recently used, with a bonus for shared prefixes)
    tiers.py      the tier protocol, the RAM tier, and the guard every lower tier is called through
    disk.py       the disk tier (diskcache): evicted snapshots kept across restarts
    remote.py     the shared (Redis) tier
    snapshots.py  SnapshotCache: the index over the tiers (lookup, insert, spill, eviction)
"""

from .snapshots import CacheStats, RestorePlan, SnapshotCache

__all__ = ["CacheStats", "RestorePlan", "SnapshotCache"]
