"""OpenAI's chat completions (POST /v1/chat/completions): the body parsed into a ChatCall, and the answer as
chat.completion chunks or, not streamed, the chat.completion they add up to.

Field policy: server/protocols/openai.py (shared with /v1/completions). Logprobs: server/logprobs.py.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from orchestrator.config import Config
from orchestrator.output.grammar import Structure
from orchestrator.output.reply import Reply
from orchestrator.request import Event, Result

from .. import logprobs
from ..conversation import conversation
from ..validate import (MAX_TOP_LOGPROBS, bad, body_fields, boolean, check_prompt_size, json_object, number,
                        schema_spec, thinking_from_effort)
from .base import ChatCall, Reading, Sse, timings
from .openai import CHAT, OpenAIEncoder, check_fields, generation, usage

RESERVED_TEMPLATE_VARS = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}


def _tools(raw: Any) -> list[dict] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad("'tools' must be a list", "tools")
    for j, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad(f"'tools[{j}]' must be {{\"type\": \"function\", \"function\": {{...}}}}", f"tools[{j}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"'tools[{j}].function.name' must be a non-empty string", f"tools[{j}].function.name")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise bad(f"'tools[{j}].function.parameters' must be a JSON schema object",
                      f"tools[{j}].function.parameters")
    return raw or None


def _tool_choice(raw: Any, tools: list[dict] | None) -> tuple[str, str | None]:
    """(the tool choice: 'auto', 'none' or 'required', the function a named choice forces or None); a named
    function must be in `tools`. 'none' drops the tools from the prompt; 'required' and a named function are
    enforced by a grammar (orchestrator/output/grammar.py). Raises InvalidRequest for another shape or an
    unknown function."""
    if raw is None:
        return "auto", None
    if raw in ("auto", "none", "required"):
        return raw, None
    fn = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise bad("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                  "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if not any(t["function"]["name"] == fn["name"] for t in tools or ()):
        raise bad(f"'tool_choice' names the function {json.dumps(fn['name'])[:60]}, which is not in 'tools'",
                  "tool_choice.function.name")
    return "required", fn["name"]


def _response_format(raw: Any) -> dict | None:
    """The JSON schema the reply must be valid against: None for {"type": "text"} (or null),
    {"type": "object"} for {"type": "json_object"}, the schema of {"type": "json_schema", "json_schema":
    {"name", "schema", "strict", "description"}} (strict or not, the grammar enforces it). Raises
    InvalidRequest naming the field."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise bad("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                  "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                  "response_format")
    spec = raw.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("'response_format.json_schema' must be an object with \"name\" and \"schema\"",
                  "response_format.json_schema")
    return schema_spec(spec, "response_format.json_schema")


def _chat_logprobs(body: dict) -> int | None:
    """None, or the number of most likely tokens to return with each token's logprob (chat: `logprobs` true,
    `top_logprobs` 0..MAX_TOP_LOGPROBS; above 0 it needs `logprobs` true, as in OpenAI's API)."""
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise bad("'logprobs' must be true or false", "logprobs")
    top = number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, None, integer=True)
    if top and not on:  # 0 asks for nothing: accepted without logprobs, as clients send it by default
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if on else None


def parse_chat(body: Any, cfg: Config | None = None) -> ChatCall:
    """Validate a /v1/chat/completions body against the limits of `cfg` (defaults: Config()).

    Raises InvalidRequest naming the field."""
    cfg = cfg or Config(cache_ram_mib=0)
    check_fields(json_object(body), CHAT)
    check_prompt_size(body_fields(body, ("messages", "tools", "chat_template_kwargs")), cfg)
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_VARS)
    if reserved:
        raise bad(f"'chat_template_kwargs' cannot set {', '.join(reserved)}: the server sets them",
                  "chat_template_kwargs")
    thinking = thinking_from_effort(body.get("reasoning_effort"))
    if thinking is not None and "enable_thinking" not in kwargs:  # the caller's explicit switch wins
        kwargs = {**kwargs, "enable_thinking": thinking}
    tools = _tools(body.get("tools"))
    choice, forced_name = _tool_choice(body.get("tool_choice"), tools)
    if choice == "none":
        tools = None
    boolean(body, "parallel_tool_calls")
    structure = Structure(response=_response_format(body.get("response_format")), tool_choice=choice,
                          tool_name=forced_name, parallel_tool_calls=body.get("parallel_tool_calls") is not False)
    messages, breakpoints, late_system = conversation(body.get("messages"), cfg.max_messages)
    options = generation(body, cfg, _chat_logprobs(body))
    return ChatCall(messages=messages, tools=tools, template_kwargs=dict(kwargs),
                       options=options, prompt_cache_key=body.get("prompt_cache_key") or "",
                       cache_breakpoints=breakpoints, late_system=late_system, structure=structure)


class ChatEncoder(OpenAIEncoder):
    """OpenAI's chunks, each of one choice (its `index`; with n > 1 choices their chunks interleave as they are
    generated, each choice opening with its role chunk and ending with its finish_reason chunk); with
    stream_options.include_usage every chunk carries "usage": null and one last chunk with no choices carries the
    usage of all choices, as OpenAI sends them, and the `timings` a non-streamed body has (llama-server sends its
    own in the last chunk). `final`: the chat.completion, each choice's message the pieces its chunks carried."""

    route, kind, closing = "/v1/chat/completions", "chat", "data: [DONE]\n\n"

    def __init__(self, call: ChatCall, reply: Reply, model: str, piece: logprobs.Piece) -> None:
        self.cid, self.created, self.model, self.piece = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model, piece
        n = call.options.n
        self.with_usage = call.options.include_usage
        self.readings = [Reading(reply) for _ in range(n)]
        self.held: list[list] = [[] for _ in range(n)]  # per choice: logprobs of tokens no chunk carried yet
        self.seen = [0] * n  # per choice: logprobs received with TEXT events
        self.sent: list[list[dict]] = [[] for _ in range(n)]  # per choice: the logprobs entries sent
        self.results: list[Result] = []

    def _chunk(self, delta: dict | None, finish: str | None = None, i: int = 0) -> Sse:
        choices = [] if delta is None else [{"index": i, "delta": delta, "finish_reason": finish, "logprobs": None}]
        body = {"id": self.cid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": choices}
        if self.with_usage:
            body["usage"] = None
        return None, body

    def _pieces(self, pieces: list[tuple[str, str]], i: int) -> list[Sse]:
        return [self._chunk({_KEYS[k]: text}, i=i) for k, text in pieces]

    def _attach(self, chunks: list[Sse], i: int) -> list[Sse]:
        """Put choice i's held logprobs on the first of `chunks` (each token's once, in order)."""
        if self.held[i] and chunks:
            entries = logprobs.chat(self.held[i], self.piece)
            chunks[0][1]["choices"][0]["logprobs"] = entries
            self.sent[i] += entries["content"]
            self.held[i].clear()
        return chunks

    def start(self) -> list[Sse]:
        return [self._chunk({"role": "assistant", "content": ""}, i=i) for i in range(len(self.readings))]

    def text(self, ev: Event) -> list[Sse]:
        i = ev.index
        self.held[i].extend(ev.logprobs)
        self.seen[i] += len(ev.logprobs)
        return self._attach(self._pieces(self.readings[i].push(ev.text), i), i)

    def done(self, r: Result) -> list[Sse]:
        i = r.index
        rest, calls = self.readings[i].finish(r.cut)
        self.held[i].extend((r.logprobs or [])[self.seen[i]:])
        out = self._pieces(rest, i)
        if calls:
            out.append(self._chunk({"tool_calls": [dict(c, index=j) for j, c in enumerate(calls)]}, i=i))
        out.append(self._chunk({}, "tool_calls" if calls else r.finish_reason, i))
        return self._attach(out, i)

    def final(self) -> dict:
        choices = []
        for r in self.results:
            out = self.readings[r.index].output()
            choices.append({"index": r.index, "message": Reply.message(out),
                            "finish_reason": "tool_calls" if out.tool_calls else r.finish_reason,
                            "logprobs": None if r.logprobs is None else {"content": self.sent[r.index],
                                                                          "refusal": None}})
        return {"id": self.cid, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(self.results), "timings": timings(self.results[0])}


_KEYS = {"reasoning": "reasoning_content", "content": "content"}
