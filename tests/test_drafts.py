"""Drafts without a second model (speculative/ngram.py) and the per-request draft length (speculative/policy.py):
pure modules, no engine."""

from __future__ import annotations

import numpy as np

from orchestrator.speculative.ngram import NgramDrafter
from orchestrator.speculative.policy import DraftLength, VerifyCosts

WIDTHS = (2, 3, 4, 5, 6, 7)


# ---------------------------------------------------------------- drafts


def test_ngram_drafts_what_followed_the_latest_earlier_match():
    d = NgramDrafter([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3], min_n=2, max_n=3)
    assert d.draft(3) == [4, 5, 6]  # the latest earlier "1 2 3", not the first
    assert d.draft(10) == [4, 5, 6, 1, 2, 3, 4, 5, 6, 1]  # past the end: the 6-token period repeats
    assert d.draft(0) == []
    d.extend([7])
    assert d.draft(4) == []  # "2 3 7", "3 7": never seen


def test_ngram_drafts_a_loop_on_past_the_end():
    """A run of one token, or a short loop, matches one period back: the draft repeats the period for all k tokens
    (a draft cut at the end would give one token a verification, whatever the width allows)."""
    assert NgramDrafter([7, 5, 5, 5, 5], min_n=2, max_n=2, long=()).draft(6) == [5] * 6
    assert NgramDrafter([1, 8, 9, 8, 9, 8], min_n=2, max_n=3, long=()).draft(5) == [9, 8, 9, 8, 9]


def test_ngram_prefers_the_longest_suffix():
    d = NgramDrafter([5, 1, 2, 8, 0, 2, 9, 5, 1, 2], min_n=1, max_n=3)
    assert d.draft(1) == [8]  # "5 1 2" (n=3) wins over the later "2" (n=1) that was followed by 9


def test_ngram_long_suffix_finds_the_copy_being_made():
    """An edit copying a file whose blocks differ by one token (1 or 2 here): every 4-token suffix recurs in each
    block, and its latest occurrence is the previous block, which drafts that block's number; the 8-token suffix
    holds the number of the block being copied and drafts its continuation."""
    block = lambda i: [10, 11, 12, i, 13, 14, 15, 16, 17, 18, 19, 20 + i]
    prompt = block(1) + block(2) + [99]
    copy = block(1)[:8]  # the answer has copied block 1 up to here
    d = NgramDrafter(prompt + copy)
    assert d.draft(4) == block(1)[8:12]  # [17, 18, 19, 21]
    short = NgramDrafter(prompt + copy, long=())
    assert short.draft(4) == block(2)[8:12]  # the latest 4-gram "14 15 16" is block 2's: [17, 18, 19, 22]


def test_ngram_incremental_equals_built_at_once():
    rng = np.random.default_rng(1)
    tokens = [int(x) for x in rng.integers(0, 6, 300)]
    inc = NgramDrafter(tokens[:10], follow=False)
    for i in range(10, len(tokens)):
        inc.extend([tokens[i]])
        assert inc.draft(5) == NgramDrafter(tokens[:i + 1]).draft(5)
        assert inc.lookup() == NgramDrafter(tokens[:i + 1]).lookup()


def test_ngram_follows_the_source_it_copies_past_a_suffix_every_block_shares():
    """Blocks that differ only at their ends, 20 shared tokens apart: at a block's end every suffix up to 16 tokens
    recurs in each block and the latest occurrence is the last block's, which drafts its number (53); the copy
    being made is block 1's, which the last draft came from and the answer still agrees with over 21 tokens."""
    block = lambda i: [i] + list(range(20, 40)) + [50 + i]
    prompt = block(1) + block(2) + block(3) + [99]
    d = NgramDrafter(prompt + [1, 20])
    assert d.draft(3) == [21, 22, 23]  # "1 20" occurs in block 1 only: the source
    d.extend(list(range(21, 40)))
    assert d.draft(2) == [51, 2]
    assert NgramDrafter(d.tokens, follow=False).draft(2) == [53, 99]
    d.extend([51, 2, 20, 21])  # the copy goes on into block 2, still the source's continuation
    assert d.draft(2) == [22, 23]
    d.extend([7])  # the answer leaves the source: nothing agrees, and "22 7" never occurred
    assert d.draft(2) == []


def test_ngram_a_longer_lookup_match_wins_over_the_source():
    """The last draft's source agrees with the end over 8 tokens, the lookup's 16-token match over 16: the
    lookup's continuation (70) is drafted, not the source's (80)."""
    t = list(range(60, 76))
    tokens = [1] + t + [70] + [5] + t[8:] + [80] + [9] + t
    d = NgramDrafter(tokens)
    d._source = len(tokens) - tokens.index(80)  # as if the last draft had come from the second block
    assert d._agreement(tokens.index(80)) == 8
    assert d.draft(1) == [70]
    d._source = len(tokens) - tokens.index(80)
    d.reach = 8  # agreements counted up to 8 only: a tie, which the source wins
    assert d.draft(1) == [80]


def fixed_costs(per_row: float) -> VerifyCosts:
    """Costs where a verification of w tokens takes 1 + per_row * (w - 1) plain decode steps."""
    costs = VerifyCosts()
    for _ in range(2):  # the first observation of each width is a warm-up, dropped
        costs.observe(1, 0.01)
        for w in WIDTHS:
            costs.observe(w, 0.01 * (1 + per_row * (w - 1)))
    return costs


def test_draft_length_stops_verifying_when_nothing_is_accepted():
    """Drafts never accepted: at most a rejected verification or two at the prior, then the unverified drafts'
    misses keep the estimate down and nothing more is verified."""
    length = DraftLength(WIDTHS, fixed_costs(0.2))
    verifications = 0
    for _ in range(1000):
        w = length.width(6)
        assert w == 1 or w in WIDTHS
        if w > 1:
            verifications += 1
            length.observe(w - 1, 0)
        else:
            length.shadow(False)
    assert verifications <= 2


def test_unverified_drafts_that_match_bring_verification_back():
    length = DraftLength(WIDTHS, fixed_costs(0.2))
    length.observe(6, 0)
    for _ in range(10):
        length.shadow(False)
    assert length.width(6) == 1
    steps = 0
    while length.width(6) == 1:
        length.shadow(True)
        steps += 1
    assert 1 <= steps <= 10  # about as many matching drafts in a row as the counts remember (decay 0.9)


def test_draft_length_follows_acceptance_and_cost():
    """Cheap rows and drafts always accepted: the widest width; drafts often rejected: narrower; rows as dear as
    decode steps: no width ever pays (a verified token is at best as cheap as a step)."""
    length = DraftLength(WIDTHS, fixed_costs(0.1))
    for _ in range(5):
        length.observe(6, 6)
    assert length.width(6) == 7 and length.width(2) == 3 and length.width(0) == 1
    for _ in range(8):
        length.observe(6, 3)
    narrower = length.width(6)
    assert 1 < narrower < 7
    dear = DraftLength(WIDTHS, fixed_costs(1.0))
    for _ in range(5):
        dear.observe(6, 5)
    assert dear.width(6) == 1
    for _ in range(50):
        dear.shadow(True)
    assert dear.width(6) == 1
    assert DraftLength(()).width(6) == 1


def test_a_dear_rollback_narrows_or_stops_verification():
    """The same acceptance and verification costs: where a rejected verification's rollback costs two decode
    steps more, narrower widths (fewer rejections) or none."""
    cheap, dear = fixed_costs(0.3), fixed_costs(0.3)
    for _ in range(2):
        cheap.observe_rewind(0.0)
        dear.observe_rewind(0.02)
    assert cheap.rewind_ratio() == 0.0 and dear.rewind_ratio() == 2.0
    a, b = DraftLength(WIDTHS, cheap), DraftLength(WIDTHS, dear)
    for length in (a, b):
        for _ in range(5):
            length.observe(4, 3)
    assert a.width(6) > b.width(6)


def test_verify_costs_are_measured_ratios_with_a_prior_until_then():
    costs = VerifyCosts(prior=0.25, rewind_prior=0.5)
    assert costs.ratio(1) == 1.0 and costs.ratio(5) == 2.0 and costs.rewind_ratio() == 0.5
    costs.observe(1, 0.02)
    costs.observe(5, 0.50)  # first observations: warm-ups (a new graph), dropped
    costs.observe_rewind(0.50)
    assert costs.ratio(5) == 2.0 and costs.rewind_ratio() == 0.5
    costs.observe(1, 0.02)
    costs.observe(5, 0.05)
    assert costs.ratio(5) == 2.5
    costs.observe(5, 0.10)  # moving average, weight 0.2
    assert abs(costs.ratio(5) - 3.0) < 1e-9
    costs.observe_rewind(0.01)
    assert abs(costs.rewind_ratio() - 0.5) < 1e-9


def test_widths_not_measured_follow_the_rows_measured():
    """One width measured (3 rows at 2 steps: half a step a row) prices the others the same way."""
    costs = VerifyCosts(prior=0.25)
    for _ in range(2):
        costs.observe(1, 0.01)
        costs.observe(3, 0.02)
    assert costs.ratio(3) == 2.0 and abs(costs.ratio(7) - 4.0) < 1e-9 and abs(costs.ratio(2) - 1.5) < 1e-9


def test_costs_measured_at_start_price_the_first_verifications_until_timed_here():
    """calibration.measure_verify_costs' ratios stand in for the optimistic prior: widths measured at start keep
    their ratio, the others follow their rows, a rollback its own; this scheduler's own timings then win."""
    costs = VerifyCosts(prior=0.25, rewind_prior=1.0, start={2: 1.8, 4: 3.4, 0: 1.6})
    assert costs.ratio(2) == 1.8 and costs.ratio(4) == 3.4 and costs.rewind_ratio() == 1.6
    assert abs(costs.ratio(6) - (1 + 0.8 * 5)) < 1e-9  # 0.8 a row, the mean of the two measured widths
    for _ in range(2):
        costs.observe(1, 0.01)
        costs.observe(4, 0.02)
    assert costs.ratio(4) == 2.0 and costs.ratio(2) == 1.8
    attention_only = VerifyCosts(start={2: 1.2, 0: 0.0})  # a KV removal: free
    assert attention_only.rewind_ratio() == 0.0


def test_start_costs_where_rows_are_dear_keep_a_first_request_from_verifying_at_the_prior():
    """At 0.8 of a step a row (the qwen3.5-4b preset on 2 cores: bench/results/2026-12-06/sizes-verification)
    drafts accepted at 0.85 do not pay at any width; at the prior's 0.25 a row they seem to, which is what a
    request's first verifications cost before its timings came in."""
    start = {w: 1 + 0.8 * (w - 1) for w in WIDTHS} | {0: 1.6}
    measured, prior = DraftLength(WIDTHS, VerifyCosts(start=start)), DraftLength(WIDTHS, VerifyCosts())
    for length in (measured, prior):
        for i in range(40):
            length.shadow(i % 7 != 0)
    assert prior.width(6) > 1 and measured.width(6) == 1


def test_partial_acceptance_where_verifying_does_not_pay_decodes_about_as_fast_as_plain():
    """Drafts accepted 75% of the time, independently, at the qwen3.5-0.8b preset's costs (a width-7
    verification 3.5 decode steps, a rollback 1.8): no width pays (about 0.7 tokens a step at best), so the
    policy must stay near plain decoding. The rule before (per-verification decay 0.8, the mean) chased runs of
    accepted drafts into rejections: 0.89x in this simulation, 0.80x measured (bench/results/2026-12-04/
    speculative, 25% forced corruption). Where every draft is accepted it must still verify at the widest width."""
    from bench.spec_policy import COSTS, Fixed, answer
    import random

    ratio, rewind = COSTS["0.8b"]
    rates = [answer(DraftLength(WIDTHS, Fixed(ratio, rewind)), lambda t: 0.75, 300, random.Random(seed))
             for seed in range(100)]
    assert sum(rates) / len(rates) >= 0.95
    always = DraftLength(WIDTHS, Fixed(ratio, rewind))
    assert answer(always, lambda t: 1.0, 300, random.Random(0)) > 1.9
    assert always.width(6) == 7


def test_the_cautious_estimate_is_below_the_mean_and_closes_on_it():
    length = DraftLength(WIDTHS)
    assert length.cautious() < length.acceptance()
    for _ in range(50):
        length.shadow(True)
        length.shadow(False)
    assert abs(length.acceptance() - 0.5) < 0.05
    assert 0.5 - 0.5 * (0.25 / 10) ** 0.5 - 0.05 < length.cautious() < length.acceptance()


def test_replay_of_a_recorded_answer_counts_what_the_drafts_save():
    from bench.spec_policy import replay

    costs = {w: 1 + 0.25 * (w - 1) for w in range(2, 9)}
    block = list(range(100, 160))
    copied = replay(block, block, 60, costs, 0.0)  # the answer copies the prompt: drafts cover it
    assert copied[0] > 1.5 and 0 < copied[2] <= copied[1]
    fresh = replay(block, list(range(500, 560)), 60, costs, 0.0)  # nothing repeats: plain decoding, no drafts
    assert fresh == (60 / 59, 0, 0)  # n tokens, n - 1 plain steps (the first is the prompt's)
