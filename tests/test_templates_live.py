"""Boundary detection on other families' templates at the model level: the tiny model served with another
template (--chat-template-file), each request compared with a cold run, and the hit checked exactly: the
deepest stored snapshot (a boundary of the earlier request, or its whole prompt) whose tokens prefix the new
prompt."""

import pytest

from orchestrator.runtime import Runtime

from .conftest import assert_same_as_cold, make_config
from .test_boundaries import TEMPLATES

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SYSTEM = {"role": "system", "content": "You answer weather questions in one short sentence. " * 5}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
RESULT = {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny, 21 C"}

NAMES = ["meta-llama-Llama-3.1-8B-Instruct", "mistralai-Mistral-Nemo-Instruct-2407", "google-gemma-2-2b-it",
         "openai-gpt-oss-120b", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "ibm-granite-granite-4.0"]
NO_TOOL_TURNS = {"google-gemma-2-2b-it"}  # alternating user/assistant only, no system role
# DeepSeek's markers (<｜Assistant｜>) are plain text in the tiny model's Qwen vocabulary, so BPE merges across
# the end of the last message differ once more text follows: the token check drops that boundary.
TEXT_MARKERS = {"deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"}


@pytest.fixture(scope="module", params=NAMES)
def served(request, tiny_model):
    rt = Runtime.start(make_config(tiny_model, chat_template=TEMPLATES / f"{request.param}.jinja"))
    yield request.param, rt
    rt.close()


def expected_hit(first, second, m: int) -> int:
    """The deepest checkpoint the first request stored (its boundaries and its prompt end) that prefixes the
    second prompt and leaves m = min_segment tokens to prefill (or is the whole second prompt: a repeat)."""
    n = len(first.tokens)
    stored, pos = [first.result.cached_tokens], first.result.cached_tokens
    for b in sorted(set(first.boundaries.positions(n))):  # the scheduler's segment rule
        if b - pos >= m and n - b >= m:
            stored.append(b)
            pos = b
    stored.append(n)
    if first.tokens == second.tokens:
        return n
    shared = [p for p in stored if p <= len(second.tokens) - m and first.tokens[:p] == second.tokens[:p]]
    return max(shared, default=0)


def test_turns_hit_the_detected_boundaries_and_equal_cold_runs(served):
    name, rt = served
    rt.cache.clear()
    if name in NO_TOOL_TURNS:
        turns = [[{"role": "user", "content": "Weather in Paris?"}],
                 [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And Oslo?"}]]
        tools = None
    else:
        turns = [[SYSTEM, {"role": "user", "content": "Weather in Paris?"}], [CALL, RESULT],
                 [{"role": "assistant", "content": "It is sunny in Paris."}, {"role": "user", "content": "And Oslo?"}]]
        tools = TOOLS
    msgs, prev = [], None
    for turn in turns:
        msgs = msgs + turn
        cur = assert_same_as_cold(rt, msgs, tools, max_tokens=4)
        found = [e for e in cur.boundaries.message_ends if e is not None]
        assert found and (cur.boundaries.message_ends[-1] is not None or name in TEXT_MARKERS)
        if prev is None:
            assert cur.result.cached_tokens == 0
        else:
            # The earlier request's last boundary is a token prefix of this prompt (it was append-checked) ...
            end = max(e for e in prev.boundaries.message_ends if e is not None)
            assert prev.tokens[:end] == cur.tokens[:end]
            # ... and the hit is exactly the deepest stored snapshot that prefixes this prompt.
            m = rt.scheduler.min_segment
            assert cur.result.cached_tokens == expected_hit(prev, cur, m) >= min(end, len(prev.tokens) - m)
        prev = cur
        rt.cache.check()
