"""OpenAI's legacy completions (POST /v1/completions): the body parsed into a CompletionCall (the caller's own
prompt text, no template), and the answer as text_completion chunks or, not streamed, the text_completion they
add up to.

Field policy: server/protocols/openai.py (shared with /v1/chat/completions). Logprobs: server/logprobs.py.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from orchestrator.config import Config
from orchestrator.request import Event, Result

from .. import logprobs
from ..validate import (MAX_TOP_LOGPROBS, GenerationOptions, bad, body_fields, boolean, check_prompt_size,
                        json_object, number)
from .base import Sse, timings
from .openai import COMPLETION, OpenAIEncoder, check_fields, generation, usage


@dataclass
class CompletionCall:
    prompt: str
    options: GenerationOptions
    echo: bool = False


def parse_completion(body: Any, cfg: Config | None = None) -> CompletionCall:
    """Validate a /v1/completions body against the limits of `cfg` (defaults: Config()).

    Raises InvalidRequest naming the field."""
    cfg = cfg or Config(cache_ram_mib=0)
    check_fields(json_object(body), COMPLETION)
    check_prompt_size(body_fields(body, ("prompt",)), cfg)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad("'prompt' must be a non-empty string", "prompt")
    echo = bool(boolean(body, "echo"))
    lps = number(body, "logprobs", 0, MAX_TOP_LOGPROBS, None, integer=True)  # alternatives per position
    if echo and lps is not None:
        raise bad("'logprobs' cannot be combined with 'echo': the prompt's tokens are restored from the cache or "
                  "prefilled without their log-probabilities", "logprobs")
    return CompletionCall(prompt=prompt, options=generation(body, cfg, lps), echo=echo)


class CompletionEncoder(OpenAIEncoder):
    """text_completion chunks, each of one choice (echo: each choice opens with the prompt), each text event's
    logprobs on its chunk, a choice's finish_reason on its last; with stream_options.include_usage a last chunk
    with no choices carries the usage and timings. `final`: the text_completion, each choice's text and logprobs
    those of its chunks."""

    route, kind, closing = "/v1/completions", "completion", "data: [DONE]\n\n"

    def __init__(self, call: CompletionCall, model: str, piece: logprobs.Piece) -> None:
        self.cid, self.created, self.model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), model
        n = call.options.n
        self.call, self.with_usage = call, call.options.include_usage
        self.wants_logprobs = call.options.logprobs is not None
        self.lps = [logprobs.CompletionLogprobs(piece, len(call.prompt)) for _ in range(n)]  # per choice
        self.seen = [0] * n  # per choice: logprobs sent with text chunks
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.blocks: list[dict] = [{"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                                   for _ in range(n)]  # per choice: the logprobs of its chunks, together
        self.results: list[Result] = []

    def _chunk(self, text: str | None, finish: str | None = None, entries=None, i: int = 0) -> Sse:
        block = None
        if entries is not None:
            block = self.lps[i].block(entries)
            for key, values in block.items():
                self.blocks[i][key] += values
        choices = [] if text is None else [{"index": i, "text": text, "finish_reason": finish, "logprobs": block}]
        out = {"id": self.cid, "object": "text_completion", "created": self.created, "model": self.model,
               "choices": choices}
        if self.with_usage:
            out["usage"] = None
        return None, out

    def start(self) -> list[Sse]:
        return [self._chunk(self.call.prompt, i=i) for i in range(len(self.lps))] if self.call.echo else []

    def text(self, ev: Event) -> list[Sse]:
        self.seen[ev.index] += len(ev.logprobs)
        self.texts[ev.index].append(ev.text)
        return [self._chunk(ev.text, None, ev.logprobs if self.wants_logprobs else None, ev.index)]

    def done(self, r: Result) -> list[Sse]:
        return [self._chunk("", r.finish_reason, None if r.logprobs is None else r.logprobs[self.seen[r.index]:],
                            r.index)]

    def final(self) -> dict:
        echo = self.call.prompt if self.call.echo else ""
        return {"id": self.cid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": r.index, "text": echo + "".join(self.texts[r.index]),
                             "finish_reason": r.finish_reason,
                             "logprobs": None if r.logprobs is None else self.blocks[r.index]} for r in self.results],
                "usage": usage(self.results), "timings": timings(self.results[0])}
