"""n > 1 choices from one prefill (issue 13, item 6), over HTTP with the real openai client on the tiny model.

The prompt is prefilled (or restored) once and its state copied to n slots; choice i is sampled with seed + i, so
each choice equals the cold run (cache_prompt false, n = 1) of that seed: same text, same logprobs. Usage counts
the prompt once. Streams carry each choice's chunks with its `index`. n above --parallel - 1 is a 400 naming `n` (a slot is left to others).
The scheduling rules (slots, cancellation, failures) are unit-tested on the fake engine in test_scheduler.py.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from .conftest import serving

PARALLEL = 4  # n is at most PARALLEL - 1: one slot is left to other requests
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three animals."}]
PROMPT = "A list of animals: cat, dog,"
POINT = {"type": "object", "additionalProperties": False, "required": ["x", "label"],
         "properties": {"x": {"type": "integer"}, "label": {"type": "string", "maxLength": 8}}}


@pytest.fixture(scope="module")
def srv(tiny_model):
    with serving(tiny_model, parallel=PARALLEL) as (rt, server):
        yield rt, server


@pytest.fixture()
def oai(srv):
    return openai.OpenAI(base_url=srv[1].url + "/v1", api_key="unused", max_retries=0)


def chat(oai, cache=True, **kw):
    extra = dict(NO_THINK, **kw.pop("extra_body", {}))
    if not cache:
        extra["cache_prompt"] = False
    kw.setdefault("max_tokens", 8)
    return oai.chat.completions.create(model="m", messages=MSGS, extra_body=extra, **kw)


def lp(content) -> list:
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in content]


def assert_chat_choices_equal_cold(oai, r, n, seed, **kw):
    assert [c.index for c in r.choices] == list(range(n))
    colds = [chat(oai, cache=False, n=1, seed=seed + i, **kw) for i in range(n)]
    for c, cold in zip(r.choices, colds):
        assert c.message.content == cold.choices[0].message.content, f"choice {c.index}"
        assert c.finish_reason == cold.choices[0].finish_reason
        if kw.get("logprobs"):
            assert lp(c.logprobs.content) == lp(cold.choices[0].logprobs.content)
    assert r.usage.prompt_tokens == colds[0].usage.prompt_tokens  # the prompt counts once
    assert r.usage.completion_tokens == sum(c.usage.completion_tokens for c in colds)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    return colds


def test_chat_choices_each_equal_the_cold_run_of_seed_plus_index_and_reuse_the_cache(oai, srv):
    rt = srv[0]
    rt.scheduler.drain()
    rt.cache.clear()
    kw = dict(temperature=1.0, logprobs=True, top_logprobs=2)
    first = chat(oai, n=3, seed=7, **kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert_chat_choices_equal_cold(oai, first, 3, 7, **kw)
    assert len({c.message.content for c in first.choices}) > 1, "each choice samples with its own seed"
    rt.scheduler.drain()
    again = chat(oai, n=3, seed=7, **kw)  # restored once, then copied to the three slots
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert [c.message.content for c in again.choices] == [c.message.content for c in first.choices]
    assert_chat_choices_equal_cold(oai, again, 3, 7, **kw)


def test_greedy_choices_are_identical(oai):
    r = chat(oai, n=2, temperature=0)
    assert r.choices[0].message.content == r.choices[1].message.content
    assert r.usage.completion_tokens == 2 * chat(oai, temperature=0).usage.completion_tokens


def test_streamed_chat_choices_carry_their_index_and_equal_the_unstreamed_ones(oai):
    kw = dict(n=3, seed=21, temperature=1.0, logprobs=True, top_logprobs=1)
    whole = chat(oai, **kw)
    chunks = list(chat(oai, stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(len(c.choices) == 1 for c in chunks[:-1])
    for i, choice in enumerate(whole.choices):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
        streamed = [e for c in mine if c.logprobs for e in c.logprobs.content]
        assert lp(streamed) == lp(choice.logprobs.content)


def test_structured_output_holds_for_every_choice(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT, "strict": True}}
    kw = dict(temperature=1.0, max_tokens=60, response_format=fmt)
    r = chat(oai, n=2, seed=3, **kw)
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), POINT)
    assert_chat_choices_equal_cold(oai, r, 2, 3, **kw)


def completion(oai, cache=True, **kw):
    kw.setdefault("max_tokens", 8)
    return oai.completions.create(model="m", prompt=PROMPT, extra_body={} if cache else {"cache_prompt": False},
                                  **kw)


def test_completion_choices_equal_their_cold_runs_streamed_and_echoed(oai):
    kw = dict(temperature=1.0, logprobs=2)
    r = completion(oai, n=2, seed=40, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    colds = [completion(oai, cache=False, seed=40 + i, **kw) for i in range(2)]
    for c, cold in zip(r.choices, colds):
        assert c.text == cold.choices[0].text
        assert c.logprobs.model_dump() == cold.choices[0].logprobs.model_dump()
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.prompt_tokens == colds[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(c.usage.completion_tokens for c in colds)
    chunks = list(completion(oai, n=2, seed=40, stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    for i, c in enumerate(r.choices):
        mine = [ch.choices[0] for ch in chunks[:-1] if ch.choices[0].index == i]
        assert "".join(m.text for m in mine) == c.text
        assert [t for m in mine if m.logprobs for t in m.logprobs.tokens] == c.logprobs.tokens
        assert [o for m in mine if m.logprobs for o in m.logprobs.text_offset] == c.logprobs.text_offset
    echoed = list(completion(oai, n=2, seed=40, temperature=1.0, echo=True, stream=True))
    for i, c in enumerate(r.choices):
        assert "".join(ch.choices[0].text for ch in echoed if ch.choices[0].index == i) == PROMPT + c.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("n", [PARALLEL, 0, -1, True, 1.5])
def test_n_outside_1_to_parallel_minus_1_is_400_naming_n(srv, path, n):
    body = {"model": "m", "max_tokens": 2, "n": n}
    body.update({"messages": MSGS} if path.endswith("chat/completions") else {"prompt": PROMPT})
    r = httpx.post(srv[1].url + path, json=body, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "n" and err["type"] == "invalid_request_error"
    if n == PARALLEL:
        assert f"--parallel {PARALLEL}" in err["message"] and "left to other requests" in err["message"]
