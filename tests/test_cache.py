"""Radix tree, eviction policy and snapshot cache, with fake snapshots (bytes whose length is the cost),
exact orders, and a recount of every counter after each operation."""

import random

import pytest

from orchestrator.cache import SnapshotCache
from orchestrator.policy import EvictionPolicy
from orchestrator.radix import KV, REC, RadixTree


def test_radix_path_and_kv_covering():
    t = RadixTree()
    t.insert([1, 2, 3], REC, 10)
    t.insert([1, 2, 3, 4, 5], REC, 11)
    t.insert([1, 2, 3, 4, 5, 6, 7], KV, 12)
    t.insert([1, 2, 9], REC, 13)
    t.check()
    assert [(p.depth, p.rec, p.kv) for p in t.path([1, 2, 3, 4, 5, 6, 7, 8])] == \
        [(3, 10, None), (5, 11, None), (7, None, 12)]
    assert [p.depth for p in t.path([1, 2, 3, 4, 5, 6, 7], max_tokens=5)] == [3, 5]
    # KV at depth 7 covers depths 3 and 5 (its prefix), not the [1, 2, 9] branch.
    assert t.kv_covering([1, 2, 3, 4, 5], 5) == 12
    assert t.kv_covering([1, 2, 3], 3) == 12
    assert t.kv_covering([1, 2, 9], 3) is None
    assert t.kv_covering([1, 2, 3, 4, 9], 4) == 12  # depth 4 lies inside an edge below which the KV sits
    assert t.tokens_of(13) == (1, 2, 9)
    assert t.find([1, 2, 3], REC) == 10 and t.find([1, 2, 3], KV) is None and t.find([1, 2], REC) is None


def test_radix_remove_prunes_and_keeps_kv_counts():
    t = RadixTree()
    t.insert([1, 2, 3], REC, 1)
    assert t.insert([1, 2, 3], REC, 2) == 1
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
        t.insert([], REC, 5)
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
            kind = rng.choice([REC, KV])
            toks = tuple(rng.choice([1, 2, 3]) for _ in range(rng.randint(1, 8)))
            replaced = t.insert(toks, kind, eid)
            if replaced is not None:
                assert stored.pop(replaced) == (kind, toks)
            stored[eid] = (kind, toks)
        t.check()
        q = [rng.choice([1, 2, 3]) for _ in range(rng.randint(1, 10))]
        limit = rng.randint(0, len(q))
        want = sorted((len(v), k, e) for e, (k, v) in stored.items() if len(v) <= limit and tuple(q[: len(v)]) == v)
        got = sorted((p.depth, kind, e) for p in t.path(q, limit) for kind, e in ((REC, p.rec), (KV, p.kv)) if e)
        assert got == want
        d = rng.randint(1, len(q))
        covering = [e for e, (k, v) in stored.items() if k == KV and len(v) >= d and v[:d] == tuple(q[:d])]
        found = t.kv_covering(q, d)
        assert (found is None) == (not covering) and (found is None or found in covering)


def test_policy_covered_kv_first_then_recency_with_a_bonus_for_expensive_and_shared():
    t = RadixTree()
    shared = [7] * 1000  # a prefix (tools block) with three conversations below
    t.insert(shared, REC, 1)
    for i, tail in enumerate(([1] * 50, [2] * 50, [3] * 50)):
        t.insert(shared + tail, REC, 10 + i)
    t.insert(shared + [1] * 30, KV, 20)
    t.insert(shared + [1] * 50, KV, 21)
    p = EvictionPolicy()
    fresh = {e: (100_000, 10) for e in (1, 10, 11, 12, 20, 21)}
    assert p.victim(t, fresh) == 20  # covered by KV 21
    del fresh[20]
    t.remove(20)
    # Same size and age: a turn's checkpoint (50 tokens, one branch) goes before the shared prefix.
    assert p.victim(t, fresh) in (10, 11, 12)
    assert p.priority(t, 1, 100_000, 10) > p.priority(t, 10, 100_000, 10)
    # The shared prefix outlives a turn used a little later, but not forever.
    assert p.priority(t, 1, 100_000, 10) > p.priority(t, 10, 100_000, 14)
    assert p.priority(t, 1, 100_000, 10) < p.priority(t, 10, 100_000, 200)
    # A checkpoint a few tokens after another is cheap to recompute per byte.
    t.insert(shared + [2] * 52, REC, 30)
    assert p.value(t, 30, 100_000) < p.value(t, 11, 100_000)
    # A KV entry whose path another KV branch shares almost to its end holds few unique tokens.
    t.insert(shared + [1] * 48 + [9, 9, 9], KV, 31)
    assert t.recompute_tokens(31) == 3 and t.recompute_tokens(21) == 2


def test_cache_budget_checked_before_insert_and_never_exceeded():
    c = SnapshotCache(budget_bytes=100)
    assert c.put([1, 2], REC, b"a" * 40)
    assert c.put([1, 3], REC, b"b" * 40)
    assert c.put([1, 4], REC, b"c" * 40)  # evicts one (no disk tier: dropped)
    c.check()
    s = c.stats()
    assert s.ram_bytes == 80 and s.evictions == 1 and s.dropped == 1
    assert not c.put([5], REC, b"d" * 101)  # larger than the whole budget: not kept, nothing evicted
    assert c.stats().rejected_too_large == 1 and c.stats().ram_entries == 2
    c.check()


def test_plan_needs_kv_covering_the_checkpoint_or_live_tokens():
    c = SnapshotCache(budget_bytes=10_000)
    a = list(range(100, 130))
    c.put(a[:10], REC, b"r10")
    c.put(a[:20], REC, b"r20")
    c.put(a[:30], REC, b"r30")
    prompt = a[:25] + [999] * 5
    assert c.plan(prompt, len(prompt) - 2).n_tokens == 0  # checkpoints, but no KV anywhere
    plan = c.plan(prompt, len(prompt) - 2, live_tokens=a[:15])
    assert (plan.n_tokens, plan.kv_id, plan.tier) == (10, None, "live")
    c.put(a, KV, b"kv30")
    plan = c.plan(prompt, len(prompt) - 2)
    assert plan.n_tokens == 20 and plan.tier == "ram"
    kv, rec = c.load(plan)
    assert (kv, rec) == (b"kv30", b"r20")
    assert c.load(plan) == (b"kv30", b"r20")  # restoring copies, never consumes
    assert c.plan(a, len(a) - 2).n_tokens == 20  # at least two tokens left to prefill


def test_new_kv_drops_a_superseded_branch_with_its_end_checkpoints():
    c = SnapshotCache(budget_bytes=10_000)
    turn1 = list(range(1000, 1100)) + [7] * 10  # a boundary at 100, then end of prompt and generated tokens
    c.put(turn1[:100], REC, b"r100")
    c.put(turn1[:104], REC, b"r104", boundary=False)
    c.put(turn1, REC, b"r110", boundary=False)
    c.put(turn1, KV, b"k110")
    other = list(range(1000, 1100)) + [5] * 4  # another conversation: a boundary of its own after the fork
    c.put(other, REC, b"r104b")
    c.put(other + [6] * 6, REC, b"r110b", boundary=False)
    c.put(other + [6] * 6, KV, b"k110b")
    turn2 = list(range(1000, 1100)) + [8] * 50  # the next turn of turn1's conversation
    c.put(turn2, REC, b"r150", boundary=False)
    c.put(turn2, KV, b"k150")
    left = sorted((k, len(t), t[100]) for k, _tier, t in c.entries() if len(t) > 100) + \
        [(k, len(t), None) for k, _tier, t in c.entries() if len(t) == 100]
    # turn1's branch held only end checkpoints beyond the fork: it went. The other conversation has a
    # boundary checkpoint of its own after the fork: kept. The shared boundary checkpoint is kept.
    assert sorted(left, key=str) == sorted([(KV, 110, 5), (REC, 104, 5), (REC, 110, 5), (KV, 150, 8),
                                            (REC, 150, 8), (REC, 100, None)], key=str)
    c.check()


def test_deeper_kv_replaces_shallower_kv_on_the_same_path():
    c = SnapshotCache(budget_bytes=100_000)
    c.put([1, 2, 3], KV, b"k3")
    c.put([1, 2, 3, 4, 5], KV, b"k5")
    assert [(k, t) for k, _tier, t in c.entries()] == [(KV, (1, 2, 3, 4, 5))]
    c.check()


def test_an_entry_larger_than_the_ram_budget_goes_straight_to_disk(tmp_path):
    from orchestrator.disk import DiskTier

    with DiskTier(tmp_path, 1 << 20, b"f" * 32) as disk:
        c = SnapshotCache(budget_bytes=100, disk=disk)
        assert c.put([1, 2, 3], REC, b"r" * 50)
        assert c.put([1, 2, 3, 4, 5], KV, b"k" * 500)  # 5x the RAM budget
        assert c.contains([1, 2, 3, 4, 5], KV)
        s = c.stats()
        assert s.ram_bytes == 50 and s.disk_entries == 1 and s.rejected_too_large == 0
        plan = c.plan([1, 2, 3, 4, 5, 6, 7], 5)
        assert plan.n_tokens == 3 and plan.tier == "disk"
        assert c.load(plan) == (b"k" * 500, b"r" * 50)  # read from disk, not promoted (it cannot fit)
        assert c.stats().ram_bytes == 50
        c.check()


def test_entries_the_disk_tier_evicts_leave_the_index(tmp_path):
    """The disk tier's LRU evicts to stay within its budget; the index must forget those entries. It used to keep
    them: the soak's radix nodes and metadata grew without bound, and plans named snapshots that were gone."""
    from orchestrator.disk import DiskTier

    with DiskTier(tmp_path, 4100, b"f" * 32) as disk:  # 7 files of 59 + 16 + 500 bytes
        c = SnapshotCache(budget_bytes=1000, disk=disk)  # 2 entries of 500 bytes
        for i in range(1, 101):
            assert c.put([i, 7, 7, 7], REC, bytes([i]) * 500)
            c.check()
        s = c.stats()
        assert (s.ram_entries, s.disk_entries, len(c.entries())) == (2, 7, 9)  # RAM 99, 100; disk 92..98
        assert s.dropped == 100 - 9

        def plan(i):
            return c.plan([i, 7, 7, 7, 8], 4, live_tokens=[i, 7, 7, 7])  # live KV, so only the checkpoint is planned

        assert plan(91).n_tokens == 0  # spilled, then evicted from disk: gone from the index too
        oldest_on_disk = plan(92)
        assert (oldest_on_disk.n_tokens, oldest_on_disk.tier) == (4, "disk")
        assert c.load(oldest_on_disk) == (None, bytes([92]) * 500)
        # The promotion spilled a RAM entry; the disk tier made room by evicting 93 (92 was just read).
        c.check()
        assert plan(93).n_tokens == 0 and plan(92).tier == "live" and plan(94).tier == "disk"
        assert len(c.entries()) == 8 and c.stats().disk_entries == 7  # 92 is in RAM and keeps its disk copy
