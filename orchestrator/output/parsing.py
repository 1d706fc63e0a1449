"""Output parsing: reasoning to reasoning_content, tool-call blocks to tool_calls, per template family.

The syntax of each family (reasoning tags, where tool calls start, how they parse) is an `OutputFormat` from
orchestrator/formats.py, chosen from the chat template; gpt-oss's harmony channels are parsed by
orchestrator/harmony.py. The default is Qwen3.5's format:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

`arguments` is returned as a JSON string, as OpenAI does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .formats import HARMONY, QWEN35, OutputFormat
from .harmony import HarmonyStreamParser, parse_harmony
from .stops import partial_suffix

@dataclass
class ParsedOutput:
    """content: visible text; reasoning: text inside <think>; tool_calls: OpenAI-shaped dicts."""

    content: str
    reasoning: str | None
    tool_calls: list[dict] = field(default_factory=list)


def _first_start(text: str, fmt: OutputFormat) -> int:
    found = [i for i in (text.find(m) for m in fmt.call_starts) if i >= 0]
    return min(found) if found else -1


def parse_tool_calls(text: str, fmt: OutputFormat = QWEN35, tools: list[dict] | None = None, cut: bool = False
                     ) -> tuple[str, list[dict]]:
    """Split `text` into the content before the first tool call and the parsed calls (`tools`: the request's,
    whose schemas type the arguments in formats that write raw values: `OutputFormat.typed_args`).

    Text that starts a tool call but does not complete one stays in the content where the model ended there
    (nothing is invented), and is dropped where generation was `cut` at its budget: the call was partial, and
    its markup is not an answer (the route reports the length stop).
    """
    i = _first_start(text, fmt)
    calls = fmt.calls(text[i:], tools) if i >= 0 else []
    if not calls:
        return (text[:i].rstrip("\n"), []) if cut and i >= 0 else (text, [])
    return text[:i].rstrip("\n"), calls


def split_reasoning(text: str, opens_reasoning: bool, think: tuple[str, str] | None = QWEN35.think
                    ) -> tuple[str | None, str]:
    """(reasoning, rest). `opens_reasoning`: the prompt ended inside an open reasoning block. `think`: the
    format's (open, close) tags; None: no reasoning."""
    if think is None:
        return None, text.strip("\n")
    think_open, think_close = think
    if opens_reasoning:
        if think_close in text:
            reasoning, rest = text.split(think_close, 1)
            return reasoning.strip("\n"), rest.strip("\n")
        return text.strip("\n"), ""  # cut off while thinking
    if text.lstrip().startswith(think_open):
        return split_reasoning(text.lstrip()[len(think_open):], True, think)
    return None, text.strip("\n")


def parse_output(text: str, opens_reasoning: bool, parse_tools: bool = True, fmt: OutputFormat = QWEN35,
                 tools: list[dict] | None = None, cut: bool = False) -> ParsedOutput:
    """Parse a whole completion in format `fmt` (`tools`: the request's, `cut`: stopped at its budget; see
    parse_tool_calls). Reasoning and content lose leading and trailing newlines (the templates put them around
    both), so the streamed pieces of `StreamParser` add up to the same strings."""
    if fmt is HARMONY:
        return ParsedOutput(*parse_harmony(text, parse_tools))
    reasoning, rest = split_reasoning(text, opens_reasoning, fmt.think)
    content, calls = parse_tool_calls(rest, fmt, tools, cut) if parse_tools else (rest, [])
    return ParsedOutput(content=content, reasoning=reasoning, tool_calls=calls)


class StreamParser:
    """Routes streamed text deltas to ("reasoning", s) / ("content", s) pieces; holds tool-call text back.

    Tool calls are parsed once at the end (`finish`), from everything after the first call-start marker of
    `fmt`. For harmony, use `make_stream_parser`. `reasoning_end`: characters of the pushed text through the end
    of the reasoning (its closing tag; all of it when generation ended inside it), None while no reasoning has
    ended; after `finish`, None exactly where `parse` returns no reasoning (None).
    """

    def __init__(self, opens_reasoning: bool, parse_tools: bool = True, fmt: OutputFormat = QWEN35,
                 tools: list[dict] | None = None) -> None:
        self.fmt = fmt
        self.tools = tools
        self.think_open, self.think_close = fmt.think or ("", "")
        opens_reasoning = opens_reasoning and fmt.think is not None
        self.in_reasoning = opens_reasoning
        self.parse_tools = parse_tools
        self.buf = ""  # text not yet routed (could be the start of a tag)
        self.tool_text = ""
        self.in_tools = False
        self._held = ""  # trailing newlines not emitted yet
        self._started = False  # the current section has emitted text
        self._may_open_think = not opens_reasoning and fmt.think is not None
        self.pushed = 0  # characters pushed so far; `buf` is always their tail
        self.reasoning_end: int | None = None

    def push(self, delta: str) -> list[tuple[str, str]]:
        self.buf += delta
        self.pushed += len(delta)
        out: list[tuple[str, str]] = []
        if self._may_open_think:  # a completion may itself open with <think>
            head = self.buf.lstrip()
            if len(head) < len(self.think_open) and self.think_open.startswith(head):
                return out
            self._may_open_think = False
            if head.startswith(self.think_open):
                self.in_reasoning = True
                self.buf = head[len(self.think_open):]
        while self.buf:
            if self.in_tools:
                self.tool_text += self.buf
                self.buf = ""
                break
            tags = (self.think_close,) if self.in_reasoning else (self.fmt.call_starts if self.parse_tools else ())
            found = [(j, t) for t in tags if (j := self.buf.find(t)) >= 0]
            i, tag = min(found) if found else (-1, "")
            if i >= 0:
                if self.in_reasoning:
                    self._end_section(out, self.buf[:i])
                else:  # content up to a tool call: its trailing newlines are dropped only if the call parses
                    self._emit(out, self.buf[:i])
                if self.in_reasoning:
                    self.reasoning_end = self.pushed - len(self.buf) + i + len(tag)
                self.buf = self.buf[i + len(tag):]
                if self.in_reasoning:
                    self.in_reasoning = False
                else:
                    self.in_tools = True
                    self.tool_text = tag
                continue
            keep = partial_suffix(self.buf, tags)
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

    def finish(self, cut: bool = False) -> tuple[list[tuple[str, str]], list[dict]]:
        """Flush held text; returns the last pieces and the tool calls (`cut`: generation stopped at its budget,
        so a call that does not parse is partial and dropped, as parse_tool_calls does)."""
        out: list[tuple[str, str]] = []
        if self.in_reasoning:  # ended while thinking: all of it was reasoning
            self.reasoning_end = self.pushed
        if self.in_tools:
            _, calls = parse_tool_calls(self.tool_text + self.buf, self.fmt, self.tools)
            if not calls and not cut:
                self._end_section(out, self.tool_text + self.buf)
            return out, calls
        self._end_section(out, self.buf)
        self.buf = ""
        return out, []


def make_stream_parser(opens_reasoning: bool, parse_tools: bool = True, fmt: OutputFormat = QWEN35,
                       tools: list[dict] | None = None):
    """A streaming parser for `fmt`: push(delta) -> [(kind, text)], finish() -> ([(kind, text)], tool_calls)."""
    if fmt is HARMONY:
        return HarmonyStreamParser(parse_tools)
    return StreamParser(opens_reasoning, parse_tools, fmt, tools)
