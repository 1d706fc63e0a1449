"""What every protocol hands the request driver: the neutral call a chat body parses into, and the `Encoder`
that turns a job's events into the protocol's answer.

An encoder is fed a job's events in order (`start`, then `text` per TEXT event and `done` per choice's result,
`end` once every choice is done, or `error`) and returns, for each, the stream events to send: (event name or
None, JSON payload). A stream sends them as they come (server/driver.py frames them); a non-streamed request
feeds the same calls and answers `final()`, which is built only from what those calls recorded. So the body of
a non-streamed answer is the fold of its stream: the two cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.output.grammar import Structure
from orchestrator.output.parsing import ParsedOutput
from orchestrator.output.reply import Reply
from orchestrator.request import Event, Result

from ..validate import GenerationOptions

Sse = tuple[str | None, dict]  # one stream event: (its `event:` name, or None for a data-only line; its payload)


@dataclass
class ChatCall:
    """A chat request in the prompt builder's terms, whatever protocol it came in.

    messages: OpenAI-style, as server/conversation.py returns them; tools: OpenAI-style function tools, as
    rendered; cache_breakpoints: (message index, content characters before it); late_system: where the first
    system message after the leading ones came from (the caller's index or path), None if there is none;
    options: None on a route that generates nothing (count_tokens)."""

    messages: list[dict]
    tools: list[dict] | None
    template_kwargs: dict[str, Any]
    options: GenerationOptions | None
    prompt_cache_key: str = ""  # OpenAI's; the scheduler may route requests with the same key together
    cache_breakpoints: tuple[tuple[int, int], ...] = ()
    late_system: int | str | None = None
    structure: Structure = field(default_factory=Structure)  # response format, tool choice, parallel calls


class Encoder:
    """One request's answer in one protocol (see the module docstring). `route`: the path, for failure counts;
    `kind`: the log's name of the request (a stream's is kind + "-stream"); `closing`: the line that ends a
    stream after its last event (OpenAI's `data: [DONE]`), or ""."""

    route = ""
    kind = ""
    closing = ""

    def start(self) -> list[Sse]:
        return []

    def text(self, ev: Event) -> list[Sse]:
        raise NotImplementedError

    def done(self, r: Result) -> list[Sse]:
        raise NotImplementedError

    def end(self, results: list[Result]) -> list[Sse]:
        return []

    def error(self, e: Exception) -> list[Sse]:
        raise NotImplementedError

    def final(self) -> dict:
        raise NotImplementedError


class Reading:
    """One choice's reply as it streams: text deltas in (`push`), the reply shaper's pieces out, and what they add
    up to (`output`: the ParsedOutput that `Reply.parse` gives for the whole text)."""

    def __init__(self, reply: Reply) -> None:
        self.parser = reply.stream()
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[dict] = []

    def push(self, text: str) -> list[tuple[str, str]]:
        return self._keep(self.parser.push(text))

    def finish(self, cut: bool) -> tuple[list[tuple[str, str]], list[dict]]:
        rest, self.calls = self.parser.finish(cut)
        return self._keep(rest), self.calls

    def _keep(self, pieces: list[tuple[str, str]]) -> list[tuple[str, str]]:
        for kind, text in pieces:
            (self.reasoning if kind == "reasoning" else self.content).append(text)
        return pieces

    def output(self) -> ParsedOutput:
        """After `finish`: the whole reply (reasoning None where no reasoning section was opened)."""
        reasoning = "".join(self.reasoning) if self.parser.reasoning_end is not None else None
        return ParsedOutput(content="".join(self.content), reasoning=reasoning, tool_calls=self.calls)

    def reasoning_tokens(self, r: Result) -> int:
        """After `finish`: the completion tokens generated up to the end of the reasoning (Result.token_ends)."""
        end = self.parser.reasoning_end
        return 0 if end is None else sum(1 for e in r.token_ends if e <= end)


def timings(r: Result) -> dict:
    """llama-server's `timings` of a result, with this server's cache figures (milliseconds)."""
    return {"cache_source": r.restore_source, "restore_ms": round(r.restore_s * 1e3, 3),
            "prefill_ms": round(r.prefill_s * 1e3, 3), "snapshot_ms": round(r.snapshot_s * 1e3, 3),
            "ttft_ms": round(r.ttft_s * 1e3, 3),
            "total_ms": round(r.total_s * 1e3, 3), "snapshots_saved": r.snapshots_saved}
