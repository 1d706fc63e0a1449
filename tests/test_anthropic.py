"""Anthropic's Messages API (POST /v1/messages) through the official anthropic client, on a live server (tiny
model): answers and stream events, system as a string or blocks, tool_use / tool_result blocks, cache usage,
cache_control marks as snapshot boundaries, and errors in Anthropic's shape. Every cached answer is compared
with the same request run cold (the extension field cache_prompt: false)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from server.protocols.anthropic import parse_messages
from server.protocols.openai_chat import parse_chat

from .conftest import scripted

SYSTEM = "You are the help desk of a public library. Answer in one short sentence and cite the shelf. " * 3
TOOLS = [{"name": "find_book", "description": "Find a book in the catalogue",
          "input_schema": {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}},
         {"name": "opening_hours", "description": "Opening hours of a branch",
          "input_schema": {"type": "object", "properties": {"branch": {"type": "string"}}, "required": ["branch"]}}]
USES = [{"type": "tool_use", "id": "toolu_a", "name": "find_book", "input": {"title": "Dune"}},
        {"type": "tool_use", "id": "toolu_b", "name": "opening_hours", "input": {"branch": "Central"}}]
RESULTS = {"toolu_a": "Dune: shelf 12, two copies available.", "toolu_b": "Central: 9:00-20:00 today."}
COLD = {"cache_prompt": False}


@pytest.fixture()
def claude(live_server, runtime):
    runtime.cache.clear()
    yield anthropic.Anthropic(base_url=live_server.url, api_key="unused", max_retries=0)
    runtime.scheduler.drain()
    runtime.cache.check()


GREEDY = {"temperature": 0}  # the 2026 SDK no longer has sampling arguments; the API and this server take them


def ask(claude, messages, cold=False, **kw):
    kw.setdefault("system", SYSTEM)
    extra = {**GREEDY, **(COLD if cold else {}), **kw.pop("extra_body", {})}
    return claude.messages.create(model="tiny", max_tokens=kw.pop("max_tokens", 6), messages=messages,
                                  extra_body=extra, **kw)


def prompt_of(runtime, body):
    req = parse_messages({"model": "m", "max_tokens": 1, **body})
    return runtime.prompts.chat(req.messages, req.tools, req.template_kwargs, req.cache_breakpoints)


def total(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_a_message_its_usage_and_a_cache_hit_that_equals_cold(claude, runtime):
    messages = [{"role": "user", "content": "Where can I find Dune?"}]
    first = ask(claude, messages)
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert first.stop_reason == "max_tokens" and first.stop_sequence is None and first.usage.output_tokens == 6
    assert [b.type for b in first.content] == ["text"] and first.content[0].text
    n = len(prompt_of(runtime, {"system": SYSTEM, "messages": messages}).tokens)
    counted = claude.messages.count_tokens(model="tiny", system=SYSTEM, messages=messages)
    assert counted.input_tokens == n
    assert first.usage.cache_read_input_tokens == 0 and first.usage.cache_creation_input_tokens == n
    assert total(first.usage) == n
    # system as blocks is the same prompt: a repeat, restored whole (the prompt end and its logits)
    second = ask(claude, messages, system=[{"type": "text", "text": SYSTEM[:40]}, {"type": "text", "text": SYSTEM[40:]}])
    assert total(second.usage) == n and second.usage.cache_read_input_tokens == n
    assert second.usage.cache_creation_input_tokens == 0
    cold = ask(claude, messages, cold=True)
    assert cold.usage.cache_read_input_tokens == 0 and total(cold.usage) == n
    assert first.content == second.content == cold.content


def test_stream_events_add_up_to_the_message(claude, live_server):
    messages = [{"role": "user", "content": "Which shelf holds atlases?"}]
    full = ask(claude, messages, max_tokens=8, thinking={"type": "enabled", "budget_tokens": 1024})
    with claude.messages.stream(model="tiny", max_tokens=8, system=SYSTEM, messages=messages, extra_body=GREEDY,
                                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") >= 1
    assert final.content == full.content and [b.type for b in final.content][0] == "thinking"
    assert final.stop_reason == full.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8 and total(final.usage) == total(full.usage)
    # message_start has the figures message_delta repeats: a repeat of `full`, restored
    assert events[0].message.usage.cache_read_input_tokens == final.usage.cache_read_input_tokens
    assert full.usage.cache_read_input_tokens == 0 and final.usage.cache_read_input_tokens > total(full.usage) - 16
    # on the wire: each event is named (event:) and typed (data.type) alike
    body = {"model": "m", "max_tokens": 3, "system": SYSTEM, "messages": messages, "stream": True, **GREEDY}
    with httpx.stream("POST", live_server.url + "/v1/messages", json=body, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line[len("event: "):] for line in lines[0::2]]
    datas = [json.loads(line[len("data: "):]) for line in lines[1::2]]
    assert names == [d["type"] for d in datas] and names[0] == "message_start" and names[-1] == "message_stop"


INPUT = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def sse_usage(url: str, body: dict) -> tuple[dict, dict]:
    """The usage of a streamed answer's message_start and message_delta, as sent."""
    with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True}, timeout=300) as r:
        datas = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    start = next(d["message"]["usage"] for d in datas if d["type"] == "message_start")
    return start, next(d["usage"] for d in datas if d["type"] == "message_delta")


def added_up(start: dict, delta: dict) -> dict:
    """The usage Claude Code 2.1.x keeps for a stream: message_start's, each figure replaced by message_delta's
    where that is above 0 (its bundled updateUsage)."""
    return {k: delta[k] if delta.get(k) else start[k] for k in start}


def test_usage_is_in_the_messages_apis_terms_from_message_start(claude, runtime, live_server):
    """input_tokens excludes the cached tokens in message_start, message_delta and the message alike (they add
    up to the prompt): a client that adds up the stream's figures counts none twice."""
    question = [{"role": "user", "content": "Which shelf holds atlases?"}]
    answer = {"role": "assistant", "content": "Shelf 4."}
    body = {"model": "m", "max_tokens": 3, "system": SYSTEM, **GREEDY}
    n = len(prompt_of(runtime, {"system": SYSTEM, "messages": question}).tokens)
    start, delta = sse_usage(live_server.url, {**body, "messages": question})  # cold cache: all written
    assert start == {"input_tokens": 0, "cache_creation_input_tokens": n, "cache_read_input_tokens": 0,
                     "output_tokens": 0}
    assert {k: delta[k] for k in INPUT} == {k: start[k] for k in INPUT} and delta["output_tokens"] == 3
    runtime.scheduler.drain()
    for follow in ("And maps?", "And globes?"):  # restores the first turn's prompt
        messages = question + [answer, {"role": "user", "content": follow}]
        m = len(prompt_of(runtime, {"system": SYSTEM, "messages": messages}).tokens)
        start, delta = sse_usage(live_server.url, {**body, "messages": messages})
        read = start["cache_read_input_tokens"]
        assert 0 < read < m and start["input_tokens"] + read + start["cache_creation_input_tokens"] == m
        assert {k: delta[k] for k in INPUT} == {k: start[k] for k in INPUT}
        assert sum(added_up(start, delta)[k] for k in INPUT) == m
        runtime.scheduler.drain()
        other = ask(claude, question + [answer, {"role": "user", "content": follow + " Please."}], max_tokens=3)
        assert 0 < other.usage.cache_read_input_tokens and other.usage.input_tokens == 0
        assert total(other.usage) == len(prompt_of(runtime, {"system": SYSTEM, "messages": question + [
            answer, {"role": "user", "content": follow + " Please."}]}).tokens)
    cold = ask(claude, question, cold=True, max_tokens=3)  # a cold run reads and writes nothing
    assert (cold.usage.input_tokens, cold.usage.cache_read_input_tokens, cold.usage.cache_creation_input_tokens) \
        == (n, 0, 0)
    start, delta = sse_usage(live_server.url, {**body, "messages": question, **COLD})
    assert (start["input_tokens"], start["cache_read_input_tokens"]) == (n, 0) and delta["input_tokens"] == n


def test_tool_results_in_any_order_bind_by_id_and_share_the_openai_prefix(claude, runtime, live_server):
    def conversation(order):
        return [{"role": "user", "content": "Is Dune on the shelf, and is the Central branch open?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}, *USES]},
                {"role": "user", "content": [*({"type": "tool_result", "tool_use_id": f"toolu_{k}",
                                                "content": RESULTS[f"toolu_{k}"]} for k in order),
                                             {"type": "text", "text": "Thanks!"}]}]

    ab, ba = (prompt_of(runtime, {"system": SYSTEM, "tools": TOOLS, "messages": conversation(o)}) for o in ("ab", "ba"))
    assert ab.tokens == ba.tokens
    # the same conversation in OpenAI's format (thinking off, as Anthropic's default) renders the same tokens
    oai_messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": conversation("ab")[0]["content"]},
                    {"role": "assistant", "content": "Let me check.", "tool_calls": [
                        {"id": u["id"], "type": "function", "function": {"name": u["name"],
                                                                         "arguments": json.dumps(u["input"])}}
                        for u in USES]},
                    {"role": "tool", "tool_call_id": "toolu_b", "content": RESULTS["toolu_b"]},
                    {"role": "tool", "tool_call_id": "toolu_a", "content": RESULTS["toolu_a"]},
                    {"role": "user", "content": "Thanks!"}]
    oai_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                   "parameters": t["input_schema"]}} for t in TOOLS]
    req = parse_chat({"messages": oai_messages, "tools": oai_tools,
                      "chat_template_kwargs": {"enable_thinking": False}})
    assert runtime.prompts.chat(req.messages, req.tools, req.template_kwargs).tokens == ab.tokens
    oai = openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)
    first = oai.chat.completions.create(model="m", messages=oai_messages, tools=oai_tools, max_tokens=6, temperature=0,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert first.usage.prompt_tokens == len(ab.tokens)
    warm = ask(claude, conversation("ba"), tools=TOOLS)  # restores what the OpenAI request stored
    cold = ask(claude, conversation("ab"), tools=TOOLS, cold=True)
    assert total(warm.usage) == len(ab.tokens) and warm.usage.cache_read_input_tokens > len(ab.tokens) - 16
    assert warm.content == cold.content
    assert warm.content[0].text == first.choices[0].message.content


CALL = "<tool_call>\n<function=find_book>\n<parameter=title>\nDune\n</parameter>\n</function>\n</tool_call>"


def test_tool_use_answers_stream_and_go_back_as_tool_results(claude, runtime, monkeypatch):
    messages = [{"role": "user", "content": "Is Dune on the shelf?"}]
    scripted(runtime, monkeypatch, "I will look it up.\n\n" + CALL)
    r = ask(claude, messages, tools=TOOLS)
    assert r.stop_reason == "tool_use" and r.content[1].id.startswith("toolu_")
    assert [b.type for b in r.content] == ["text", "tool_use"] and r.content[0].text == "I will look it up."
    use = r.content[1]
    assert use.name == "find_book" and use.input == {"title": "Dune"} and use.id
    with claude.messages.stream(model="tiny", max_tokens=6, system=SYSTEM, tools=TOOLS, messages=messages,
                                extra_body=GREEDY) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in deltas and final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [("text", None), ("tool_use", use.input)]
    monkeypatch.undo()
    follow = messages + [{"role": "assistant", "content": [b.to_dict() for b in r.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                       "content": [{"type": "text", "text": RESULTS["toolu_a"]}]}]}]
    warm = ask(claude, follow, tools=TOOLS)
    cold = ask(claude, follow, tools=TOOLS, cold=True)
    assert warm.usage.cache_read_input_tokens > 0 and warm.content == cold.content


def test_stop_sequence_is_reported(claude):
    messages = [{"role": "user", "content": "Recite the shelves."}]
    free = ask(claude, messages, max_tokens=12).content[0].text
    assert len(free) >= 6, "the greedy model stopped before a stop sequence could be tested"
    stop = free[3:6]
    r = ask(claude, messages, max_tokens=12, stop_sequences=["not in the text at all", stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == free[: free.find(stop)].strip("\n")


def test_cache_control_marks_a_snapshot_boundary(claude, runtime):
    doc = "Catalogue excerpt: " + " ".join(f"title {i} shelf {i % 9};" for i in range(120))

    def conversation(question, marked=True):
        part = {"type": "text", "text": doc}
        if marked:
            part["cache_control"] = {"type": "ephemeral"}
        return [{"role": "user", "content": [part, {"type": "text", "text": "\n\n" + question}]}]

    first = prompt_of(runtime, {"system": SYSTEM, "messages": conversation("Where is title 7?")})
    (offset,) = first.boundaries.extra
    assert first.boundaries.system_end < offset < first.boundaries.message_ends[-1]
    ask(claude, conversation("Where is title 7?"))
    r = ask(claude, conversation("Which shelf has the most titles?"))
    cold = ask(claude, conversation("Which shelf has the most titles?"), cold=True)
    assert r.usage.cache_read_input_tokens == offset and r.content == cold.content
    runtime.scheduler.drain()
    runtime.cache.clear()
    ask(claude, conversation("Where is title 7?", marked=False))
    r = ask(claude, conversation("Which shelf has the most titles?", marked=False))
    assert r.usage.cache_read_input_tokens == first.boundaries.system_end  # without the mark: the system prompt


@pytest.mark.parametrize("change,where", [
    (dict(extra_body={"frequency_penalty": 1}), "frequency_penalty"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]), "messages[0].content[0].type"),
    (dict(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]),
     "messages[1].role"),
    (dict(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": USES},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "?"}]}]),
     "messages[2].content[0]"),
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "hi",
                                                  "cache_control": {"type": "persistent"}}]}]),
     "messages[0].content[0].cache_control"),
    (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
    (dict(extra_body={"temperature": 1.5}), "temperature"),
], ids=["unknown field", "image", "prefill", "tool_result without its call", "cache_control type", "server tool",
        "temperature"])
def test_bad_requests_are_400_in_anthropics_error_shape(claude, change, where):
    kw = {"messages": [{"role": "user", "content": "hi"}], **change}
    with pytest.raises(anthropic.BadRequestError) as e:
        ask(claude, **kw)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert set(e.value.body["error"]) == {"type", "message"} and where in e.value.body["error"]["message"]


def test_other_errors_keep_anthropics_shape(live_server):
    r = httpx.post(live_server.url + "/v1/messages", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.post(live_server.url + "/v1/messages", content=b"x", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x " * 20000}]}
    r = httpx.post(live_server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
