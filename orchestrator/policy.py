"""Eviction policy for the RAM tier: which snapshot entry to spill first.

Cost-aware, not plain LRU. An entry's value per byte is

    value = recompute_tokens × (1 + shared) / nbytes × 0.5 ** (age / half_life)

  * recompute_tokens: tokens that must be prefilled again if the entry is gone (a checkpoint: from the
    nearest ancestor checkpoint, so one 64 tokens after another is cheap and the tools block is not; a KV
    entry: its whole prefix);
  * shared: how many distinct continuations (leaves) its prefix has, so a prefix shared by many conversations
    (the tools block, a common system prompt) outlives their individual turns;
  * age: lookups since the entry was last used; half_life in lookups (default 64) lets unused entries go.

A KV entry with a deeper KV entry on the same path is *covered* (the deeper one restores every position it
does): value 0, evicted first. The lowest value goes first; ties go least recently used first.
"""

from __future__ import annotations

from dataclasses import dataclass

from .radix import RadixTree


@dataclass(frozen=True)
class EvictionPolicy:
    half_life: float = 64.0  # lookups

    def value(self, tree: RadixTree, eid: int, nbytes: int, last_used: int, now: int) -> float:
        """Value per byte of keeping entry `eid` (higher = keep). `last_used`/`now` are lookup ticks."""
        if tree.covered(eid):
            return 0.0
        age = max(0, now - last_used)
        return tree.recompute_tokens(eid) * (1 + tree.branches_below(eid)) / max(nbytes, 1) \
            * 0.5 ** (age / self.half_life)

    def victim(self, tree: RadixTree, candidates: dict[int, tuple[int, int]], now: int) -> int:
        """The entry to evict among `candidates` ({eid: (nbytes, last_used)}). Raises ValueError if empty."""
        if not candidates:
            raise ValueError("nothing to evict")
        return min(candidates, key=lambda e: (self.value(tree, e, *candidates[e], now), candidates[e][1]))
