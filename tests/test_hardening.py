"""Input limits, request fields, content types and authentication on live servers (tiny model).

Every refusal is an OpenAI-style 4xx naming the field, and the next request is served normally.
"""

from __future__ import annotations

import argparse
import json

import anthropic
import httpx
import openai
import pytest

from orchestrator import cli
from orchestrator.runtime import Runtime
from server.protocols.openai import DEFAULT_ONLY, FIELDS

from .conftest import LiveServer, make_config

KEY = "sk-test-0123456789"
MSGS = [{"role": "system", "content": "You answer in one word. " * 8}, {"role": "user", "content": "Colour of grass?"}]


@pytest.fixture(scope="module")
def limited(tiny_model):
    """A server with small limits and an API key."""
    rt = Runtime.start(make_config(tiny_model, ctx_size=4096, cache_ram_mib=256, api_key=KEY, max_body_mib=1,
                                   max_messages=6, max_tokens_limit=16))
    srv = LiveServer(rt)
    yield rt, srv
    srv.stop()
    rt.close()


@pytest.fixture()
def authed(limited):
    _rt, srv = limited
    with httpx.Client(base_url=srv.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def chat(**kw):
    return {"model": "tiny", "messages": MSGS, "max_tokens": 4, "temperature": 0, **kw}


def assert_error(r: httpx.Response, status: int, param) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    return err


# ------------------------------------------------------------------ request fields

ACCEPTED = [  # what OpenAI-compatible clients send, with values the server honours or that are defaults
    {"n": 1}, {"logprobs": False}, {"top_logprobs": 0}, {"presence_penalty": 0}, {"frequency_penalty": 0.0},
    {"logit_bias": {}}, {"response_format": {"type": "text"}}, {"store": False}, {"service_tier": "auto"},
    {"user": "u-1"}, {"safety_identifier": "s-1"}, {"prompt_cache_key": "k-1"}, {"cache_salt": "tenant-a"},
    {"cache_prompt": True}, {"stream_options": None}, {"parallel_tool_calls": False}, {"tool_choice": "auto"},
    {"tool_choice": "none"}, {"chat_template_kwargs": {"enable_thinking": False}}, {"metadata": {"a": "b"}},
    {"max_completion_tokens": 3}, {"top_p": 0.9, "top_k": 20, "min_p": 0.0, "seed": 7}, {"stop": ["\n\n"]},
    {"n": None, "logprobs": None, "reasoning_effort": None, "stream": None, "temperature": None},
    # hints and effort (server/fields.py): the hosted API takes them and they change nothing here or map to the
    # thinking switch (pi sends reasoning_effort "medium" with store false: tests/fixtures/captures/pi/)
    {"store": True}, {"service_tier": "flex"}, {"reasoning_effort": "low"}, {"reasoning_effort": "none"},
    {"reasoning_effort": "medium", "store": False},
    {"top_k": -1},  # vLLM's "off" (its default), which LiteLLM/LangChain users pass through to it
]


@pytest.mark.parametrize("extra", ACCEPTED, ids=lambda e: ",".join(e))
def test_fields_clients_send_are_accepted(authed, extra):
    r = authed.post("/v1/chat/completions", json=chat(**extra))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


REFUSED = [  # (extra fields, the field the error must name)
    ({"foo": 1}, "foo"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"n": 2}, "n"),
    ({"n": True}, "n"),
    ({"logprobs": 3}, "logprobs"),  # chat takes true/false
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema"),
    ({"store": "yes"}, "store"),
    ({"service_tier": 3}, "service_tier"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"echo": True}, "echo"),  # a /v1/completions field
    ({"cache_salt": 5}, "cache_salt"),
    ({"user": "x" * 2000}, "user"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_k": -2}, "top_k"),
    ({"messages": [{"role": "user", "content": "hi"}] * 7}, "messages"),  # above --max-messages 6
]


@pytest.mark.parametrize("extra,param", REFUSED, ids=[",".join(e) + "=" + str(p) for e, p in REFUSED])
def test_unsupported_fields_and_values_are_400_naming_the_field(limited, authed, extra, param):
    rt, _srv = limited
    authed.post("/v1/chat/completions", json=chat())
    rt.scheduler.drain()
    before = rt.cache.stats()
    err = assert_error(authed.post("/v1/chat/completions", json=chat(**extra)), 400, param)
    assert err["type"] == "invalid_request_error"
    rt.scheduler.drain()
    assert rt.cache.stats().inserts == before.inserts
    again = authed.post("/v1/chat/completions", json=chat())
    assert again.status_code == 200 and again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_max_tokens_is_capped_and_a_null_max_completion_tokens_falls_back_to_max_tokens(authed):
    r = authed.post("/v1/chat/completions", json=chat(max_tokens=2, max_completion_tokens=None)).json()
    assert r["usage"]["completion_tokens"] <= 2
    r = authed.post("/v1/chat/completions", json={k: v for k, v in chat().items() if k != "max_tokens"}).json()
    assert r["usage"]["completion_tokens"] <= 16  # no budget: until the context is full, capped by the limit


@pytest.mark.parametrize("body", [{"max_tokens": 128000}, {"max_completion_tokens": 2 ** 31 - 1}])
def test_a_budget_above_the_servers_cap_is_served_up_to_it_and_ends_with_length(authed, body):
    """Claude Code asks for 128,000 tokens, opencode for 32,000: served, as llama-server does, never refused."""
    r = authed.post("/v1/chat/completions", json={**chat(), **body})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16 and r.json()["choices"][0]["finish_reason"] == "length"


def test_completions_refuse_chat_fields_and_non_default_values(authed):
    body = {"prompt": "one two three", "max_tokens": 3, "temperature": 0}
    assert authed.post("/v1/completions", json={**body, "best_of": 1, "suffix": "", "echo": False}).status_code == 200
    assert_error(authed.post("/v1/completions", json={**body, "messages": MSGS}), 400, "messages")
    assert_error(authed.post("/v1/completions", json={**body, "chat_template_kwargs": {}}), 400,
                 "chat_template_kwargs")
    assert_error(authed.post("/v1/completions", json={**body, "best_of": 3}), 400, "best_of")
    assert_error(authed.post("/v1/completions", json={**body, "suffix": "end"}), 400, "suffix")
    assert_error(authed.post("/v1/completions", json={**body, "logprobs": 21}), 400, "logprobs")
    assert_error(authed.post("/v1/completions", json={**body, "logprobs": 1, "echo": True}), 400, "logprobs")


def test_every_default_only_field_is_an_accepted_field():
    assert set(DEFAULT_ONLY) <= set(FIELDS)


def test_openai_client_defaults_work_and_extras_are_refused_by_name(limited):
    _rt, srv = limited
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0, n=1,
                                       user="u", extra_body={"cache_salt": "t1", "prompt_cache_key": "k"})
    assert r.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, extra_body={"mirostat": 2})
    assert e.value.body["param"] == "mirostat"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).models.list()


# ------------------------------------------------------------------ body size and content type

def test_body_over_the_size_limit_is_413_and_the_next_request_is_served(authed):
    big = chat(messages=[{"role": "user", "content": "x" * (1 << 20)}])
    err = assert_error(authed.post("/v1/chat/completions", json=big), 413, None)
    assert err["code"] == "request_too_large" and "--max-body-size" in err["message"]

    def chunks():  # no Content-Length: the cap applies while reading
        for _ in range(40):
            yield b" " * 65536

    r = authed.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413, None)
    assert authed.post("/v1/chat/completions", json=chat()).status_code == 200


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x"])
def test_non_json_content_type_is_415(authed, ctype):
    r = authed.post("/v1/chat/completions", content=b'{"messages": []}', headers={"content-type": ctype})
    assert_error(r, 415, "Content-Type")
    assert authed.post("/v1/chat/completions", json=chat()).status_code == 200


@pytest.mark.parametrize("ctype", [None, "application/json; charset=utf-8", "application/vnd.api+json"])
def test_json_content_types_and_none_are_accepted(authed, ctype):
    headers = {} if ctype is None else {"content-type": ctype}
    r = authed.post("/v1/chat/completions", content=json.dumps(chat()).encode(), headers=headers)
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ authentication

@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("GET", "/v1/models/tiny"), ("GET", "/metrics"),
                                         ("GET", "/v1/cache/stats"),
                                         ("GET", "/openapi.json"), ("POST", "/v1/chat/completions"),
                                         ("POST", "/v1/completions"), ("POST", "/v1/cache/flush")])
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", "Bearer", f"{KEY}"])
def test_every_endpoint_but_health_needs_the_key(limited, method, path, auth):
    rt, srv = limited
    rt.scheduler.drain()  # an earlier test's after-generation snapshot may still be landing
    before = len(rt.cache.entries())
    headers = {} if auth is None else {"Authorization": auth}
    r = httpx.request(method, srv.url + path, headers=headers, json=chat(), timeout=60)
    err = assert_error(r, 401, None)
    assert err["code"] == "invalid_api_key" and KEY not in r.text
    assert len(rt.cache.entries()) == before  # a refused flush flushed nothing
    assert httpx.get(srv.url + "/health", timeout=60).status_code == 200


def test_the_right_key_opens_every_endpoint_and_flush_empties_the_cache(limited, authed):
    rt, _srv = limited
    for path in ("/v1/models", "/metrics", "/v1/cache/stats", "/openapi.json"):
        assert authed.get(path).status_code == 200, path
    lower = httpx.get(authed.base_url.join("/v1/models"), headers={"Authorization": f"bearer {KEY}"})
    assert lower.status_code == 200  # the scheme is case-insensitive
    authed.post("/v1/chat/completions", json=chat())
    rt.scheduler.drain()
    assert rt.cache.entries()
    r = authed.post("/v1/cache/flush")
    assert r.status_code == 200 and r.json()["flushed_entries"] > 0
    assert rt.cache.entries() == []
    rt.cache.check()
    again = authed.post("/v1/chat/completions", json=chat())  # nothing of before: no entry, no live state
    assert again.status_code == 200 and again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_anthropic_routes_take_the_key_as_x_api_key_and_refuse_in_their_shape(limited):
    _rt, srv = limited
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(srv.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60).status_code == 200
    for headers in ({}, {"x-api-key": "wrong"}, {"x-api-key": KEY + "x"}):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = httpx.post(srv.url + path, json=body, headers=headers, timeout=60)
            assert r.status_code == 401 and KEY not in r.text
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    r = anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0).messages.create(
        model="m", max_tokens=2, messages=body["messages"])
    assert r.usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=2, messages=body["messages"])


def test_flush_is_off_without_a_key(client, runtime):
    client.post("/v1/chat/completions", json=chat())
    runtime.scheduler.drain()
    n = len(runtime.cache.entries())
    assert_error(client.post("/v1/cache/flush"), 403, None)
    assert len(runtime.cache.entries()) == n > 0
    assert client.get("/v1/models").status_code == 200  # no key configured: no authentication


def _parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers())
    return cli._config(parser.parse_args(["serve", *argv]))


def test_cli_limits_and_api_key_flag_and_environment(monkeypatch):
    cfg = _parse(["--api-key", "abc", "--max-body-size", "2", "--max-messages", "9", "--max-tokens-limit", "99",
                  "--cache-ram", "1"])
    assert (cfg.api_key, cfg.max_body_bytes, cfg.max_messages, cfg.max_tokens_limit) == ("abc", 2 << 20, 9, 99)
    monkeypatch.setenv("ORCHESTRATOR_API_KEY", "from-env")
    assert _parse(["--cache-ram", "1"]).api_key == "from-env"
    monkeypatch.delenv("ORCHESTRATOR_API_KEY")
    assert _parse(["--cache-ram", "1"]).api_key is None
    with pytest.raises(SystemExit):
        _parse(["--api-key", " "])


def test_binding_beyond_loopback_without_a_key_warns():
    from orchestrator.config import Config
    assert "without --api-key" in cli.bind_warning(Config(host="0.0.0.0", cache_ram_mib=0))
    assert cli.bind_warning(Config(host="0.0.0.0", api_key="k", cache_ram_mib=0)) is None
    assert cli.bind_warning(Config(host="127.0.0.1", cache_ram_mib=0)) is None
