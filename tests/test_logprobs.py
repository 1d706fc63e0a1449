"""logprobs and top_logprobs (issue 13, item 5): OpenAI's shapes on chat and completions, streamed and not, as
natural-log softmax of the raw logits the sampler saw; a cached run's logprobs equal the cold run's.
"""

from __future__ import annotations

import math

import numpy as np
import openai
import pytest

from orchestrator.request import Job, SamplingParams
from orchestrator.sampling import token_logprob

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three."}]


@pytest.fixture()
def oai(live_server):
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)


def chat(oai, cache=True, **kw):
    extra = dict(NO_THINK)
    if not cache:
        extra["cache_prompt"] = False
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return oai.chat.completions.create(model="m", messages=MSGS, extra_body=extra, **kw)


def entries(content):
    return [(e.token, bytes(e.bytes), e.logprob, [(t.token, bytes(t.bytes), t.logprob) for t in e.top_logprobs])
            for e in content]


def test_chat_logprobs_shape_and_values(oai, runtime, fresh_cache):
    r = chat(oai, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in content).decode() == r.choices[0].message.content
    for e in content:
        assert e.token == bytes(e.bytes).decode("utf-8", "replace") and e.logprob <= 0
        assert len(e.top_logprobs) == 3
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True) and sum(math.exp(x) for x in lps) <= 1 + 1e-9
        # greedy: the sampled token is the most likely one
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
    # the first step's values are the log-softmax of the raw first-step logits
    prompt = runtime.prompts.chat(MSGS, None, {"enable_thinking": False})
    res = runtime.scheduler.run(Job(prompt_tokens=prompt.tokens, max_tokens=1, use_cache=False, want_logits=True,
                                    sampling=SamplingParams(temperature=0.0)))
    x = res.first_logits.astype(np.float64)
    ref = x - x.max() - np.log(np.exp(x - x.max()).sum())
    assert content[0].logprob == pytest.approx(ref[res.completion_tokens[0]], abs=1e-9)
    assert [t.logprob for t in content[0].top_logprobs] == pytest.approx(sorted(ref)[::-1][:3], abs=1e-9)


def test_logprobs_off_by_default_and_top_zero(oai, fresh_cache):
    assert chat(oai).choices[0].logprobs is None
    r = chat(oai, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)


def test_cached_logprobs_equal_cold(oai, fresh_cache):
    first = chat(oai, logprobs=True, top_logprobs=5)
    warm = chat(oai, logprobs=True, top_logprobs=5)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    cold = chat(oai, cache=False, logprobs=True, top_logprobs=5)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert entries(warm.choices[0].logprobs.content) == entries(cold.choices[0].logprobs.content) \
        == entries(first.choices[0].logprobs.content)


def test_sampling_with_temperature_reports_the_raw_logits(oai, fresh_cache):
    """temperature and top_p change what is sampled, not the reported distribution."""
    greedy = chat(oai, logprobs=True, top_logprobs=2, max_tokens=1)
    hot = chat(oai, logprobs=True, top_logprobs=2, max_tokens=1, temperature=1.5, top_p=0.5, seed=3)
    g, h = greedy.choices[0].logprobs.content[0], hot.choices[0].logprobs.content[0]
    assert [(t.token, t.logprob) for t in g.top_logprobs] == [(t.token, t.logprob) for t in h.top_logprobs]


@pytest.mark.parametrize("stop", [None, ["zz"]])
def test_streamed_chat_logprobs_add_up_to_the_whole_answer(oai, fresh_cache, stop):
    whole = chat(oai, logprobs=True, top_logprobs=2, max_tokens=10, stop=stop)
    chunks = list(chat(oai, logprobs=True, top_logprobs=2, max_tokens=10, stop=stop, stream=True,
                       stream_options={"include_usage": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert entries(streamed) == entries(whole.choices[0].logprobs.content)
    for c in chunks:  # a chunk's logprobs cover tokens up to its text
        if c.choices and c.choices[0].logprobs and c.choices[0].delta.content:
            assert c.choices[0].delta.content in b"".join(
                bytes(e.bytes) for e in c.choices[0].logprobs.content).decode("utf-8", "replace")


def test_completions_logprobs_shape_offsets_and_stream(oai, fresh_cache):
    prompt = "One, two,"
    kw = dict(model="m", prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    r = oai.completions.create(**kw)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == r.choices[0].text
    offsets = [len(prompt) + len("".join(lp.tokens[:i])) for i in range(n)]
    assert lp.text_offset == offsets
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[tok] == value and 2 <= len(top) <= 3 and max(top.values()) == value  # greedy
    streamed = list(oai.completions.create(stream=True, **kw))
    parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [x for p in parts for x in p.token_logprobs] == lp.token_logprobs
    assert [x for p in parts for x in p.text_offset] == lp.text_offset
    zero = oai.completions.create(**dict(kw, logprobs=0)).choices[0].logprobs
    assert zero.token_logprobs == lp.token_logprobs and all(len(t) == 1 for t in zero.top_logprobs)
    cold = oai.completions.create(**kw, extra_body={"cache_prompt": False}).choices[0].logprobs
    assert cold.token_logprobs == lp.token_logprobs


@pytest.mark.parametrize("route,extra,param", [
    ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 1.5}, "top_logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": 2, "echo": True}, "logprobs"),
])
def test_bad_logprobs_are_400_naming_the_field(client, fresh_cache, route, extra, param):
    body = {"model": "m", "max_tokens": 2, **extra}
    body.update({"messages": MSGS} if route.endswith("chat/completions") else {"prompt": "hi"})
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_token_logprob_is_the_log_softmax():
    logits = np.array([1.0, 3.0, 2.0, 3.0], dtype=np.float32)
    e = token_logprob(logits, 2, k=3)
    ref = np.log(np.exp(logits.astype(np.float64)) / np.exp(logits.astype(np.float64)).sum())
    assert e.logprob == pytest.approx(ref[2]) and [t for t, _ in e.top] == [1, 3, 2]  # ties by id
    with pytest.raises(ValueError):
        token_logprob(logits, 4)
