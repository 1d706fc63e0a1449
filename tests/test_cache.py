"""Radix tree and snapshot LRU, with fake snapshots (bytes whose length is the cost) and exact orders."""

import random

import pytest

from orchestrator.cache import SnapshotCache
from orchestrator.radix import RadixTree


def test_radix_deepest_prefix_wins_and_respects_limit():
    t = RadixTree()
    t.insert([1, 2, 3], 10)
    t.insert([1, 2, 3, 4, 5], 11)
    t.insert([1, 2, 9], 12)
    t.check()
    assert t.match([1, 2, 3, 4, 5, 6]).snapshot_id == 11
    assert t.match([1, 2, 3, 4, 5, 6]).n_tokens == 5
    # A byte-identical repeat must leave at least one token to prefill: the limit excludes depth 5.
    assert t.match([1, 2, 3, 4, 5], max_tokens=4).snapshot_id == 10
    assert t.match([1, 2, 3, 4, 7]).snapshot_id == 10
    assert t.match([1, 2, 9, 9]).snapshot_id == 12
    assert t.match([1, 2]).snapshot_id is None
    assert t.match([7]).n_tokens == 0
    assert t.tokens_of(12) == (1, 2, 9)


def test_radix_replace_and_remove_prune():
    t = RadixTree()
    t.insert([1, 2, 3], 1)
    assert t.insert([1, 2, 3], 2) == 1
    t.insert([1, 2, 3, 4], 3)
    t.remove(2)
    t.check()
    assert t.match([1, 2, 3, 4, 5]).snapshot_id == 3
    assert t.match([1, 2, 3, 5]).snapshot_id is None
    t.remove(3)
    t.check()
    assert len(t) == 0
    with pytest.raises(ValueError):
        t.insert([], 5)
    with pytest.raises(KeyError):
        t.remove(3)


def test_radix_random_against_bruteforce():
    rng = random.Random(7)
    t = RadixTree()
    stored: dict[int, tuple[int, ...]] = {}
    for sid in range(1, 400):
        if stored and rng.random() < 0.3:
            victim = rng.choice(list(stored))
            t.remove(victim)
            del stored[victim]
        else:
            toks = tuple(rng.choice([1, 2, 3]) for _ in range(rng.randint(1, 8)))
            replaced = t.insert(toks, sid)
            if replaced is not None:
                assert stored.pop(replaced) == toks
            stored[sid] = toks
        t.check()
        q = [rng.choice([1, 2, 3]) for _ in range(rng.randint(1, 10))]
        limit = rng.randint(0, len(q))
        best = max(
            ((len(v), k) for k, v in stored.items() if len(v) <= limit and tuple(q[: len(v)]) == v),
            default=(0, None),
        )
        m = t.match(q, limit)
        assert (m.n_tokens, m.snapshot_id) == best


def test_lru_budget_checked_before_insert_and_exact_eviction_order():
    c = SnapshotCache(budget_bytes=100)
    assert c.put([1], b"a" * 40)
    assert c.put([2], b"b" * 40)
    c.lookup([1, 5])  # touch [1]: now [2] is least recently used
    assert c.put([3], b"c" * 40)  # needs 20 more bytes: evicts [2] only
    assert c.prefixes() == [(1,), (3,)]
    assert c.stats().bytes == 80 and c.stats().evictions == 1
    c.check()
    assert not c.put([4], b"d" * 101)  # larger than the whole budget: not kept, nothing evicted
    assert c.prefixes() == [(1,), (3,)]
    assert c.stats().rejected_too_large == 1


def test_restore_copies_never_consumes():
    c = SnapshotCache(budget_bytes=1000)
    c.put([1, 2, 3], b"state")
    for _ in range(3):
        m = c.lookup([1, 2, 3, 4])
        assert m.n_tokens == 3
        assert c.get(m.snapshot_id) == b"state"
    assert c.stats().entries == 1 and c.stats().hits == 3


def test_put_same_prefix_replaces_without_leaking_bytes():
    c = SnapshotCache(budget_bytes=1000)
    c.put([1, 2], b"x" * 10)
    c.put([1, 2], b"y" * 30)
    assert c.stats().bytes == 30 and c.stats().entries == 1
    assert c.get(c.lookup([1, 2, 3]).snapshot_id) == b"y" * 30
    c.check()
