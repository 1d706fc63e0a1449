"""OpenAI's wire format as agent clients read it, on a live server (tiny model), through the official openai
client where one applies: the streaming usage chunk, echo while streaming, tool results bound to their calls by
id, leading system and developer messages, GET /v1/models/{id}, max_completion_tokens, and the counters of
refused and failed requests. Every cached answer is compared with the same request run cold (cache_prompt
false)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from orchestrator.request import Job, SamplingParams
from server.protocols.openai_chat import parse_chat

from .conftest import LiveServer

TEMPLATES = Path(__file__).resolve().parent / "templates"
SYSTEM = "You are a weather desk assistant. Use the tools, then answer in one sentence. " * 3
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALLS = [{"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}}]
RESULTS = {"call_a": "Paris: 18 C, light rain, wind 12 km/h from the west.",
           "call_b": "Oslo: 21:40 local time (CET), Tuesday."}


@pytest.fixture()
def oai(live_server):
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def sse(client: httpx.Client, path: str, body: dict) -> list:
    """The `data:` payloads of a stream, [DONE] last."""
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# ------------------------------------------------------------------ item 1: streaming usage, echo

@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_usage_arrives_in_a_last_chunk_without_choices_as_openai_sends_it(client, path):
    body = {"model": "m", "max_tokens": 5, "temperature": 0, "stream": True}
    body.update({"messages": [{"role": "user", "content": "Name a colour."}]} if path.endswith("chat/completions")
                else {"prompt": "Colours: red, green,"})
    with_usage = sse(client, path, {**body, "stream_options": {"include_usage": True}})
    # every chunk but the last carries "usage": null; the finish_reason chunk is the one before the usage chunk
    assert all("usage" in c and c["usage"] is None for c in with_usage[:-1])
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["usage"]["completion_tokens"] == 5
    timings = with_usage[-1]["timings"]  # the breakdown a non-streamed body carries
    assert timings["ttft_ms"] >= timings["prefill_ms"] > 0 and timings["total_ms"] >= timings["ttft_ms"]
    assert timings["cache_source"] in ("none", "live", "ram", "disk") and timings["snapshots_saved"] >= 0
    assert with_usage[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in with_usage[:-2])
    assert len({c["id"] for c in with_usage}) == 1
    without = sse(client, path, body)
    assert all("usage" not in c and c["choices"] for c in without)
    assert without[-1]["choices"][0]["finish_reason"] == "length"


def test_openai_client_reads_usage_from_the_choiceless_chunk(oai):
    stream = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Name a fruit."}],
                                         max_tokens=4, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    stream = oai.completions.create(model="m", prompt="Fruits: apple, pear,", max_tokens=4, temperature=0,
                                    stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-2].choices[0].finish_reason == "length"


def test_echo_while_streaming_sends_the_prompt_first(oai):
    prompt = "The seven colours of the rainbow are"
    plain = oai.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0)
    echoed = oai.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0, echo=True)
    chunks = list(oai.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                         stream=True))
    assert chunks[0].choices[0].text == prompt
    streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == echoed.choices[0].text == prompt + plain.choices[0].text
    assert len(plain.choices[0].text) > 0


# ------------------------------------------------------------------ item 2: tool results bound by id

def tool_turn(order: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is the weather in Paris, and what time is it in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": CALLS},
            *({"role": "tool", "tool_call_id": f"call_{k}", "content": RESULTS[f"call_{k}"]} for k in order)]


def test_tool_results_in_any_order_give_the_same_prompt_answer_and_a_full_cache_hit(oai, runtime):
    runtime.cache.clear()
    prompts = {order: runtime.prompts.chat(*(lambda r: (r.messages, r.tools, r.template_kwargs))(
        parse_chat({"messages": tool_turn(order), "tools": TOOLS}))) for order in ("ab", "ba")}
    assert prompts["ab"].tokens == prompts["ba"].tokens  # results rendered in call order
    assert prompts["ab"].text.index(RESULTS["call_a"]) < prompts["ab"].text.index(RESULTS["call_b"])

    def ask(order: str, cache: bool = True):
        return oai.chat.completions.create(model="m", messages=tool_turn(order), tools=TOOLS, max_tokens=8,
                                           temperature=0, extra_body={"cache_prompt": cache})

    ab = ask("ab")  # completion order == call order: stores the prompt's snapshots
    ba = ask("ba")  # call b finished first
    again = ask("ab")  # an exact repeat: the most a request can restore
    cold = ask("ba", cache=False)
    assert ab.usage.prompt_tokens == ba.usage.prompt_tokens == len(prompts["ab"].tokens)
    assert cached(ab.usage) == 0 and cached(cold.usage) == 0
    assert cached(ba.usage) == cached(again.usage) > ba.usage.prompt_tokens - 16
    assert ab.choices[0].message == ba.choices[0].message == again.choices[0].message == cold.choices[0].message


@pytest.mark.parametrize("results,param", [
    (["c", "a"], "messages[3].tool_call_id"),  # an id no call has
    (["b", "b"], "messages[4].tool_call_id"),  # the same call answered twice
    (["b"], "messages[2].tool_calls[0].id"),  # call a left without a result
], ids=["unknown id", "answered twice", "incomplete"])
def test_tool_results_that_do_not_match_the_calls_are_400_naming_the_message(oai, runtime, results, param):
    messages = tool_turn("") + [{"role": "tool", "tool_call_id": f"call_{k}", "content": "x"} for k in results]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=2)
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error"


# ------------------------------------------------------------------ item 3: system and developer messages

def test_leading_system_and_developer_messages_are_merged_with_a_blank_line(oai, runtime):
    runtime.cache.clear()
    user = {"role": "user", "content": "Is it going to rain in Paris?"}
    split = [{"role": "system", "content": SYSTEM}, {"role": "developer", "content": "Answer in French."},
             {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, user]
    merged = [{"role": "system", "content": SYSTEM + "\n\nAnswer in French.\n\nBe brief."}, user]
    req = parse_chat({"messages": split})
    assert req.messages == merged
    assert runtime.prompts.chat(req.messages, None, {}).tokens == runtime.prompts.chat(merged, None, {}).tokens

    def ask(messages, cache=True):
        return oai.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"cache_prompt": cache})

    one = ask(merged)
    three = ask(split)
    cold = ask(split, cache=False)
    assert one.usage.prompt_tokens == three.usage.prompt_tokens
    assert cached(three.usage) > three.usage.prompt_tokens - 16  # the same tokens: restored, as a repeat
    assert one.choices[0].message == three.choices[0].message == cold.choices[0].message


def test_a_breakpoint_in_a_merged_system_message_moves_with_its_text():
    part = {"type": "text", "text": "Second.", "prompt_cache_breakpoint": {"mode": "explicit"}}
    req = parse_chat({"messages": [{"role": "system", "content": "First."}, {"role": "developer", "content": [part]},
                                   {"role": "user", "content": "hi"}]})
    assert req.messages[0]["content"] == "First.\n\nSecond."
    assert req.cache_breakpoints == ((0, len("First.\n\nSecond.")),)


def test_a_later_system_message_is_a_user_turn_where_the_template_refuses_it(oai, runtime):
    """Qwen3.5's template raises on a system message after the first: it is rendered as a user message where it
    stands (late_system_as_user), its text in the prompt, the prompt before it unchanged."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."},
                {"role": "assistant", "content": "Hello."}, {"role": "system", "content": "Now answer in French."},
                {"role": "user", "content": "Weather?"}]
    r = oai.chat.completions.create(model="m", messages=messages, max_tokens=2)
    as_user = [dict(m, role="user") if i == 3 else m for i, m in enumerate(messages)]
    prompt = runtime.prompts.chat(parse_chat({"messages": as_user}).messages, None, {})
    assert "<|im_start|>user\nNow answer in French.<|im_end|>" in prompt.text
    assert r.usage.prompt_tokens == len(prompt.tokens)
    before = runtime.prompts.chat(parse_chat({"messages": messages[:3] + [messages[4]]}).messages, None, {})
    end = before.boundaries.message_ends[2]
    assert prompt.tokens[:end] == before.tokens[:end]


def test_a_later_system_message_is_rendered_where_the_template_supports_it(start, tiny_model):
    """Qwen3's template writes a system turn anywhere in the conversation. This server also has a model id with
    a slash, as Hugging Face names go, which GET /v1/models/{id} serves."""
    rt = start(chat_template=TEMPLATES / "Qwen-Qwen3-0.6B.jinja", model_alias="Qwen/Qwen3-test")
    srv = LiveServer(rt)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        late = "Now answer in French."
        messages = [{"role": "system", "content": SYSTEM}, {"role": "developer", "content": "Be brief."},
                    {"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
                    {"role": "developer", "content": late}, {"role": "user", "content": "Weather?"}]
        req = parse_chat({"messages": messages})
        text = rt.prompts.chat(req.messages, None, {}).text
        assert f"<|im_start|>system\n{SYSTEM}\n\nBe brief.<|im_end|>" in text
        assert f"<|im_start|>system\n{late}<|im_end|>" in text
        warm = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)
        cold = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0,
                                              extra_body={"cache_prompt": False})
        assert warm.choices[0].message == cold.choices[0].message
        assert client.models.retrieve("Qwen/Qwen3-test").id == "Qwen/Qwen3-test"
    finally:
        srv.stop()


# ------------------------------------------------------------------ item 8: models, max_completion_tokens

def test_get_model_by_id_and_404_for_another(oai, runtime):
    model = oai.models.retrieve(runtime.model_id)
    assert model.id == runtime.model_id and model.object == "model"
    assert model == oai.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("gpt-nothing")
    assert e.value.body["code"] == "model_not_found" and e.value.body["type"] == "invalid_request_error"
    assert "gpt-nothing" in e.value.body["message"]


def test_max_completion_tokens_wins_over_max_tokens(oai):
    messages = [{"role": "user", "content": "Count to twenty."}]
    for max_tokens, max_completion_tokens in ((2, 5), (5, 2)):
        r = oai.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=max_tokens,
                                        max_completion_tokens=max_completion_tokens)
        assert r.usage.completion_tokens == max_completion_tokens and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:  # both are checked, even the one that loses
        oai.chat.completions.create(model="m", messages=messages, max_tokens=0, max_completion_tokens=2)
    assert e.value.body["param"] == "max_tokens"


# ------------------------------------------------------------------ item 9: refused and failed requests

def errors(base_url: str, **headers) -> dict[tuple[str, str, str], float]:
    out = {}
    for line in httpx.get(base_url + "/metrics", headers=headers, timeout=60).text.splitlines():
        if line.startswith("orchestrator_request_errors_total{"):
            labels, value = line[len("orchestrator_request_errors_total{"):].rsplit("} ", 1)
            kv = dict(item.split("=", 1) for item in labels.split(","))
            out[(kv["route"].strip('"'), kv["status"].strip('"'), kv["code"].strip('"'))] = float(value)
    return out


def test_refused_requests_are_counted_by_route_status_and_code_and_logged(client, live_server, caplog):
    before = errors(live_server.url)
    caplog.set_level("INFO", logger="orchestrator.server")
    client.post("/v1/chat/completions", json={"messages": []})
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x " * 20000}]})
    client.post("/v1/completions", content=b"prompt=x", headers={"content-type": "text/plain"})
    client.get("/v1/models/nope")
    client.get("/v1/no-such-route")
    after = errors(live_server.url)
    expected = {("/v1/chat/completions", "400", "invalid_request_error"): 1,
                ("/v1/chat/completions", "400", "context_length_exceeded"): 1,
                ("/v1/completions", "415", "invalid_request_error"): 1,
                ("/v1/models/{model_id}", "404", "model_not_found"): 1, ("unmatched", "404", "not_found"): 1}
    for key, n in expected.items():
        assert after.get(key, 0) - before.get(key, 0) == n, (key, after)
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused ")]
    assert len(refusals) == 5 and "status=400 code=context_length_exceeded" in refusals[1]


def test_unmatched_route_and_method_name_their_code_in_the_body_as_the_counter_does(client, live_server):
    before = errors(live_server.url)
    r = client.get("/v1/no-such-route")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    after = errors(live_server.url)
    for code, status in (("not_found", "404"), ("method_not_allowed", "405")):
        assert after.get(("unmatched", status, code), 0) - before.get(("unmatched", status, code), 0) == 1


def test_429_504_and_client_disconnects_are_counted(start, tiny_model):
    rt = start(parallel=1, queue_size=1, timeout=2.0)
    srv = LiveServer(rt)
    try:
        gate = threading.Event()
        # hold the only slot: a job whose sink blocks the worker until released
        rt.scheduler.submit(Job(rt.engine.tokenize("hold the slot " * 8), max_tokens=64,
                                sampling=SamplingParams(temperature=0.0), timeout_s=0),
                            lambda ev: gate.wait(120) if ev.kind == "text" else None)
        body = {"model": "m", "prompt": "one two three four", "max_tokens": 2, "temperature": 0}
        queued: list[httpx.Response] = []
        t = threading.Thread(target=lambda: queued.append(httpx.post(srv.url + "/v1/completions", json=body,
                                                                     timeout=120)))
        t.start()
        deadline = time.time() + 60
        while httpx.get(srv.url + "/health").json()["queue_length"] < 1:
            assert time.time() < deadline
            time.sleep(0.05)
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 429
        time.sleep(2.5)  # the queued request runs past --timeout (2 s) while the slot is held
        gate.set()  # the worker goes on, and finds it expired
        t.join(120)
        assert queued[0].status_code == 504
        long = {"model": "m", "prompt": "count slowly: one two three", "max_tokens": 3000, "temperature": 0}
        with httpx.stream("POST", srv.url + "/v1/completions", json=dict(long, stream=True), timeout=60) as r:
            assert next(r.iter_lines()).startswith("data: ")  # then the client goes away mid-stream
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json=long, timeout=httpx.Timeout(60, read=1.0))
        deadline = time.time() + 60
        while errors(srv.url).get(("/v1/completions", "499", "cancelled"), 0) < 2:
            assert time.time() < deadline, errors(srv.url)
            time.sleep(0.1)
        counts = errors(srv.url)
        assert counts[("/v1/completions", "429", "queue_full")] == 1
        assert counts[("/v1/completions", "504", "timeout")] == 1
        assert counts[("/v1/completions", "499", "cancelled")] == 2
    finally:
        gate.set()
        srv.stop()
