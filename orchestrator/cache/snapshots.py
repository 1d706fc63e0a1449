"""Snapshot cache: a radix tree of token prefixes (the index) over an ordered list of storage tiers (the bytes).

Knows tokens and bytes, nothing of llama.cpp or HTTP. Entries come in three kinds (`EntryKind`, radix.py):
CHECKPOINT (a recurrent checkpoint: llama_state_seq_get_data_ext with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY), KV
(the attention KV of a prefix, stored where a branch ends) and LOGITS (where a prompt ends: a plan with
`whole=True` restores that prompt entire, with no prefill). Which kinds a model has is its `StateKind`'s
`entry_kinds` (state.py); how deep they restore and what a new entry supersedes follows from what the kinds can
do (`PrefixRules`, rules.py): on a hybrid model a restore of position p needs a checkpoint at p and KV covering
p (a KV entry at or below p in the tree, or the live sequence when it holds tokens[:p]); on a KV-only model any
prefix of a KV entry restores.

    plan = cache.plan(tokens, max_tokens, live_tokens)   # deepest restorable position, and from what
    parts = cache.load(plan)                            # bytes of its parts (copies; entries stay)

Tiers (`orchestrator.cache.tiers`): every entry is stored first in tiers[0], the hot tier (RAM), whose resident
bytes never exceed its budget, checked before an insert. When an entry must leave it, the `EvictionPolicy`
picks it and it spills: it is written to every local lower tier that takes it (the disk tier) and read from
the fastest of them that holds it; a later hit is promoted back to the hot tier. Lower tiers evict on their
own and report it (`on_evict`): the entry falls back to the next tier that holds it, and the index forgets
what no tier holds. A failing lower tier is a miss, never an error: lower tiers are called through
`GuardedTier` (tiers.py), which logs an exception once and answers as a miss or a refused put. Thread-safe: one
lock guards the tree and the tiers.

Shared tiers (`SharedTier`: the remote tier, which other replicas write to and read from) are used otherwise:

    put           every new entry is also written to them at once (write-behind: the tier queues it); a KV
                  entry is listed at the checkpoints on its path too (`covers`), so it is found for those
    discover      per request, before planning: what they list for the prompt's prefixes deeper than the local
                  plan is indexed ("adopted") for that request; a plan may then name them (tier "remote")
    load          an adopted part is read from the shared tier and promoted to the hot tier
    evict, settle an entry that leaves the local tiers leaves the index too (the shared tier may still hold it:
                  `discover` finds it again); an adopted entry not promoted is forgotten at the next discover

so the index never grows with what other replicas store. Only a part llama.cpp refused (`discard`) is deleted
from a shared tier; a corrupt one the tier deletes itself.

Tenant isolation: every method keyed by tokens takes a keyword `salt` (the request's `cache_salt`; "" = the
shared cache). Each salt has its own radix tree, so a lookup never sees, and a KV entry never covers, an entry
stored under another salt; on disk the salt's hash is part of the key (and of the hash in it), so entries keep
their salt across restarts. The RAM budget and the eviction order are shared by all salts.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Sequence

from .keys import disk_key, salt_id, salt_of_key
from .policy import Candidate, EvictionPolicy
from .radix import CHECKPOINT, KV, LOGITS, EntryKind, RadixTree, common_len
from .rules import PrefixRules, StoresKinds
from .tiers import GuardedTier, Tier, TierStats

log = logging.getLogger("orchestrator.cache.snapshots")

HOT = 0  # index of the hot tier in `SnapshotCache.tiers`
_EMPTY = RadixTree()  # the tree of a salt with no entries (never modified)


@dataclass(frozen=True)
class RestorePlan:
    """How to restore the deepest reusable prefix of a prompt.

    n_tokens: prompt tokens restored (0: nothing). checkpoint_id: the recurrent checkpoint at n_tokens. kv_id:
    the stored KV entry covering n_tokens, or None when the live sequence's own KV is used. logits_id: the
    LOGITS entry at n_tokens when the plan restores a whole prompt with the logits of its last token (None: the
    restore is followed by a prefill). tier: the name of the tier the slowest part comes from ("ram", "disk",
    "remote"), "live" for live KV and the rest (if any) in the hot tier, or "none".
    """

    n_tokens: int = 0
    checkpoint_id: int | None = None
    kv_id: int | None = None
    tier: str = "none"
    logits_id: int | None = None

    @property
    def ids(self) -> tuple[int, ...]:
        """The ids of the stored entries the plan reads."""
        return tuple(i for i in (self.checkpoint_id, self.kv_id, self.logits_id) if i is not None)


class Parts(NamedTuple):
    """The bytes of a plan's stored parts (`SnapshotCache.load`): kv None when the live sequence's KV serves,
    checkpoint None where the model has none, logits None unless the plan has a logits_id."""

    kv: bytes | None
    checkpoint: bytes | None
    logits: bytes | None = None


@dataclass
class _Meta:
    kind: EntryKind
    nbytes: int
    level: int  # index in SnapshotCache.tiers of the tier holding the entry (HOT: the hot tier)
    last_used: int
    key: str  # disk key: salt id + kind + hash of the tokens (stable across restarts)
    boundary: bool = True  # a checkpoint at a template boundary or interval (False: end of a request)
    salt: str = ""  # salt id (salt_id()) of the tree holding the entry
    source: str | None = None  # adopted: the key a shared tier holds the bytes under (None: `key`)
    shared: bool = False  # written to, or read from, a shared tier


@dataclass
class CacheStats:
    """Counters since start, and what the tiers hold now. ram_*: the hot tier; disk_*: the lower tiers together
    (bytes as each tier counts them: payload in RAM, whole files on disk); tiers: each tier's own stats."""

    ram_entries: int = 0
    ram_bytes: int = 0
    ram_budget_bytes: int = 0
    disk_entries: int = 0
    disk_bytes: int = 0
    disk_budget_bytes: int = 0
    entries_by_kind: dict = field(default_factory=dict)
    inserts: int = 0
    evictions: int = 0  # entries leaving RAM (spilled or dropped)
    spills: int = 0  # evictions that reached the disk tier
    promotions: int = 0  # disk hits copied back to RAM
    dropped: int = 0  # entries lost (no disk tier, disk full or evicted by its budget, or corrupt on disk)
    rejected_too_large: int = 0
    shared_found: int = 0  # entries a shared tier listed for a request's prefixes, deeper than the local ones
    shared_skipped: int = 0  # plans through them not taken: recomputing was faster than fetching
    tiers: list = field(default_factory=list)  # TierStats of each tier, hot first


def _holds(stored: Sequence[int], path: Sequence[int], kind: EntryKind) -> bool:
    """Whether an entry stored for `stored` tokens serves the index's `path`: the same prefix, or, for KV (which
    is prefix-closed; a restore truncates it), a longer one that extends it."""
    stored = tuple(stored)
    return stored == tuple(path) or (kind.prefix_closed and len(stored) > len(path)
                                     and stored[: len(path)] == tuple(path))


class SnapshotCache:
    """Prefix cache of state snapshots: radix tree over `tiers` (hot first; see the module docstring).

    tiers: a hot tier that never evicts on its own (`RamTier`), then any lower tiers (`DiskTier`, `RemoteTier`),
    in the order entries spill. The local lower tiers' entries are indexed at construction, so a restarted server
    keeps its cache; shared tiers are asked per request (`discover`).
    The cache owns its tiers: `close` closes them. state: the model's state kind (state.StateKind: the cache
    reads its `entry_kinds`; default: KV and checkpoints, a hybrid model's).
    """

    def __init__(self, tiers: Sequence[Tier], policy: EvictionPolicy | None = None,
                 state: StoresKinds | None = None) -> None:
        if not tiers:
            raise ValueError("a snapshot cache needs at least its hot tier")
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        self.hot = self.tiers[HOT]
        self.state = state
        self.rules = PrefixRules(state.entry_kinds if state is not None else (KV, CHECKPOINT))
        self.policy = policy or EvictionPolicy()
        self._trees: dict[str, RadixTree] = {"": RadixTree()}  # salt id -> its tree
        self._meta: dict[int, _Meta] = {}
        self._by_key: dict[str, int] = {}  # disk key -> entry id, for the disk tier's evictions
        self._gone: list[tuple[int, str]] = []  # (level, key) lower tiers evicted, not yet settled (`_settle`)
        self._resident: dict[int, None] = {}  # ids in the hot tier, in the order of last use (`_fetch`)
        self._resident_kv: dict[int, None] = {}  # the KV entries among them, in the same order
        self._ids = itertools.count(1)
        self._tick = 0
        self._lock = threading.RLock()
        self._stats = CacheStats()
        self._warned_too_large = False
        self._closed = False
        self._lower: dict[int, GuardedTier] = {level: GuardedTier(t) for level, t in enumerate(self.tiers) if level}
        self._local = tuple(level for level in range(1, len(self.tiers)) if not self.tiers[level].shared)
        self._shared = tuple(level for level in range(1, len(self.tiers)) if self.tiers[level].shared)
        self._adopted: list[int] = []  # ids indexed by the last `discover`
        for level in self._local:
            self._index_tier(level)
            self._lower[level].on_evict = functools.partial(self._on_evict, level)

    @property
    def budget_bytes(self) -> int:
        """The hot tier's budget: the most payload bytes kept in RAM."""
        return self.hot.budget_bytes

    @property
    def has_shared(self) -> bool:
        """Whether a shared tier is configured (`discover` may find entries other replicas stored)."""
        return bool(self._shared)

    def tier(self, name: str) -> Tier | None:
        """The tier called `name` ("ram", "disk"), or None."""
        return next((t for t in self.tiers if t.name == name), None)

    # ------------------------------------------------------------------ lookup

    def _tree(self, sid: str) -> RadixTree:
        """The tree of salt id `sid`, created empty if needed."""
        tree = self._trees.get(sid)
        if tree is None:
            tree = self._trees[sid] = RadixTree()
        return tree

    def _tree_of(self, eid: int) -> RadixTree:
        return self._trees[self._meta[eid].salt]

    def plan(self, tokens: Sequence[int], max_tokens: int, live_tokens: Sequence[int] = (), *,
             salt: str = "", whole: bool = False) -> RestorePlan:
        """The deepest position p <= max_tokens that the entries stored under `salt` restore (with the live
        sequence's KV where the state kind can use it): on a hybrid model a checkpoint at tokens[:p] and KV
        covering p, on a KV-only model KV covering p.

        whole: the whole of `tokens` instead, with its logits (p = len(tokens), logits_id set), where a LOGITS
        entry for exactly `tokens` is stored and the rest restores that deep; else as without it.
        `live_tokens`: tokens whose KV the live sequence holds, computed by prefill (usable KV source; the
        caller passes () when the live sequence belongs to another salt).
        """
        with self._lock:
            self._tick += 1
            tree = self._trees.get(salt_id(salt), _EMPTY)
            live = common_len(live_tokens, tokens)
            logits_id = tree.find(tokens, LOGITS) if whole and tokens else None
            if logits_id is not None:
                n, checkpoint_id, kv_id = self.rules.match(tree, tokens, len(tokens), live)
                if n == len(tokens):
                    return RestorePlan(n, checkpoint_id, kv_id, self._tier_name(checkpoint_id, kv_id, logits_id),
                                       logits_id)
            n, checkpoint_id, kv_id = self.rules.match(tree, tokens, max_tokens, live)
            if n <= 0:
                return RestorePlan()
            return RestorePlan(n, checkpoint_id, kv_id, self._tier_name(checkpoint_id, kv_id))

    def _tier_name(self, checkpoint_id: int | None, kv_id: int | None, logits_id: int | None = None) -> str:
        """Where the slowest of a plan's stored parts is: the deepest tier among them; "live" when the KV is the
        live sequence's and the rest (if any) is in the hot tier."""
        level = max((self._meta[i].level for i in (checkpoint_id, kv_id, logits_id) if i is not None), default=HOT)
        return "live" if level == HOT and kv_id is None else self.tiers[level].name

    def load(self, plan: RestorePlan) -> Parts | None:
        """The bytes of a plan's parts, promoting entries of lower tiers to the hot tier.

        Returns None if a part is gone (evicted, or corrupt on disk); that part is then dropped from the index
        and the caller plans again. A plan's ids name entries of the salt it was made for; `load` needs no salt.
        """
        with self._lock:
            pinned = set(plan.ids)
            try:
                got = [self._fetch(i, pinned) if i is not None else None
                       for i in (plan.kv_id, plan.checkpoint_id, plan.logits_id)]
            finally:
                self._settle()  # promotions make room by spilling, and spills make lower tiers evict
            if len([g for g in got if g is not None]) < len(plan.ids):
                return None
            return Parts(*got)

    def discard(self, plan: RestorePlan) -> int:
        """Drop the entries a plan names (llama.cpp refused to restore them). Returns how many were dropped."""
        with self._lock:
            gone = [i for i in plan.ids if i in self._meta]
            for eid in gone:
                self._forget(eid, shared=True)
            self._stats.dropped += len(gone)
            return len(gone)

    def _fetch(self, eid: int, pinned: set[int]) -> bytes | None:
        meta = self._meta.get(eid)
        if meta is None:
            return None
        if meta.level == HOT and meta.last_used < self._tick:  # `_resident` stays in the order of last use
            self._unresident(eid)
            self._make_resident(eid)
        meta.last_used = self._tick
        if meta.level == HOT:
            return self.hot.get(meta.key).payload
        got = self._lower[meta.level].get(meta.source or meta.key)
        if got is not None and (got.kind != meta.kind or (got.tokens is not None and not _holds(
                got.tokens, self._tree_of(eid).tokens_of(eid), meta.kind))):
            log.warning("snapshot %s in the %s tier holds another prefix or kind than its key says; dropped",
                        meta.source or meta.key, self.tiers[meta.level].name)
            got = None
        if got is None:
            self._forget(eid)
            self._stats.dropped += 1
            return None
        data = got.payload
        self._stats.promotions += 1
        meta.shared = meta.shared or meta.level in self._shared
        if self._make_room(len(data), pinned) and self.hot.put(meta.key, (), meta.kind, data):
            self._make_resident(eid)
            meta.level, meta.nbytes, meta.source = HOT, len(data), None
        return data

    def contains(self, tokens: Sequence[int], kind: EntryKind = CHECKPOINT, *, salt: str = "",
                 covered: bool = False) -> bool:
        """Whether an entry of `kind` for exactly `tokens` is stored under `salt` (in any tier); with `covered`
        and a prefix-closed kind, or one for tokens that extend them (KV: it restores `tokens` too)."""
        with self._lock:
            tree = self._trees.get(salt_id(salt))
            if tree is None or not tokens:
                return False
            if covered and EntryKind(kind).prefix_closed:
                return tree.kv_covering(tokens, len(tokens)) is not None
            return tree.find(tokens, kind) is not None

    # ------------------------------------------------------------------ shared tiers

    def discover(self, tokens: Sequence[int], max_tokens: int, deeper_than: int, *, salt: str = "") -> int:
        """Index what the shared tiers list for tokens[:n], deeper_than < n <= max_tokens, under `salt` (one
        probe per shared tier; see the module docstring), so that `plan` may use it. Entries adopted by the
        previous call and not promoted since are forgotten first. Returns how many entries were adopted.

        Skipped: what the local index holds already, and listed KV where local KV covers the position (a plan
        should not fetch what it has).
        """
        with self._lock:
            self._release_adopted()
            if not self._shared or max_tokens <= deeper_than:
                return 0
            sid = salt_id(salt)
            for level in self._shared:
                for item in self._lower[level].probe(tokens, deeper_than, max_tokens, sid):
                    path, kind = tuple(tokens[: item.n_tokens]), EntryKind(item.kind)
                    tree = self._trees.get(sid, _EMPTY)
                    if item.key != disk_key(kind, path, sid) or tree.find(path, kind) is not None:
                        continue
                    if kind.prefix_closed and tree.kv_covering(path, len(path)) is not None:
                        continue
                    eid = next(self._ids)
                    self._index(eid, path, _Meta(kind, item.nbytes, level, self._tick, item.key, True, sid,
                                                 source=item.source, shared=True))
                    self._adopted.append(eid)
            self._stats.shared_found += len(self._adopted)
            return len(self._adopted)

    def release_adopted(self) -> None:
        """Forget the entries the last `discover` adopted that were not promoted (the caller will not fetch
        them)."""
        with self._lock:
            self._stats.shared_skipped += 1
            self._release_adopted()

    def _release_adopted(self) -> None:
        for eid in self._adopted:
            meta = self._meta.get(eid)
            if meta is not None and meta.level in self._shared:
                self._detach(eid)
        self._adopted = []

    def transfer_s(self, plan: RestorePlan) -> float:
        """Measured seconds to read the parts of `plan` that are in a shared tier only (0.0 when none are)."""
        with self._lock:
            total = 0.0
            for eid in (plan.checkpoint_id, plan.kv_id):
                meta = self._meta.get(eid) if eid is not None else None
                if meta is not None and meta.level in self._shared:
                    total += self._lower[meta.level].transfer_s(meta.nbytes)
            return total

    def _share(self, meta: _Meta, tokens: Sequence[int], data: bytes) -> None:
        """Write a new entry to every shared tier (write-behind); a KV entry is listed at the checkpoints on
        its path too."""
        if not self._shared:
            return
        covers: list[int] = []
        if meta.kind.prefix_closed:
            covers = [n.depth for n in self._tree(meta.salt).path(tokens)
                      if n.checkpoint is not None and n.depth < len(tokens)]
        for level in self._shared:
            meta.shared |= self._lower[level].put(meta.key, tokens, meta.kind, data, covers)

    # ------------------------------------------------------------------ insert and evict

    def put(self, tokens: Sequence[int], kind: EntryKind, data: bytes, boundary: bool = True, *,
            salt: str = "") -> bool:
        """Store an entry of `kind` for exactly `tokens` under `salt` in the hot tier (replacing one at the same
        prefix).

        boundary: False for checkpoints at the end of a request (end of prompt, after generation), which
        `_drop_superseded` may drop with their branch; True for template boundaries and interval checkpoints.

        An entry larger than the whole hot budget goes straight to the first lower tier that takes it (it is
        read from there on every hit); without one it is not kept (a warning says so once). Returns False when
        nothing was stored. Raises ValueError for an empty prefix or an unknown kind.
        """
        with self._lock:
            try:
                return self._put(tokens, kind, data, boundary, salt)
            finally:
                self._settle()

    def _put(self, tokens: Sequence[int], kind: EntryKind, data: bytes, boundary: bool, salt: str) -> bool:
        kind = EntryKind(kind)
        nbytes = len(data)
        too_large = nbytes > self.budget_bytes
        if too_large and len(self.tiers) == 1:
            self._stats.rejected_too_large += 1
            if not self._warned_too_large:
                self._warned_too_large = True
                log.warning("a %.1f MiB snapshot exceeds the %.1f MiB RAM budget and there is no disk tier: "
                            "such snapshots are not kept (raise --cache-ram or set --cache-disk-dir)",
                            nbytes / 2**20, self.budget_bytes / 2**20)
            return False
        sid = salt_id(salt)
        if not tokens:
            raise ValueError("cannot store a snapshot of an empty prefix")
        tree = self._trees.get(sid)
        old = tree.find(tokens, kind) if tree is not None else None
        if old is not None:
            self._forget(old)
        if not too_large and not self._make_room(nbytes, set()):
            return False
        if kind.prefix_closed:
            self._drop_superseded(tokens, sid)
        eid = next(self._ids)
        key = disk_key(kind, tokens, sid)
        if too_large:  # straight to a lower tier
            level = self._spill(key, tokens, kind, data)
            if level is None:
                self._stats.rejected_too_large += 1
                return False
            meta = _Meta(kind, nbytes, level, self._tick, key, boundary, sid)
            self._index(eid, tokens, meta)
            self._share(meta, tokens, data)
            self._stats.inserts += 1
            self._stats.spills += 1
            return True
        if not self.hot.put(key, tokens, kind, data):
            return False
        meta = _Meta(kind, nbytes, HOT, self._tick, key, boundary, sid)
        self._index(eid, tokens, meta)
        self._share(meta, tokens, data)
        self._make_resident(eid)
        self._stats.inserts += 1
        return True

    def _spill(self, key: str, tokens: Sequence[int], kind: EntryKind, data: bytes) -> int | None:
        """Write an entry to every local lower tier that takes it; returns the level of the fastest one, or None.
        (Shared tiers got it when it was stored.)"""
        took = [level for level in self._local if self._lower[level].put(key, tokens, kind, data)]
        return took[0] if took else None

    def _drop_superseded(self, tokens: Sequence[int], sid: str) -> None:
        """Before storing KV for `tokens`: drop the entries it supersedes (`PrefixRules.superseded`)."""
        kv_ids = [e for e, m in self._meta.items() if m.kind.prefix_closed and m.salt == sid]
        for eid in self.rules.superseded(self._tree(sid), tokens, kv_ids, lambda e: self._meta[e].boundary):
            self._forget(eid)

    def _make_room(self, nbytes: int, pinned: set[int]) -> bool:
        """Evict hot entries (policy order, never `pinned`) until `nbytes` more fit; False if impossible."""
        if nbytes > self.budget_bytes:
            return False
        while self.hot.bytes + nbytes > self.budget_bytes:
            candidates = self._candidates(pinned)
            if self.policy.recency_only:  # the first is the victim: no need to rank them
                victim = next(candidates, Candidate(None, _EMPTY, 0, 0)).eid
            else:
                victim = self.policy.victim(candidates)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _candidates(self, pinned: set[int]) -> Iterator[Candidate]:
        """The hot tier's entries but `pinned`, covered KV entries first (every policy evicts them first: another
        KV entry deeper on their path restores all they do), then all in the order of last use (the covered
        ones again), made as they are asked for: a policy that weighs recency may stop at the first few."""
        for eid in self._resident_kv:
            if eid not in pinned and self._tree_of(eid).covered(eid):
                yield Candidate(eid, self._tree_of(eid), self._meta[eid].nbytes, self._meta[eid].last_used)
        for eid in self._resident:
            if eid not in pinned:
                yield Candidate(eid, self._tree_of(eid), self._meta[eid].nbytes, self._meta[eid].last_used)

    def _make_resident(self, eid: int) -> None:
        """Entry `eid` is (again) in the hot tier, used last."""
        self._resident[eid] = None
        if self._meta[eid].kind.prefix_closed:
            self._resident_kv[eid] = None

    def _unresident(self, eid: int) -> None:
        del self._resident[eid]
        self._resident_kv.pop(eid, None)

    def _evict(self, eid: int) -> None:
        """Move a hot entry down to the first lower tier that takes it, or drop it."""
        meta = self._meta[eid]
        data = self.hot.get(meta.key).payload
        self.hot.delete(meta.key)
        self._unresident(eid)
        self._stats.evictions += 1
        level = self._spill(meta.key, self._tree_of(eid).tokens_of(eid), meta.kind, data) \
            if self._local else None
        if level is not None:
            meta.level = level
            self._stats.spills += 1
        else:  # a shared tier may still hold it: `discover` finds it there again
            self._detach(eid)
            self._stats.dropped += not meta.shared

    def _index(self, eid: int, tokens: Sequence[int], meta: _Meta) -> None:
        """Add entry `eid` (stored in the tier `meta.level` names) to its salt's tree and the indexes."""
        self._tree(meta.salt).insert(tokens, meta.kind, eid)
        self._meta[eid] = meta
        self._by_key[meta.key] = eid

    def _detach(self, eid: int) -> None:
        """Remove entry `eid` from its tree and the indexes (its bytes are the caller's business)."""
        meta = self._meta.pop(eid)
        tree = self._trees[meta.salt]
        tree.remove(eid)
        del self._by_key[meta.key]
        if meta.salt and not len(tree):
            del self._trees[meta.salt]  # an idle salt leaves nothing behind

    def _on_evict(self, level: int, key: str) -> None:
        self._gone.append((level, key))

    def _settle(self) -> None:
        """Move entries whose copy a lower tier evicted to fit its budget (`Tier.on_evict`) to the next tier that
        holds them, and forget those no tier holds any more.

        Run at the end of each operation that writes to a lower tier, when the index is consistent again.
        Without it the index kept every snapshot ever spilled: the soak (bench/soak.py) saw radix nodes and
        metadata grow by about 1,000 a minute, and plans named snapshots that were gone."""
        while self._gone:
            level, key = self._gone.pop()
            eid = self._by_key.get(key)
            meta = self._meta.get(eid) if eid is not None else None
            # A promoted (hot) entry, or one read from a faster tier, only lost a copy it does not use.
            if meta is None or meta.level != level or self._lower[level].contains(key):
                continue
            deeper = [d for d in self._local if d > level and self._lower[d].contains(key)]
            if deeper:
                meta.level = deeper[0]
            else:
                self._detach(eid)
                self._stats.dropped += 1

    def _forget(self, eid: int, shared: bool = False) -> None:
        """Drop an entry from the index and the local tiers; from the shared tiers too when `shared` (it is bad:
        other replicas must not restore it either)."""
        meta = self._meta[eid]
        if meta.level == HOT:
            self.hot.delete(meta.key)
            self._unresident(eid)
        for level in self._local:  # a promoted entry keeps its lower copy: delete it too
            self._lower[level].delete(meta.key)
        if shared:
            for level in self._shared:
                self._lower[level].delete(meta.source or meta.key)
        self._detach(eid)

    def _index_tier(self, level: int) -> None:
        """Index what lower tier `level` holds (at start: a restarted server keeps its cache)."""
        tier, n = self.tiers[level], 0
        for info in self._lower[level].entries():
            sid = salt_of_key(info.key)
            try:
                kind = EntryKind(info.kind)
            except ValueError:
                kind = None
            if kind is None or not info.tokens or disk_key(kind, info.tokens, sid) != info.key:
                log.warning("snapshot %s in the %s tier does not match its key (kind, salt or tokens); deleted",
                            info.key, tier.name)
                self._lower[level].delete(info.key)
                continue
            if self._tree(sid).find(info.tokens, kind) is not None:
                continue
            self._index(next(self._ids), info.tokens, _Meta(kind, info.nbytes, level, 0, info.key, True, sid))
            n += 1
        if n:
            log.info("snapshot cache: indexed %d entries from the %s tier", n, tier.name)

    # ------------------------------------------------------------------ inspection

    def clear(self) -> int:
        """Forget every entry the index knows, in the local tiers; returns how many there were. A shared tier keeps
        its entries (other replicas use them; flush Redis with redis-cli, docs/scale-out.md)."""
        with self._lock:
            self._release_adopted()
            n = len(self._meta)
            for eid in list(self._meta):
                self._forget(eid)
            return n

    def stats(self) -> CacheStats:
        with self._lock:
            s = self._stats
            tiers = [self._tier_stats(level) for level in range(len(self.tiers))]
            s.ram_entries, s.ram_bytes, s.ram_budget_bytes = tiers[HOT].entries, tiers[HOT].bytes, \
                tiers[HOT].budget_bytes
            s.disk_entries = sum(t.entries for t in tiers[1:])
            s.disk_bytes = sum(t.bytes for t in tiers[1:])
            s.disk_budget_bytes = sum(t.budget_bytes for t in tiers[1:])
            s.entries_by_kind = {str(k): sum(1 for m in self._meta.values() if m.kind == k) for k in EntryKind}
            s.tiers = tiers
            return CacheStats(**{f: getattr(s, f) for f in s.__dataclass_fields__})

    def _tier_stats(self, level: int) -> TierStats:
        tier = self.tiers[level]
        if level == HOT:
            return tier.stats()
        return self._lower[level].stats() or TierStats(tier.name, 0, 0, 0, disabled=True)

    def entries(self, *, salt: str | None = None) -> list[tuple[EntryKind, str, tuple[int, ...]]]:
        """(kind, tier name, tokens) of every entry, or of those stored under `salt` (for tests and diagnostics)."""
        with self._lock:
            sid = salt_id(salt) if salt is not None else None
            return [(m.kind, self.tiers[m.level].name, self._tree_of(e).tokens_of(e)) for e, m in self._meta.items()
                    if sid is None or m.salt == sid]

    def salts(self) -> dict[str, int]:
        """Entries per salt id ("" = unsalted), for tests and diagnostics."""
        with self._lock:
            out: dict[str, int] = {}
            for m in self._meta.values():
                out[m.salt] = out.get(m.salt, 0) + 1
            return out

    def check(self) -> None:
        """Recount from scratch and compare with the incremental counters (for tests)."""
        with self._lock:
            ids: set[int] = set()
            for sid, tree in self._trees.items():
                tree.check()
                tree_ids = set(tree.ids())
                assert all(self._meta[e].salt == sid for e in tree_ids), "entry in another salt's tree"
                ids |= tree_ids
            assert set(self._meta) == ids
            assert self._by_key == {m.key: e for e, m in self._meta.items()}
            assert not self._gone
            assert all(self.tiers[m.level].contains(m.source or m.key) for m in self._meta.values()), \
                "an entry whose snapshot its tier no longer holds"
            assert set(self._resident) == {e for e, m in self._meta.items() if m.level == HOT}
            used = [self._meta[e].last_used for e in self._resident]
            assert used == sorted(used), "the hot tier's entries out of the order of last use"
            assert len(self.hot) == len(self._resident), "the hot tier holds entries the index does not know"
            assert list(self._resident_kv) == [e for e in self._resident if self._meta[e].kind.prefix_closed]
            assert self.hot.bytes == sum(self._meta[e].nbytes for e in self._resident) <= self.budget_bytes

    def close(self) -> None:
        """Write the RAM tier's entries that no local lower tier holds yet down to them (`flush_down`), then close
        every tier (idempotent)."""
        with self._lock:
            if not self._closed:
                self.flush_down()
            self._closed = True
            for tier in self.tiers:
                tier.close()

    def flush_down(self) -> int:
        """Copy every RAM-resident entry that no local lower tier holds to them (the RAM tier is write-back: an
        entry reaches the disk only when evicted, so without this a stopped server loses its newest snapshots,
        the ones its sessions restore next). Entries stay in RAM. Returns how many were written. A server that
        is killed, not stopped, still loses them."""
        written = 0
        with self._lock:
            if not self._local:
                return 0
            for eid in list(self._resident):
                meta = self._meta[eid]
                if any(self._lower[level].contains(meta.key) for level in self._local):
                    continue
                entry = self.hot.get(meta.key)
                if entry is None:
                    continue
                if self._spill(meta.key, self._tree_of(eid).tokens_of(eid), meta.kind, entry.payload) is not None:
                    written += 1
            self._settle()
        if written:
            log.info("wrote %d snapshots from RAM to the disk tier at shutdown", written)
        return written

