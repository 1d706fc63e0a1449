"""Which after-generation states the likely next request can restore (PromptBuilder.restorable_after, issue 18).

The state after an answer is worth storing only when the next request starts with the prompt and exactly the
generated tokens. On Qwen3.5 that is a tool call (its results follow, and the template keeps the reasoning of
turns after the last user message), not a text answer with thinking on (the next user message drops its
reasoning) nor with thinking off (the empty think block of the generation prompt is not rendered in history).
"""

from __future__ import annotations

import pytest

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


@pytest.mark.parametrize("thinking", [True, False])
def test_a_tool_call_is_restorable_and_a_text_answer_is_not(runtime, thinking):
    pb, eng = runtime.prompts, runtime.engine
    eog = eng.tokenize("<|im_end|>")[0]
    kw = {"enable_thinking": thinking}
    prompt = pb.chat(MSGS, TOOLS, kw)
    check = pb.restorable_after(MSGS, TOOLS, kw, prompt)
    reasoning = "I should look it up.\n</think>\n\n" if thinking else ""
    call = eng.tokenize(reasoning + CALL) + [eog]
    assert check(call) == (14 if thinking else 16)  # the tool result's tokens around an empty content
    assert check(call[:-1]) == check(call) + 1  # cut by max_tokens before the end of turn: its own token is added
    assert check(eng.tokenize(reasoning + "It is sunny.") + [eog]) is None
    # A call whose spacing differs from the template's rendering is not restorable either: tokens must match.
    assert check(eng.tokenize(reasoning + CALL.replace("\n</parameter>", "</parameter>")) + [eog]) is None


def test_an_unfinished_tool_call_is_text_and_not_restorable(runtime):
    pb, eng = runtime.prompts, runtime.engine
    prompt = pb.chat(MSGS, TOOLS, {})
    check = pb.restorable_after(MSGS, TOOLS, {}, prompt)
    assert check(eng.tokenize("Let me see.\n</think>\n\nhalf a call <tool_call>\n<function=get_weather>")) is None


def test_a_conversation_the_template_rejects_is_not_restorable_and_does_not_raise(runtime):
    pb, eng = runtime.prompts, runtime.engine
    prompt = pb.chat(MSGS, TOOLS, {})
    check = pb.restorable_after([{"role": "user", "content": "x"}, {"role": "system", "content": "late"}], TOOLS,
                                {}, prompt)
    assert check(eng.tokenize(CALL)) is None


def test_over_http_a_text_answer_with_thinking_on_leaves_no_after_generation_work(runtime, client):
    """A chat answer that the next user turn would not restore is not re-prefilled: the cache keeps the prompt's
    KV to its end and nothing longer, and the answer equals its cold run."""
    runtime.scheduler.drain()
    runtime.cache.clear()
    stats = runtime.scheduler.reuse.after_stats
    before = (stats.unrestorable, stats.answer, stats.tokens)
    body = {"model": "m", "messages": MSGS, "max_tokens": 24, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": True}}
    warm = client.post("/v1/chat/completions", json=body).json()
    runtime.scheduler.drain()
    prompt_len = warm["usage"]["prompt_tokens"]
    kv_lengths = {len(tokens) for kind, _tier, tokens in runtime.cache.entries() if str(kind) == "kv"}
    assert kv_lengths == {prompt_len}  # the prompt's KV, to its end
    assert (stats.unrestorable, stats.answer) == (before[0] + 1, before[1])
    assert stats.tokens == before[2]  # nothing re-prefilled after generation
    cold = client.post("/v1/chat/completions", json=dict(body, cache_prompt=False)).json()
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]


def test_after_generation_counters_reach_metrics_and_cache_stats(runtime, client):
    runtime.scheduler.drain()
    text = client.get("/metrics").text
    stats = runtime.scheduler.reuse.after_stats
    assert f'orchestrator_after_generation_total{{outcome="unrestorable"}} {float(stats.unrestorable)}' in text
    assert f"orchestrator_after_generation_tokens_total {float(stats.tokens)}" in text
    assert client.get("/v1/cache/stats").json()["after_generation"]["unrestorable"] == stats.unrestorable
