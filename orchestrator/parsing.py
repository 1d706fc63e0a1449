"""Qwen3.5 output parsing: <think>…</think> to reasoning_content, <tool_call> blocks to tool_calls.

Qwen3.5's tool-call format (from its chat template, which also renders it back in history):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter value that parses as JSON (number, object, list, true/false/null) is kept as that value, otherwise
it is a string. `arguments` is returned as a JSON string, as OpenAI does.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN = "<tool_call>"
_CALL_RE = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


@dataclass
class ParsedOutput:
    """content: visible text; reasoning: text inside <think>; tool_calls: OpenAI-shaped dicts."""

    content: str
    reasoning: str | None
    tool_calls: list[dict] = field(default_factory=list)


def _value(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Split `text` into the content before the first <tool_call> and the parsed calls.

    Text that starts a tool call but does not complete one stays in the content (nothing is invented).
    """
    calls = []
    for m in _CALL_RE.finditer(text):
        args = {name.strip(): _value(val) for name, val in _PARAM_RE.findall(m.group(2))}
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": m.group(1).strip(), "arguments": json.dumps(args, ensure_ascii=False)}})
    if not calls:
        return text, []
    return text[: text.find(CALL_OPEN)].rstrip("\n"), calls


def split_reasoning(text: str, opens_reasoning: bool) -> tuple[str | None, str]:
    """(reasoning, rest). `opens_reasoning`: the prompt ended inside an open <think> block."""
    if opens_reasoning:
        if THINK_CLOSE in text:
            reasoning, rest = text.split(THINK_CLOSE, 1)
            return reasoning.strip("\n"), rest.strip("\n")
        return text.strip("\n"), ""  # cut off while thinking
    if text.lstrip().startswith(THINK_OPEN):
        return split_reasoning(text.lstrip()[len(THINK_OPEN):], True)
    return None, text.strip("\n")


def parse_output(text: str, opens_reasoning: bool, parse_tools: bool = True) -> ParsedOutput:
    """Parse a whole completion. Reasoning and content lose leading and trailing newlines (the template puts
    them around both), so the streamed pieces of `StreamParser` add up to the same strings."""
    reasoning, rest = split_reasoning(text, opens_reasoning)
    content, calls = parse_tool_calls(rest) if parse_tools else (rest, [])
    return ParsedOutput(content=content, reasoning=reasoning, tool_calls=calls)


class StreamParser:
    """Routes streamed text deltas to ("reasoning", s) / ("content", s) pieces; holds tool-call text back.

    Tool calls are parsed once at the end (`finish`), from everything after the first <tool_call>.
    """

    def __init__(self, opens_reasoning: bool, parse_tools: bool = True) -> None:
        self.in_reasoning = opens_reasoning
        self.parse_tools = parse_tools
        self.buf = ""  # text not yet routed (could be the start of a tag)
        self.tool_text = ""
        self.in_tools = False
        self._held = ""  # trailing newlines not emitted yet
        self._started = False  # the current section has emitted text
        self._may_open_think = not opens_reasoning
        self.saw_reasoning = opens_reasoning

    def push(self, delta: str) -> list[tuple[str, str]]:
        self.buf += delta
        out: list[tuple[str, str]] = []
        if self._may_open_think:  # a completion may itself open with <think>
            head = self.buf.lstrip()
            if len(head) < len(THINK_OPEN) and THINK_OPEN.startswith(head):
                return out
            self._may_open_think = False
            if head.startswith(THINK_OPEN):
                self.in_reasoning = True
                self.saw_reasoning = True
                self.buf = head[len(THINK_OPEN):]
        while self.buf:
            if self.in_tools:
                self.tool_text += self.buf
                self.buf = ""
                break
            tag = THINK_CLOSE if self.in_reasoning else (CALL_OPEN if self.parse_tools else None)
            i = self.buf.find(tag) if tag else -1
            if i >= 0:
                if self.in_reasoning:
                    self._end_section(out, self.buf[:i])
                else:  # content up to a tool call: its trailing newlines are dropped only if the call parses
                    self._emit(out, self.buf[:i])
                self.buf = self.buf[i + len(tag):]
                if self.in_reasoning:
                    self.in_reasoning = False
                else:
                    self.in_tools = True
                    self.tool_text = CALL_OPEN
                continue
            keep = _partial_suffix(self.buf, tag) if tag else 0
            self._emit(out, self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            break
        return out

    def _emit(self, out: list, text: str, section_end: bool = False) -> None:
        """Emit text of the current section without its leading newlines and, until more text follows, its
        trailing ones (dropped at the section's end)."""
        kind = "reasoning" if self.in_reasoning else "content"
        text = self._held + text
        if not self._started:
            text = text.lstrip("\n")
        body = text.rstrip("\n")
        self._held = "" if section_end else text[len(body):]
        if body:
            self._started = True
            out.append((kind, body))

    def _end_section(self, out: list, text: str) -> None:
        self._emit(out, text, section_end=True)
        self._held, self._started = "", False

    def finish(self) -> tuple[list[tuple[str, str]], list[dict]]:
        """Flush held text; returns the last pieces and the tool calls."""
        out: list[tuple[str, str]] = []
        if self.in_tools:
            _, calls = parse_tool_calls(self.tool_text + self.buf)
            if not calls:
                self._end_section(out, self.tool_text + self.buf)
            return out, calls
        self._end_section(out, self.buf)
        self.buf = ""
        return out, []


def _partial_suffix(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
