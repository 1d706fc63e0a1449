"""Storage tiers of the snapshot cache: one protocol, bytes in and bytes out, and the RAM tier.

A tier stores opaque snapshot payloads under string keys (the cache's `disk_key`: salt, kind, length and hash of
the prefix), with the entry's kind and, where the tier persists them, its token ids. It knows nothing of the
radix tree, of llama.cpp or of HTTP. `SnapshotCache` holds an ordered list of tiers, fastest first:

    tiers[0]   the hot tier (RAM). The cache decides what leaves it, by its eviction policy, and moves it to
               the first lower tier that takes it. A hot tier never evicts on its own: `put` refuses (False)
               what does not fit.
    tiers[1:]  lower tiers (disk, then remote). Each keeps within its own budget by evicting on its own (least
               recently used), and reports every key it evicted through `on_evict`, so that the cache's index
               forgets it.

A shared tier (`SharedTier`, `shared` True: the remote tier, which other replicas write to) differs in three
ways: the cache writes every new entry to it at once (write-behind: `put` queues and returns), not when RAM
evicts it; it is never listed (`entries()` is empty), the cache asks it per request what it holds for the
request's prefixes (`probe`); and it evicts silently, so the index keeps its entries only for the request that
found them.

Failure semantics: a failing tier is a miss, never an error to the client. `get` of a key that is missing,
corrupt or unreadable returns None; `put` that cannot store returns False; a tier that breaks (a full or
failing disk) disables its writes and says so once in the log. The cache also treats an exception out of a
lower tier as a miss (logged once per tier: `GuardedTier`, the wrapper the cache calls lower tiers through), so
a broken tier costs prefill time, not requests.

A new tier is one class with the members of `Tier`.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, Protocol, Sequence, runtime_checkable

from .radix import EntryKind

log = logging.getLogger("orchestrator.cache.tiers")


class Stored(NamedTuple):
    """What `Tier.get` returns. tokens: the prefix the payload belongs to, or None from a tier that does not
    keep token ids (RAM: the cache's own index knows them)."""

    kind: EntryKind
    tokens: tuple[int, ...] | None
    payload: bytes


@dataclass(frozen=True)
class EntryInfo:
    """One stored entry as `Tier.entries()` lists it. `nbytes`: what it costs the tier's budget."""

    key: str
    kind: EntryKind
    tokens: tuple[int, ...] | None
    nbytes: int


@dataclass(frozen=True)
class TierStats:
    """Counters of one tier since it opened, and what it holds now (`bytes` as counted against its budget)."""

    name: str
    entries: int
    bytes: int
    budget_bytes: int
    hits: int = 0
    misses: int = 0
    inserts: int = 0
    evictions: int = 0  # entries the tier evicted on its own to fit its budget
    rejected_too_large: int = 0
    rejected_invalid: int = 0  # entries found corrupt or of another model, deleted
    disabled: bool = False  # writes are off after a failure (a shared tier: unreachable now)
    errors: int = 0  # operations that failed (connection, timeout, refused): each served as a miss
    dropped: int = 0  # writes not made: the write-behind queue was full or the tier unreachable


@runtime_checkable
class Tier(Protocol):
    """A byte store of snapshot entries under string keys. See the module docstring for the failure semantics.

    Thread-safety is the tier's own business (the cache calls it under its lock, the tier may be shared).
    """

    name: str  # "ram", "disk", "remote": reported as `restore_source` and as the metrics' tier label
    shared: bool  # other processes write to it (SharedTier)
    on_evict: Callable[[str], None] | None  # called with each key the tier evicted on its own

    @property
    def budget_bytes(self) -> int: ...

    @property
    def bytes(self) -> int: ...

    def __len__(self) -> int: ...

    def get(self, key: str) -> Stored | None:
        """The entry under `key`, or None (absent, corrupt, unreadable: a miss). Marks it used."""

    def put(self, key: str, tokens: Sequence[int], kind: EntryKind, payload: bytes) -> bool:
        """Store `payload` under `key`, replacing what was there. False when nothing was stored."""

    def contains(self, key: str) -> bool:
        """Whether an entry is stored under `key` (without reading or touching it)."""

    def delete(self, key: str) -> bool:
        """Forget `key`; whether it was stored."""

    def entries(self) -> Iterator[EntryInfo]:
        """Every entry, in the tier's eviction order where it has one (least recently used first). The cache
        rebuilds its index from a persistent tier with it."""

    def stats(self) -> TierStats: ...

    def close(self) -> None:
        """Release files and connections. Idempotent."""


@runtime_checkable
class SharedTier(Tier, Protocol):
    """A tier other replicas write to and read from (the module docstring says how the cache uses it)."""

    def put(self, key: str, tokens: Sequence[int], kind: EntryKind, payload: bytes,
            covers: Sequence[int] = ()) -> bool:
        """Queue the entry for writing; False when it is dropped. `covers`: for a KV entry, the shallower
        positions (< len(tokens)) where a checkpoint is stored on its path: the entry is listed there too, so
        that a replica restoring one of them finds KV that covers it."""

    def probe(self, tokens: Sequence[int], lo: int, hi: int, sid: str) -> list["Listed"]:
        """Entries of salt id `sid` that restore tokens[:n] for lo < n <= hi, checked against `tokens`. [] when
        the tier is unreachable."""

    def transfer_s(self, nbytes: int) -> float:
        """Measured seconds to read `nbytes` now (math.inf while unreachable or unmeasured)."""


@dataclass(frozen=True)
class Listed:
    """An entry a shared tier lists for a prefix of a request, as `SharedTier.probe` returns it.

    key: the entry's key at `n_tokens` (keys.disk_key of its kind and tokens[:n_tokens]); source: the key the
    tier stores the bytes under: the same, or, for a KV entry listed at a checkpoint it covers, the key of the
    deeper KV entry (its payload holds more tokens; a restore truncates it). nbytes: bytes to transfer.
    """

    key: str
    kind: EntryKind
    n_tokens: int
    nbytes: int
    source: str


class GuardedTier:
    """A lower tier as the cache calls it: the members of `SharedTier`, each of which turns an exception out of
    the tier into a miss (get: None, put: False, contains/delete: False, entries/probe: [], stats: None,
    transfer_s: math.inf, so nothing is fetched), logged once per tier. Covers are passed to shared tiers only.
    Attributes and properties (name, shared, on_evict, bytes, budget_bytes) are the tier's own."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.name, self.shared = tier.name, tier.shared
        self._warned = False

    @property
    def on_evict(self) -> Callable[[str], None] | None:
        return self.tier.on_evict

    @on_evict.setter
    def on_evict(self, fn: Callable[[str], None] | None) -> None:
        self.tier.on_evict = fn

    @property
    def budget_bytes(self) -> int:
        return self.tier.budget_bytes

    @property
    def bytes(self) -> int:
        return self.tier.bytes

    def __len__(self) -> int:
        return len(self.tier)

    def _call(self, op: str, default, fn: Callable, *args):
        """fn(*args), a method of the tier; `default` when it raises (logged once, naming `op`)."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - the module docstring's failure semantics
            if not self._warned:
                self._warned = True
                log.warning("snapshot tier %r failed (%s: %s); treated as a miss", self.name, op, e)
            return default

    def get(self, key: str) -> Stored | None:
        return self._call("get", None, self.tier.get, key)

    def put(self, key: str, tokens: Sequence[int], kind: EntryKind, payload: bytes,
            covers: Sequence[int] = ()) -> bool:
        if self.shared:
            return bool(self._call("put", False, self.tier.put, key, tokens, kind, payload, covers))
        return bool(self._call("put", False, self.tier.put, key, tokens, kind, payload))

    def contains(self, key: str) -> bool:
        return bool(self._call("contains", False, self.tier.contains, key))

    def delete(self, key: str) -> bool:
        return bool(self._call("delete", False, self.tier.delete, key))

    def entries(self) -> list[EntryInfo]:
        """Every entry, listed whole (a failure half way is a tier that lists nothing)."""
        return self._call("entries", [], lambda: list(self.tier.entries()))

    def stats(self) -> TierStats | None:
        return self._call("stats", None, self.tier.stats)

    def probe(self, tokens: Sequence[int], lo: int, hi: int, sid: str) -> list[Listed]:
        return self._call("probe", [], lambda: list(self.tier.probe(tokens, lo, hi, sid)))

    def transfer_s(self, nbytes: int) -> float:
        return self._call("transfer_s", math.inf, lambda: float(self.tier.transfer_s(nbytes)))

    def close(self) -> None:
        self.tier.close()


class RamTier:
    """The hot tier: payloads in a dict, at most `budget_bytes` of them. Never evicts on its own (the cache's
    policy decides); `put` returns False when the entry does not fit. Keeps no token ids."""

    name = "ram"
    shared = False

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("cache budget must be >= 0 bytes")
        self._budget = budget_bytes
        self._data: dict[str, tuple[EntryKind, bytes]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.on_evict: Callable[[str], None] | None = None
        self._inserts = self._too_large = 0

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def contains(self, key: str) -> bool:
        return key in self._data

    def get(self, key: str) -> Stored | None:
        """The entry under `key` (no copy: bytes are immutable), or None. Hits and misses of the hot tier are
        the cache's plans, so it counts none here."""
        with self._lock:
            got = self._data.get(key)
            return Stored(got[0], None, got[1]) if got is not None else None

    def put(self, key: str, tokens: Sequence[int], kind: EntryKind, payload: bytes) -> bool:
        with self._lock:
            old = self._data.get(key)
            room = self._budget - self._bytes + (len(old[1]) if old is not None else 0)
            if len(payload) > room:
                if len(payload) > self._budget:
                    self._too_large += 1
                return False
            if old is not None:
                self._bytes -= len(old[1])
                del self._data[key]
            self._data[key] = (EntryKind(kind), bytes(payload))  # no copy of bytes (Engine.save_state's)
            self._bytes += len(payload)
            self._inserts += 1
            return True

    def delete(self, key: str) -> bool:
        with self._lock:
            old = self._data.pop(key, None)
            if old is None:
                return False
            self._bytes -= len(old[1])
            return True

    def entries(self) -> Iterator[EntryInfo]:
        with self._lock:
            items = list(self._data.items())
        for key, (kind, payload) in items:
            yield EntryInfo(key, kind, None, len(payload))

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.name, len(self._data), self._bytes, self._budget, inserts=self._inserts,
                             rejected_too_large=self._too_large)

    def close(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0
