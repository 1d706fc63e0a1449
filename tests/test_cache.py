"""Radix tree, eviction policy and snapshot cache, with fake snapshots (bytes whose length is the cost),
exact orders, and a recount of every counter after each operation."""

import random

import pytest

from orchestrator.cache.snapshots import SnapshotCache
from orchestrator.cache.policy import Candidate, EvictionPolicy
from orchestrator.cache.radix import CHECKPOINT, KV, RadixTree
from orchestrator.cache.tiers import RamTier


def test_radix_path_and_kv_covering():
    t = RadixTree()
    t.insert([1, 2, 3], CHECKPOINT, 10)
    t.insert([1, 2, 3, 4, 5], CHECKPOINT, 11)
    t.insert([1, 2, 3, 4, 5, 6, 7], KV, 12)
    t.insert([1, 2, 9], CHECKPOINT, 13)
    t.check()
    assert [(p.depth, p.checkpoint, p.kv) for p in t.path([1, 2, 3, 4, 5, 6, 7, 8])] == \
        [(3, 10, None), (5, 11, None), (7, None, 12)]
    assert [p.depth for p in t.path([1, 2, 3, 4, 5, 6, 7], max_tokens=5)] == [3, 5]
    # KV at depth 7 covers depths 3 and 5 (its prefix), not the [1, 2, 9] branch.
    assert t.kv_covering([1, 2, 3, 4, 5], 5) == 12
    assert t.kv_covering([1, 2, 3], 3) == 12
    assert t.kv_covering([1, 2, 9], 3) is None
    assert t.kv_covering([1, 2, 3, 4, 9], 4) == 12  # depth 4 lies inside an edge below which the KV sits
    assert t.tokens_of(13) == (1, 2, 9)
    assert t.find([1, 2, 3], CHECKPOINT) == 10 and t.find([1, 2, 3], KV) is None and t.find([1, 2], CHECKPOINT) is None


def test_radix_remove_prunes_and_keeps_kv_counts():
    t = RadixTree()
    t.insert([1, 2, 3], CHECKPOINT, 1)
    assert t.insert([1, 2, 3], CHECKPOINT, 2) == 1
    t.insert([1, 2, 3, 4], KV, 3)
    t.insert([1, 2, 3, 4, 5], KV, 4)
    assert t.covered(3) and not t.covered(4)
    t.remove(4)
    t.check()
    assert not t.covered(3)
    t.remove(2)
    t.remove(3)
    t.check()
    assert len(t) == 0
    with pytest.raises(ValueError):
        t.insert([], CHECKPOINT, 5)
    with pytest.raises(KeyError):
        t.remove(3)


def test_radix_random_against_bruteforce():
    rng = random.Random(7)
    t = RadixTree()
    stored: dict[int, tuple[str, tuple[int, ...]]] = {}
    for eid in range(1, 500):
        if stored and rng.random() < 0.3:
            victim = rng.choice(list(stored))
            t.remove(victim)
            del stored[victim]
        else:
            kind = rng.choice([CHECKPOINT, KV])
            toks = tuple(rng.choice([1, 2, 3]) for _ in range(rng.randint(1, 8)))
            replaced = t.insert(toks, kind, eid)
            if replaced is not None:
                assert stored.pop(replaced) == (kind, toks)
            stored[eid] = (kind, toks)
        t.check()
        q = [rng.choice([1, 2, 3]) for _ in range(rng.randint(1, 10))]
        limit = rng.randint(0, len(q))
        want = sorted((len(v), k, e) for e, (k, v) in stored.items() if len(v) <= limit and tuple(q[: len(v)]) == v)
        got = sorted((p.depth, kind, e) for p in t.path(q, limit)
                     for kind, e in ((CHECKPOINT, p.checkpoint), (KV, p.kv)) if e)
        assert got == want
        d = rng.randint(1, len(q))
        covering = [e for e, (k, v) in stored.items() if k == KV and len(v) >= d and v[:d] == tuple(q[:d])]
        found = t.kv_covering(q, d)
        assert (found is None) == (not covering) and (found is None or found in covering)


def test_policy_covered_kv_first_then_recency_with_a_bonus_for_expensive_and_shared():
    t = RadixTree()
    shared = [7] * 1000  # a prefix (tools block) with three conversations below
    t.insert(shared, CHECKPOINT, 1)
    for i, tail in enumerate(([1] * 50, [2] * 50, [3] * 50)):
        t.insert(shared + tail, CHECKPOINT, 10 + i)
    t.insert(shared + [1] * 30, KV, 20)
    t.insert(shared + [1] * 50, KV, 21)
    p = EvictionPolicy()
    fresh = [Candidate(e, t, 100_000, 10) for e in (1, 10, 11, 12, 20, 21)]
    assert p.victim(fresh) == 20  # covered by KV 21
    fresh = [c for c in fresh if c.eid != 20]
    t.remove(20)
    # Same size and age: a turn's checkpoint (50 tokens, one branch) goes before the shared prefix.
    assert p.victim(fresh) == 10  # the first of equals
    assert p.victim([]) is None
    assert p.priority(t, 1, 100_000, 10) > p.priority(t, 10, 100_000, 10)
    # The shared prefix outlives a turn used a little later, but not forever.
    assert p.priority(t, 1, 100_000, 10) > p.priority(t, 10, 100_000, 14)
    assert p.priority(t, 1, 100_000, 10) < p.priority(t, 10, 100_000, 200)
    # A checkpoint a few tokens after another is cheap to recompute per byte.
    t.insert(shared + [2] * 52, CHECKPOINT, 30)
    assert p.value(t, 30, 100_000) < p.value(t, 11, 100_000)
    # A KV entry whose path another KV branch shares almost to its end holds few unique tokens.
    t.insert(shared + [1] * 48 + [9, 9, 9], KV, 31)
    assert t.recompute_tokens(31) == 3 and t.recompute_tokens(21) == 2


def test_cache_budget_checked_before_insert_and_never_exceeded():
    c = SnapshotCache([RamTier(100)])
    assert c.put([1, 2], CHECKPOINT, b"a" * 40)
    assert c.put([1, 3], CHECKPOINT, b"b" * 40)
    assert c.put([1, 4], CHECKPOINT, b"c" * 40)  # evicts one (no disk tier: dropped)
    c.check()
    s = c.stats()
    assert s.ram_bytes == 80 and s.evictions == 1 and s.dropped == 1
    assert not c.put([5], CHECKPOINT, b"d" * 101)  # larger than the whole budget: not kept, nothing evicted
    assert c.stats().rejected_too_large == 1 and c.stats().ram_entries == 2
    c.check()


def test_plan_needs_kv_covering_the_checkpoint_or_live_tokens():
    c = SnapshotCache([RamTier(10_000)])
    a = list(range(100, 130))
    c.put(a[:10], CHECKPOINT, b"r10")
    c.put(a[:20], CHECKPOINT, b"r20")
    c.put(a[:30], CHECKPOINT, b"r30")
    prompt = a[:25] + [999] * 5
    assert c.plan(prompt, len(prompt) - 2).n_tokens == 0  # checkpoints, but no KV anywhere
    plan = c.plan(prompt, len(prompt) - 2, live_tokens=a[:15])
    assert (plan.n_tokens, plan.kv_id, plan.tier) == (10, None, "live")
    c.put(a, KV, b"kv30")
    plan = c.plan(prompt, len(prompt) - 2)
    assert plan.n_tokens == 20 and plan.tier == "ram"
    kv, rec, _ = c.load(plan)
    assert (kv, rec) == (b"kv30", b"r20")
    assert c.load(plan) == (b"kv30", b"r20", None)  # restoring copies, never consumes
    assert c.plan(a, len(a) - 2).n_tokens == 20  # at least two tokens left to prefill


def test_new_kv_drops_a_superseded_branch_with_its_end_checkpoints():
    c = SnapshotCache([RamTier(10_000)])
    turn1 = list(range(1000, 1100)) + [7] * 10  # a boundary at 100, then end of prompt and generated tokens
    c.put(turn1[:100], CHECKPOINT, b"r100")
    c.put(turn1[:104], CHECKPOINT, b"r104", boundary=False)
    c.put(turn1, CHECKPOINT, b"r110", boundary=False)
    c.put(turn1, KV, b"k110")
    other = list(range(1000, 1100)) + [5] * 4  # another conversation: a boundary of its own after the fork
    c.put(other, CHECKPOINT, b"r104b")
    c.put(other + [6] * 6, CHECKPOINT, b"r110b", boundary=False)
    c.put(other + [6] * 6, KV, b"k110b")
    turn2 = list(range(1000, 1100)) + [8] * 50  # the next turn of turn1's conversation
    c.put(turn2, CHECKPOINT, b"r150", boundary=False)
    c.put(turn2, KV, b"k150")
    left = sorted((k, len(t), t[100]) for k, _tier, t in c.entries() if len(t) > 100) + \
        [(k, len(t), None) for k, _tier, t in c.entries() if len(t) == 100]
    # turn1's branch held only end checkpoints beyond the fork: it went. The other conversation has a
    # boundary checkpoint of its own after the fork: kept. The shared boundary checkpoint is kept.
    assert sorted(left, key=str) == sorted([(KV, 110, 5), (CHECKPOINT, 104, 5), (CHECKPOINT, 110, 5), (KV, 150, 8),
                                            (CHECKPOINT, 150, 8), (CHECKPOINT, 100, None)], key=str)
    c.check()


def test_deeper_kv_replaces_shallower_kv_on_the_same_path():
    c = SnapshotCache([RamTier(100_000)])
    c.put([1, 2, 3], KV, b"k3")
    c.put([1, 2, 3, 4, 5], KV, b"k5")
    assert [(k, t) for k, _tier, t in c.entries()] == [(KV, (1, 2, 3, 4, 5))]
    c.check()


def test_an_entry_larger_than_the_ram_budget_goes_straight_to_disk(tmp_path):
    from orchestrator.cache.disk import DiskTier

    with DiskTier(tmp_path, 1 << 20, b"f" * 32) as disk:
        c = SnapshotCache([RamTier(100), disk])
        assert c.put([1, 2, 3], CHECKPOINT, b"r" * 50)
        assert c.put([1, 2, 3, 4, 5], KV, b"k" * 500)  # 5x the RAM budget
        assert c.contains([1, 2, 3, 4, 5], KV)
        s = c.stats()
        assert s.ram_bytes == 50 and s.disk_entries == 1 and s.rejected_too_large == 0
        plan = c.plan([1, 2, 3, 4, 5, 6, 7], 5)
        assert plan.n_tokens == 3 and plan.tier == "disk"
        assert c.load(plan) == (b"k" * 500, b"r" * 50, None)  # read from disk, not promoted (it cannot fit)
        assert c.stats().ram_bytes == 50
        c.check()


def test_a_stopped_cache_writes_its_ram_entries_to_disk_so_a_restart_restores_them(tmp_path):
    """The RAM tier is write-back: an entry reaches the disk only when evicted. Closing the cache (a server that
    is stopped) writes the rest down, so the next process restores the newest snapshots, not only older spills
    (W6's restart restored 79% of the previous request without it)."""
    from orchestrator.cache.disk import DiskTier

    fp = b"f" * 32
    with DiskTier(tmp_path, 1 << 20, fp) as disk:
        c = SnapshotCache([RamTier(1000), disk])
        assert c.put([1, 2, 3], CHECKPOINT, b"r" * 400) and c.put([1, 2, 3, 4], CHECKPOINT, b"s" * 400)
        assert c.put([1, 2, 3, 4, 5, 6], CHECKPOINT, b"t" * 400)  # evicts [1, 2, 3] to disk
        assert c.stats().disk_entries == 1
        c.close()
        c.close()  # idempotent
    with DiskTier(tmp_path, 1 << 20, fp) as disk:
        again = SnapshotCache([RamTier(1000), disk])
        assert again.stats().disk_entries == 3
        plan = again.plan([1, 2, 3, 4, 5, 6, 7], 6, live_tokens=[1, 2, 3, 4, 5, 6])  # live KV: the checkpoint alone
        assert (plan.n_tokens, plan.tier) == (6, "disk") and again.load(plan) == (None, b"t" * 400, None)
        again.check()


def test_entries_the_disk_tier_evicts_leave_the_index(tmp_path):
    """The disk tier's LRU evicts to stay within its budget; the index must forget those entries. It used to keep
    them: the soak's radix nodes and metadata grew without bound, and plans named snapshots that were gone."""
    from orchestrator.cache.disk import DiskTier

    with DiskTier(tmp_path, 4100, b"f" * 32) as disk:  # 7 files of 59 + 16 + 500 bytes
        c = SnapshotCache([RamTier(1000), disk])  # 2 entries of 500 bytes
        for i in range(1, 101):
            assert c.put([i, 7, 7, 7], CHECKPOINT, bytes([i]) * 500)
            c.check()
        s = c.stats()
        assert (s.ram_entries, s.disk_entries, len(c.entries())) == (2, 7, 9)  # RAM 99, 100; disk 92..98
        assert s.dropped == 100 - 9

        def plan(i):
            return c.plan([i, 7, 7, 7, 8], 4, live_tokens=[i, 7, 7, 7])  # live KV, so only the checkpoint is planned

        assert plan(91).n_tokens == 0  # spilled, then evicted from disk: gone from the index too
        oldest_on_disk = plan(92)
        assert (oldest_on_disk.n_tokens, oldest_on_disk.tier) == (4, "disk")
        assert c.load(oldest_on_disk) == (None, bytes([92]) * 500, None)
        # The promotion spilled a RAM entry; the disk tier made room by evicting 93 (92 was just read).
        c.check()
        assert plan(93).n_tokens == 0 and plan(92).tier == "live" and plan(94).tier == "disk"
        assert len(c.entries()) == 8 and c.stats().disk_entries == 7  # 92 is in RAM and keeps its disk copy


class DictTier:
    """A lower tier in a dict, least recently used out first: what a new tier (a shared one across machines)
    has to implement. `broken` makes every call raise."""

    def __init__(self, name: str, budget_bytes: int) -> None:
        from collections import OrderedDict

        self.name, self.budget_bytes, self.on_evict, self.broken = name, budget_bytes, None, False
        self.shared = False
        self.data: OrderedDict = OrderedDict()

    @property
    def bytes(self) -> int:
        return sum(len(v[2]) for v in self.data.values())

    def __len__(self) -> int:
        return len(self.data)

    def _check(self) -> None:
        if self.broken:
            raise OSError("the tier is down")

    def get(self, key):
        from orchestrator.cache.tiers import Stored

        self._check()
        if key not in self.data:
            return None
        self.data.move_to_end(key)
        return Stored(*self.data[key])

    def put(self, key, tokens, kind, payload) -> bool:
        self._check()
        if len(payload) > self.budget_bytes:
            return False
        self.data.pop(key, None)
        evicted = []
        while self.bytes + len(payload) > self.budget_bytes:
            evicted.append(self.data.popitem(last=False)[0])
        self.data[key] = (kind, tuple(tokens), bytes(payload))
        for k in evicted:
            self.on_evict(k)
        return True

    def contains(self, key) -> bool:
        self._check()
        return key in self.data

    def delete(self, key) -> bool:
        self._check()
        return self.data.pop(key, None) is not None

    def entries(self):
        from orchestrator.cache.tiers import EntryInfo

        self._check()
        return iter([EntryInfo(k, v[0], v[1], len(v[2])) for k, v in self.data.items()])

    def stats(self):
        from orchestrator.cache.tiers import TierStats

        self._check()
        return TierStats(self.name, len(self.data), self.bytes, self.budget_bytes)

    def close(self) -> None:
        pass


def test_ram_and_disk_tiers_implement_the_tier_protocol(tmp_path):
    from orchestrator.cache.disk import DiskTier
    from orchestrator.cache.tiers import Tier

    with DiskTier(tmp_path, 1000, b"f" * 32) as disk:
        assert isinstance(disk, Tier) and isinstance(RamTier(10), Tier) and isinstance(DictTier("x", 1), Tier)


def test_a_third_tier_is_one_class_entries_spill_down_the_list_and_are_promoted_back():
    ram, mid, far = RamTier(100), DictTier("mid", 100), DictTier("far", 1000)
    c = SnapshotCache([ram, mid, far])
    for i in range(1, 8):
        assert c.put([i, 7], CHECKPOINT, bytes([i]) * 60)  # one fits in RAM; mid holds one more
        c.check()
    where = {t[0]: tier for _kind, tier, t in c.entries()}
    assert where[7] == "ram" and where[6] == "mid" and where[1] == "far"
    plan = c.plan([1, 7, 9], 2, live_tokens=[1, 7])
    assert (plan.n_tokens, plan.tier) == (2, "far")
    assert c.load(plan) == (None, bytes([1]) * 60, None)  # promoted: 7 spills to mid, mid's 6 to far
    c.check()
    assert {t[0]: tier for _kind, tier, t in c.entries()}[1] == "ram"
    assert [s.name for s in c.stats().tiers] == ["ram", "mid", "far"]


def test_a_failing_lower_tier_is_a_miss_never_an_error(caplog):
    ram, bad = RamTier(100), DictTier("shared", 1000)
    c = SnapshotCache([ram, bad])
    assert c.put([1, 2], CHECKPOINT, b"a" * 60) and c.put([3, 4], CHECKPOINT, b"b" * 60)  # [1, 2] spilled
    bad.broken = True
    plan = c.plan([1, 2, 3], 2, live_tokens=[1, 2])
    assert plan.tier == "shared"
    assert c.load(plan) is None  # a miss: the entry is forgotten, the caller plans again
    assert c.plan([1, 2, 3], 2, live_tokens=[1, 2]).n_tokens == 0
    assert c.put([5, 6], CHECKPOINT, b"c" * 60)  # the spill of [3, 4] fails: dropped, the put succeeds
    assert [t for _k, _tier, t in c.entries()] == [(5, 6)]
    assert c.stats().tiers[1].disabled  # stats of a broken tier: reported as off
    assert any("'shared' failed" in r.getMessage() for r in caplog.records)
    bad.broken = False
    c.check()


def test_a_guarded_tier_is_a_shared_tier_whose_failures_are_misses_logged_once(caplog):
    from orchestrator.cache.tiers import GuardedTier, SharedTier

    class DownShared(DictTier):
        def put(self, key, tokens, kind, payload, covers=()) -> bool:
            self.covers = tuple(covers)
            return super().put(key, tokens, kind, payload)

        def probe(self, tokens, lo, hi, sid):
            self._check()
            return []

        def transfer_s(self, nbytes):
            self._check()
            return 0.5

    tier = DownShared("remote", 1000)
    tier.shared = True
    guarded = GuardedTier(tier)
    assert isinstance(guarded, SharedTier)
    assert guarded.put("k", [1, 2], CHECKPOINT, b"x" * 10, covers=[1]) and tier.covers == (1,)
    assert guarded.transfer_s(10) == 0.5
    tier.broken = True
    with caplog.at_level("WARNING", logger="orchestrator.cache.tiers"):
        assert guarded.get("k") is None and not guarded.put("k", [1, 2], CHECKPOINT, b"x")
        assert guarded.probe([1, 2], 0, 2, "") == [] and guarded.entries() == [] and guarded.stats() is None
        assert guarded.transfer_s(10) == float("inf")  # unmeasurable: never worth a fetch
        assert not guarded.contains("k") and not guarded.delete("k")
    assert [r.getMessage() for r in caplog.records if "'remote' failed" in r.getMessage()] == [
        "snapshot tier 'remote' failed (get: the tier is down); treated as a miss"]
