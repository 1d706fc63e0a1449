"""Boundary detector: where in a rendered chat prompt the state is worth a snapshot.

Boundaries are found from the model's own template by rendering, not by patterns:

    <|im_start|>system\\n# Tools ... </IMPORTANT>\\n\\nYou are ...<|im_end|>\\n<|im_start|>user\\n ... <|im_end|>\\n<|im_start|>assistant\\n
                                      ▲ tools_end                      ▲ system_end = message_ends[0]    ▲ message_ends[1]

* tools_end: where the text rendered for the tools stops being shared by conversations with other system texts.
  In Qwen3.5's template the tools block opens the system turn, before the system text, so agents that share
  tool schemas but not system text still share this prefix. Found as the longest common prefix of three
  renders with the same tools (system text "A…", system text "B…", no system message), cut to the request's text.
* message_ends[i]: end of message i as it is rendered *in this prompt*. Candidate A renders messages[:i+1]
  alone; candidate B renders messages[:i+1] followed by a placeholder user message and cuts after the last
  end-of-turn marker (e.g. `<|im_end|>` plus whitespace) before it, which is the history form of the turn
  (Qwen3.5 drops the reasoning of assistant turns that precede a newer user message). A candidate is kept only
  if its text is a prefix of the full prompt text; otherwise the message has no boundary (None).
* system_end: message_ends[0] when the first message is a system message; with tools and no system message,
  the end of the tools-only system turn.

Character offsets are mapped to token offsets with each token's byte length (llama_token_to_piece): a boundary
at byte b becomes the number of tokens whose bytes end at or before b. A snapshot is keyed by its tokens, so a
boundary that some later prompt does not share costs a miss, never a wrong answer.
"""

from __future__ import annotations

import bisect
import itertools
import json
from dataclasses import dataclass
from typing import Any, Sequence

from .errors import InvalidRequest
from .template import ChatTemplate

PLACEHOLDER = "\ue000orchestrator-boundary\ue001"


@dataclass(frozen=True)
class Boundaries:
    """Token offsets into one prompt (0 < offset <= n_prompt tokens; None where not found).

    message_ends[i] is the number of prompt tokens through the end of messages[i].
    """

    tools_end: int | None
    system_end: int | None
    message_ends: tuple[int | None, ...]

    def positions(self, n_prompt: int) -> list[int]:
        """Sorted distinct offsets strictly inside the prompt (0 < p < n_prompt), where snapshots are taken."""
        found = {self.tools_end, self.system_end, *self.message_ends}
        return sorted(p for p in found if p is not None and 0 < p < n_prompt)


def _lcp(*texts: str) -> int:
    n = 0
    for chars in zip(*texts):
        if any(c != chars[0] for c in chars):
            break
        n += 1
    return n


class BoundaryDetector:
    """Finds boundary character offsets from a `ChatTemplate`.

    `eot_text` is the text of the template's end-of-turn marker (Qwen3.5: `<|im_end|>`, llama_vocab_eot or
    eos), used by candidate B. Renders per request: about two per message, plus three per distinct tools list
    (memoised).
    """

    def __init__(self, template: ChatTemplate, eot_text: str) -> None:
        self.template = template
        self.eot_text = eot_text
        self._tools_prefix: dict[str, str] = {}

    def char_boundaries(self, messages: list[dict], tools: list[dict] | None, full_text: str,
                        template_kwargs: dict[str, Any]) -> tuple[int | None, int | None, list[int | None]]:
        """(tools_end, system_end, message_ends) as character offsets into `full_text`."""
        message_ends = [self._message_end(messages[: i + 1], full_text, template_kwargs, tools)
                        for i in range(len(messages))]
        tools_end = system_end = None
        if tools:
            tools_end = _lcp(full_text, self._tools_prefix_text(tools, template_kwargs)) or None
        if messages and messages[0].get("role") == "system":
            system_end = message_ends[0]
        elif tools:
            system_end = self._message_end([], full_text, template_kwargs, tools)
        return tools_end, system_end, message_ends

    def _render(self, messages: list[dict], tools, kwargs, add_generation_prompt: bool) -> str | None:
        try:
            return self.template.render(messages, tools, add_generation_prompt=add_generation_prompt, **kwargs)
        except InvalidRequest:
            return None

    def _message_end(self, prefix: list[dict], full_text: str, kwargs, tools=None) -> int | None:
        if prefix:
            text = self._render(prefix, tools, kwargs, add_generation_prompt=False)
            if text and full_text.startswith(text):
                return len(text)
        text = self._render(prefix + [{"role": "user", "content": PLACEHOLDER}], tools, kwargs, False)
        if not text or not self.eot_text:
            return None
        q = text.find(PLACEHOLDER)
        r = text.rfind(self.eot_text, 0, q)
        if q < 0 or r < 0:
            return None
        end = r + len(self.eot_text)
        while end < q and text[end].isspace():
            end += 1
        return end if end > 0 and full_text.startswith(text[:end]) else None

    def _tools_prefix_text(self, tools: list[dict], kwargs) -> str:
        key = json.dumps([tools, kwargs], sort_keys=True, default=str)
        cached = self._tools_prefix.get(key)
        if cached is None:
            user = {"role": "user", "content": PLACEHOLDER}
            renders = [self._render(msgs, tools, kwargs, True) for msgs in (
                [{"role": "system", "content": "A" + PLACEHOLDER}, user],
                [{"role": "system", "content": "B" + PLACEHOLDER}, user],
                [user])]
            cached = renders[0][: _lcp(*renders)] if all(r is not None for r in renders) else ""
            if len(self._tools_prefix) > 64:
                self._tools_prefix.clear()
            self._tools_prefix[key] = cached
        return cached


def byte_offsets(text: str, char_offsets: Sequence[int | None]) -> list[int | None]:
    """UTF-8 byte offsets of character offsets into `text`."""
    return [None if c is None else len(text[:c].encode("utf-8")) for c in char_offsets]


def token_offsets(piece_lengths: Sequence[int], byte_offsets_: Sequence[int | None]) -> list[int | None]:
    """Map byte offsets to token counts: for byte b, the number of tokens whose bytes end at or before b.

    piece_lengths[i] is the byte length of token i's text (llama_token_to_piece with special tokens rendered).
    """
    ends = list(itertools.accumulate(piece_lengths))
    return [None if b is None else bisect.bisect_right(ends, b) for b in byte_offsets_]


def detect(detector: BoundaryDetector, messages: list[dict], tools: list[dict] | None, full_text: str,
           piece_lengths: Sequence[int], template_kwargs: dict[str, Any]) -> Boundaries:
    """Boundaries of one chat prompt in tokens. `piece_lengths` are the byte lengths of the prompt's tokens."""
    tools_end, system_end, ends = detector.char_boundaries(messages, tools, full_text, template_kwargs)
    t_tools, t_system, *t_ends = token_offsets(piece_lengths, byte_offsets(full_text, [tools_end, system_end, *ends]))
    return Boundaries(tools_end=t_tools or None, system_end=t_system or None,
                      message_ends=tuple(t or None for t in t_ends))
