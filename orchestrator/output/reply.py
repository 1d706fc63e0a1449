"""The reply shaper: one request's generated text -> the answer every route returns.

Built with the prompt (`PromptBuilder.chat`), because what the text means depends on it: the template family's
output format, the request's tools (they type the arguments of formats that write raw values, and without tools no
tool call is parsed), and whether the prompt ended inside an open reasoning block. Every route (chat,
completions' chat-less prompts excepted, messages, responses) and the after-generation check
(`PromptBuilder.restorable_after`) read the answer through it, so one completion has one meaning everywhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .formats import QWEN35, OutputFormat
from .parsing import ParsedOutput, make_stream_parser, parse_output


@dataclass(frozen=True)
class Reply:
    """fmt: the output format; tools: the request's OpenAI-style tools (None: tool calls are not parsed, the text
    stays content); opens_reasoning: the generation prompt ends inside an open reasoning block."""

    fmt: OutputFormat = QWEN35
    tools: list[dict] | None = None
    opens_reasoning: bool = False

    @property
    def parses_tools(self) -> bool:
        return self.tools is not None

    def parse(self, text: str, cut: bool = False) -> ParsedOutput:
        """A whole completion: reasoning, content and OpenAI-shaped tool calls (arguments a JSON string). `cut`:
        generation stopped at its budget (`Result.cut`): a partial tool call is dropped, not returned as text."""
        return parse_output(text, self.opens_reasoning, self.parses_tools, self.fmt, self.tools, cut)

    def stream(self):
        """A stream parser: push(delta) -> [(kind, text)], finish(cut) -> ([(kind, text)], tool_calls); its pieces
        add up to what `parse` returns for the whole text."""
        return make_stream_parser(self.opens_reasoning, self.parses_tools, self.fmt, self.tools)

    @staticmethod
    def message(out: ParsedOutput, object_arguments: bool = False) -> dict[str, Any]:
        """The assistant message of OpenAI's chat API for a parsed completion: role, content, reasoning_content
        (when there was reasoning) and tool_calls (when there were calls). object_arguments: each call's
        arguments as a mapping (what the prompt builder renders) instead of OpenAI's JSON string."""
        message: dict[str, Any] = {"role": "assistant", "content": out.content}
        if out.reasoning is not None:
            message["reasoning_content"] = out.reasoning
        if out.tool_calls:
            message["tool_calls"] = [dict(c, function=dict(c["function"], arguments=json.loads(
                c["function"]["arguments"]))) for c in out.tool_calls] if object_arguments else out.tool_calls
        return message
