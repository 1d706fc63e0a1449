"""Structured output on /v1/messages, through the official anthropic client on a live server (tiny model):
`output_config.format` (and the beta's `output_format`) make the answer's text JSON valid against the schema, and
`tool_choice` "any" / "tool" / `disable_parallel_tool_use` force the calls, with the same grammars as the chat
route (output/grammar.py). Every cached answer equals its cold run."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from .test_structured import CITY

WEATHER = {"name": "get_weather", "description": "Weather of a city", "input_schema": {
    "type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]}}}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "required": ["zone"], "properties": {
    "zone": {"enum": ["utc", "cet"]}}}}
FORMAT = {"type": "json_schema", "schema": CITY}
MESSAGES = [{"role": "user", "content": "Describe a city."}]


@pytest.fixture()
def claude(live_server, fresh_cache):
    return anthropic.Anthropic(base_url=live_server.url, api_key="unused", max_retries=0)


def ask(claude, cold=False, **kw):
    extra = {"temperature": 0, **({"cache_prompt": False} if cold else {}), **kw.pop("extra_body", {})}
    return claude.messages.create(model="tiny", max_tokens=kw.pop("max_tokens", 120),
                                  messages=kw.pop("messages", MESSAGES), extra_body=extra, **kw)


def test_output_config_format_gives_json_of_the_schema_and_a_cached_run_equals_cold(claude):
    first = ask(claude, extra_body={"output_config": {"format": FORMAT}})
    again = ask(claude, extra_body={"output_config": {"format": FORMAT}})
    cold = ask(claude, cold=True, extra_body={"output_config": {"format": FORMAT}})
    assert again.usage.cache_read_input_tokens > 0 and cold.usage.cache_read_input_tokens == 0
    for r in (first, again, cold):
        assert r.stop_reason == "end_turn" and [b.type for b in r.content] == ["text"]
        jsonschema.validate(json.loads(r.content[0].text), CITY)
    assert first.content == again.content == cold.content


def test_without_a_format_the_random_model_writes_no_json(claude):
    """The control: what makes the answers above valid is the grammar."""
    with pytest.raises(ValueError):
        json.loads(ask(claude).content[0].text)


def test_the_beta_output_format_and_the_stream_give_the_same_answer(claude, live_server):
    whole = ask(claude, extra_body={"output_config": {"format": FORMAT}})
    beta = ask(claude, extra_body={"output_format": FORMAT})
    assert beta.content == whole.content
    body = {"model": "m", "max_tokens": 120, "temperature": 0, "messages": MESSAGES, "stream": True,
            "output_config": {"format": FORMAT}}
    r = httpx.post(live_server.url + "/v1/messages", json=body, timeout=120)
    deltas = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    text = "".join(d["delta"]["text"] for d in deltas if d["type"] == "content_block_delta"
                   and d["delta"]["type"] == "text_delta")
    assert text == whole.content[0].text


def test_tool_choice_any_forces_one_valid_call_and_equals_cold(claude):
    kw = dict(tools=[WEATHER, TIME], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    r = ask(claude, **kw)
    assert r.stop_reason == "tool_use"
    (use,) = [b for b in r.content if b.type == "tool_use"]
    jsonschema.validate(use.input, (WEATHER if use.name == "get_weather" else TIME)["input_schema"])
    warm, cold = ask(claude, **kw), ask(claude, cold=True, **kw)
    assert warm.usage.cache_read_input_tokens > 0
    calls = [[(b.name, b.input) for b in x.content if b.type == "tool_use"] for x in (r, warm, cold)]
    assert calls[0] == calls[1] == calls[2]


def test_a_named_tool_choice_forces_that_tool(claude):
    for tool in (WEATHER, TIME):
        r = ask(claude, tools=[WEATHER, TIME], tool_choice={"type": "tool", "name": tool["name"],
                                                            "disable_parallel_tool_use": True})
        (use,) = [b for b in r.content if b.type == "tool_use"]
        assert use.name == tool["name"]
        jsonschema.validate(use.input, tool["input_schema"])


def test_auto_leaves_the_random_model_free_text(claude):
    """The control for the two above: with tool_choice auto the random model writes no call."""
    r = ask(claude, tools=[WEATHER, TIME], max_tokens=16)
    assert r.stop_reason == "max_tokens" and not [b for b in r.content if b.type == "tool_use"]


@pytest.mark.parametrize("extra,param", [
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
    ({"output_config": {"format": FORMAT}, "output_format": FORMAT}, "output_format"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "integer", "minimum": 5,
                                                                     "maximum": 1}}}},
     "output_config.format.schema"),
], ids=["type", "no schema", "both", "contradictory schema"])
def test_bad_formats_are_400_naming_the_field(claude, extra, param):
    with pytest.raises(anthropic.BadRequestError) as e:
        ask(claude, extra_body=extra)
    assert e.value.body["error"]["type"] == "invalid_request_error" and param in e.value.body["error"]["message"]
    ask(claude, max_tokens=2)  # and the next request is served
