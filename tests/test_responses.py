"""OpenAI's Responses API (POST /v1/responses): the translation of input items and tools into the messages the
prompt builder renders (unit tests on the captured client requests, tests/fixtures/captures/), and the route through the
official openai client on a live server (tiny model): output items, usage with cached_tokens, the stream's events
as the SDK parses them, tool calls (scripted), and errors naming the field. Every cached answer is compared with
the same request run cold (the extension field cache_prompt: false)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import openai
import pytest

from orchestrator.errors import InvalidRequest
from server.protocols.responses import parse_responses
from server.protocols.openai_chat import parse_chat
from server.validate import thinking_from_effort

from .conftest import scripted

CAPTURES = Path(__file__).parent / "fixtures" / "captures"
INSTRUCTIONS = "You are the help desk of a public library. Answer in one short sentence and cite the shelf. " * 3
TOOL = {"type": "function", "name": "find_book", "description": "Find a book in the catalogue", "strict": True,
        "parameters": {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"],
                       "additionalProperties": False}}
NAMESPACE = {"type": "namespace", "name": "branch", "description": "Branch tools",
             "tools": [{"type": "function", "name": "opening_hours", "description": "Opening hours",
                        "parameters": {"type": "object", "properties": {"branch": {"type": "string"}}}}]}
CALL = "<tool_call>\n<function=find_book>\n<parameter=title>\nDune\n</parameter>\n</function>\n</tool_call>"
NS_CALL = ("<tool_call>\n<function=branch.opening_hours>\n<parameter=branch>\nCentral\n</parameter>\n</function>\n"
           "</tool_call>")
GREEDY = {"temperature": 0}
NO_THINKING = {"effort": "none"}
COLD = {"cache_prompt": False}


def body_of(name: str) -> dict:
    return json.loads((CAPTURES / name).read_text())["body"]


def refused(body: dict) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        parse_responses({"model": "m", **body})
    return e.value


# ------------------------------------------------------------------ translation (no model)

def test_codex_request_translates_to_one_system_message_and_flattened_tools():
    body = body_of("codex/002.json")
    req = parse_responses(body)
    roles = [m["role"] for m in req.messages]
    assert roles == ["system", "user", "user", "assistant", "tool"]
    developer = [item["content"] for item in body["input"][:2]]
    assert req.messages[0]["content"] == "\n\n".join("".join(p["text"] for p in c) for c in developer)
    call = req.messages[3]["tool_calls"][0]
    assert call["id"] == body["input"][4]["call_id"] and call["function"] == {"name": "exec_command",
                                                                             "arguments": {"cmd": "ls"}}
    assert req.messages[4]["tool_call_id"] == call["id"] and req.messages[4]["content"] == body["input"][5]["output"]
    names = [t["function"]["name"] for t in req.tools]
    namespace = next(t for t in body["tools"] if t["type"] == "namespace")
    assert names == [t["name"] for t in body["tools"] if t["type"] == "function"][:4] + [
        f"{namespace['name']}.{t['name']}" for t in namespace["tools"]] + [
        t["name"] for t in body["tools"] if t["type"] == "function"][4:]
    assert req.names["multi_agent_v1.close_agent"].namespace == "multi_agent_v1"
    assert all(set(t["function"]) <= {"name", "description", "parameters"} for t in req.tools)
    assert req.template_kwargs == {}  # reasoning {"summary": "auto"}: the template's default
    assert req.structure.tool_choice == "auto" and req.structure.parallel_tool_calls


def test_the_second_codex_run_renders_the_same_prefix():
    """Two `codex exec` runs in one repository differ only in the last user message (and the items' ids)."""
    a, b = parse_responses(body_of("codex/001.json")), parse_responses(body_of("codex/003.json"))
    assert a.messages[:-1] == b.messages[:-1] and a.tools == b.tools and a.messages[-1] != b.messages[-1]


def test_agents_sdk_turns_bind_tool_results_and_map_effort_none_to_thinking_off():
    body = body_of("openai-agents/004.json")
    req = parse_responses(body)
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "tool", "assistant", "user",
                                                 "assistant", "tool"]
    assert req.messages[0]["content"] == body["instructions"]
    assert req.messages[4]["content"] == "hi" and "tool_calls" not in req.messages[4]
    assert req.template_kwargs == {"enable_thinking": False}
    assert req.tools == [{"type": "function", "function": {k: body["tools"][0][k] for k in
                                                           ("name", "description", "parameters")}}]


def test_items_render_as_the_chat_route_renders_the_same_conversation(runtime):
    items = [{"role": "user", "content": "Is Dune here?"},
             {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "short"}],
              "content": [{"type": "reasoning_text", "text": "Look it up."}], "encrypted_content": "opaque"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
             {"type": "function_call", "call_id": "c1", "name": "find_book", "arguments": '{"title": "Dune"}'},
             {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "shelf 12"}]}]
    req = parse_responses({"model": "m", "instructions": INSTRUCTIONS, "input": items, "tools": [TOOL]})
    chat = parse_chat({"model": "m", "tools": [{"type": "function", "function": {
        k: TOOL[k] for k in ("name", "description", "parameters")}}], "messages": [
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Is Dune here?"},
        {"role": "assistant", "content": "Let me see.", "reasoning_content": "Look it up.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "find_book",
                                                                      "arguments": '{"title": "Dune"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "shelf 12"}]})
    assert req.messages == chat.messages and req.tools == chat.tools
    a = runtime.prompts.chat(req.messages, req.tools, req.template_kwargs)
    assert a.text == runtime.prompts.chat(chat.messages, chat.tools, {}).text and "Look it up." in a.text
    # a summary stands in for reasoning content when there is none
    summary_only = [dict(items[1], content=[])] + items[2:]
    again = parse_responses({"model": "m", "input": items[:1] + summary_only, "tools": [TOOL]})
    assert again.messages[1]["reasoning_content"] == "short"


def test_output_items_group_into_assistant_turns():
    """reasoning, message and calls of one turn are one assistant message; a second message, or reasoning after
    the turn's output, starts the next one."""
    said = lambda text: {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    think = lambda text: {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}
    call = {"type": "function_call", "call_id": "c1", "name": "find_book", "arguments": "{}"}
    req = parse_responses({"model": "m", "tools": [TOOL], "input": [
        {"role": "user", "content": "a"}, think("r1"), said("one"), said("two"), think("r2"), call,
        {"type": "function_call_output", "call_id": "c1", "output": "x"}]})
    assert [(m["role"], m.get("content"), m.get("reasoning_content"), len(m.get("tool_calls", [])))
            for m in req.messages] == [("user", "a", None, 0), ("assistant", "one", "r1", 0),
                                       ("assistant", "two", None, 0), ("assistant", "", "r2", 1),
                                       ("tool", "x", None, 0)]


def test_a_string_input_hosted_tools_and_custom_tools():
    req = parse_responses({"model": "m", "input": "hello", "tools": [
        {"type": "web_search"}, {"type": "local_shell"}, {"type": "file_search", "vector_store_ids": ["v"]},
        {"type": "custom", "name": "apply_patch", "description": "Patch files", "format": {"type": "text"}}]})
    assert req.messages == [{"role": "user", "content": "hello"}]
    assert req.tools == [{"type": "function", "function": {
        "name": "apply_patch", "description": "Patch files", "parameters": {
            "type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}}]
    assert parse_responses({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}).tools is None


def test_refusals_name_the_field():
    assert refused({"input": "x", "store": True}).param == "store"
    assert refused({"input": "x", "previous_response_id": "resp_1"}).param == "previous_response_id"
    assert refused({"input": "x", "background": True}).param == "background"
    assert refused({"input": "x", "frequency_penalty": 0.5}).param == "frequency_penalty"
    e = refused({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}]})
    assert e.param == "input[0].content[0].type"
    assert refused({"input": "x", "tools": [{"type": "some_new_tool"}]}).param == "tools[0].type"
    assert refused({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}
                   ).param == "tool_choice"
    assert refused({"input": "x", "include": ["message.output_text.logprobs"]}).param == "include"
    assert refused({"input": [{"type": "item_reference", "id": "msg_1"}]}).param == "input[0].type"
    e = refused({"input": [{"role": "user", "content": "x"},
                           {"type": "function_call_output", "call_id": "nowhere", "output": "y"}]})
    assert e.param == "input[1].call_id" and "input[1]" in e.message
    assert refused({"input": "x", "reasoning": {"effort": "extreme"}}).param == "reasoning.effort"
    assert refused({"input": "x", "text": {"format": {"type": "json_schema", "name": 5}}}).param == "text.format.name"
    # accepted: hints and metadata, store false, include of encrypted reasoning
    parse_responses({"model": "m", "input": "x", "store": False, "include": ["reasoning.encrypted_content"],
                     "client_metadata": {"a": "b"}, "prompt_cache_retention": "24h", "text": {"verbosity": "low"},
                     "truncation": "auto", "service_tier": "auto", "stream_options": {"include_obfuscation": False}})


def test_thinking_from_effort():
    assert [thinking_from_effort(v) for v in (None, "none", "minimal", "low", "medium", "high", "xhigh")] == [
        None, False, False, True, True, True, True]


# ------------------------------------------------------------------ the route

@pytest.fixture()
def oai(live_server, runtime):
    runtime.cache.clear()
    yield openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)
    runtime.scheduler.drain()
    runtime.cache.check()


def ask(oai, input_, cold=False, **kw):
    kw.setdefault("instructions", INSTRUCTIONS)
    kw.setdefault("reasoning", NO_THINKING)
    extra = {**(COLD if cold else {}), **kw.pop("extra_body", {})}
    return oai.responses.create(model="tiny", input=input_, max_output_tokens=kw.pop("max_output_tokens", 6),
                                extra_body=extra, **GREEDY, **kw)


def finishing(runtime, monkeypatch, text: str) -> None:
    """scripted(), and the scripted answer ends as a trained model's would (finish_reason "stop")."""
    scripted(runtime, monkeypatch, text)
    submit = runtime.scheduler.submit

    def fake(job, sink, *args):
        def wrap(ev):
            if ev.kind == "done":
                ev = dataclasses.replace(ev, result=dataclasses.replace(ev.result, finish_reason="stop"))
            sink(ev)
        return submit(job, wrap, *args)

    monkeypatch.setattr(runtime.scheduler, "submit", fake)


def test_an_answer_its_usage_and_a_cache_hit_that_equals_cold(oai, runtime):
    first = ask(oai, "Where can I find Dune?")
    assert first.id.startswith("resp_") and first.object == "response" and first.status == "incomplete"
    assert first.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in first.output] == ["message"] and first.output_text
    n = first.usage.input_tokens
    assert first.usage.output_tokens == 6 and first.usage.total_tokens == n + 6
    assert first.usage.input_tokens_details.cached_tokens == 0
    second = ask(oai, [{"role": "user", "content": [{"type": "input_text", "text": "Where can I find Dune?"}]}])
    assert second.usage.input_tokens_details.cached_tokens == n  # the same prompt: restored whole, with its logits
    cold = ask(oai, "Where can I find Dune?", cold=True)
    assert cold.usage.input_tokens_details.cached_tokens == 0
    assert first.output_text == second.output_text == cold.output_text


def test_reasoning_comes_back_as_a_reasoning_item(oai):
    r = ask(oai, "Think first.", reasoning={"effort": "high"})
    assert [o.type for o in r.output] == ["reasoning"]
    assert r.output[0].content[0].type == "reasoning_text" and r.output[0].summary == []
    assert r.usage.output_tokens_details.reasoning_tokens > 0


def events(oai, input_, **kw) -> list:
    kw.setdefault("instructions", INSTRUCTIONS)
    kw.setdefault("reasoning", NO_THINKING)
    stream = oai.responses.create(model="tiny", input=input_, max_output_tokens=kw.pop("max_output_tokens", 6),
                                  stream=True, **GREEDY, **kw)
    return list(stream)


def test_stream_events_in_order_add_up_to_the_answer(oai):
    full = ask(oai, "Which shelf holds atlases?", reasoning={"effort": "high"}, max_output_tokens=8)
    evs = events(oai, "Which shelf holds atlases?", reasoning={"effort": "high"}, max_output_tokens=8)
    kinds = [e.type for e in evs]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    n = kinds.count("response.reasoning_text.delta")
    assert n > 0 and kinds[4:4 + n] == ["response.reasoning_text.delta"] * n
    assert kinds[4 + n:] == ["response.reasoning_text.done", "response.content_part.done",
                             "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    assert evs[0].response.status == "in_progress" and evs[0].response.output == []
    text = "".join(e.delta for e in evs if e.type == "response.reasoning_text.delta")
    assert text == evs[4 + n].text == full.output[0].content[0].text
    final = evs[-1].response
    assert final.output[0].content[0].text == text and final.usage.output_tokens == 8
    assert final.usage.input_tokens == full.usage.input_tokens


def test_tool_calls_stream_and_go_back_as_function_call_output(oai, runtime, monkeypatch):
    question = [{"role": "user", "content": "Is Dune on the shelf, and when is Central open?"}]
    finishing(runtime, monkeypatch, "I will look it up.\n\n" + CALL + "\n" + NS_CALL)
    tools = [TOOL, NAMESPACE, {"type": "web_search"}]
    r = ask(oai, question, tools=tools)
    assert r.status == "completed" and [o.type for o in r.output] == ["message", "function_call", "function_call"]
    assert r.output[0].content[0].text == "I will look it up."
    a, b = r.output[1], r.output[2]
    assert (a.name, json.loads(a.arguments), a.call_id.startswith("call")) == ("find_book", {"title": "Dune"}, True)
    assert (b.name, b.namespace, json.loads(b.arguments)) == ("opening_hours", "branch", {"branch": "Central"})
    with oai.responses.stream(model="tiny", instructions=INSTRUCTIONS, input=question, tools=tools,
                              reasoning=NO_THINKING, max_output_tokens=6, **GREEDY) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds.count("response.function_call_arguments.delta") == 2
    assert kinds.count("response.function_call_arguments.done") == 2 and kinds[-1] == "response.completed"
    assert [(o.type, getattr(o, "name", None)) for o in final.output] == [
        ("message", None), ("function_call", "find_book"), ("function_call", "opening_hours")]
    monkeypatch.undo()
    follow = question + [o.to_dict() for o in r.output] + [
        {"type": "function_call_output", "call_id": a.call_id, "output": "Dune: shelf 12."},
        {"type": "function_call_output", "call_id": b.call_id, "output": [{"type": "input_text", "text": "9-20"}]}]
    warm = ask(oai, follow, tools=tools)
    cold = ask(oai, follow, tools=tools, cold=True)
    assert warm.usage.input_tokens_details.cached_tokens > 0 and warm.output_text == cold.output_text
    assert warm.usage.input_tokens == cold.usage.input_tokens


def test_a_custom_tool_call_comes_back_as_custom_tool_call(oai, runtime, monkeypatch):
    finishing(runtime, monkeypatch, "<tool_call>\n<function=apply_patch>\n<parameter=input>\n*** Begin Patch\n"
                                    "</parameter>\n</function>\n</tool_call>")
    r = ask(oai, "Patch it.", tools=[{"type": "custom", "name": "apply_patch", "description": "Patch files"}])
    assert [(o.type, o.name, o.input) for o in r.output] == [("custom_tool_call", "apply_patch", "*** Begin Patch")]


def test_errors_are_openai_shaped_and_the_next_request_is_served(oai, live_server):
    with pytest.raises(openai.BadRequestError) as e:
        ask(oai, "x", store=True)
    assert e.value.body["param"] == "store" and "not stored" in e.value.body["message"]
    r = httpx.post(live_server.url + "/v1/responses", json={"model": "m", "input": "x", "tools": [{"type": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].type"
    r = httpx.post(live_server.url + "/v1/responses", json={"model": "m", "input": "x", "max_output_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens", r.text  # its own name
    assert ask(oai, "Still there?").usage.output_tokens == 6
