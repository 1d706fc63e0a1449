"""Structured output (issue 13, item 4): response_format, tool_choice "required" or named, parallel_tool_calls
false, enforced by llama.cpp's grammar sampler, over HTTP with the real openai client and pydantic-ai.

The tiny model has random weights: without the grammar its text is never JSON nor a tool call, so output that
parses and validates here is the grammar's doing. Schemas bound their strings so that greedy random text ends.
Every constrained answer is compared with its cold run (cache_prompt false): same text, same logprobs.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from pydantic import BaseModel, Field

from orchestrator.errors import InvalidRequest
from orchestrator.output import grammar
from orchestrator.output.formats import QWEN35, detect_format
from orchestrator.output.grammar import Structure
from orchestrator.output.parsing import parse_output
from orchestrator.request import SamplingParams

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
MSGS = [{"role": "system", "content": "You answer in JSON."}, {"role": "user", "content": "Describe a city."}]
CITY = {"type": "object", "additionalProperties": False, "required": ["name", "population", "kind", "capital"],
        "properties": {"name": {"type": "string", "maxLength": 12}, "population": {"type": "integer"},
                       "kind": {"enum": ["town", "city", "megacity"]}, "capital": {"type": "boolean"},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"},
        "unit": {"type": "string", "enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["utc", "cet"]},
                                                           "exact": {"type": "boolean"}}}}}


@pytest.fixture()
def oai(live_server):
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)


def ask(oai, cache=True, **kw):
    extra = dict(NO_THINK, **kw.pop("extra_body", {}))
    if not cache:
        extra["cache_prompt"] = False
    kw.setdefault("messages", MSGS)
    kw.setdefault("max_tokens", 120)
    return oai.chat.completions.create(model="m", temperature=0, logprobs=True, extra_body=extra, **kw)


def logprob_list(r):
    return [(t.token, t.logprob) for t in r.choices[0].logprobs.content]


def assert_equals_cold(oai, warm, **kw):
    """`warm` (a cached run) equals the cold run of the same request: text, tool calls and every logprob."""
    cold = ask(oai, cache=False, **kw)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    a, b = warm.choices[0].message, cold.choices[0].message
    assert (a.content, a.reasoning_content if hasattr(a, "reasoning_content") else None) == \
        (b.content, b.reasoning_content if hasattr(b, "reasoning_content") else None)
    assert [(c.function.name, c.function.arguments) for c in a.tool_calls or ()] == \
        [(c.function.name, c.function.arguments) for c in b.tool_calls or ()]
    assert logprob_list(warm) == logprob_list(cold)


# ------------------------------------------------------------------ response_format

def test_json_schema_output_validates_and_a_cached_run_equals_cold(oai, fresh_cache):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    first = ask(oai, response_format=fmt)
    again = ask(oai, response_format=fmt)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the grammar changes sampling, not the prompt
    for r in (first, again):
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert_equals_cold(oai, again, response_format=fmt)


def test_without_the_grammar_the_random_model_writes_no_json(oai, fresh_cache):
    """The control: what makes the answers above valid is the grammar."""
    r = ask(oai)
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


def test_json_object_output_is_a_json_object(oai, fresh_cache):
    r = ask(oai, response_format={"type": "json_object"}, max_tokens=200)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert_equals_cold(oai, ask(oai, response_format={"type": "json_object"}, max_tokens=200),
                       response_format={"type": "json_object"}, max_tokens=200)


def test_streamed_json_schema_output_equals_the_non_streamed_one(oai, fresh_cache):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    whole = ask(oai, response_format=fmt)
    stream = ask(oai, response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), CITY)


def test_with_thinking_on_the_reasoning_is_not_constrained(oai, fresh_cache):
    """Thinking on: the grammar waits for </think> (a lazy grammar), so the reasoning is token for token what
    the model writes without any response_format (the random model never closes it)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    free = ask(oai, extra_body=think, max_tokens=12)
    constrained = ask(oai, extra_body=think, max_tokens=12, response_format=fmt)
    assert constrained.choices[0].message.reasoning_content
    assert logprob_list(constrained) == logprob_list(free)


# ------------------------------------------------------------------ tool_choice and parallel_tool_calls

def check_call(call, tool):
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_choice_required_makes_a_valid_call_and_equals_cold(oai, fresh_cache):
    kw = dict(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    r = ask(oai, **kw)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    check_call(call, WEATHER if call.function.name == "get_weather" else TIME)
    warm = ask(oai, **kw)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    assert_equals_cold(oai, warm, **kw)


def test_a_named_tool_choice_forces_that_function(oai, fresh_cache):
    for tool in (WEATHER, TIME):
        r = ask(oai, tools=[WEATHER, TIME], parallel_tool_calls=False,
                tool_choice={"type": "function", "function": {"name": tool["function"]["name"]}})
        (call,) = r.choices[0].message.tool_calls
        check_call(call, tool)


def test_required_tool_calls_stream_like_the_whole_answer(oai, fresh_cache):
    kw = dict(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    whole = ask(oai, **kw).choices[0].message.tool_calls
    calls = [tc for c in ask(oai, stream=True, **kw) if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in whole]


def test_parallel_calls_allowed_are_all_valid(oai, fresh_cache):
    r = ask(oai, tools=[WEATHER, TIME], tool_choice="required", max_tokens=160)
    calls = r.choices[0].message.tool_calls
    assert calls
    for call in calls:
        check_call(call, WEATHER if call.function.name == "get_weather" else TIME)


def test_forced_tokens_trigger_the_lazy_grammars(runtime, fresh_cache):
    """In process, on the engine: with thinking on, reasoning is free until </think>, then the reply is JSON for
    the schema; with tool_choice auto and parallel_tool_calls false, text is free until <tool_call>, then exactly
    one call and the end. The trigger tokens are forced (the random model would not write them)."""
    rt = runtime
    fmt = rt.prompts.output_format
    tools = [WEATHER, TIME]
    cases = [  # (structure, tools, thinking, forced text)
        (Structure(response=CITY), None, True, "some reasoning</think>"),
        (Structure(parallel_tool_calls=False), tools, False, "Let me check.\n<tool_call>"),
        (Structure(tool_choice="required", parallel_tool_calls=False), tools, True, "hmm</think>"),
    ]
    for structure, tools_, thinking, forced in cases:
        prompt = rt.prompts.chat(MSGS, tools_, {"enable_thinking": thinking})
        assert prompt.opens_reasoning == thinking
        c = rt.constraint(structure, tools_, prompt.opens_reasoning)
        rt.scheduler.drain()
        engine = rt.engine  # the worker is idle (drained); nothing else decodes
        engine.clear(0)
        engine.decode(0, prompt.tokens, 0)
        sampler = engine.sampler(SamplingParams(grammar=c.gbnf, grammar_triggers=c.triggers))
        try:
            text, pos = forced, len(prompt.tokens)
            for tok in engine.tokenize(forced):
                sampler.accept(tok)
                engine.decode(0, [tok], pos)
                pos += 1
            for _ in range(150):
                tok = sampler.sample()
                if engine.is_eog(tok):
                    break
                text += engine.piece(tok).decode("utf-8", "replace")
                engine.decode(0, [tok], pos)
                pos += 1
            else:
                pytest.fail(f"no end of generation after the grammar completed: {text!r}")
        finally:
            sampler.close()
            engine.clear(0)
        out = parse_output(text, prompt.opens_reasoning, tools_ is not None, fmt, tools_)
        if structure.response is not None:
            assert out.reasoning == "some reasoning"
            jsonschema.validate(json.loads(out.content), CITY)
        else:
            assert len(out.tool_calls) == 1, text
            call = out.tool_calls[0]
            tool = WEATHER if call["function"]["name"] == "get_weather" else TIME
            jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
    rt.scheduler.reuse.reset(rt.scheduler.slots[0])


# ------------------------------------------------------------------ pydantic-ai output_type

class City(BaseModel):
    name: str = Field(max_length=12)
    population: int
    kind: str = Field(json_schema_extra={"enum": ["town", "city", "megacity"]})
    capital: bool


def test_pydantic_ai_output_type_gives_a_validated_model(live_server, fresh_cache):
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    sent: list[dict] = []

    async def capture(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    http = httpx.AsyncClient(event_hooks={"request": [capture]}, timeout=300)
    client = openai.AsyncOpenAI(base_url=live_server.url + "/v1", api_key="unused", http_client=http)
    chat = OpenAIChatModel("m", provider=OpenAIProvider(openai_client=client))
    settings = {"max_tokens": 160, "temperature": 0.0, "extra_body": NO_THINK}
    for output_type in (City, NativeOutput(City)):  # a final_result tool (tool_choice required); response_format
        agent = Agent(chat, output_type=output_type, system_prompt="Describe a city.", model_settings=settings,
                      retries=0)
        result = agent.run_sync("Paris")
        assert isinstance(result.output, City)
        assert result.output.kind in ("town", "city", "megacity") and len(result.output.name) <= 12
    tool_run, native_run = sent  # one request each: the first answer validated
    assert tool_run["tool_choice"] == "required" and tool_run["tools"][0]["function"]["name"] == "final_result"
    assert native_run["response_format"]["type"] == "json_schema"


class Node(BaseModel):
    """A recursive model: pydantic's schema is a root `$ref` into `$defs`."""
    name: str = Field(max_length=6)
    children: list[Node] = Field(default_factory=list, max_length=2)


def test_a_root_ref_schema_from_a_recursive_pydantic_model_is_served(oai, runtime, fresh_cache):
    schema = Node.model_json_schema()
    assert schema["$ref"] == "#/$defs/Node" and "Node" in schema["$defs"]
    r = ask(oai, max_tokens=160, response_format={"type": "json_schema", "json_schema": {"name": "node",
                                                                                        "schema": schema}})
    if r.choices[0].finish_reason == "stop":
        Node.model_validate_json(r.choices[0].message.content)
    # The grammar holds the recursion: a nested instance fits it token by token, a wrong key does not.
    c = runtime.constraint(Structure(response=schema), None, False)
    engine = runtime.engine
    for text, fits in (('{"name": "a", "children": [{"name": "b", "children": []}]}', True),
                       ('{"name": "a", "kids": []}', False)):
        g = engine.grammars.open(c.gbnf)
        try:
            ok = True
            for tok in engine.tokenize(text):
                if not g.mask()[tok]:
                    ok = False
                    break
                g.accept(tok)
            assert ok == fits, text
        finally:
            g.close()


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "maxLength": 10 ** 9}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "frob"}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters.properties.a"),
])
def test_bad_structured_output_requests_are_400_naming_the_field(client, fresh_cache, extra, param):
    body = {"model": "m", "messages": MSGS, "max_tokens": 4, **NO_THINK, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert client.post("/v1/chat/completions", json={"model": "m", "messages": MSGS, "max_tokens": 2}
                       ).status_code == 200


def test_formats_without_a_call_grammar_are_refused_by_name():
    mistral = detect_format("[TOOL_CALLS]")
    with pytest.raises(InvalidRequest) as e:
        grammar.build(Structure(tool_choice="required"), [WEATHER], mistral, False)
    assert e.value.param == "tool_choice"
    with pytest.raises(InvalidRequest) as e:
        grammar.build(Structure(parallel_tool_calls=False), [WEATHER], mistral, False)
    assert e.value.param == "parallel_tool_calls"
    harmony = detect_format("<|channel|>")
    with pytest.raises(InvalidRequest) as e:
        grammar.build(Structure(response={"type": "object"}), None, harmony, False)
    assert e.value.param == "response_format"
    # hermes: JSON calls; nothing to constrain without a structure
    assert grammar.build(Structure(), [WEATHER], QWEN35, True) is None
    hermes = grammar.build(Structure(tool_choice="required"), [WEATHER], detect_format("<tool_call>"), False)
    assert hermes.triggers == () and '"<tool_call>\\n"' in hermes.gbnf


def test_plain_string_arguments_stay_strings_where_they_parse_as_json():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\n1234\n</parameter>\n<parameter=days>\n3\n" \
           "</parameter>\n</function>\n</tool_call>"
    out = parse_output(text, False, True, QWEN35, [WEATHER])
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {"city": "1234", "days": 3}
    out = parse_output(text, False, True, QWEN35)  # without the schema, as before: JSON keeps its type
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {"city": 1234, "days": 3}


def test_engine_logits_are_untouched_by_the_grammar(runtime, fresh_cache):
    """The logprobs come from the raw logits: sampling under a grammar leaves them as they were."""
    engine = runtime.engine
    runtime.scheduler.drain()
    prompt = runtime.prompts.chat(MSGS, None, {"enable_thinking": False})
    engine.clear(0)
    engine.decode(0, prompt.tokens, 0)
    before = engine.logits()
    c = runtime.constraint(Structure(response=CITY), None, False)
    sampler = engine.sampler(SamplingParams(grammar=c.gbnf))
    try:
        tok = sampler.sample()
    finally:
        sampler.close()
    assert engine.piece(tok).decode().lstrip().startswith("{")
    assert np.array_equal(engine.logits(), before)
    engine.clear(0)
    runtime.scheduler.reuse.reset(runtime.scheduler.slots[0])


def test_grammar_errors_name_each_routes_own_field():
    """The same contradictory schema, given as chat's response_format, Responses' text.format and the Messages
    API's output_config.format: the 400 names the field the request used."""
    from server.protocols.anthropic import parse_messages
    from server.protocols.responses import parse_responses
    from server.protocols.openai_chat import parse_chat

    bad = {"type": "integer", "minimum": 5, "maximum": 1}
    chat = parse_chat({"model": "m", "messages": MSGS, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": bad}}}).structure
    responses = parse_responses({"model": "m", "input": "x", "text": {"format": {
        "type": "json_schema", "name": "n", "schema": bad}}}).structure
    messages = parse_messages({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                               "output_config": {"format": {"type": "json_schema", "schema": bad}}}).structure
    for structure, param in ((chat, "response_format.json_schema.schema"), (responses, "text.format.schema"),
                             (messages, "output_config.format.schema")):
        with pytest.raises(InvalidRequest) as e:
            grammar.build(structure, None, QWEN35, False)
        assert e.value.param == param
