"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the sequence's last n tokens.

A pure index over one request's tokens (prompt + answer so far); no model. The reference is llama.cpp's
`ngram-simple` mode (common/speculative.cpp): match the last n tokens, n from `max_n` down to `min_n`, and draft
what followed the most recent earlier match.

    tokens:  ... a b c X Y Z ... a b c | ?      (| = the end: the last n = 3 tokens are "a b c")
    draft:               X Y Z                 (what followed the latest earlier "a b c")
"""

from __future__ import annotations

from typing import Sequence


class NgramDrafter:
    """Drafts for one sequence. `extend` appends tokens (O(max_n - min_n + 1) each); `draft(k)` proposes at most
    k tokens (O(max_n + k)). Invariant: `_last[n][gram]` is the end offset (exclusive) of the latest occurrence
    of `gram` (an n-tuple) among tokens[:len(tokens) - 1], so a match is always strictly earlier than the end."""

    def __init__(self, tokens: Sequence[int] = (), min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the sequence."""
        for tok in tokens:
            end = len(self.tokens)  # index the grams ending at the previous last token: they now have a follower
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    self._last[n][tuple(self.tokens[end - n:end])] = end
            self.tokens.append(tok)

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix (longest n
        first); [] when no suffix of at least min_n tokens occurred before."""
        toks, end = self.tokens, len(self.tokens)
        if k <= 0:
            return []
        for n in range(self.max_n, self.min_n - 1, -1):
            if end <= n:
                continue
            at = self._last[n].get(tuple(toks[end - n:end]))
            if at is not None:
                return toks[at:min(at + k, end)]
        return []
