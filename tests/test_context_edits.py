"""Anthropic's tool-result clearing (context_management edit clear_tool_uses_20250919, server/protocols/context_edits.py):
the edit's fields and defaults, which tool uses it clears, and on a live server (tiny model) what the answer
reports, count_tokens' original length, clear_at_least, and that the next turn restores the cleared prompt and
equals its cold run."""

from __future__ import annotations

import httpx
import pytest

from orchestrator.errors import InvalidRequest
from server.protocols.anthropic import parse_messages
from server.protocols.context_edits import EDIT, PLACEHOLDER, ClearToolUses

TOOLS = [{"name": "read_file", "description": "Read a file", "input_schema": {
             "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
         {"name": "grep", "description": "Search files", "input_schema": {
             "type": "object", "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]}}]


def session(n: int) -> list[dict]:
    """A tool loop of n tool uses, alternating read_file and grep, each result ~100 tokens."""
    msgs: list[dict] = [{"role": "user", "content": "Find where the cache is flushed."}]
    for k in range(n):
        name, arg = ("read_file", {"path": f"src/mod{k}.py"}) if k % 2 == 0 else ("grep", {"pattern": f"flush{k}"})
        msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"tu{k}", "name": name, "input": arg}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"tu{k}",
                                               "content": f"result {k}: " + "def flush(self): pass\n" * 12}]}]
    return msgs


def body(n: int, **edit) -> dict:
    return {"model": "m", "max_tokens": 3, "temperature": 0, "tools": TOOLS, "messages": session(n),
            "context_management": {"edits": [{"type": EDIT, **edit}]}}


def results(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "tool"]


def test_defaults_are_anthropics():
    edit = ClearToolUses.parse({"type": EDIT}, "e")
    assert edit.trigger == ("input_tokens", 100_000) and edit.keep == 3 and edit.clear_at_least == 0
    assert edit.exclude == frozenset() and edit.inputs is False


def test_all_but_the_kept_most_recent_uses_are_cleared_outside_exclude_tools():
    messages = parse_messages(body(5)).messages
    edit = ClearToolUses.parse({"type": EDIT, "keep": {"type": "tool_uses", "value": 2}}, "e")
    tool_at = [i for i, m in enumerate(messages) if m["role"] == "tool"]
    marks = ((tool_at[0], len(messages[tool_at[0]]["content"])), (tool_at[4], 7))
    out, moved, n = edit.apply(messages, marks)
    assert n == 3 and results(out)[:3] == [PLACEHOLDER] * 3
    assert moved == ((tool_at[0], len(PLACEHOLDER)), (tool_at[4], 7))  # a mark in a cleared result ends with it
    assert results(out)[3:] == results(messages)[3:] and PLACEHOLDER not in results(messages)
    out, _, n = ClearToolUses.parse({"type": EDIT, "keep": {"type": "tool_uses", "value": 0},
                                     "exclude_tools": ["grep"]}, "e").apply(messages, ())
    assert n == 3 and [r == PLACEHOLDER for r in results(out)] == [True, False, True, False, True]


def test_clear_tool_inputs_clears_the_calls_arguments_too():
    messages = parse_messages(body(2)).messages
    args = lambda ms: [c["function"]["arguments"] for m in ms for c in m.get("tool_calls") or ()]  # noqa: E731
    keep0 = {"type": EDIT, "keep": {"type": "tool_uses", "value": 0}}
    assert args(ClearToolUses.parse(keep0, "e").apply(messages, ())[0]) == args(messages)
    assert args(ClearToolUses.parse({**keep0, "clear_tool_inputs": True}, "e").apply(messages, ())[0]) == [{}, {}]
    named = ClearToolUses.parse({**keep0, "clear_tool_inputs": ["grep"]}, "e").apply(messages, ())[0]
    assert args(named) == [args(messages)[0], {}]


def test_the_tool_uses_trigger_counts_uses():
    messages = parse_messages(body(3)).messages
    assert ClearToolUses.parse({"type": EDIT, "trigger": {"type": "tool_uses", "value": 2}}, "e").triggered(1, messages)
    assert not ClearToolUses.parse({"type": EDIT, "trigger": {"type": "tool_uses", "value": 3}}, "e").triggered(
        10**6, messages)


@pytest.mark.parametrize("edit,param", [
    ({"keep": {"type": "tool_uses", "value": -1}}, "e.keep"),
    ({"trigger": {"type": "messages", "value": 3}}, "e.trigger"),
    ({"clear_at_least": 5000}, "e.clear_at_least"),
    ({"exclude_tools": "grep"}, "e.exclude_tools"),
    ({"clear_tool_inputs": "yes"}, "e.clear_tool_inputs"),
    ({"keep_last": 2}, "e.keep_last"),
])
def test_bad_edits_name_their_field(edit, param):
    with pytest.raises(InvalidRequest) as e:
        ClearToolUses.parse({"type": EDIT, **edit}, "e")
    assert e.value.param == param


def post(url, b, path="/v1/messages"):
    r = httpx.post(url + path, json=b, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def prompt_total(answer) -> int:
    u = answer["usage"]
    return u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]


def test_a_triggered_edit_is_applied_and_reported(live_server, fresh_cache):
    def count(b):
        return post(live_server.url, {k: v for k, v in b.items() if k not in ("max_tokens", "temperature")},
                    "/v1/messages/count_tokens")

    full = count({k: v for k, v in body(4).items() if k != "context_management"})["input_tokens"]
    edited = body(4, trigger={"type": "input_tokens", "value": 100}, keep={"type": "tool_uses", "value": 1})
    counted = count(edited)
    assert counted["context_management"] == {"original_input_tokens": full} and counted["input_tokens"] < full - 100
    answer = post(live_server.url, edited)
    assert answer["context_management"] == {"applied_edits": [
        {"type": EDIT, "cleared_tool_uses": 3, "cleared_input_tokens": full - counted["input_tokens"]}]}
    assert prompt_total(answer) == counted["input_tokens"]
    not_yet = post(live_server.url, body(4))  # the default trigger, 100,000 tokens, is not reached
    assert "context_management" not in not_yet and prompt_total(not_yet) == full
    too_little = post(live_server.url, dict(edited, context_management={"edits": [dict(
        edited["context_management"]["edits"][0], clear_at_least={"type": "input_tokens", "value": full})]}))
    assert "context_management" not in too_little and prompt_total(too_little) == full


def test_the_next_turn_restores_the_cleared_prompt_and_equals_cold(live_server, fresh_cache):
    edit = {"trigger": {"type": "input_tokens", "value": 100}, "keep": {"type": "tool_uses", "value": 2}}
    first = post(live_server.url, body(3, **edit))
    second_body = body(4, **edit)
    second = post(live_server.url, second_body)
    # turn 2 clears one use more (tu1): its prompt is turn 1's through the end of tu0's cleared result at least
    assert second["context_management"]["applied_edits"][0]["cleared_tool_uses"] == 2
    assert first["context_management"]["applied_edits"][0]["cleared_tool_uses"] == 1
    assert second["usage"]["cache_read_input_tokens"] > 0
    cold = post(live_server.url, dict(second_body, cache_prompt=False))
    assert cold["usage"]["cache_read_input_tokens"] == 0 and cold["content"] == second["content"]
