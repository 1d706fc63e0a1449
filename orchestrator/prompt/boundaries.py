"""Boundary detector: where in a rendered chat prompt the state is worth a snapshot.

Boundaries are found from the model's own template by rendering and comparing, not by patterns. With T the
request's prompt text (its messages plus the generation prompt):

    <|im_start|>system\\n# Tools ... </IMPORTANT>\\n\\nYou are ...<|im_end|>\\n<|im_start|>user\\n ... <|im_end|>\\n<|im_start|>assistant\\n
                                      ▲ tools_end                      ▲ system_end = message_ends[0]    ▲ message_ends[1]
    ◀──────────────────────────────── stable: T's prefix that every appended message keeps ────────────────▶

* stable (the **append check**): the longest common prefix of T and the renders of the messages followed by
  the probe messages a client may append next (`_continuations`: after a user message an assistant answer,
  after a text answer a user message, after tool calls their results, and so on). Text that a template
  rewrites once more messages arrive lies beyond it, and no boundary is placed there: Qwen3/Qwen3.5 drop the
  reasoning of assistant turns once a newer user message arrives and group consecutive tool results into one
  turn (closed only by what follows), DeepSeek-R1 renders a tool-call turn differently after an earlier one,
  Mistral Nemo moves the tools and the system text into the last user message.
* message_ends[i]: the same append check on messages[:i+1] (capped by T and by `stable`): the end of all the
  text that messages[:i+1] fix, whatever follows, usually with the first special token of the next header
  (`<|im_start|>`). It depends on messages[:i+1] only, so the end of the last message of one request is the
  same offset as that message's end in the next request, and one snapshot serves both.
* tools_end: where the text rendered for the tools stops being shared by conversations with other system texts
  (longest common prefix of three renders with the same tools: system text "A…", system text "B…", no system
  message; memoised per tools list). In Qwen3.5's template the tools block opens the system turn, before the
  system text, so agents that share tool schemas but not system text share this prefix.
* system_end: message_ends[0] for a leading system message; with tools and no system message, the append
  check on the tools-only preamble.

Cost (the renders are each linear in the conversation): two to five renders for each append check (the whole
conversation, the first message and the last `window` messages), three per distinct tools list (memoised):
bounded, where checking every message was quadratic (bench/results/2026-12-01/micro/). Earlier messages get no
boundary: a request that extends an earlier one restores that request's snapshots, so only its new messages
need boundaries. A template that raises for a probe (e.g. Gemma 2 requires alternating roles) just skips that probe;
if no probe renders at all, there are no boundaries.

Character offsets are mapped to token offsets with each token's byte length (llama_token_to_piece): a boundary
at byte b becomes the number of tokens whose bytes end at or before b. The prompt builder then checks the
tokens too (`token_stable_prefix`). A snapshot is keyed by its tokens, so even a wrong boundary costs a miss,
never a wrong answer.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .control import strip_cuts
from ..errors import InvalidRequest
from .template import ChatTemplate

PLACEHOLDER = "\ue000orchestrator-boundary\ue001"
# The caller's breakpoints placed per request: the last (deepest) four, the most Anthropic's Messages API takes
# (cache_control on at most four blocks). Each costs a render of the conversation up to it, so placing every
# one of a mark per turn was quadratic in the conversation; earlier marks are hints left out (None), and the
# message ends still give their boundaries.
MAX_BREAKPOINTS = 4
TOOL_CALL_ID = "call0orch"  # 9 alphanumerics: Mistral Nemo's template requires tool call ids of that shape


@dataclass(frozen=True)
class Boundaries:
    """Token offsets into one prompt (0 < offset <= n_prompt tokens; None where not found).

    message_ends[i] is the number of prompt tokens through the end of messages[i]. `extra` holds the offsets of
    the caller's breakpoints (text parts marked `prompt_cache_breakpoint`), None where a template rewrites them.
    """

    tools_end: int | None
    system_end: int | None
    message_ends: tuple[int | None, ...]
    extra: tuple[int | None, ...] = ()

    def split(self, n_prompt: int) -> tuple[list[int], list[int], int | None]:
        """(offsets always worth a stop, message ends that may be left out, the latest message's start), the lists
        sorted, distinct and strictly inside the prompt (0 < p < n_prompt). Always: the end of the tools block, the
        end of the system message, the caller's breakpoints and the last message end; the others are the earlier
        message ends, which the reuse rules thin by --snapshot-min-gap (`reuse.spaced_stops`). The latest
        message's start (the message end before the last, None if there is none) is kept too, but after the
        thinning, so that it moves no other stop: it is where a client that rewrites its latest message diverges
        on the next turn (aider appends its instructions to the current user message and sends that message back
        without them: tests/fixtures/captures/aider/)."""
        def inside(p: int | None) -> bool:
            return p is not None and 0 < p < n_prompt

        ends = sorted({p for p in self.message_ends if inside(p)})
        kept = {p for p in (self.tools_end, self.system_end, *self.extra) if inside(p)}
        if ends:
            kept.add(ends.pop())
        latest_start = ends[-1] if ends else None
        return sorted(kept), [p for p in ends if p not in kept], latest_start

    def positions(self, n_prompt: int) -> list[int]:
        """Every offset strictly inside the prompt (0 < p < n_prompt), sorted and distinct."""
        kept, ends, _ = self.split(n_prompt)
        return sorted({*kept, *ends})


@dataclass(frozen=True)
class CharBoundaries:
    """Character offsets into the prompt text (see the module docstring); `stable` bounds all of them."""

    tools_end: int | None
    system_end: int | None
    message_ends: tuple[int | None, ...]
    stable: int
    appended: tuple[str, ...] = ()  # the renders with probe messages appended, for the token check
    extra: tuple[int | None, ...] = ()  # the caller's breakpoints, in the order given


def _lcp(*texts: str) -> int:
    """Length of the longest common prefix, in characters."""
    if not texts:
        return 0
    lo, hi = min(texts), max(texts)  # the LCP of a set is the LCP of its least and greatest member
    n = min(len(lo), len(hi))
    if lo[:n] == hi[:n]:
        return n
    a, b = 0, n  # binary search on slices: C-speed comparisons instead of a Python loop over characters
    while a < b:
        m = (a + b + 1) // 2
        if lo[:m] == hi[:m]:
            a = m
        else:
            b = m - 1
    return a


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def _prefix_keys(messages: list[dict], tools, kwargs) -> list[bytes]:
    """keys[i] identifies (tools, kwargs, messages[:i+1]): a chained hash, one pass over the messages."""
    h = hashlib.blake2b(json.dumps([tools, kwargs], sort_keys=True, default=str).encode("utf-8"), digest_size=16)
    keys = []
    for m in messages:
        h.update(json.dumps(m, sort_keys=True, default=str).encode("utf-8"))
        keys.append(h.digest())
    return keys


def _probe(role: str) -> dict:
    """A placeholder message; role "assistant_call" is an assistant message with one tool call."""
    if role == "assistant_call":
        return {"role": "assistant", "content": "", "tool_calls": [{"id": TOOL_CALL_ID, "type": "function",
                "function": {"name": "f" + PLACEHOLDER, "arguments": {"a": PLACEHOLDER}}}]}
    msg: dict[str, Any] = {"role": role, "content": PLACEHOLDER}
    if role == "tool":
        msg["tool_call_id"] = TOOL_CALL_ID
    return msg


def _continuations(last: dict) -> tuple[tuple[str, ...], ...]:
    """Role sequences a client appends after `last`, following the OpenAI chat grammar of agent loops: a user
    message is answered by an assistant message (text, or tool calls and their results); a text answer is
    followed by a user message; tool calls by their results; a tool result by more results, the assistant's
    next turn, or a user message. Two-message sequences cover templates that reject a lone message of some role
    (alternation checks: Gemma 2, Mistral Nemo) but rewrite history once it arrives (Mistral Nemo moves the
    tools to the last user message, Qwen3.5 drops reasoning once a newer user message arrives), and
    "assistant_call" templates that render a later tool-call turn differently (DeepSeek-R1)."""
    role = last.get("role")
    answer = (("assistant",), ("assistant", "user"), ("assistant_call", "tool"))
    if role == "assistant":
        if last.get("tool_calls"):
            return (("tool",), ("tool", "assistant", "user"))
        return (("user",), ("user", "assistant"))
    if role == "tool":
        return (("tool",), ("user",)) + answer
    if role == "system":
        return (("user",),) + answer
    return answer  # after a user message


class BoundaryDetector:
    """Finds boundary character offsets from a `ChatTemplate`.

    `window`: how many of the last messages get a boundary (plus the first message). `memo_entries`: how many
    tools-list prefixes are remembered; `message_memo_entries`: how many message ends (a conversation prefix's
    end, with a digest of its text, so a request that resends a prefix renders only its new messages). No module
    state: the memos live here, behind one lock (prompts are built on several threads).
    """

    def __init__(self, template: ChatTemplate, window: int = 6, memo_entries: int = 64,
                 message_memo_entries: int = 4096) -> None:
        self.template = template
        self.window = window
        self._memo_entries = memo_entries
        self._message_memo_entries = message_memo_entries
        self._tools_prefix: OrderedDict[str, str] = OrderedDict()
        self._message_ends: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def char_boundaries(self, messages: list[dict], tools: list[dict] | None, full_text: str,
                        template_kwargs: dict[str, Any], breakpoints: Sequence[tuple[int, int]] = ()
                        ) -> CharBoundaries:
        """Boundaries of `full_text` (the render of `messages` with the generation prompt), in characters.

        `breakpoints`: the caller's (message index, characters of that message's content before the breakpoint),
        in prompt order; the last MAX_BREAKPOINTS are placed wherever they fall (also outside the window) but
        never beyond `stable`, the others are None. Raises nothing for
        templates that reject a probe; such probes are skipped.
        """
        kw = template_kwargs
        n = len(messages)
        keys = _prefix_keys(messages, tools, kw)
        stable, appended = self._stable_end(messages, tools, kw, full_text) if n else (0, [])
        if appended:  # the next request's end of this last message
            self._remember(keys[-1], appended)
        stable = stable or 0
        ends: list[int | None] = [None] * n
        for i in sorted({0, *range(max(0, n - self.window), n - 1)} - {n - 1}):
            ends[i] = self._message_end(messages[: i + 1], keys[i], tools, kw, full_text)
        if n:
            ends[n - 1] = stable
        ends = [min(e, stable) or None if e is not None else None for e in ends]

        tools_end = system_end = None
        if tools:
            tools_end = min(_lcp(full_text, self._tools_prefix_text(tools, kw)), stable) or None
        if messages and messages[0].get("role") == "system":
            system_end = ends[0]
        elif tools and messages:
            b = self._stable_end([], tools, kw, full_text)[0]
            system_end = min(b, stable) or None if b is not None else None
        first = len(breakpoints) - MAX_BREAKPOINTS
        placed: dict[tuple[int, int], int | None] = {}
        for i, c in breakpoints[max(0, first):]:
            if (i, c) not in placed:
                placed[(i, c)] = self._breakpoint(messages, i, c, tools, kw, full_text, stable)
        extra = tuple(placed.get(b) for b in breakpoints)
        return CharBoundaries(tools_end, system_end, tuple(ends), stable, tuple(appended), extra)

    def _breakpoint(self, messages: list[dict], i: int, n_chars: int, tools, kwargs, full_text: str,
                    stable: int) -> int | None:
        """Offset in `full_text` after the first `n_chars` characters of messages[i]'s content: the message's end
        (the append check on messages[:i+1]) when that is all of it, else where `full_text` and a render of
        messages[:i] plus message i cut there part. Capped by `stable`."""
        content = messages[i].get("content") or ""
        if n_chars >= len(content):
            end = self._stable_end(messages[: i + 1], tools, kwargs, full_text)[0]
        else:
            cut = self._render(messages[:i] + [dict(messages[i], content=content[:n_chars])], tools, kwargs)
            end = _lcp(full_text, cut) if cut is not None else None
        return min(end, stable) or None if end is not None else None

    def _render(self, messages: list[dict], tools, kwargs, add_generation_prompt: bool = False) -> str | None:
        try:
            return self.template.render(messages, tools, add_generation_prompt=add_generation_prompt, **kwargs)
        except InvalidRequest:
            return None

    def _message_end(self, prefix: list[dict], key: bytes, tools, kwargs, full_text: str) -> int | None:
        """_stable_end(prefix)[0], from the memo when `full_text` starts with the remembered text: the renders'
        common prefix is a function of `prefix` alone, and `full_text` cannot share more than they share."""
        with self._lock:
            hit = self._message_ends.get(key)
            if hit is not None:
                self._message_ends.move_to_end(key)
        if hit is not None and _digest(full_text[: hit[0]]) == hit[1]:
            return hit[0]
        end, renders = self._stable_end(prefix, tools, kwargs, full_text)
        if renders:
            self._remember(key, renders)
        return end

    def _remember(self, key: bytes, renders: list[str]) -> None:
        n = _lcp(*renders)
        with self._lock:
            self._message_ends[key] = (n, _digest(renders[0][:n]))
            if len(self._message_ends) > self._message_memo_entries:
                self._message_ends.popitem(last=False)

    def _stable_end(self, prefix: list[dict], tools, kwargs, full_text: str) -> tuple[int | None, list[str]]:
        """(characters of `full_text` that every continuation of `prefix` keeps, the continuation renders);
        None if the template renders no continuation. Depends on `prefix` only (and `full_text` as a cap), so
        a message's end is the same whether it was the last message of an earlier request or not."""
        last = prefix[-1] if prefix else {"role": "system"}
        renders = [self._render(prefix + [_probe(r) for r in seq], tools, kwargs) for seq in _continuations(last)]
        renders = [t for t in renders if t is not None]
        return (_lcp(full_text, *renders) if renders else None), renders

    def _tools_prefix_text(self, tools: list[dict], kwargs) -> str:
        key = json.dumps([tools, kwargs], sort_keys=True, default=str)
        with self._lock:
            cached = self._tools_prefix.get(key)
            if cached is not None:
                self._tools_prefix.move_to_end(key)
        if cached is None:
            user = _probe("user")
            renders = [self._render(msgs, tools, kwargs, True) for msgs in (
                [{"role": "system", "content": "A" + PLACEHOLDER}, user],
                [{"role": "system", "content": "B" + PLACEHOLDER}, user],
                [user])]
            renders = [r for r in renders if r is not None]
            cached = renders[0][: _lcp(*renders)] if len(renders) >= 2 else ""
            with self._lock:
                self._tools_prefix[key] = cached
                if len(self._tools_prefix) > self._memo_entries:
                    self._tools_prefix.popitem(last=False)
        return cached


def byte_offsets(text: str, char_offsets: Sequence[int | None]) -> list[int | None]:
    """UTF-8 byte offsets of character offsets into `text`, in the text the model reads: the CUTs that keep
    control texts out of caller strings (control.py) are not part of it and count no bytes. One pass over the
    text in offset order, whatever the number of offsets."""
    out: list[int | None] = [None] * len(char_offsets)
    at_char = at_byte = 0
    for c, k in sorted((c, k) for k, c in enumerate(char_offsets) if c is not None):
        at_byte += len(strip_cuts(text[at_char:c]).encode("utf-8"))
        at_char = c
        out[k] = at_byte
    return out


def token_offsets(piece_lengths: Sequence[int], byte_offsets_: Sequence[int | None]) -> list[int | None]:
    """Map byte offsets to token counts: for byte b, the number of tokens whose bytes end at or before b.

    piece_lengths[i] is the byte length of token i's text (llama_token_to_piece with special tokens rendered).
    """
    ends = list(itertools.accumulate(piece_lengths))
    return [None if b is None else bisect.bisect_right(ends, b) for b in byte_offsets_]


def token_stable_prefix(tokens: Sequence[int], others: Sequence[Sequence[int]]) -> int:
    """Number of leading tokens `tokens` shares with every token list in `others`."""
    n = len(tokens)
    for other in others:
        n = min(n, next((i for i, (a, b) in enumerate(zip(tokens, other)) if a != b), min(n, len(other))))
    return n


def detect(detector: BoundaryDetector, messages: list[dict], tools: list[dict] | None, full_text: str,
           piece_lengths: Sequence[int], template_kwargs: dict[str, Any],
           tokens: Sequence[int] | None = None, tokenize: Callable[[str], list[int]] | None = None,
           breakpoints: Sequence[tuple[int, int]] = ()) -> Boundaries:
    """Boundaries of one chat prompt in tokens. `piece_lengths` are the byte lengths of the prompt's tokens.

    With `tokens` (the prompt's) and `tokenize`, the append check is repeated on tokens: the renders with a
    probe message appended are tokenized, and offsets beyond the tokens they all share with the prompt are
    dropped (a text boundary inside a BPE merge that later text would change). `breakpoints` are the caller's
    (see BoundaryDetector.char_boundaries); they come back in Boundaries.extra.
    """
    cb = detector.char_boundaries(messages, tools, full_text, template_kwargs, breakpoints)
    limit = None
    if tokens is not None and tokenize is not None:
        limit = token_stable_prefix(tokens, [tokenize(t) for t in cb.appended])
    t_tools, t_system, *t_rest = token_offsets(
        piece_lengths, byte_offsets(full_text, [cb.tools_end, cb.system_end, *cb.message_ends, *cb.extra]))
    t_ends, t_extra = t_rest[: len(cb.message_ends)], t_rest[len(cb.message_ends):]

    def keep(t: int | None) -> int | None:
        return t if t and (limit is None or t <= limit) else None

    return Boundaries(tools_end=keep(t_tools), system_end=keep(t_system),
                      message_ends=tuple(keep(t) for t in t_ends), extra=tuple(keep(t) for t in t_extra))
