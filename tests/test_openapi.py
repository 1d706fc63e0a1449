"""/openapi.json describes the real API, and a bounded schemathesis run against a live server on loopback finds
no 5xx, no undocumented status code and no response that violates the published schema."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                 status_code_conformance)

from server.docs import openapi_schema
from server.protocols.anthropic import COUNT_TOKENS, MESSAGES
from server.protocols.anthropic import FIELDS as ANTHROPIC_FIELDS
from server.fields import REFUSED
from server.protocols.responses import FIELDS as RESPONSES_FIELDS
from server.protocols.openai import CHAT, COMPLETION, FIELDS

from .conftest import serving


@pytest.fixture(scope="module")
def fuzz_server(tiny_model):
    """Small limits keep every generated request cheap: at most 4 completion tokens, 4 messages, 2,048 context."""
    with serving(tiny_model, ctx_size=2048, cache_ram_mib=64, max_tokens_limit=4, max_messages=4,
                 max_body_mib=1) as served:
        yield served


def test_published_request_fields_are_exactly_the_accepted_ones(fuzz_server):
    rt, srv = fuzz_server
    doc = httpx.get(srv.url + "/openapi.json").json()
    assert doc == openapi_schema(rt.config)
    schemas = doc["components"]["schemas"]
    for name, endpoint in (("ChatCompletionRequest", CHAT), ("CompletionRequest", COMPLETION)):
        assert set(schemas[name]["properties"]) == {f for f, eps in FIELDS.items() if endpoint in eps}
        assert schemas[name]["additionalProperties"] is False
    for name, route in (("MessagesRequest", MESSAGES), ("CountTokensRequest", COUNT_TOKENS)):
        assert set(schemas[name]["properties"]) == {f for f, routes in ANTHROPIC_FIELDS.items() if route in routes}
        assert schemas[name]["additionalProperties"] is False
    assert set(schemas["ResponsesRequest"]["properties"]) == {f for f, r in RESPONSES_FIELDS.items()
                                                              if r.kind != REFUSED}
    assert schemas["ResponsesRequest"]["additionalProperties"] is False
    # any positive budget is accepted: generation is capped by --max-tokens-limit, not the request refused
    assert schemas["ChatCompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 2 ** 31 - 1
    assert schemas["MessagesRequest"]["properties"]["max_tokens"]["maximum"] == 2 ** 31 - 1
    routes = {r.path.replace(":path", "") for r in srv.server.config.app.routes}
    assert set(doc["paths"]) == routes


def test_schemathesis_finds_no_server_errors_or_schema_violations(fuzz_server):
    rt, srv = fuzz_server
    schema = schemathesis.openapi.from_dict(httpx.get(srv.url + "/openapi.json").json())
    strategies = []
    for result in schema.get_all_operations():
        op = result.ok()
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.method.upper() == "POST" else [])
        strategies += [op.as_strategy(generation_mode=m) for m in modes]
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    statuses: dict[tuple[str, int], int] = {}

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(strategies))
    def fuzz(case):
        response = case.call_and_validate(base_url=srv.url, checks=checks, timeout=120)
        key = (case.path, response.status_code)
        statuses[key] = statuses.get(key, 0) + 1

    fuzz()
    for path in ("/v1/chat/completions", "/v1/completions"):  # both generated and refused, on both endpoints
        assert statuses.get((path, 200), 0) > 0 and statuses.get((path, 400), 0) > 0, statuses
    assert statuses.get(("/v1/messages", 400), 0) > 0, statuses
    # Answers the fuzzer rarely reaches (most generated conversations end with an assistant message, which
    # /v1/messages refuses), validated against the document the same way.
    ops = {(r.ok().method.upper(), r.ok().path): r.ok() for r in schema.get_all_operations()}
    history = {"model": "m", "max_tokens": 3, "system": [{"type": "text", "text": "Be brief.",
                                                          "cache_control": {"type": "ephemeral"}}],
               "tools": [{"name": "f", "input_schema": {"type": "object"}}],
               "messages": [{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                                               "input": {}}]},
                            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                          "content": "ok"}]}]}
    cases = [(("POST", "/v1/messages"), {"body": history}, 200),
             (("POST", "/v1/messages"), {"body": dict(history, stream=True)}, 200),
             (("POST", "/v1/messages/count_tokens"), {"body": {k: history[k] for k in ("model", "messages")}}, 200),
             (("GET", "/v1/models/{model_id}"), {"path_parameters": {"model_id": rt.model_id}}, 200),
             (("GET", "/v1/models/{model_id}"), {"path_parameters": {"model_id": "other"}}, 404)]
    for key, kwargs, status in cases:
        case = ops[key].Case(media_type="application/json" if "body" in kwargs else None, **kwargs)
        assert case.call_and_validate(base_url=srv.url, checks=checks, timeout=120).status_code == status, key
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"
    rt.scheduler.drain()
    rt.cache.check()
