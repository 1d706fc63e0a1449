"""Cache on equals cache off: same greedy tokens and bit-identical first-step logits, on the tiny Qwen3.5.

Each scenario also checks cached_tokens exactly against the offsets the boundary detector reports.
"""

import json
import random

import numpy as np
import pytest

from orchestrator.request import Job, SamplingParams
from orchestrator.runtime import Runtime
from orchestrator.models.synth import ensure_model

from .conftest import assert_same_as_cold, make_config

pytestmark = pytest.mark.usefixtures("fresh_cache")

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_files", "description": "Search the repository for files matching a glob pattern.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1}},
            "required": ["pattern"]}}},
]
SYSTEM = ("You are a careful coding assistant working in a large Python monorepo. Prefer small, reviewable "
          "changes; explain your reasoning briefly; never invent file names; ask before deleting anything. ") * 6


def sys_msg(text=SYSTEM):
    return {"role": "system", "content": text}


def user(text):
    return {"role": "user", "content": text}


def test_shared_tools_and_system_prefix_different_user_tails(runtime):
    assert_same_as_cold(runtime, [sys_msg(), user("List the test files.")], TOOLS)
    second = assert_same_as_cold(runtime, [sys_msg(), user("What is the weather in Oslo today?")], TOOLS)
    assert second.boundaries.system_end is not None
    assert second.result.cached_tokens == second.boundaries.system_end
    assert second.boundaries.tools_end < second.boundaries.system_end


def test_byte_identical_repeat_restores_the_whole_prompt(runtime):
    msgs = [sys_msg(), user("Summarise the module layout.")]
    first = assert_same_as_cold(runtime, msgs, TOOLS)
    assert first.result.cached_tokens == 0
    again = assert_same_as_cold(runtime, msgs, TOOLS)
    # The first run stored the checkpoint at its prompt's end and the logits of its last token: an identical
    # request restores the whole prompt and samples from them, with no prefill.
    assert again.result.cached_tokens == len(again.tokens)


def test_turn_two_extension(runtime):
    msgs = [sys_msg(), user("Hello, who are you?")]
    assert_same_as_cold(runtime, msgs, enable_thinking=False)
    msgs2 = msgs + [{"role": "assistant", "content": "I am a coding assistant."}, user("Great. Which files changed?")]
    second = assert_same_as_cold(runtime, msgs2, enable_thinking=False)
    assert second.result.cached_tokens == second.boundaries.message_ends[1]


def test_tool_call_turn_extends_the_previous_prompt_end(runtime):
    msgs = [sys_msg(), user("What's the weather in Paris?")]
    first = assert_same_as_cold(runtime, msgs, TOOLS)
    call = {"role": "assistant", "content": "", "reasoning_content": "I should call the weather tool.",
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    msgs2 = msgs + [call, {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18, "sky": "clear"}'}]
    second = assert_same_as_cold(runtime, msgs2, TOOLS)
    # The assistant turn after the last user query keeps its <think> block, so the whole previous prompt
    # (which ended with "<think>\n") is a prefix: the previous request's prompt end is restored.
    assert second.tokens[: len(first.tokens)] == first.tokens
    assert second.result.cached_tokens == len(first.tokens)


def test_x_then_y_then_x_again(runtime):
    x = [sys_msg("You translate English to French. Answer with the translation only."), user("Good morning")]
    y = [sys_msg("You are a SQL expert. Answer with one query."), user("Count the users table")]
    assert_same_as_cold(runtime, x)
    y1 = assert_same_as_cold(runtime, y)
    assert y1.result.cached_tokens == 0
    x2 = assert_same_as_cold(runtime, x)
    assert x2.result.cached_tokens == len(x2.tokens)  # x's prompt end and logits outlived y


def test_history_rewrite_with_thinking_hits_through_previous_user_message(runtime):
    msgs = [sys_msg(), user("Is 97 prime?")]
    assert_same_as_cold(runtime, msgs, enable_thinking=True)
    answered = {"role": "assistant", "reasoning_content": "97 is not divisible by 2, 3, 5 or 7.", "content": "Yes."}
    msgs2 = msgs + [answered, user("And 91?")]
    second = assert_same_as_cold(runtime, msgs2, enable_thinking=True)
    # The template drops the reasoning of the now-earlier assistant turn: the prompt diverges there.
    assert second.result.cached_tokens == second.boundaries.message_ends[1] > 0


def test_thinking_off_generation_prompt_is_not_in_history(runtime):
    msgs = [sys_msg(), user("Name a prime above 90.")]
    first = assert_same_as_cold(runtime, msgs, enable_thinking=False)
    prompt_text = runtime.prompts.chat(msgs, None, {"enable_thinking": False}).text
    assert prompt_text.endswith("<think>\n\n</think>\n\n")
    msgs2 = msgs + [{"role": "assistant", "content": "97"}, user("Another one?")]
    second = assert_same_as_cold(runtime, msgs2, enable_thinking=False)
    assert second.tokens[: len(first.tokens)] != first.tokens
    assert second.result.cached_tokens == second.boundaries.message_ends[1]


def test_short_system_prompt_is_cached(runtime):
    short = sys_msg("You are a terse assistant for a bicycle shop. Reply in one short sentence: no lists, "
                    "no code, no emojis, and never more than twenty words.")
    first = assert_same_as_cold(runtime, [short, user("Hi")])
    assert 30 <= first.boundaries.system_end <= 60
    second = assert_same_as_cold(runtime, [short, user("What time zone is Tokyo in?")])
    assert second.result.cached_tokens == second.boundaries.system_end


def test_no_system_message(runtime):
    msgs = [user("Write a haiku about caches.")]
    first = assert_same_as_cold(runtime, msgs)
    assert first.boundaries.system_end is None and first.boundaries.tools_end is None
    msgs2 = msgs + [{"role": "assistant", "content": "Warm lines wait in RAM"}, user("Another, about disks.")]
    second = assert_same_as_cold(runtime, msgs2)
    assert second.result.cached_tokens == second.boundaries.message_ends[0]


def test_changing_system_text_still_reuses_tools_block(runtime):
    first = assert_same_as_cold(runtime, [sys_msg("Current time: 2026-11-29T10:00:01Z. " + SYSTEM), user("hi")],
                                TOOLS)
    second = assert_same_as_cold(runtime, [sys_msg("Current time: 2026-11-29T10:00:07Z. " + SYSTEM), user("hi")],
                                 TOOLS)
    assert second.boundaries.tools_end is not None
    assert second.result.cached_tokens == second.boundaries.tools_end == first.boundaries.tools_end
    # Tools without a system message share the same tools block.
    third = assert_same_as_cold(runtime, [user("hi there")], TOOLS)
    assert third.result.cached_tokens == third.boundaries.tools_end


@pytest.fixture(scope="module")
def q4_runtime():
    rt = Runtime.start(make_config(ensure_model("tiny-q4"), ctx_size=4096))
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def odd_runtime():
    """tiny-q4 served as on a CPU whose kernels pair rows in even ubatches (ARM i8mm: chunks.py): the plain
    probe made to fail, so calibration falls back to odd ubatches (measured exact here too, and stricter)."""
    from orchestrator import calibration
    from orchestrator.errors import EngineError

    def paired(engine, *a, **k):
        raise EngineError("prefill splits change the logits (as with ARM i8mm's two-row dot products)")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibration, "measure_min_segment", paired)
        rt = Runtime.start(make_config(ensure_model("tiny-q4"), ctx_size=4096, rs_snapshots=24))
    yield rt
    rt.close()


def test_odd_ubatches_are_chosen_where_only_they_are_exact(odd_runtime, caplog):
    """Calibration's fallback: min_segment twice the odd size measured exact, and every prefill ubatch a
    request makes of odd length, whatever its stops, chunk size and restore; a checkpoint near the end is taken
    back only from within the last (possibly halved) call (Engine.rollback_reach): none is missed."""
    import llama_cpp

    from orchestrator import calibration

    eng = odd_runtime.engine
    m = calibration.measure_odd_segment(eng)
    assert m % 2 == 1 and eng.odd_ubatches and eng.min_segment == 2 * m
    sizes = []
    real = llama_cpp.llama_decode

    def recording(ctx, batch):
        sizes.append(batch.n_tokens)
        return real(ctx, batch)

    rng = random.Random(5)
    tokens = eng.tokenize(" ".join(rng.choice(["gamma", "delta", "[1, 2]", "\n"]) for _ in range(400)))
    n = len(tokens)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llama_cpp, "llama_decode", recording)
        odd_runtime.scheduler.drain()
        odd_runtime.cache.clear()
        for cuts in ([40, 41, 130, 131, 300], [2 * m, 4 * m + 1, n - 2 * m], [n - 4, n - m + 1, n - 1]):
            for k in (n - 1, n):
                odd_runtime.scheduler.run(Job(tokens[:k], boundaries=cuts, max_tokens=2, want_logits=True))
                odd_runtime.scheduler.drain()
    prefills = [k for k in sizes if k > 2]
    assert prefills and all(k % 2 == 1 for k in prefills), sizes
    assert eng.rollback and not [r for r in caplog.records if "could not be taken back" in r.getMessage()]
    assert any(k == m for k in prefills)  # even stretches were cut in two (the second m long)


def test_min_segment_is_measured_per_model(runtime, q4_runtime):
    """F16 weights are split-invariant down to 2-token ubatches; Q4_K_M weights only from 8 tokens on this CPU
    class (a shorter ubatch takes other matmul kernels). Measured at start, not assumed."""
    assert runtime.engine.min_segment == 2
    assert q4_runtime.engine.min_segment > 2
    eng = q4_runtime.engine
    tokens = eng.tokenize("a quantized model gives other logits for short ubatches " * 8)
    eng.clear(0)
    eng.decode(0, tokens, 0)
    whole = eng.logits()
    short = eng.min_segment - 1
    eng.clear(0)
    eng.decode(0, tokens[:-short], 0, want_logits=False)
    eng.decode(0, tokens[-short:], len(tokens) - short)
    differs = not np.array_equal(eng.logits(), whole)
    eng.clear(0)
    assert differs  # so the measured minimum is needed, not just safe


@pytest.mark.parametrize("which", ["tiny", "tiny-q4", "tiny-q4-odd"])
def test_random_prefill_splits_are_bit_identical(which, runtime, q4_runtime, odd_runtime):
    """The property the cache rests on: any split into segments of >= min_segment tokens, with a restore at
    any segment end, gives the logits of one cold prefill. Cuts closer than that are skipped by the scheduler.
    tiny-q4-odd: the same with prefill ubatches kept odd (chunks.py)."""
    runtime = {"tiny": runtime, "tiny-q4": q4_runtime, "tiny-q4-odd": odd_runtime}[which]
    m = runtime.scheduler.min_segment
    rng = random.Random(3)
    text = " ".join(rng.choice(["alpha", "beta", "{\"k\": 1}", "数据", "🙂", "def f(x):", "\n\n"]) for _ in range(300))
    tokens = runtime.engine.tokenize(text)
    cold = runtime.scheduler.run(Job(tokens, max_tokens=1, use_cache=False, want_logits=True))
    cold_shorter = runtime.scheduler.run(Job(tokens[:-1], max_tokens=1, use_cache=False, want_logits=True))
    n = len(tokens)
    for _ in range(4):
        cuts = sorted(rng.sample(range(2, n - 2), 6)) + [n - rng.randint(2, 9)]  # some cuts close to the end
        runtime.scheduler.drain()  # else the next request takes over the last one's after-generation work
        runtime.cache.clear()
        warm = runtime.scheduler.run(Job(tokens, boundaries=cuts, max_tokens=1, want_logits=True))
        assert np.array_equal(warm.first_logits, cold.first_logits)
        runtime.scheduler.drain()
        kept, pos = [], 0
        for c in sorted(set(cuts)):
            if c - pos >= m and n - c >= m:
                kept.append(c)
                pos = c
        again = runtime.scheduler.run(Job(tokens, boundaries=cuts, max_tokens=1, want_logits=True))
        assert again.cached_tokens == n  # a repeat: the prompt end and its logits
        assert np.array_equal(again.first_logits, cold.first_logits)
        runtime.scheduler.drain()
        # one token shorter: restored at the deepest cut with at least m tokens after it, then prefilled
        shorter = runtime.scheduler.run(Job(tokens[:-1], boundaries=cuts, max_tokens=1, want_logits=True))
        assert shorter.cached_tokens == max([c for c in kept if n - 1 - c >= m], default=0)
        assert np.array_equal(shorter.first_logits, cold_shorter.first_logits)


@pytest.mark.parametrize("wait", [True, False])
def test_after_generation_snapshot_equals_cold_prefill(runtime, wait):
    """The state after generation is stored as a batch prefill, so continuing from it equals a cold run; a
    request that arrives while that work runs takes it over where it got (issue 18), also exactly."""
    msgs = [user("Count from one to ten." if wait else "Count from ten to one.")]
    prompt = runtime.prompts.chat(msgs, None, {})
    first = runtime.scheduler.run(Job(prompt.tokens, prompt.boundaries, max_tokens=12,
                                      sampling=SamplingParams(temperature=0.0)))
    assert first.finish_reason == "length"
    if wait:
        runtime.scheduler.drain()
    extended = prompt.tokens + first.completion_tokens + runtime.engine.tokenize("\nMore text follows here.")
    warm = runtime.scheduler.run(Job(extended, max_tokens=4, want_logits=True))
    cold = runtime.scheduler.run(Job(extended, max_tokens=4, use_cache=False, want_logits=True))
    full = len(prompt.tokens) + len(first.completion_tokens)
    if wait:
        assert warm.cached_tokens == full
    else:
        assert len(prompt.tokens) - runtime.engine.min_segment <= warm.cached_tokens <= full
    assert warm.completion_tokens == cold.completion_tokens
    assert np.array_equal(warm.first_logits, cold.first_logits)


def test_min_segment_is_measured_once_per_model_and_cpu(tmp_path, tiny_model, monkeypatch):
    from orchestrator import calibration

    file = tmp_path / "calibration.json"
    rt = Runtime.start(make_config(tiny_model, calibration_file=file))
    measured = rt.engine.min_segment
    rt.close()
    assert list(json.loads(file.read_text()).values()) == [measured]
    monkeypatch.setattr(calibration, "measure_min_segment", lambda *a, **k: pytest.fail("measured again"))
    rt = Runtime.start(make_config(tiny_model, calibration_file=file))
    assert rt.engine.min_segment == measured
    rt.close()
