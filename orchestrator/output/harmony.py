"""gpt-oss's harmony format: generated text is a sequence of assistant messages on channels.

The gpt-oss template's generation prompt ends with `<|start|>assistant`, so the text opens with a message
header (facts from openai-gpt-oss-120b.jinja and llama.cpp's common/parsers/gpt-oss.cpp):

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER                       (then <|return|>, end of generation)
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}   (then <|call|>)
    <|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{ARGS}               (recipient first)

The analysis channel becomes reasoning_content; final and recipient-less commentary (a preamble) become content;
a message addressed `to=functions.NAME` becomes a tool call when its body is a JSON object (else its body is
kept as content). Bodies are kept verbatim.
"""

from __future__ import annotations

import json
import re

from .formats import tool_call
from .stops import partial_suffix

START, MESSAGE = "<|start|>assistant", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


def _kind(header: str) -> tuple[str, str | None]:
    """("reasoning" | "content" | "tool", tool name) of a message header."""
    recipient = _RECIPIENT.search(header)
    if recipient:
        return "tool", recipient.group(1)
    channel = _CHANNEL.search(header)
    return ("reasoning" if channel and channel.group(1) == "analysis" else "content"), None


def _call(name: str, body: str) -> dict | None:
    try:
        args = json.loads(body)
    except ValueError:
        return None
    return tool_call(name, args) if isinstance(args, dict) else None


def parse_harmony(text: str, parse_tools: bool = True) -> tuple[str, str | None, list[dict]]:
    """(content, reasoning or None, tool calls) of a whole harmony completion."""
    parser = HarmonyStreamParser(parse_tools)
    pieces = parser.push(text)
    rest, calls = parser.finish()
    pieces += rest
    reasoning = [s for k, s in pieces if k == "reasoning"]
    return "".join(s for k, s in pieces if k == "content"), ("".join(reasoning) if reasoning else None), calls


class HarmonyStreamParser:
    """Streams harmony text as ("reasoning", s) / ("content", s) pieces; tool-call bodies are held and parsed at
    the end of their message. Same interface as parsing.StreamParser (`reasoning_end`: characters of the pushed
    text through the last reasoning piece, None while there is none)."""

    def __init__(self, parse_tools: bool = True) -> None:
        self.parse_tools = parse_tools
        self.buf = ""
        self.in_body = False
        self.kind, self.name = "content", None
        self.tool_body = ""
        self.calls: list[dict] = []
        self.pushed = 0  # characters pushed so far; `buf` is always their tail
        self.reasoning_end: int | None = None

    def push(self, delta: str) -> list[tuple[str, str]]:
        self.buf += delta
        self.pushed += len(delta)
        out: list[tuple[str, str]] = []
        while self.buf:
            if not self.in_body:
                i = self.buf.find(MESSAGE)
                if i < 0:
                    break
                self.kind, self.name = _kind(self.buf[:i])
                if self.kind == "tool" and not self.parse_tools:
                    self.kind = "content"
                self.buf, self.in_body, self.tool_body = self.buf[i + len(MESSAGE):], True, ""
                continue
            found = [(j, t) for t in ENDS + (START,) if (j := self.buf.find(t)) >= 0]
            if not found:
                keep = partial_suffix(self.buf, ENDS + (START,))
                self._body(out, self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            j, tag = min(found)
            self._body(out, self.buf[:j])
            self._end_message(out)
            self.buf = self.buf[j + (len(tag) if tag != START else 0):]
        return out

    def _body(self, out: list, text: str) -> None:
        if not text:
            return
        if self.kind == "tool":
            self.tool_body += text
        else:
            out.append((self.kind, text))
            if self.kind == "reasoning":  # `text` is a prefix of `buf`
                self.reasoning_end = self.pushed - len(self.buf) + len(text)

    def _end_message(self, out: list) -> None:
        if self.in_body and self.kind == "tool":
            call = _call(self.name, self.tool_body)
            if call:
                self.calls.append(call)
            elif self.tool_body:
                out.append(("content", self.tool_body))
        self.in_body, self.tool_body = False, ""

    def finish(self, cut: bool = False) -> tuple[list[tuple[str, str]], list[dict]]:
        """Flush: the open message ends here (cut off, or at an end-of-generation token not in the text). `cut`
        is the other parsers' (StreamParser.finish); a harmony call's body is parsed as it comes either way."""
        out: list[tuple[str, str]] = []
        if self.in_body:
            self._body(out, self.buf)
            self._end_message(out)
        elif self.buf.replace(START, "").strip():  # text that never opened a message: plain content
            out.append(("content", self.buf))
        self.buf = ""
        return out, self.calls
