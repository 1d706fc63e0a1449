"""Snapshot cache: a radix tree of token prefixes over a byte-bounded LRU of snapshot bytes.

Knows tokens and bytes, nothing of llama.cpp or HTTP. The engine produces the bytes
(llama_state_seq_get_data) and consumes them (llama_state_seq_set_data).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from .radix import Match, RadixTree


@dataclass(frozen=True)
class CacheStats:
    """Counters since start. Bytes are snapshot payload bytes resident in RAM."""

    entries: int
    bytes: int
    budget_bytes: int
    hits: int
    misses: int
    inserts: int
    evictions: int
    rejected_too_large: int


class SnapshotCache:
    """Prefix cache of sequence-state snapshots, bounded by `budget_bytes`, least recently used out first.

    * `lookup(tokens, max_tokens)` returns the deepest stored prefix (a `Match`) and marks it used.
    * `get(snapshot_id)` returns the bytes; restoring copies them, the entry stays (never consumed).
    * `put(tokens, data)` stores a snapshot of the state after exactly `tokens`. The budget is checked before
      the insert: LRU entries are evicted until the new one fits, and a snapshot larger than the whole
      budget is not kept (`put` returns False). Resident bytes never exceed the budget.

    Thread-safe: one lock guards the tree and the LRU.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("cache budget must be >= 0 bytes")
        self.budget_bytes = budget_bytes
        self._tree = RadixTree()
        self._data: OrderedDict[int, bytes] = OrderedDict()  # LRU order: first = least recently used
        self._bytes = 0
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._hits = self._misses = self._inserts = self._evictions = self._too_large = 0

    def lookup(self, tokens: Sequence[int], max_tokens: int | None = None) -> Match:
        """Deepest snapshot whose tokens are a prefix of `tokens` and cover at most `max_tokens` tokens."""
        with self._lock:
            m = self._tree.match(tokens, max_tokens)
            if m.snapshot_id is None:
                self._misses += 1
            else:
                self._hits += 1
                self._data.move_to_end(m.snapshot_id)
            return m

    def get(self, snapshot_id: int) -> bytes | None:
        """Bytes of a snapshot, or None if it was evicted since the lookup."""
        with self._lock:
            data = self._data.get(snapshot_id)
            if data is not None:
                self._data.move_to_end(snapshot_id)
            return data

    def contains(self, tokens: Sequence[int]) -> bool:
        """Whether a snapshot of exactly `tokens` is stored (lets the engine skip a redundant save)."""
        with self._lock:
            return self._tree.find(tokens) is not None

    def put(self, tokens: Sequence[int], data: bytes) -> bool:
        """Store the state after exactly `tokens`; replaces one stored at the same prefix.

        Returns False (and stores nothing) if `data` alone exceeds the budget. Raises ValueError for an
        empty prefix.
        """
        nbytes = len(data)
        with self._lock:
            if nbytes > self.budget_bytes:
                self._too_large += 1
                return False
            old = self._tree.find(tokens)
            if old is not None:
                self._drop(old)
            while self._bytes + nbytes > self.budget_bytes:
                victim = next(iter(self._data))
                self._drop(victim)
                self._evictions += 1
            sid = next(self._ids)
            self._tree.insert(tokens, sid)
            self._data[sid] = data
            self._bytes += nbytes
            self._inserts += 1
            return True

    def _drop(self, sid: int) -> None:
        self._bytes -= len(self._data.pop(sid))
        self._tree.remove(sid)

    def clear(self) -> None:
        """Forget every snapshot."""
        with self._lock:
            for sid in list(self._data):
                self._drop(sid)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                entries=len(self._data),
                bytes=self._bytes,
                budget_bytes=self.budget_bytes,
                hits=self._hits,
                misses=self._misses,
                inserts=self._inserts,
                evictions=self._evictions,
                rejected_too_large=self._too_large,
            )

    def prefixes(self) -> list[tuple[int, ...]]:
        """Token prefixes stored, least recently used first (for tests and diagnostics)."""
        with self._lock:
            return [self._tree.tokens_of(sid) for sid in self._data]

    def check(self) -> None:
        """Recount bytes and entries from scratch and compare with the tree (for tests)."""
        with self._lock:
            self._tree.check()
            assert self._bytes == sum(len(d) for d in self._data.values())
            assert len(self._tree) == len(self._data)
            assert all(sid in self._tree for sid in self._data)
            assert self._bytes <= self.budget_bytes
