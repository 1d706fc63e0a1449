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

from .radix import CHECKPOINT, RadixTree


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
        """The id of the entry to evict first among `candidates` (the first of equals), or None if there is none.

        Candidates come as SnapshotCache._candidates gives them: covered KV entries first, then every entry in the
        order of last use. A covered entry first is the victim; otherwise a priority is never below an entry's
        last use (the bonus is >= 0), so reading stops at the first entry used no earlier than the best priority
        so far: an eviction ranks the entries within a few bonus spans of the oldest, not the whole tier (each
        value walks the entry's subtree, and a tier holds thousands). The answer is the full ranking's."""
        best, best_key = None, None
        for c in candidates:
            if best is None and c.tree.covered(c.eid):
                return c.eid
            if best_key is not None and (1, c.last_used) >= best_key:
                break
            key = self.priority(c.tree, c.eid, c.nbytes, c.last_used)
            if best_key is None or key < best_key:
                best, best_key = c, key
        return best.eid if best is not None else None


@dataclass(frozen=True)
class ValuePolicy:
    """Evict by the prefill an entry is likely to save per byte, with recency (Marconi, arXiv 2411.19379, weighs
    FLOPs saved per byte against recency; this weighs where requests restore).

    A request restores where it leaves the tree: at a fork (a shared system prompt, tools block or history), or
    at the end of a branch it continues (its conversation's last turn: the last message end, the repeat point,
    the prompt end, and the KV there). A checkpoint inside an unbranched stretch, more than `near_end` tokens
    above the stretch's end, is restored only by a request that diverges inside that stretch. With interval
    checkpoints every 512 tokens (--checkpoint-interval) these are most of a long prompt's bytes: a 12,000-token
    prompt of the 0.8B stores about 23 checkpoints (19.3 MiB each) beside 141 MiB of KV, and all but the last
    one or two are mid-stretch. Such a *mid-stretch* checkpoint ranks `horizon` lookups older than it is;
    every other entry by its last use; a covered KV entry (another KV entry deeper on its path restores all it
    does) goes first, as in `EvictionPolicy`.

        priority = (0, last_used)                                   covered KV
                   (1, last_used)                                   mid-stretch checkpoint
                   (1, last_used + horizon)                         the rest          (lowest goes first)

    `victim` expects covered KV entries first, then the rest in the order of last use (SnapshotCache keeps its
    hot tier so) and ranks only the oldest of each class, so an eviction reads a few entries, not all.
    """

    horizon: float = 4096.0  # lookups (about 12 per request with 4 slots) a likely restore point outlives others
    near_end: int = 512  # tokens: a checkpoint this close above a fork or branch end is a likely restore point
    recency_only = False

    def likely(self, tree: RadixTree, eid: int) -> bool:
        """Whether a later request is likely to restore entry `eid` (all but mid-stretch checkpoints)."""
        return tree.kind_of(eid) is not CHECKPOINT or tree.stretch_below(eid, self.near_end + 1) <= self.near_end

    def priority(self, tree: RadixTree, eid: int, nbytes: int, last_used: int) -> tuple[int, float]:
        """Sort key: lower is evicted first."""
        if tree.covered(eid):
            return 0, float(last_used)
        return 1, last_used + self.horizon * self.likely(tree, eid)

    def victim(self, candidates: Iterable[Candidate]) -> int | None:
        """The id of the entry to evict first among `candidates`, or None if there is none. The candidates come
        covered KV entries first, then in the order of last use (the first of equals goes); it stops reading
        them once it has the oldest of both classes (SnapshotCache._candidates gives them so)."""
        cheap = likely = None
        for c in candidates:
            if c.tree.covered(c.eid):
                return c.eid
            if self.likely(c.tree, c.eid):
                likely = likely or c
            else:
                cheap = cheap or c
            if cheap is not None and likely is not None:
                break
        if cheap is None or likely is None:
            best = cheap or likely
            return best.eid if best is not None else None
        return cheap.eid if cheap.last_used <= likely.last_used + self.horizon else likely.eid


# Eviction policies by name (Config.cache_policy, --cache-policy): each a factory of a fresh policy object.
POLICIES = {
    "lru": lambda: EvictionPolicy(bonus_ticks=0.0),  # least recently used first (covered KV still goes first)
    "recency-value": EvictionPolicy,  # recency with a bonus for tokens saved per byte and sharing (the default)
    "value": ValuePolicy,  # recency, mid-stretch checkpoints first (where requests are likely to restore)
}
