"""The value policy (orchestrator/cache/policy.py ValuePolicy) and the least-recently-used fast path of the RAM
tier: which entry goes first, on small trees with exact answers, and the same choice as ranking every entry."""

import random

from orchestrator.cache.policy import POLICIES, Candidate, EvictionPolicy, ValuePolicy
from orchestrator.cache.radix import CHECKPOINT, KV, LOGITS, RadixTree
from orchestrator.cache.snapshots import SnapshotCache
from orchestrator.cache.tiers import RamTier


def _chain() -> tuple[RadixTree, list[int]]:
    """One 2,100-token prompt with interval checkpoints every 512 tokens, its prompt end and its KV."""
    t = RadixTree()
    prompt = list(range(1, 2101))
    for eid, depth in ((1, 512), (2, 1024), (3, 1536), (4, 2048), (5, 2100)):
        t.insert(prompt[:depth], CHECKPOINT, eid)
    t.insert(prompt, LOGITS, 6)
    t.insert(prompt, KV, 7)
    return t, prompt


def test_mid_stretch_checkpoints_go_before_the_branch_end_even_when_used_later():
    t, _ = _chain()
    p = ValuePolicy(horizon=100, near_end=512)
    # 512, 1024 and 1536 lie more than 512 tokens above the branch's end (2100); 2048 lies 52 above it.
    assert [p.likely(t, e) for e in range(1, 8)] == [False, False, False, True, True, True, True]
    # The branch end was used at tick 1, the mid-stretch checkpoints later: one of those still goes first.
    order = [Candidate(e, t, 1000, 1) for e in (4, 5, 6, 7)] + [Candidate(e, t, 1000, 50) for e in (1, 2, 3)]
    assert p.victim(order) == 1
    # LRU takes the branch end's checkpoint (the oldest, first of equals): what the next turn restores.
    assert EvictionPolicy(bonus_ticks=0).victim(order) == 4


def test_recency_still_matters_a_stale_restore_point_goes_before_a_fresh_mid_stretch_one():
    t, _ = _chain()
    p = ValuePolicy(horizon=100, near_end=512)
    order = [Candidate(4, t, 1000, 10), Candidate(1, t, 1000, 200)]  # 10 + 100 < 200
    assert p.victim(order) == 4
    order = [Candidate(4, t, 1000, 150), Candidate(1, t, 1000, 200)]  # 150 + 100 > 200
    assert p.victim(order) == 1


def test_a_fork_is_a_restore_point_and_covered_kv_goes_first():
    t, prompt = _chain()
    t.insert(prompt[:1024] + [9] * 700, CHECKPOINT, 8)  # another conversation leaves the prompt at 1024
    p = ValuePolicy(horizon=100, near_end=400)
    assert p.likely(t, 2) and not p.likely(t, 1) and not p.likely(t, 3)  # 512 and 564 tokens above a fork/end
    assert ValuePolicy(near_end=512).likely(t, 1)  # 512 above the fork: near enough
    t.insert(prompt[:1500], KV, 9)  # covered by KV 7
    order = [Candidate(e, t, 1000, 1) for e in (1, 2, 3, 4, 5, 6, 7, 8, 9)]
    assert p.victim([c for c in order if t.covered(c.eid)] + order) == 9  # covered first, as the cache gives them
    assert p.victim(order[:8]) == 1
    assert p.victim([]) is None


def test_victim_is_the_lowest_priority_on_random_trees():
    rng = random.Random(5)
    for _ in range(200):
        t, eid = RadixTree(), 0
        for _ in range(rng.randint(1, 12)):
            eid += 1
            tokens = [rng.randint(1, 3) for _ in range(rng.randint(1, 40))]
            kind = rng.choice((CHECKPOINT, CHECKPOINT, KV, LOGITS))
            if t.find(tokens, kind) is None:
                t.insert(tokens, kind, eid)
        p = ValuePolicy(horizon=rng.choice((0, 3, 50)), near_end=rng.choice((0, 5, 20)))
        ticks = sorted(rng.randint(0, 60) for _ in range(len(t)))
        order = [Candidate(e, t, 10, u) for e, u in zip(t.ids(), ticks)]
        order = [c for c in order if t.covered(c.eid)] + order  # as SnapshotCache gives them
        best = min(order, key=lambda c: p.priority(t, c.eid, c.nbytes, c.last_used))
        assert p.priority(t, p.victim(order), 10, 0)[0] == p.priority(t, best.eid, 10, 0)[0]
        chosen = next(c for c in order if c.eid == p.victim(order))
        assert p.priority(t, chosen.eid, 10, chosen.last_used) == p.priority(t, best.eid, 10, best.last_used)


def test_the_cache_keeps_the_restore_points_under_the_value_policy_and_loses_them_under_lru():
    a, b = list(range(1, 2101)), list(range(5001, 7101))  # two conversations, 2,100 tokens each

    def store(c, prompt):
        for depth in (512, 1024, 1536, 2048, 2100):  # interval checkpoints, last message end, prompt end
            assert c.put(prompt[:depth], CHECKPOINT, b"c" * 100)
        assert c.put(prompt, KV, b"k" * 100)
        c.check()

    for policy, kept in ((ValuePolicy(near_end=512), True), (POLICIES["lru"](), False)):
        c = SnapshotCache([RamTier(800)], policy=policy)
        store(c, a)
        store(c, b)  # four of a's entries must go
        left = {len(tokens) for kind, _, tokens in c.entries() if kind == CHECKPOINT and tokens[0] == 1}
        assert left == ({2048, 2100} if kept else {2100})
        # a's next turn shares its prompt up to the last message end, 2048: restorable only where it stayed.
        assert c.plan(a[:2048] + [7] * 300, 2300).n_tokens == (2048 if kept else 0)


def same_entries_under_random_traffic(rng: random.Random, steps: int, longest: int, make) -> None:
    """Two caches from `make()` (a pair) take the same random puts and restores; after every put they hold the
    same entries."""
    a, b = make()
    for step in range(steps):
        tokens = [rng.randint(1, 3) for _ in range(rng.randint(1, longest))]
        if rng.random() < 0.3:
            for c in (a, b):
                plan = c.plan(tokens, len(tokens), tokens)
                if plan.n_tokens:
                    c.load(plan)
            continue
        kind, size = rng.choice(((CHECKPOINT, rng.randint(20, 120)), (KV, rng.randint(20, 200))))
        for c in (a, b):
            c.put(tokens, kind, b"x" * size)
            c.check()
        assert sorted(a.entries()) == sorted(b.entries()), step


def test_lru_fast_path_picks_what_ranking_every_entry_picks():
    rng = random.Random(11)
    for _ in range(30):
        same_entries_under_random_traffic(rng, 60, 12, lambda: (
            SnapshotCache([RamTier(500)], policy=POLICIES["lru"]()), SnapshotCache([RamTier(500)], policy=_Ranked())))


class _Ranked(EvictionPolicy):
    """Least recently used by ranking every candidate (EvictionPolicy.victim), not the cache's fast path."""

    def __init__(self):
        super().__init__(bonus_ticks=0.0)

    @property
    def recency_only(self) -> bool:
        return False


def test_recency_value_stops_reading_early_and_evicts_what_ranking_every_entry_evicts():
    # EvictionPolicy.victim stops at the first candidate used no earlier than its best priority so far; the cache
    # must keep exactly the entries a full ranking of every candidate keeps (min over all, first of equals).
    rng = random.Random(23)
    for _ in range(60):
        bonus, reference = rng.choice((0.5, 4.0, 40.0)), rng.choice((1 / 65536, 0.3, 3.0))  # bonuses 0..many ticks
        same_entries_under_random_traffic(rng, 80, 14, lambda: (
            SnapshotCache([RamTier(600)], policy=EvictionPolicy(bonus_ticks=bonus, reference=reference)),
            SnapshotCache([RamTier(600)], policy=_RankAll(bonus, reference))))


def test_recency_value_reads_only_the_oldest_entries():
    t, _ = _chain()
    seen = []

    def candidates():
        for e, used in zip(t.ids(), range(0, 7000, 1000)):
            seen.append(e)
            yield Candidate(e, t, 10**6, used)

    assert EvictionPolicy(bonus_ticks=4.0).victim(candidates()) is not None
    assert len(seen) < len(t)  # the bonus (a few dozen ticks) cannot lift the oldest over one 1,000 ticks newer


class _RankAll(EvictionPolicy):
    """EvictionPolicy ranking every candidate (the rule before the early stop)."""

    def __init__(self, bonus, reference):
        super().__init__(bonus_ticks=bonus, reference=reference)

    def victim(self, candidates):
        best = min(candidates, key=lambda c: self.priority(c.tree, c.eid, c.nbytes, c.last_used), default=None)
        return best.eid if best is not None else None
