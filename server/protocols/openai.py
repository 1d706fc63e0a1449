"""OpenAI's field policy, shared by its two routes (chat completions and legacy completions): one table, each
field listing the routes it is known on, and the checks of the fields both routes take.

Every top-level field is honoured, accepted as a hint, accepted with its default value only (`DEFAULT_ONLY`:
e.g. best_of=2, presence_penalty=0.5 are refused), or refused; a field in no table is refused by name
(server/fields.py), so a client never believes a setting took effect when it did not.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from orchestrator.config import Config
from orchestrator.request import Result

from .. import fields
from ..errors import error_payload
from ..fields import DEFAULT_ONLY as _DEFAULT_ONLY_KIND, HINT, HONOURED, Rule
from ..validate import TEMPERATURE, GenerationOptions, bad, boolean, identities, mapping, options
from .base import Encoder, Sse, timings

CHAT, COMPLETION = "chat", "completion"
PATHS = {CHAT: "/v1/chat/completions", COMPLETION: "/v1/completions"}
_BOTH = (CHAT, COMPLETION)
IDENTITIES = ("model", "cache_salt", "prompt_cache_key", "user", "safety_identifier")

# The field policy of both routes (server/fields.py): field -> Rule(kind, routes, note[, accepts]). New request
# fields are added here (and to server/docs.py, which tests/test_openapi.py checks against this table).
_ANY_NUMBER_ZERO = lambda v: v == 0 and not isinstance(v, bool)  # noqa: E731
FIELDS: dict[str, Rule] = {
    # what to run
    "model": Rule(HONOURED, _BOTH, "any string: the one model served answers"),
    "messages": Rule(HONOURED, (CHAT,), "see Conversations"),
    "tools": Rule(HONOURED, (CHAT,), "function tools, rendered by the template"),
    "tool_choice": Rule(HONOURED, (CHAT,), '"auto", "none" (drops the tools), "required" and a named function '
                                           "(a grammar enforces them)"),
    "parallel_tool_calls": Rule(HONOURED, (CHAT,), "false: at most one tool call (a grammar enforces it)"),
    "response_format": Rule(HONOURED, (CHAT,), "text, json_object, json_schema (a grammar enforces it)"),
    "reasoning_effort": Rule(HONOURED, (CHAT,), '"none"/"minimal": thinking off, "low" and above: on '
                                                "(`enable_thinking`; an explicit `chat_template_kwargs` wins)"),
    "chat_template_kwargs": Rule(HONOURED, (CHAT,), "variables for the template, e.g. enable_thinking"),
    "prompt": Rule(HONOURED, (COMPLETION,), "a string, or a list of one string; the caller's own markup"),
    "echo": Rule(HONOURED, (COMPLETION,), "the prompt is returned before the completion"),
    # generation
    "max_tokens": Rule(HONOURED, _BOTH, "any positive budget: generation stops at it, at --max-tokens-limit or "
                                        "where the context is full (finish_reason length)"),
    "max_completion_tokens": Rule(HONOURED, _BOTH, "wins over max_tokens, as in OpenAI's docs"),
    "temperature": Rule(HONOURED, _BOTH, "{:g} to {:g}".format(*TEMPERATURE)),
    "top_p": Rule(HONOURED, _BOTH, "0 to 1"),
    "top_k": Rule(HONOURED, _BOTH, "an extension, as in vLLM and llama.cpp; 0 or -1 (vLLM's default): off"),
    "min_p": Rule(HONOURED, _BOTH, "an extension, as in vLLM and llama.cpp"),
    "seed": Rule(HONOURED, _BOTH, "reproducible sampling"),
    "stop": Rule(HONOURED, _BOTH, "up to 16 strings"),
    "stream": Rule(HONOURED, _BOTH, "server-sent events ending with [DONE]"),
    "stream_options": Rule(HONOURED, _BOTH, "include_usage"),
    "n": Rule(HONOURED, _BOTH, "1 to --parallel minus 1 (a slot is left to others): one prefill, choice i "
                               "sampled with seed + i"),
    "logprobs": Rule(HONOURED, _BOTH, "chat: true/false; completions: 0 to 20 alternatives"),
    "top_logprobs": Rule(HONOURED, (CHAT,), "0 to 20, with logprobs: true"),
    # cache control and caller identity
    "cache_prompt": Rule(HONOURED, _BOTH, "an extension: false is a cold run that neither reads nor writes the "
                                          "cache"),
    "cache_salt": Rule(HONOURED, _BOTH, "an extension: requests share snapshots only with the same salt"),
    "prompt_cache_key": Rule(HONOURED, _BOTH, "requests with the same key are routed to the same slot when they "
                                              "can be"),
    "user": Rule(HINT, _BOTH, "an identity, checked to be a short string"),
    "safety_identifier": Rule(HINT, _BOTH, "an identity, checked to be a short string"),
    "metadata": Rule(HINT, (CHAT,), "an object"),
    "store": Rule(HINT, (CHAT,), "nothing is stored for later retrieval: the answer is the same"),
    "service_tier": Rule(HINT, (CHAT,), "one tier serves every request"),
    # accepted only with their default value: another value would change the answer
    "best_of": Rule(_DEFAULT_ONLY_KIND, (COMPLETION,), "1", lambda v: v == 1 and not isinstance(v, bool)),
    "presence_penalty": Rule(_DEFAULT_ONLY_KIND, _BOTH, "0 (penalties are not implemented)", _ANY_NUMBER_ZERO),
    "frequency_penalty": Rule(_DEFAULT_ONLY_KIND, _BOTH, "0 (penalties are not implemented)", _ANY_NUMBER_ZERO),
    "logit_bias": Rule(_DEFAULT_ONLY_KIND, _BOTH, "an empty object", lambda v: v == {}),
    "suffix": Rule(_DEFAULT_ONLY_KIND, (COMPLETION,), "an empty string", lambda v: v == ""),
}

# field -> (accepts the value?, the values accepted, for the error message). null is always accepted.
DEFAULT_ONLY: dict[str, tuple[Callable[[Any], bool], str]] = {
    k: (r.accepts, r.note) for k, r in FIELDS.items() if r.kind == fields.DEFAULT_ONLY}


def check_fields(body: dict, route: str) -> None:
    """Refuse fields not in FIELDS for `route`, DEFAULT_ONLY fields with another value, identity fields that are
    not short strings and hints of the wrong type. Raises InvalidRequest naming the field."""
    fields.check(body, FIELDS, route, PATHS[route])
    identities(body, IDENTITIES)
    mapping(body, "metadata")
    boolean(body, "store")
    if body.get("service_tier") is not None and not isinstance(body["service_tier"], str):
        raise bad("'service_tier' must be a string", "service_tier")


def generation(body: dict, cfg: Config, logprobs: int | None) -> GenerationOptions:
    """The generation options of an OpenAI body, with the route's `logprobs` (checked by the route)."""
    opts = options(body, cfg)
    opts.logprobs = logprobs
    return opts


def usage(results: Sequence[Result]) -> dict:
    """OpenAI's usage of a request's choices: the prompt counted once (it is prefilled once), the completion tokens
    of every choice."""
    first = results[0]
    completion = sum(len(r.completion_tokens) for r in results)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}


class OpenAIEncoder(Encoder):
    """What both OpenAI routes' encoders end a stream with: with stream_options.include_usage, one last chunk (the
    route's `_chunk(None)`: no choices) carrying the usage and timings; an error as OpenAI's error object."""

    with_usage: bool
    results: list[Result]

    def end(self, results: list[Result]) -> list[Sse]:
        self.results = results
        if not self.with_usage:
            return []
        _, last = self._chunk(None)
        return [(None, dict(last, usage=usage(results), timings=timings(results[0])))]

    def error(self, e: Exception) -> list[Sse]:
        return [(None, error_payload(e)[0])]
