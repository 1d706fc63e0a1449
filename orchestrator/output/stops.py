"""Incremental detokenization with stop strings, for streaming.

Token bytes arrive one piece at a time; UTF-8 characters may span pieces, and a stop string may span tokens.
`TextStream.push` returns the text that is safe to emit now: complete characters, minus any tail that could
still grow into a stop string.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field


def partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`: text that could still
    grow into a tag, so a stream holds it back.

    >>> partial_suffix("answer</thi", ("</think>",))
    5
    """
    return max((k for t in tags for k in range(1, min(len(t), len(text) + 1)) if text.endswith(t[:k])), default=0)


@dataclass
class TextStream:
    """Accumulates token bytes; `stop` strings end the text (the stop string itself is not part of it).

    matched: the stop string that ended the text (the one at the earliest position; of several there, the first
    in `stop`), None while none has. ends: per pushed token, the characters of `text` through it when it was
    pushed (nondecreasing; a token that holds part of a stop string may end past the final `text`)."""

    stop: tuple[str, ...] = ()
    text: str = ""  # all complete text so far (before any stop string)
    emitted: int = 0  # characters of `text` already returned
    stopped: bool = False
    matched: str | None = None
    ends: list[int] = field(default_factory=list)
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the new text safe to emit (may be empty)."""
        if self.stopped:
            return ""
        self.text += self._decoder.decode(piece)
        out = self._release(final=False)
        self.ends.append(len(self.text))
        return out

    def finish(self) -> str:
        """Flush at the end of generation: everything not yet emitted (incomplete UTF-8 becomes U+FFFD)."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if not self.stopped:
            for s in self.stop:
                i = self.text.find(s, max(0, self.emitted - len(s)))
                if i >= 0:
                    self.text = self.text[:i]
                    self.stopped, self.matched = True, s
        limit = len(self.text)
        if not final and not self.stopped:  # hold back a tail that is a prefix of a stop string
            limit -= partial_suffix(self.text, self.stop)
        limit = max(limit, self.emitted)
        out = self.text[self.emitted:limit]
        self.emitted = limit
        return out
