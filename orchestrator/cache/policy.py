"""Eviction policy for the RAM tier: which snapshot entry to spill first.

Least recently used first, with a bonus for what is expensive to recompute and widely shared:

    priority = last_used + bonus_ticks × log2(1 + value / reference)      (lowest priority goes first)
    value    = recompute_tokens × (1 + shared) / nbytes                    (tokens per byte)

  * recompute_tokens: tokens that must be prefilled again if the entry is gone — a checkpoint's, from the
    nearest ancestor checkpoint (one 64 tokens after another is cheap, the tools block is not); a KV entry's,
    only those no other KV entry covers (the KV of a dead branch that shares all but its last few tokens with a
    live one is cheap);
  * shared: how many distinct continuations (leaves) the entry's prefix has, so a prefix shared by many
    conversations (the tools block, a common system prompt) outlives their individual turns;
  * last_used: the lookup tick of the entry's last use; every doubling of value buys `bonus_ticks` lookups.

A KV entry with a deeper KV entry on the same path is *covered* (the deeper one restores every position it
does) and goes before everything else. Recency stays the main key because an agent's next request almost
always continues one of the most recent conversations; the bonus keeps the shared prefix and long, expensive
prefixes alive across many turns of others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, NamedTuple

from .radix import RadixTree


class Candidate(NamedTuple):
    """An entry that may be evicted: its id, the tree that holds it, its size and its last use (lookup tick)."""

    eid: int
    tree: RadixTree
    nbytes: int
    last_used: int


@dataclass(frozen=True)
class EvictionPolicy:
    bonus_ticks: float = 4.0  # lookups of extra life per doubling of value
    reference: float = 1 / 65536  # value (tokens per byte) that earns one doubling: 1 token per 64 KiB

    @property
    def recency_only(self) -> bool:
        """Whether the order is least recently used alone (covered KV first): the cache then takes the oldest
        entry of its hot tier without ranking them all (`SnapshotCache._oldest`)."""
        return not self.bonus_ticks

    def value(self, tree: RadixTree, eid: int, nbytes: int) -> float:
        """Tokens of prefill saved per byte held by entry `eid` (0 for covered KV)."""
        if tree.covered(eid):
            return 0.0
        return tree.recompute_tokens(eid) * (1 + tree.branches_below(eid)) / max(nbytes, 1)

    def priority(self, tree: RadixTree, eid: int, nbytes: int, last_used: int) -> tuple[int, float]:
        """Sort key: lower is evicted first."""
        if tree.covered(eid):
            return 0, float(last_used)
        if not self.bonus_ticks:  # least recently used: no value to weigh (it walks the tree)
            return 1, float(last_used)
        return 1, last_used + self.bonus_ticks * math.log2(1 + self.value(tree, eid, nbytes) / self.reference)

    def victim(self, candidates: Iterable[Candidate]) -> int | None:
        """The id of the entry to evict first among `candidates` (the first of equals), or None if there is none."""
        best = min(candidates, key=lambda c: self.priority(c.tree, c.eid, c.nbytes, c.last_used), default=None)
        return best.eid if best is not None else None


# Eviction policies by name (Config.cache_policy, --cache-policy): each a factory of a fresh policy object.
POLICIES = {
    "lru": lambda: EvictionPolicy(bonus_ticks=0.0),  # least recently used first (covered KV still goes first)
    "recency-value": EvictionPolicy,  # recency with a bonus for tokens saved per byte and sharing (the default)
}
