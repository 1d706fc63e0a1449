"""How many drafted tokens a request verifies next: adapted to its acceptance so far, within the verification
widths calibrated exact (calibration.measure_verify_widths)."""

from __future__ import annotations

from typing import Sequence


class DraftLength:
    """Per request. `width(available)` is the ubatch width of the next step (1 = a plain decode step, no
    verification); `observe(drafted, accepted)` feeds back a verification's outcome.

    Rule: start at the widest exact width; after a verification whose drafts were all rejected, back off: the
    next `backoff` decode steps do not speculate, and `backoff` doubles (at most `max_backoff`); any accepted
    draft resets it. So a request whose drafts are never accepted verifies once in about every `max_backoff`
    steps: at most 1/max_backoff of its steps pay a verification's extra cost (`max_backoff` 32: about 3%).
    The width then follows acceptance: one more than the drafts accepted last time, at least 2."""

    def __init__(self, widths: Sequence[int], max_backoff: int = 32) -> None:
        self.widths = sorted(w for w in widths if w >= 2)
        self.max_backoff = max_backoff
        self._wait = 0  # decode steps left before the next verification
        self._backoff = 1
        self._want = self.widths[-1] if self.widths else 1

    def width(self, available: int) -> int:
        """The width to use with `available` drafted tokens (the ubatch is the pending token + drafts): the
        largest exact width <= min(wanted, available + 1), or 1."""
        if not self.widths or available <= 0:
            return 1
        if self._wait > 0:
            self._wait -= 1
            return 1
        fits = [w for w in self.widths if w <= min(self._want, available + 1)]
        return fits[-1] if fits else 1

    def observe(self, drafted: int, accepted: int) -> None:
        """A verification of `drafted` drafts accepted `accepted` (0 <= accepted <= drafted) of them."""
        if accepted == 0:
            self._wait = self._backoff
            self._backoff = min(self._backoff * 2, self.max_backoff)
        else:
            self._backoff = 1
        top = self.widths[-1] if self.widths else 1
        self._want = max(2, min(top, accepted + 2 if accepted < drafted else top))
