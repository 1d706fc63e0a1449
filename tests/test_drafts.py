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
    assert d.draft(10) == [4, 5, 6, 1, 2, 3]  # never past the end
    assert d.draft(0) == []
    d.extend([7])
    assert d.draft(4) == []  # "2 3 7", "3 7": never seen


def test_ngram_prefers_the_longest_suffix():
    d = NgramDrafter([5, 1, 2, 8, 0, 2, 9, 5, 1, 2], min_n=1, max_n=3)
    assert d.draft(1) == [8]  # "5 1 2" (n=3) wins over the later "2" (n=1) that was followed by 9


def test_ngram_incremental_equals_built_at_once():
    rng = np.random.default_rng(1)
    tokens = [int(x) for x in rng.integers(0, 6, 300)]
    inc = NgramDrafter(tokens[:10])
    for i in range(10, len(tokens)):
        inc.extend([tokens[i]])
        assert inc.draft(5) == NgramDrafter(tokens[:i + 1]).draft(5)


def fixed_costs(per_row: float) -> VerifyCosts:
    """Costs where a verification of w tokens takes 1 + per_row * (w - 1) plain decode steps."""
    costs = VerifyCosts()
    costs.observe(1, 0.01)
    for w in WIDTHS:
        costs.observe(w, 0.01 * (1 + per_row * (w - 1)))
    return costs


def test_draft_length_backs_off_when_nothing_is_accepted():
    length = DraftLength(WIDTHS, fixed_costs(0.5))
    verifications = 0
    for _ in range(1000):
        w = length.width(6)
        assert w == 1 or w in WIDTHS
        if w > 1:
            verifications += 1
            length.observe(w - 1, 0)
    assert verifications <= 1000 / 32 + 6  # about one verification per max_backoff steps


def test_draft_length_follows_acceptance_and_cost():
    """Cheap rows and drafts always accepted: the widest width; drafts mostly rejected: narrower, then none but
    probes; rows as dear as decode steps: no width ever pays (a verified token is at best as cheap as a step)."""
    length = DraftLength(WIDTHS, fixed_costs(0.1))
    for _ in range(5):
        length.observe(6, 6)
    assert length.width(6) == 7 and length.width(2) == 3 and length.width(0) == 1
    for _ in range(8):
        length.observe(6, 1)
    narrower = length.width(6)
    assert 1 < narrower < 7
    dear = DraftLength(WIDTHS, fixed_costs(1.0))
    for _ in range(5):
        dear.observe(6, 5)
    assert [dear.width(6) for _ in range(3)] == [1, 1, 2]  # backing off, then a probe at the narrowest width
    assert DraftLength(()).width(6) == 1


def test_verify_costs_are_measured_ratios_with_a_prior_until_then():
    costs = VerifyCosts(prior=0.5)
    assert costs.ratio(1) == 1.0 and costs.ratio(5) == 3.0
    costs.observe(1, 0.02)
    costs.observe(5, 0.05)
    assert costs.ratio(5) == 2.5
    costs.observe(5, 0.10)  # moving average, weight 0.2
    assert abs(costs.ratio(5) - 3.0) < 1e-9
