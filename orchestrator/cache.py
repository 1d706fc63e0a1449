"""Snapshot cache: a radix tree of token prefixes over a byte-bounded RAM tier that spills to a disk tier.

Knows tokens and bytes, nothing of llama.cpp or HTTP. Entries come in two kinds (see radix.py):
"rec" (a recurrent checkpoint: llama_state_seq_get_data_ext with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) and "kv"
(the attention KV of a prefix, stored where a branch ends). A restore of position p needs a "rec" entry at p
and KV covering p: a "kv" entry at or below p in the tree, or the live sequence when it holds tokens[:p].

    plan = cache.plan(tokens, max_tokens, live_tokens)   # deepest restorable position, and from what
    parts = cache.load(plan)                            # bytes of both parts (copies; entries stay)

RAM tier: resident bytes never exceed `budget_bytes`, checked before an insert. When an entry must go, the
`EvictionPolicy` picks it and it spills to the disk tier (if any), where a later hit is promoted back to RAM.
Thread-safe: one lock guards the tree and the tiers.

Tenant isolation: every method keyed by tokens takes a keyword `salt` (the request's `cache_salt`; "" = the
shared cache). Each salt has its own radix tree, so a lookup never sees, and a KV entry never covers, an entry
stored under another salt; on disk the salt's hash is part of the key (and of the hash in it), so entries keep
their salt across restarts. The RAM budget and the eviction order are shared by all salts.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Sequence

from .policy import EvictionPolicy
from .radix import KV, REC, RadixTree, common_len

log = logging.getLogger("orchestrator.cache")

RAM, DISK = "ram", "disk"
_DISK_KIND = {KV: "full", REC: "recurrent"}  # the disk tier's names for the two kinds
_FROM_DISK_KIND = {v: k for k, v in _DISK_KIND.items()}


@dataclass(frozen=True)
class RestorePlan:
    """How to restore the deepest reusable prefix of a prompt.

    n_tokens: prompt tokens restored (0: nothing). rec_id: the recurrent checkpoint at n_tokens. kv_id: the
    stored KV entry covering n_tokens, or None when the live sequence's own KV is used. tier: where the
    slowest part comes from ("ram", "disk", "live" for live KV + RAM checkpoint, or "none").
    """

    n_tokens: int = 0
    rec_id: int | None = None
    kv_id: int | None = None
    tier: str = "none"


@dataclass
class _Meta:
    kind: str
    nbytes: int
    tier: str
    last_used: int
    key: str  # disk key: salt id + kind + hash of the tokens (stable across restarts)
    boundary: bool = True  # a checkpoint at a template boundary or interval (False: end of a request)
    salt: str = ""  # salt id (salt_id()) of the tree holding the entry


@dataclass
class CacheStats:
    """Counters since start, and what each tier holds now (bytes are snapshot payload bytes)."""

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


def salt_id(salt: str) -> str:
    """The id of a cache salt: "" for no salt, else 32 hex digits of its BLAKE2b hash (never the salt itself)."""
    if not salt:
        return ""
    return hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16, person=b"orc-salt").hexdigest()


def disk_key(kind: str, tokens: Sequence[int], sid: str = "") -> str:
    """Disk key of an entry: "<kind>-<n>-<hash of tokens>" unsalted, "s<salt id>-<kind>-<n>-<hash of salt id and
    tokens>" under salt id `sid`."""
    h = hashlib.blake2b(sid.encode() + b"".join(t.to_bytes(4, "little") for t in tokens), digest_size=16).hexdigest()
    return f"s{sid}-{kind}-{len(tokens)}-{h}" if sid else f"{kind}-{len(tokens)}-{h}"


def _salt_of_key(key: str) -> str:
    return key[1:33] if key.startswith("s") else ""


class SnapshotCache:
    """Prefix cache of state snapshots: radix tree + RAM tier (`budget_bytes`) + optional disk tier.

    `disk` is a DiskTier (orchestrator.disk) or None; its entries are indexed at construction, so a restarted
    server keeps its cache.
    """

    def __init__(self, budget_bytes: int, disk=None, policy: EvictionPolicy | None = None,
                 truncatable: bool = False) -> None:
        if budget_bytes < 0:
            raise ValueError("cache budget must be >= 0 bytes")
        self.budget_bytes = budget_bytes
        self.truncatable = truncatable  # KV-only states: any prefix of a KV entry is restorable, no checkpoints
        self.disk = disk
        self.policy = policy or EvictionPolicy()
        self._trees: dict[str, RadixTree] = {"": RadixTree()}  # salt id -> its tree
        self._meta: dict[int, _Meta] = {}
        self._by_key: dict[str, int] = {}  # disk key -> entry id, for the disk tier's evictions
        self._gone_from_disk: list[str] = []  # keys the disk tier evicted, not yet forgotten (`_settle`)
        self._ram: dict[int, bytes] = {}
        self._ram_bytes = 0
        self._ids = itertools.count(1)
        self._tick = 0
        self._lock = threading.RLock()
        self._stats = CacheStats()
        self._warned_too_large = False
        if disk is not None:
            self._index_disk()
            disk.on_evict = self._gone_from_disk.append

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
             salt: str = "") -> RestorePlan:
        """The deepest position p <= max_tokens with a checkpoint at tokens[:p] and KV covering p, among the
        entries stored under `salt`.

        `live_tokens`: tokens whose KV the live sequence holds, computed by prefill (usable KV source; the
        caller passes () when the live sequence belongs to another salt). On a truncatable cache no
        checkpoint is needed: the deepest p covered by the live KV or a stored KV entry.
        """
        with self._lock:
            self._tick += 1
            tree = self._trees.get(salt_id(salt))
            live = common_len(live_tokens, tokens)
            if self.truncatable:
                depth, kv_id = tree.deepest_kv(tokens, max_tokens) if tree is not None else (0, None)
                if min(live, max_tokens) >= depth:
                    depth = min(live, max_tokens)
                    return RestorePlan(depth, None, None, "live") if depth > 0 else RestorePlan()
                return RestorePlan(depth, None, kv_id, DISK if self._meta[kv_id].tier == DISK else RAM)
            if tree is None:
                return RestorePlan()
            for node in reversed(tree.path(tokens, max_tokens)):
                if node.rec is None:
                    continue
                if node.depth <= live:
                    kv_id, tier = None, "live"
                else:
                    kv_id = node.kv if node.kv is not None else tree.kv_covering(tokens, node.depth)
                    if kv_id is None:
                        continue
                    tier = DISK if self._meta[kv_id].tier == DISK else RAM
                if self._meta[node.rec].tier == DISK:
                    tier = DISK
                return RestorePlan(node.depth, node.rec, kv_id, tier)
            return RestorePlan()

    def load(self, plan: RestorePlan) -> tuple[bytes | None, bytes | None] | None:
        """(kv bytes or None for live KV, checkpoint bytes or None on a truncatable cache) of a plan, promoting
        disk entries to RAM.

        Returns None if a part is gone (evicted, or corrupt on disk); that part is then dropped from the index
        and the caller plans again. A plan's ids name entries of the salt it was made for; `load` needs no salt.
        """
        with self._lock:
            pinned = {i for i in (plan.rec_id, plan.kv_id) if i is not None}
            try:
                rec = self._fetch(plan.rec_id, pinned) if plan.rec_id is not None else None
                kv = self._fetch(plan.kv_id, pinned) if plan.kv_id is not None else None
            finally:
                self._settle()  # promotions make room by spilling, and spills make the disk tier evict
            if (plan.rec_id is not None and rec is None) or (plan.kv_id is not None and kv is None):
                return None
            return kv, rec

    def discard(self, plan: RestorePlan) -> int:
        """Drop the entries a plan names (llama.cpp refused to restore them). Returns how many were dropped."""
        with self._lock:
            gone = [i for i in (plan.rec_id, plan.kv_id) if i is not None and i in self._meta]
            for eid in gone:
                self._forget(eid)
            self._stats.dropped += len(gone)
            return len(gone)

    def _fetch(self, eid: int, pinned: set[int]) -> bytes | None:
        meta = self._meta.get(eid)
        if meta is None:
            return None
        meta.last_used = self._tick
        if meta.tier == RAM:
            return self._ram[eid]
        got = self.disk.get(meta.key) if self.disk is not None else None
        if got is not None and (got[0] != _DISK_KIND[meta.kind] or got[1] != self._tree_of(eid).tokens_of(eid)):
            log.warning("snapshot %s on disk holds another prefix or kind than its key says; dropped", meta.key)
            got = None
        if got is None:
            self._forget(eid)
            self._stats.dropped += 1
            return None
        data = got[2]
        self._stats.promotions += 1
        if self._make_room(len(data), pinned):
            self._ram[eid] = data
            self._ram_bytes += len(data)
            meta.tier, meta.nbytes = RAM, len(data)
        return data

    def contains(self, tokens: Sequence[int], kind: str = REC, *, salt: str = "") -> bool:
        """Whether an entry of `kind` for exactly `tokens` is stored under `salt` (in any tier)."""
        with self._lock:
            tree = self._trees.get(salt_id(salt))
            return tree is not None and tree.find(tokens, kind) is not None

    # ------------------------------------------------------------------ insert and evict

    def put(self, tokens: Sequence[int], kind: str, data: bytes, boundary: bool = True, *, salt: str = "") -> bool:
        """Store an entry of `kind` for exactly `tokens` under `salt` in RAM (replacing one at the same prefix).

        boundary: False for checkpoints at the end of a request (end of prompt, after generation), which
        `_drop_superseded` may drop with their branch; True for template boundaries and interval checkpoints.

        An entry larger than the whole RAM budget goes straight to the disk tier (it is read from there on every
        hit); without a disk tier it is not kept (a warning says so once). Returns False when nothing was
        stored. Raises ValueError for an empty prefix or an unknown kind.
        """
        with self._lock:
            try:
                return self._put(tokens, kind, data, boundary, salt)
            finally:
                self._settle()

    def _put(self, tokens: Sequence[int], kind: str, data: bytes, boundary: bool, salt: str) -> bool:
        nbytes = len(data)
        too_large = nbytes > self.budget_bytes
        if too_large and self.disk is None:
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
        if kind == KV:
            self._drop_superseded(tokens, sid)
        eid = next(self._ids)
        if too_large:  # straight to disk
            key = disk_key(kind, tokens, sid)
            if not self.disk.put(key, tokens, _DISK_KIND[kind], data):
                self._stats.rejected_too_large += 1
                return False
            self._index(eid, tokens, _Meta(kind, nbytes, DISK, self._tick, key, boundary, sid))
            self._stats.inserts += 1
            self._stats.spills += 1
            return True
        self._index(eid, tokens, _Meta(kind, nbytes, RAM, self._tick, disk_key(kind, tokens, sid), boundary, sid))
        self._ram[eid] = data
        self._ram_bytes += nbytes
        self._stats.inserts += 1
        return True

    def _drop_superseded(self, tokens: Sequence[int], sid: str) -> None:
        """Before storing KV for `tokens`: drop the KV entries it supersedes.

        KV is prefix-closed, so a KV entry on the same path is covered outright. A KV entry E on another branch
        is superseded when every *boundary* checkpoint on E's path lies on the shared part: what E alone covers
        is then only the end of a previous request (its end-of-prompt and generated tokens, which the next
        prompt typically renders differently). E goes, with the end checkpoints in its tail, which no KV would
        cover any more; should that branch come back, it is prefilled from its last boundary checkpoint.
        """
        tree = self._tree(sid)
        for eid in [e for e, m in self._meta.items() if m.kind == KV and m.salt == sid]:
            other = tree.tokens_of(eid)
            branch = common_len(other, tokens)
            if self.truncatable and branch < len(other):
                continue  # its own branch is restorable at every token: keep it
            tail = [n.rec for n in tree.path(other) if n.depth > branch and n.rec is not None]
            if any(self._meta[r].boundary for r in tail):
                continue
            for r in tail:
                self._forget(r)
            self._forget(eid)

    def _make_room(self, nbytes: int, pinned: set[int]) -> bool:
        """Evict RAM entries (policy order, never `pinned`) until `nbytes` more fit; False if impossible."""
        if nbytes > self.budget_bytes:
            return False
        while self._ram_bytes + nbytes > self.budget_bytes:
            candidates = {e: (self._meta[e].nbytes, self._meta[e].last_used) for e in self._ram if e not in pinned}
            if not candidates:
                return False
            self._evict(min(candidates, key=lambda e: self.policy.priority(self._tree_of(e), e, *candidates[e])))
        return True

    def _evict(self, eid: int) -> None:
        meta = self._meta[eid]
        data = self._ram.pop(eid)
        self._ram_bytes -= len(data)
        self._stats.evictions += 1
        tree = self._tree_of(eid)
        if self.disk is not None and self.disk.put(meta.key, tree.tokens_of(eid), _DISK_KIND[meta.kind], data):
            meta.tier = DISK
            self._stats.spills += 1
        else:
            self._detach(eid)
            self._stats.dropped += 1

    def _index(self, eid: int, tokens: Sequence[int], meta: _Meta) -> None:
        """Add entry `eid` (stored in the tier `meta.tier` names) to its salt's tree and the indexes."""
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

    def _settle(self) -> None:
        """Forget the entries whose only copy the disk tier evicted to fit its budget (`DiskTier.on_evict`).

        Run at the end of each operation that writes to the disk tier, when the index is consistent again.
        Without it the index kept every snapshot ever spilled: the soak (bench/soak.py) saw radix nodes and
        metadata grow by about 1,000 a minute, and plans named snapshots that were gone."""
        while self._gone_from_disk:
            eid = self._by_key.get(self._gone_from_disk.pop())
            meta = self._meta.get(eid) if eid is not None else None
            # A promoted (RAM) entry only lost its old disk copy; it stays.
            if meta is not None and meta.tier == DISK and meta.key not in self.disk:
                self._detach(eid)
                self._stats.dropped += 1

    def _forget(self, eid: int) -> None:
        meta = self._meta[eid]
        if meta.tier == RAM:
            self._ram_bytes -= len(self._ram.pop(eid))
        if self.disk is not None:  # a promoted entry keeps its disk copy: delete it too
            self.disk.delete(meta.key)
        self._detach(eid)

    def _index_disk(self) -> None:
        n = 0
        for info in self.disk.entries():
            kind = _FROM_DISK_KIND.get(info.kind)
            sid = _salt_of_key(info.key)
            if kind is None or not info.tokens or disk_key(kind, info.tokens, sid) != info.key:
                log.warning("snapshot %s on disk does not match its key (kind, salt or tokens); deleted", info.key)
                self.disk.delete(info.key)
                continue
            if self._tree(sid).find(info.tokens, kind) is not None:
                continue
            self._index(next(self._ids), info.tokens, _Meta(kind, info.nbytes, DISK, 0, info.key, True, sid))
            n += 1
        if n:
            log.info("snapshot cache: indexed %d entries from the disk tier", n)

    # ------------------------------------------------------------------ inspection

    def clear(self) -> None:
        """Forget every entry in every tier."""
        with self._lock:
            for eid in list(self._meta):
                self._forget(eid)

    def stats(self) -> CacheStats:
        with self._lock:
            s = self._stats
            s.ram_entries = len(self._ram)
            s.ram_bytes = self._ram_bytes
            s.ram_budget_bytes = self.budget_bytes
            s.disk_entries = len(self.disk) if self.disk is not None else 0
            s.disk_bytes = self.disk.bytes if self.disk is not None else 0
            s.disk_budget_bytes = self.disk.budget_bytes if self.disk is not None else 0
            s.entries_by_kind = {k: sum(1 for m in self._meta.values() if m.kind == k) for k in (REC, KV)}
            return CacheStats(**{f: getattr(s, f) for f in s.__dataclass_fields__})

    def entries(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(kind, tier, tokens) of every entry (for tests and diagnostics)."""
        with self._lock:
            return [(m.kind, m.tier, self._tree_of(e).tokens_of(e)) for e, m in self._meta.items()]

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
            assert not self._gone_from_disk
            assert self.disk is None or all(m.key in self.disk for m in self._meta.values() if m.tier == DISK), \
                "an entry whose snapshot the disk tier no longer holds"
            assert set(self._ram) == {e for e, m in self._meta.items() if m.tier == RAM}
            assert self._ram_bytes == sum(len(d) for d in self._ram.values()) <= self.budget_bytes

