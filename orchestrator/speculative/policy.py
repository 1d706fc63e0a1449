"""How many drafted tokens a request verifies next: the width that yields the most tokens per second, from the
request's acceptance so far and what verifications cost on this engine, within the verification widths
calibrated exact (calibration.measure_verify_widths)."""

from __future__ import annotations

from typing import Sequence


class VerifyCosts:
    """What a verification of each width costs against a plain one-row decode step on this engine: exponential
    moving averages (weight `alpha`) of the seconds llama_decode took, shared by the requests of one scheduler
    (width 1: a plain decode step). Until both are measured, width w is taken to cost 1 + prior * (w - 1) steps.

    Why measured: exactness keeps a verification of w < 8 rows on ggml-cpu's one-row matmul kernels, so how much
    w rows cost over one depends on whether the CPU is compute- or memory-bound: about 5x for w = 7 on the
    qwen3.5-0.8b preset on 2 cores (bench/results/2026-12-03/attention-layouts), near 1x where weights stream
    from memory."""

    def __init__(self, alpha: float = 0.2, prior: float = 0.5) -> None:
        self.alpha, self.prior = alpha, prior
        self.seconds: dict[int, float] = {}

    def observe(self, width: int, seconds: float) -> None:
        old = self.seconds.get(width)
        self.seconds[width] = seconds if old is None else old + self.alpha * (seconds - old)

    def ratio(self, width: int) -> float:
        """Cost of a verification of `width` tokens in plain decode steps."""
        one, w = self.seconds.get(1), self.seconds.get(width)
        if width == 1:
            return 1.0
        return w / one if one and w else 1.0 + self.prior * (width - 1)


class DraftLength:
    """Per request. `width(available)` is the ubatch width of the next step (1 = a plain decode step, no
    verification); `observe(drafted, accepted)` feeds back a verification's outcome.

    Rule: each drafted token is taken to be accepted with probability a, estimated from this request's
    verifications (accepted drafts against rejections, older ones decayed by `decay`, starting at 2 : 1). A
    verification of width w then yields (1 - a^w) / (1 - a) tokens for `costs.ratio(w)` decode steps; the width
    with the most tokens per step is chosen, and none (1) where no width beats a plain step. When no width pays,
    or a verification accepted nothing, the next `backoff` steps do not speculate, then one probe of width 2
    refreshes the estimate; `backoff` doubles each time (at most `max_backoff`) and any accepted draft resets
    it. So a request whose drafts are never accepted verifies about once every `max_backoff` steps, and pays
    about ratio(2) / max_backoff of a step for it (32: about 5% where ratio(2) is 1.5)."""

    def __init__(self, widths: Sequence[int], costs: VerifyCosts | None = None, max_backoff: int = 32,
                 decay: float = 0.8) -> None:
        self.widths = sorted(w for w in widths if w >= 2)
        self.costs = costs if costs is not None else VerifyCosts()
        self.max_backoff, self.decay = max_backoff, decay
        self._hits, self._misses = 2.0, 1.0
        self._wait = 0  # decode steps left before the next probe
        self._probe = False  # the next step after the wait verifies at the narrowest width
        self._backoff = 1

    def acceptance(self) -> float:
        """The estimated probability that a drafted token is accepted."""
        return self._hits / (self._hits + self._misses)

    def width(self, available: int) -> int:
        """The width to use with `available` drafted tokens (the ubatch is the pending token + drafts)."""
        if not self.widths or available <= 0:
            return 1
        if self._wait > 0:
            self._wait -= 1
            return 1
        if self._probe:
            self._probe = False
            return self.widths[0]
        a = self.acceptance()
        best, rate = 1, 1.0  # tokens per plain-step time
        for w in self.widths:
            if w > available + 1:
                break
            tokens = (1 - a ** w) / (1 - a) if a < 1 else float(w)
            if tokens / self.costs.ratio(w) > rate:
                best, rate = w, tokens / self.costs.ratio(w)
        if best == 1:
            self._back_off()
        return best

    def _back_off(self) -> None:
        self._wait, self._probe = self._backoff, True
        self._backoff = min(self._backoff * 2, self.max_backoff)

    def observe(self, drafted: int, accepted: int) -> None:
        """A verification of `drafted` drafts accepted `accepted` (0 <= accepted <= drafted) of them."""
        self._hits = self._hits * self.decay + accepted
        self._misses = self._misses * self.decay + (1 if accepted < drafted else 0)
        if accepted == 0:
            self._back_off()
        else:
            self._backoff = 1
