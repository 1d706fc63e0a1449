"""One completion has one meaning on every route: the reply shaper (orchestrator/output/reply.py) reads it with the
request's tools everywhere. With Qwen3.5's XML tool-call format a parameter's value is raw text, so only the tool's
schema says whether `123` is the string "123" or the number 123: a route that parsed without the tools returned the
number (the /v1/messages bug of 29f84c5)."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import scripted

CALL = "<tool_call>\n<function=lookup>\n<parameter=code>\n123\n</parameter>\n</function>\n</tool_call>"
SCHEMA = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}
OAI_TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a code up",
                                               "parameters": SCHEMA}}]
ANT_TOOLS = [{"name": "lookup", "description": "Look a code up", "input_schema": SCHEMA}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def _sse(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def chat_args(client, stream: bool) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "code?"}], "tools": OAI_TOOLS, "max_tokens": 4,
            "temperature": 0, "stream": stream, **NO_THINK}
    if not stream:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return json.loads(r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = _sse(r)
    calls = [c for ch in chunks for c in ch["choices"][0]["delta"].get("tool_calls", []) if ch["choices"]]
    return json.loads(calls[0]["function"]["arguments"])


def messages_input(client, stream: bool) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "code?"}], "tools": ANT_TOOLS, "max_tokens": 4,
            "temperature": 0, "stream": stream}
    if not stream:
        r = client.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        return next(b for b in r.json()["content"] if b["type"] == "tool_use")["input"]
    with client.stream("POST", "/v1/messages", json=body) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line[6:]) for line in lines]
    parts = [e["delta"]["partial_json"] for e in events
             if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"]
    return json.loads("".join(parts))


ROUTES = {"chat": lambda c: chat_args(c, False), "chat-stream": lambda c: chat_args(c, True),
          "messages": lambda c: messages_input(c, False), "messages-stream": lambda c: messages_input(c, True)}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_string_parameter_that_looks_like_a_number_stays_a_string_on_every_route(route, client, runtime,
                                                                                  monkeypatch):
    scripted(runtime, monkeypatch, CALL)
    assert ROUTES[route](client) == {"code": "123"}
