"""How many drafted tokens a request verifies next: the width that yields the most tokens per second, from the
request's acceptance so far and what verifications and their rollbacks cost on this engine, within the
verification widths calibrated exact (calibration.measure_verify_widths)."""

from __future__ import annotations

import math
from typing import Mapping, Sequence


class VerifyCosts:
    """What a verification of each width, and the rollback after a rejected one, cost against a plain one-row
    decode step on this engine: exponential moving averages (weight `alpha`) of seconds, shared by the requests of
    one scheduler (width 1: a plain decode step, timed by the scheduler). A width not measured yet is taken to cost
    1 + r * (w - 1) steps, r the moving average of the extra cost per row over every width measured (rows cost
    alike: ggml-cpu runs each through the same one-row kernels), `prior` before any; a rollback `rewind_prior`
    steps until measured. The prior is optimistic (memory-bound figures), so that verifying is tried and measured
    where the drafts would pay at that price; the first observation of each width and of a rollback is dropped
    (a new ubatch shape builds llama.cpp's compute graph: a warm-up, not a cost). `start`: ratios measured at
    start (calibration.measure_verify_costs: width -> steps, 0 -> a rollback), used for a width, and for the
    rows and the rollback, until this scheduler has timed its own.

    Why measured: exactness keeps a verification of w < 8 rows on ggml-cpu's one-row matmul kernels, so how much
    w rows cost over one depends on whether the CPU is compute- or memory-bound: about 5x for w = 7 on the
    qwen3.5-0.8b preset on 2 cores (bench/results/2026-12-03/attention-layouts), near 1x where weights stream
    from memory. A rollback (verify.rewind) is a KV removal on attention-only models, and on a recurrent memory a
    checkpoint load plus the kept tokens decoded again: about one decode step more."""

    def __init__(self, alpha: float = 0.2, prior: float = 0.25, rewind_prior: float = 1.0,
                 start: Mapping[int, float] | None = None) -> None:
        self.alpha, self.prior, self.rewind_prior = alpha, prior, rewind_prior
        self.start = {w: r for w, r in (start or {}).items() if w >= 2 and r > 0}
        if start and start.get(0, -1) >= 0:
            self.rewind_prior = start[0]
        self.seconds: dict[int, float] = {}
        self.rewind_seconds: float | None = None
        self.draft_seconds: float | None = None  # per drafted token, where drafting runs a model (MTP)
        rows = [(r - 1) / (w - 1) for w, r in self.start.items()]
        # extra cost of a verified row, in plain steps
        self.per_row: float | None = max(0.0, sum(rows) / len(rows)) if rows else None
        self._warm: set[int] = set()  # widths (0: rollbacks, -1: drafts) whose first observation was dropped

    def _average(self, key: int, old: float | None, new: float) -> float | None:
        if key not in self._warm:
            self._warm.add(key)
            return old
        return new if old is None else old + self.alpha * (new - old)

    def observe(self, width: int, seconds: float) -> None:
        """A decode step (width 1) or a verification of `width` tokens took `seconds` (its rollback apart)."""
        avg = self._average(width, self.seconds.get(width), seconds)
        if avg is None:
            return
        self.seconds[width] = avg
        one = self.seconds.get(1)
        if width > 1 and one:
            row = max(0.0, (seconds / one - 1) / (width - 1))
            self.per_row = row if self.per_row is None else self.per_row + self.alpha * (row - self.per_row)

    def observe_rewind(self, seconds: float) -> None:
        """A rollback after a rejected verification took `seconds`."""
        self.rewind_seconds = self._average(0, self.rewind_seconds, seconds)

    def observe_draft(self, drafted: int, seconds: float) -> None:
        """Making `drafted` tokens took `seconds` (a model's draft steps; n-gram lookups are not timed)."""
        self.draft_seconds = self._average(-1, self.draft_seconds, seconds / drafted)

    def draft_ratio(self) -> float:
        """Cost of drafting one token in plain decode steps: 0 until measured (n-gram drafts, or before the
        first MTP drafts: optimistic, like `prior`)."""
        one = self.seconds.get(1)
        return self.draft_seconds / one if one and self.draft_seconds is not None else 0.0

    def ratio(self, width: int) -> float:
        """Cost of a verification of `width` tokens in plain decode steps."""
        one, w = self.seconds.get(1), self.seconds.get(width)
        if width == 1:
            return 1.0
        if one and w:
            return w / one
        if width in self.start:
            return self.start[width]
        return 1.0 + (self.prior if self.per_row is None else self.per_row) * (width - 1)

    def rewind_ratio(self) -> float:
        """Cost of a rollback in plain decode steps."""
        one = self.seconds.get(1)
        return self.rewind_seconds / one if one and self.rewind_seconds is not None else self.rewind_prior


class DraftLength:
    """Per request. `width(available)` is the ubatch width of the next step (1 = a plain decode step, no
    verification); `observe(drafted, accepted)` feeds back a verification's outcome, `shadow(hit)` a draft that
    was not verified, checked against the token the plain step then gave.

    Rule: each drafted token is taken to be accepted with probability a. Every drafted token checked (accepted,
    or the first rejected one) is one outcome; outcomes are counted with older ones decayed by `decay` per
    outcome, starting at `prior` hits : misses, so the counts hold about 1 / (1 - decay) recent tokens. The
    width is chosen on a cautious estimate: the mean hits / n less `z` standard errors, sqrt(a (1 - a) / n).
    A verification of width w yields (1 - a^w) / (1 - a) tokens and is rejected somewhere with probability
    1 - a^(w-1), so it costs `costs.ratio(w)` + (w - 1) * `costs.draft_ratio()` + (1 - a^(w-1)) *
    `costs.rewind_ratio()` decode steps; the width with the most tokens per step is chosen, and none (1) where no
    width beats a plain step.

    Why per token and cautious: on a hybrid a verification that fails costs a rollback, so verifying pays only
    above a high acceptance (about 0.85 on the qwen3.5-0.8b preset on 2 cores). The earlier rule decayed per
    verification and used the mean: one run of six accepted drafts moved it past that line at a true 0.75, and
    the rejections that followed cost more than the run gave (0.80x plain decoding at 25% forced corruption,
    bench/results/2026-12-04/speculative). Simulated with that run's costs (bench/spec_policy.py), this rule
    keeps 0.98x there (the old one 0.89x) and gives up about 1% where every draft is accepted and 6% at a
    uniform 0.9; with Gemma 3 270M's cheaper rows it is within 2% of the old one everywhere.

    While no width pays, the drafts are still made (an n-gram lookup: microseconds) and checked against the
    tokens that follow (`shadow`), so the estimate keeps up without verifying: a request whose drafts are never
    accepted pays at most a rejected verification or two at its start (at the prior), then only the lookups;
    drafts that start to match again (an edit reaching text it copies) raise the estimate until verifying
    pays."""

    def __init__(self, widths: Sequence[int], costs: VerifyCosts | None = None, decay: float = 0.9,
                 prior: tuple[float, float] = (2.0, 1.0), z: float = 0.5) -> None:
        self.widths = sorted(w for w in widths if w >= 2)
        self.costs = costs if costs is not None else VerifyCosts()
        self.decay, self.z = decay, z
        self._hits, self._misses = prior

    def acceptance(self) -> float:
        """The estimated probability that a drafted token is accepted (the mean of the decayed counts)."""
        return self._hits / (self._hits + self._misses)

    def cautious(self) -> float:
        """The acceptance `width` plans with: the mean less `z` standard errors of the decayed counts."""
        a, n = self.acceptance(), self._hits + self._misses
        return max(0.0, a - self.z * math.sqrt(a * (1 - a) / n))

    def width(self, available: int) -> int:
        """The width to use with `available` drafted tokens (the ubatch is the pending token + drafts)."""
        if not self.widths or available <= 0:
            return 1
        a = self.cautious()
        rewind, draft = self.costs.rewind_ratio(), self.costs.draft_ratio()
        best, rate = 1, 1.0  # tokens per plain-step time
        for w in self.widths:
            if w > available + 1:
                break
            tokens = (1 - a ** w) / (1 - a) if a < 1 else float(w)
            cost = self.costs.ratio(w) + (w - 1) * draft + (1 - a ** (w - 1)) * rewind
            if tokens / cost > rate:
                best, rate = w, tokens / cost
        return best

    def observe(self, drafted: int, accepted: int) -> None:
        """A verification of `drafted` drafts accepted `accepted` (0 <= accepted <= drafted) of them: `accepted`
        hits, then a miss unless every draft was accepted, each one outcome."""
        for _ in range(accepted):
            self._hits, self._misses = self._hits * self.decay + 1, self._misses * self.decay
        if accepted < drafted:
            self._hits, self._misses = self._hits * self.decay, self._misses * self.decay + 1

    def shadow(self, hit: bool) -> None:
        """A draft's first token, not verified, was (`hit`) or was not the token decoded next."""
        self.observe(1, 1 if hit else 0)
