"""What Claude Code 2.1.x sends to /v1/messages (captured: tests/fixtures/captures/claude-code/), field by field, on a
live server (tiny model): the billing line left out of the prompt, messages[1] with role system rendered where it
stands, context_management's thinking edits, output_config's effort, deferred tools and tool references,
thinking blocks whose signature carries an omitted display back, every thinking display it asks for, and what it
sends in its other modes (stream-json output, --resume, /compact, sub-agents)."""

from __future__ import annotations

import copy
import json

import httpx
import pytest

from orchestrator.reuse import spaced_stops
from server.protocols.anthropic import SIGNATURE_PREFIX, parse_messages
from server.conversation import late_system_as_user

from .agent_support import capture
from .conftest import scripted

TURN1, TURN2 = capture("claude-code", "turn1")["body"], capture("claude-code", "turn2")["body"]
# its other modes (tests/fixtures/captures/README.md): -p --output-format stream-json --verbose (display "updates"),
# then -c -p with it, --resume <id> -p, -c -p "/compact"; and a sub-agent's request with its parent's next one
MODES = ("stream-json-turn1", "resume-turn3", "compact", "subagent", "subagent-parent-turn2")
TOOL = {"name": "lookup", "description": "Look a word up", "input_schema": {"type": "object", "properties": {
    "word": {"type": "string"}}}}


def prompt_of(runtime, body):
    req = parse_messages(body)
    messages = late_system_as_user(req.messages) if req.late_system is not None else req.messages
    return runtime.prompts.chat(messages, req.tools, req.template_kwargs, req.cache_breakpoints)


def post(url, body, path="/v1/messages"):
    return httpx.post(url + path, json=body, timeout=300)


def test_the_billing_line_is_left_out_so_sessions_share_the_system_prompt(runtime):
    other = copy.deepcopy(TURN1)
    other["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.332.59a; cc_entrypoint=sdk-cli;"
    a, b = prompt_of(runtime, TURN1), prompt_of(runtime, other)
    assert "x-anthropic-billing-header" not in a.text and "You are a Claude agent" in a.text
    assert a.tokens == b.tokens


def test_the_environment_system_message_is_a_user_turn_where_it_stands_and_turn_two_extends_turn_one(runtime):
    one, two = prompt_of(runtime, TURN1), prompt_of(runtime, TURN2)
    env = TURN2["messages"][1]["content"]
    assert env[:40] in one.text and one.text.index("Say hi") < one.text.index(env[:40])
    end = one.boundaries.message_ends[-1]  # the end of the environment message, before the generation prompt
    assert end in spaced_stops(one.boundaries, len(one.tokens), runtime.config.snapshot_min_gap)  # turn 1 stores it; turn 2 starts with the same tokens through it
    assert end > 0.9 * len(two.tokens) and two.tokens[:end] == one.tokens[:end]


def test_claude_codes_requests_and_count_tokens_are_served(live_server, runtime):
    for body in (TURN1, TURN2):
        r = post(live_server.url, dict(body, max_tokens=2))
        assert r.status_code == 200, r.text
        events = [line for line in r.text.splitlines() if line.startswith("event: ")]
        assert events[0] == "event: message_start" and events[-1] == "event: message_stop"
        counted = post(live_server.url, {k: body[k] for k in ("model", "messages", "system", "tools", "thinking")},
                       "/v1/messages/count_tokens")
        assert counted.status_code == 200 and counted.json()["input_tokens"] == len(prompt_of(runtime, body).tokens)


@pytest.mark.parametrize("name", MODES)
def test_what_claude_code_sends_in_its_other_modes_is_accepted(name):
    body = capture("claude-code", name)["body"]
    req = parse_messages(body)
    assert req.late_system is not None and req.template_kwargs["enable_thinking"]
    assert body["thinking"]["display"] in ("updates", "omitted")


def sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def test_the_stream_json_request_with_display_updates_streams_its_thinking(live_server, runtime):
    body = capture("claude-code", "stream-json-turn1")["body"]
    assert body["thinking"] == {"type": "adaptive", "display": "updates"}
    r = post(live_server.url, dict(body, max_tokens=6))  # the random model thinks: Qwen3.5 opens <think>
    assert r.status_code == 200, r.text
    datas = sse(r.text)
    assert datas[0]["type"] == "message_start" and datas[-1]["type"] == "message_stop"
    deltas = [d["delta"] for d in datas if d["type"] == "content_block_delta"]
    thinking = [d["thinking"] for d in deltas if d["type"] == "thinking_delta"]
    assert len(thinking) > 1 and all(thinking)  # token by token, as generated
    (sig,) = [d["signature"] for d in deltas if d["type"] == "signature_delta"]
    assert sig.startswith(SIGNATURE_PREFIX)
    usage = datas[0]["message"]["usage"]
    assert sum(usage[k] for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")) \
        == len(prompt_of(runtime, body).tokens)


@pytest.mark.parametrize("display", ["summarized", "updates", "highlights", None])
def test_every_display_that_shows_thinking_shows_it_whole(live_server, runtime, monkeypatch, display):
    scripted(runtime, monkeypatch, "Weighing the options.\n</think>\n\nHello.")
    thinking = {"type": "adaptive", **({"display": display} if display else {})}
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "thinking": thinking}
    r = post(live_server.url, body)
    assert r.status_code == 200, r.text
    block, text = r.json()["content"]
    assert block["thinking"] == "Weighing the options." and block["signature"].startswith(SIGNATURE_PREFIX)
    deltas = [d["delta"] for d in sse(post(live_server.url, dict(body, stream=True)).text)
              if d["type"] == "content_block_delta"]
    assert "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta") == "Weighing the options."
    assert {"type": "signature_delta", "signature": block["signature"]} in deltas


def loop(keep=None):
    """A tool loop with thinking in two assistant turns after the user's question (Qwen3.5 renders both)."""
    msgs = [{"role": "user", "content": "Define two words."}]
    for k, word in enumerate(("apple", "pear")):
        msgs += [{"role": "assistant", "content": [{"type": "thinking", "thinking": f"Thought {k} about {word}.",
                                                    "signature": "x"},
                                                   {"type": "tool_use", "id": f"t{k}", "name": "lookup",
                                                    "input": {"word": word}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{k}", "content": "a fruit"}]}]
    body = {"model": "m", "max_tokens": 4, "tools": [TOOL], "messages": msgs, "thinking": {"type": "adaptive"}}
    if keep is not None:
        body["context_management"] = {"edits": [{"type": "clear_thinking_20251015", "keep": keep}]}
    return body


def test_clear_thinking_keeps_the_latest_turns_thinking_as_anthropic_documents(runtime):
    text = prompt_of(runtime, loop()).text
    assert "Thought 0 about apple." in text and "Thought 1 about pear." in text
    assert prompt_of(runtime, loop("all")).text == text
    one = prompt_of(runtime, loop({"type": "thinking_turns", "value": 1})).text
    assert "Thought 0 about apple." not in one and "Thought 1 about pear." in one
    none = prompt_of(runtime, loop({"type": "thinking_turns", "value": 0})).text
    assert "Thought" not in none


@pytest.mark.parametrize("change,param", [
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses"}}]}},
     "context_management.edits[0].keep"),
    ({"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": 3}]}},
     "context_management.edits[0].keep"),
    ({"context_management": {"edits": [{"type": "compact_20260112"}]}}, "context_management.edits[0].type"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
    ({"thinking": {"type": "adaptive", "display": "full"}}, "thinking.display"),
    ({"container": "c1"}, "container"),
    ({"tools": [dict(TOOL, defer_loading="yes")]}, "tools[0].defer_loading"),
], ids=["clear_tool_uses keep", "keep", "unknown edit", "effort", "format", "display", "container", "defer_loading"])
def test_what_cannot_be_honoured_is_a_400_naming_it(live_server, change, param):
    r = post(live_server.url, {**loop(), **change})
    assert r.status_code == 400 and param in r.json()["error"]["message"], r.text
    if param == "thinking.display":  # in the hosted API's words too, which Claude Code reads to retry without it
        assert "thinking.adaptive.display: Input should be " in r.json()["error"]["message"]


def test_output_config_effort_and_thinking(runtime):
    base = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    on = prompt_of(runtime, {**base, "thinking": {"type": "adaptive"}})
    off = prompt_of(runtime, base)
    assert on.text != off.text
    for effort in ("low", "medium", "high", "max"):
        assert prompt_of(runtime, {**base, "thinking": {"type": "adaptive"}, "output_config": {"effort": effort}}
                         ).text == on.text
    assert prompt_of(runtime, {**base, "output_config": {"effort": "high"}}).text == off.text  # never turns it on
    assert prompt_of(runtime, {**base, "thinking": {"type": "adaptive"}, "output_config": {"effort": "none"}}
                     ).text == off.text


def test_deferred_tools_stay_out_of_the_prompt_until_a_tool_reference_loads_them(runtime, live_server):
    deferred = {"name": "translate", "description": "Translate a word", "defer_loading": True,
                "input_schema": {"type": "object", "properties": {"to": {"type": "string"}}}}
    base = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with_deferred = prompt_of(runtime, {**base, "tools": [TOOL, deferred]})
    assert "Translate a word" not in with_deferred.text
    assert with_deferred.tokens == prompt_of(runtime, {**base, "tools": [TOOL]}).tokens
    found = {**base, "tools": [TOOL, deferred], "messages": [
        {"role": "user", "content": "Find a translator."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "s1", "name": "lookup", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "s1", "content": [
            {"type": "tool_reference", "tool_name": "translate"}]}]}]}
    text = prompt_of(runtime, found).text
    assert "Translate a word" in text and text.index("Find a translator.") < text.index("Translate a word")
    found["messages"][2]["content"][0]["content"][0]["tool_name"] = "lookup"  # not deferred: nothing to load
    r = post(live_server.url, found)
    assert r.status_code == 400 and "tool_name" in r.json()["error"]["message"]


def test_an_omitted_thinking_display_comes_back_through_its_signature(live_server, runtime, monkeypatch):
    scripted(runtime, monkeypatch, "Weighing the options.\n</think>\n\nHello.")
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "adaptive", "display": "omitted"}}
    r = post(live_server.url, body).json()
    thinking, text = r["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] == ""
    assert thinking["signature"].startswith(SIGNATURE_PREFIX) and text == {"type": "text", "text": "Hello."}
    streamed = post(live_server.url, dict(body, stream=True)).text
    deltas = [json.loads(line[6:])["delta"] for line in streamed.splitlines()
              if line.startswith("data: ") and '"content_block_delta"' in line]
    assert {"type": "signature_delta", "signature": thinking["signature"]} in deltas
    assert not any(d["type"] == "thinking_delta" for d in deltas)
    monkeypatch.undo()
    tools = [TOOL]  # with a tool result after it, Qwen3.5 renders the assistant turn's reasoning

    def follow(block):
        return {**body, "tools": tools, "messages": body["messages"] + [
            {"role": "assistant", "content": [block, {"type": "tool_use", "id": "t", "name": "lookup",
                                                      "input": {"word": "x"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}]}

    sent_back = prompt_of(runtime, follow(thinking))
    assert "Weighing the options." in sent_back.text
    assert sent_back.tokens == prompt_of(runtime, follow(dict(thinking, thinking="Weighing the options."))).tokens
    bad = post(live_server.url, follow(dict(thinking, signature=SIGNATURE_PREFIX + "%%")))
    assert bad.status_code == 400 and "signature" in bad.json()["error"]["message"]
