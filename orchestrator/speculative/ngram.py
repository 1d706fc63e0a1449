"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the sequence's last n tokens.

A pure index over one request's tokens (prompt + answer so far); no model. The reference is llama.cpp's
`ngram-simple` mode (common/speculative.cpp): match the last n tokens, longest n first, and draft what followed
the most recent earlier match.

    tokens:  ... a b c X Y Z ... a b c | ?      (| = the end: the last n = 3 tokens are "a b c")
    draft:               X Y Z                 (what followed the latest earlier "a b c")

Besides every n from `min_n` to `max_n`, a few long n (`long`, default 8 and 16) are tried first. In text that
repeats with small differences (an edit rewriting a file whose functions differ by a number, a list of similar
tool calls) a short suffix recurs everywhere and its latest occurrence is usually the previous repetition, which
drafts that repetition's numbers; a 16-token suffix still holds the distinguishing token and finds the copy being
made. On Gemma 3 270M rewriting a 150-line file (bench/results/2026-12-05/speculative-xeon) the long lengths took
acceptance from 206/272 to 212/255 drafted tokens at widths up to 7, and from 657/1039 to 246/340 per round at
widths up to 16 (llama.cpp's `ngram-mod` hashes 24-token windows for the same reason).

A draft also remembers where it came from (its source), and the next draft follows that source while the answer
still agrees with it, instead of the latest occurrence:

    prompt:  def handler_1(request, config):\n    path = config.root / 'src/app/handlers/h1.py' ... h19.py' ...
    answer:  def handler_1(request, config):\n    path = config.root / 'src/app/handlers/h1 | ?
    latest occurrence of the last 16 tokens (they do not reach back to "handler_1"): h19's, drafting "9.py'"
    the source followed: the prompt's h1 line, drafting ".py'\n    return ..."

The source is followed where the tokens before the end equal the source's over at least `look` (8) tokens and
over at least as many as the lookup's match (counted up to `reach`): the longest match wins, and between matches
as long the copy already being made. In a file of near-identical blocks the latest occurrence of a 16-token
suffix is usually another block than the one being copied. Replayed on Gemma 3 270M's recorded greedy answers at
the calibration's verification costs (reference kernels, widths up to 16; bench/results/2026-12-07/follow-source/),
the rewrite of a 150-line file decodes 1.26-1.32x faster than with the latest occurrence (first 300 and 600
tokens); six other answers (tool calls, free text, a file rename, a pyproject edit, JSON, comments added) decode
the same, and a summary that loops 0.97x at 600 tokens (the loop repeated the model's own text, not the one
followed).
"""

from __future__ import annotations

from typing import Sequence


class NgramDrafter:
    """Drafts for one sequence. `extend` appends tokens (O(len(lengths) * max length) each); `draft(k)` proposes
    at most k tokens. Memory: one dict entry (two ints) per token and length (about 0.5 KB a token with the
    default 5 lengths).

    Invariant: `_last[n][hash(gram)]` is the end offset (exclusive) of the latest occurrence of an n-gram with that
    hash among tokens[:len(tokens) - 1], so a match is always strictly earlier than the end; a lookup compares the
    tokens themselves, so a hash collision drafts nothing rather than something unrelated."""

    def __init__(self, tokens: Sequence[int] = (), min_n: int = 2, max_n: int = 4,
                 long: Sequence[int] = (8, 16), follow: bool = True, look: int = 8, reach: int = 256) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.lengths = tuple(sorted(set(range(min_n, max_n + 1)) | {n for n in long if n > max_n}, reverse=True))
        self.follow, self.look, self.reach = follow, look, reach
        self.tokens: list[int] = []
        self._last: dict[int, dict[int, int]] = {n: {} for n in self.lengths}
        self._source: int | None = None  # len(tokens) - the last draft's start: how far back its text was
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the sequence."""
        toks = self.tokens
        for tok in tokens:
            end = len(toks)  # index the grams ending at the previous last token: they now have a follower
            for n in self.lengths:
                if end >= n:
                    self._last[n][hash(tuple(toks[end - n:end]))] = end
            toks.append(tok)

    def lookup(self) -> int | None:
        """Where the text after the latest earlier occurrence of the longest matching suffix starts (longest n
        first); None when no suffix of at least min_n tokens occurred before. Pure: depends on the tokens only."""
        toks, end = self.tokens, len(self.tokens)
        for n in self.lengths:
            if end <= n:
                continue
            gram = toks[end - n:end]
            at = self._last[n].get(hash(tuple(gram)))
            if at is not None and toks[at - n:at] == gram:
                return at
        return None

    def _agreement(self, at: int) -> int:
        """How many tokens before `at` equal the tokens before the end, at most `reach`. Compared 16 at a time,
        then one by one: copying a repeated 500-token block, extend + draft took 7 us a step, against 177 us
        comparing token by token."""
        toks, end, agree, top = self.tokens, len(self.tokens), 0, min(self.reach, at)
        while agree + 16 <= top and toks[at - agree - 16:at - agree] == toks[end - agree - 16:end - agree]:
            agree += 16
        while agree < top and toks[at - 1 - agree] == toks[end - 1 - agree]:
            agree += 1
        return agree

    def draft(self, k: int) -> list[int]:
        """Up to k tokens: where the last draft's source still agrees with the sequence (module docstring), its
        continuation; else what followed the latest earlier occurrence of the longest matching suffix (`lookup`);
        [] when neither. Where the text drafted from starts fewer than k tokens before the end, the text since is
        a period that repeats (a loop, a run of one token, a table rule): the draft repeats it up to k tokens, as
        llama.cpp's ngram-mod does by looking its own drafts up again, instead of stopping at the end. Remembers
        where the draft came from, so the next one can follow it."""
        toks, end = self.tokens, len(self.tokens)
        if k <= 0:
            return []
        at = self.lookup()
        if self.follow and self._source is not None and 0 < end - self._source < end:
            follow = end - self._source  # where the last draft's source goes on at this length
            agree = self._agreement(follow)
            if agree >= self.look and (at is None or at == follow or agree >= self._agreement(at)):
                at = follow  # as long a match as the lookup's: the copy being made
        if at is None:
            return []
        self._source = end - at
        out = toks[at:min(at + k, end)]
        period = end - at  # a start closer than k to the end: a loop of this period, drafted on
        while len(out) < k:
            out.append(out[len(out) - period])
        return out
