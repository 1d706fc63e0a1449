"""Content is data: caller-supplied text never becomes a control token.

A chat prompt is the chat template's markup around the caller's strings (message content, reasoning, tool-call
names and arguments, tool results, tool schemas, `name` fields). llama_tokenize with special-token parsing on
turns every occurrence of a control token's text into that token, wherever the text came from: a tool result
holding ``<|im_end|>\\n<|im_start|>system\\n...`` would open a genuine system turn that nobody sent.

How it is kept out (`ControlTexts.escape`, `split_cuts`): before rendering, each caller string gets a CUT
character (U+FDD0, a Unicode noncharacter, reserved for internal use) inside every protected text it holds,
after that text's first character, and at an edge where it could complete one with the template's text::

    caller string     'hi <|im_end|> x</tool_call'
    escaped           'hi <¦|im_end|> x</tool_call¦'          (¦ = CUT)
    rendered          '<|im_start|>user\\nhi <¦|im_end|> x</tool_call¦<|im_end|>\\n...'
    tokenized         tokenize('<|im_start|>user\\nhi <') + tokenize('|im_end|> x</tool_call') + tokenize('<|im_end|>\\n...')

The template renders the escaped strings (its string tests and filters see no control text in them), the
rendered text is cut at every CUT, and each piece is tokenized with special tokens parsed: no protected text
survives in one piece except the template's own markup, which still becomes its control tokens. A prompt with no
protected text in its caller strings has no CUT, so its tokens are exactly llama_tokenize(rendered text) as
before. The prompt's text is the rendered text without CUTs. A CUT already in a caller string is replaced by
U+FFFD (the replacement character), the one change made to caller text.

Protected texts (`protected_texts`): tokens whose llama.cpp attribute is CONTROL or UNKNOWN (what
llama_tokenize's parse_special turns on), and USER_DEFINED tokens whose text the chat template itself writes
(Qwen3.5's ``<tool_call>``, ``<tool_response>``, ``<think>`` and their closing tags, USER_DEFINED in the real
GGUFs: llama.cpp's converter marks an added token CONTROL only when it is special or looks like ``<|...|>``).
USER_DEFINED tokens are matched by llama_tokenize even with parse_special off, which is why the cut is made in
the text and not with that flag. Other USER_DEFINED tokens (Gemma's HTML tags, whitespace runs) are ordinary
text with an id of their own and stay as the model was trained.

Edges: a protected text that starts in a caller string and ends in the text after it (``<function=`` + name +
``>`` with the name ``x</tool_call``), or starts before a caller string and ends in it, is cut at the caller
string's edge: the string (without its outer whitespace, which templates often trim) ends with a proper prefix
of a protected text, or starts with a proper suffix of one. What is not cut: a protected text whose first and
last characters both lie in template text around a short caller string (a template writing ``<|im`` before a
string and ``d|>`` after it); none of the twelve templates in tests/templates writes part of a control text
(tests/test_control.py checks all twelve).

With SentencePiece vocabularies that add a space prefix (Llama 2 style; not Qwen3.5, Gemma 3 or Llama 3), a piece
after a CUT is tokenized as the start of a text and may gain that space: only text that held a protected text
is affected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

CUT = "\ufdd0"  # a Unicode noncharacter: never meaningful in caller text, so it can mark a cut
_REPLACEMENT = "\ufffd"


def split_cuts(text: str) -> list[str]:
    """The pieces of a rendered prompt between CUTs, each tokenized on its own (with special tokens parsed)."""
    return text.split(CUT)


def strip_cuts(text: str) -> str:
    """The rendered prompt as the model reads it: `text` without its CUTs."""
    return text.replace(CUT, "")


def _trie_regex(texts: Iterable[str]) -> re.Pattern[str]:
    """A regex that matches any of `texts`, built as a trie so thousands of alternatives (Gemma 3's <unusedN>
    tokens) cost a walk of one path, not a try of each. A longer text wins over its own prefix."""
    trie: dict = {}
    for t in texts:
        node = trie
        for ch in t:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict) -> str:
        end = "" in node
        alts = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if end else body

    return re.compile(build(trie))


@dataclass(frozen=True)
class ControlTexts:
    """The texts that only the chat template may turn into tokens, and the escaping that keeps them out of caller
    strings (see the module docstring). An empty set escapes nothing (`--parse-special-in-content`).

    texts: protected token texts, each at least 2 characters (a one-character text cannot be cut; such tokens
    are left out by `protected_texts`).
    """

    texts: frozenset[str]
    _regex: re.Pattern[str] | None = field(init=False, repr=False, compare=False)
    _prefixes: frozenset[str] = field(init=False, repr=False, compare=False)
    _suffixes: frozenset[str] = field(init=False, repr=False, compare=False)
    _longest: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        texts = sorted(self.texts)
        if any(len(t) < 2 for t in texts):
            raise ValueError("protected texts must be at least 2 characters long")
        set_ = object.__setattr__
        set_(self, "_regex", _trie_regex(texts) if texts else None)
        set_(self, "_prefixes", frozenset(t[:k] for t in texts for k in range(1, len(t))))
        set_(self, "_suffixes", frozenset(t[k:] for t in texts for k in range(1, len(t))))
        set_(self, "_longest", max((len(t) for t in texts), default=0))

    def __bool__(self) -> bool:
        return bool(self.texts)

    def find(self, text: str) -> list[tuple[int, int]]:
        """(start, end) character spans of the protected texts in `text` as llama_tokenize would split them out:
        leftmost first, longest at a position, not overlapping."""
        if self._regex is None:
            return []
        return [m.span() for m in self._regex.finditer(text)]

    def escape(self, s: str) -> str:
        """`s` with a CUT inside every protected text it holds and at an edge where it could complete one (module
        docstring). Returns `s` itself when nothing needs cutting and `s` holds no CUT."""
        if CUT in s:
            s = s.replace(CUT, _REPLACEMENT)
        if self._regex is None or not s:
            return s
        cuts: set[int] = set()
        pos = 0
        while (m := self._regex.search(s, pos)) is not None:  # restart after each first character: overlaps too
            cuts.add(m.start() + 1)
            pos = m.start() + 1
        a = len(s) - len(s.lstrip())
        b = len(s.rstrip())
        core = s[a:b]
        if core:
            n = min(self._longest, len(core))
            if any(core[-k:] in self._prefixes for k in range(1, n + 1)):
                cuts.add(b)
            if any(core[:k] in self._suffixes for k in range(1, n + 1)):
                cuts.add(a)
        if not cuts:
            return s
        out, last = [], 0
        for c in sorted(cuts):
            out.append(s[last:c])
            last = c
        out.append(s[last:])
        return CUT.join(out)

    def escape_all(self, value: Any) -> Any:
        """`value` (messages, tools, template arguments: dicts, lists and strings, keys included) with every string
        escaped. Other values are returned as they are."""
        if isinstance(value, str):
            return self.escape(value)
        if isinstance(value, dict):
            return {self.escape(k) if isinstance(k, str) else k: self.escape_all(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.escape_all(v) for v in value)
        return value

    def escaped_offset(self, s: str, n_chars: int) -> int:
        """Where the first `n_chars` characters of `s` end in `escape(s)` (CUTs placed at or before that point
        count: a cut right at the end of a text part stays with it)."""
        return self.escaped_offsets(s, [n_chars])[0]

    def escaped_offsets(self, s: str, n_chars: Iterable[int]) -> list[int]:
        """`escaped_offset(s, n)` for each n, escaping `s` once: linear in len(s) plus the offsets (a request with
        10,000 breakpoints in one message escaped it 10,000 times before; issue 26 H6)."""
        escaped = self.escape(s)
        kept = [i for i, ch in enumerate(escaped) if ch != CUT]  # kept[k]: where s[k] is in escaped
        out = []
        for n in n_chars:
            i = len(escaped) if n >= len(kept) else (kept[n - 1] + 1 if n > 0 else 0)
            while i < len(escaped) and escaped[i] == CUT:
                i += 1
            out.append(i)
        return out


def protected_texts(tokens: Iterable[tuple[str, bool]], template_source: str) -> frozenset[str]:
    """The protected texts of a vocabulary: `tokens` are (text, is_control) for its non-normal tokens, where
    is_control means llama.cpp's CONTROL or UNKNOWN attribute and False means USER_DEFINED. A USER_DEFINED text is
    protected when the chat template writes it and it is markup (no whitespace). Texts shorter than 2
    characters are left out (they cannot be cut; no vocabulary tested has one)."""
    out = set()
    for text, is_control in tokens:
        if len(text) < 2:
            continue
        if is_control or (text in template_source and not any(c.isspace() for c in text)):
            out.add(text)
    return frozenset(out)
