"""Boundary detection on the real chat templates of tests/templates/ (template rendering only, no model).

The property: every boundary the detector reports for a conversation is a prefix of the prompt of any longer
conversation that starts with it (what a client sends next), so a snapshot taken there is found again.
"""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.prompt.boundaries import BoundaryDetector, detect, token_stable_prefix
from orchestrator.errors import InvalidRequest
from orchestrator.prompt.template import ChatTemplate

TEMPLATES = Path(__file__).resolve().parent / "templates"
SPECIALS = {  # the tokenizer specials each family's GGUF carries (bos_token, eos_token)
    "google-gemma-2-2b-it": ("<bos>", "<eos>"),
    "meta-llama-Llama-3.1-8B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("<s>", "</s>"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "LFM2.5-Instruct": ("<|startoftext|>", "<|im_end|>"),
}
NAMES = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))
NO_SYSTEM = {"google-gemma-2-2b-it"}  # raises on a system message
ONE_CALL = {"meta-llama-Llama-3.1-8B-Instruct"}  # raises on parallel tool calls
# Finds "the last user message" by value (`message == user_messages[-1]`), so a user message equal to the last one
# also gets the tools block in front of it: a longer conversation that ends in a repeat of an earlier user text
# renders the tools there too, and no boundary of the shorter one is a prefix of it. Only reuse suffers (the cache
# matches tokens, not boundaries); the scripts keep these templates' user texts distinct.
BY_VALUE = {"mistralai-Mistral-Nemo-Instruct-2407"}

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                         "required": ["city"]}}}]


def template(name: str) -> ChatTemplate:
    bos, eos = SPECIALS.get(name, ("", ""))
    return ChatTemplate.from_file(TEMPLATES / f"{name}.jinja", bos_token=bos, eos_token=eos)


words = st.text(alphabet=string.ascii_letters + " .,\n<>/{}\"", min_size=1, max_size=30)
call_ids = st.text(alphabet=string.ascii_letters + string.digits, min_size=9, max_size=9)


@st.composite
def scripts(draw, name: str) -> list[dict]:
    """A random conversation of 1 to 5 user turns, each answered in text or with tool calls and results."""
    msgs: list[dict] = []
    if name not in NO_SYSTEM and draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(words)})
    for turn in range(draw(st.integers(1, 5))):
        msgs.append({"role": "user", "content": (f"{turn}: " if name in BY_VALUE else "") + draw(words)})
        if name not in NO_SYSTEM and draw(st.booleans()):
            n_calls = 1 if name in ONE_CALL else draw(st.integers(1, 2))
            calls = [{"id": draw(call_ids), "type": "function", "function": {
                "name": "get_weather", "arguments": {"city": draw(words), "days": draw(st.integers(0, 9))}}}
                for _ in range(n_calls)]
            msgs.append({"role": "assistant", "content": "", "tool_calls": calls,
                         **({"reasoning_content": draw(words)} if draw(st.booleans()) else {})})
            msgs += [{"role": "tool", "tool_call_id": c["id"], "content": draw(words)} for c in calls]
        content = draw(words)
        if draw(st.booleans()):
            content = "<think>\n" + draw(words) + "\n</think>\n\n" + content
        msgs.append({"role": "assistant", "content": content,
                     **({"reasoning_content": draw(words)} if draw(st.booleans()) else {})})
    return msgs


def render(tpl: ChatTemplate, msgs, tools, **kw) -> str | None:
    try:
        return tpl.render(msgs, tools, add_generation_prompt=True, **kw)
    except InvalidRequest:
        return None


@pytest.mark.parametrize("name", NAMES)
def test_every_boundary_is_a_prefix_of_every_extension(name):
    tpl = template(name)
    det = BoundaryDetector(tpl, window=4)

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(script=scripts(name), data=st.data())
    def check(script, data):
        k = data.draw(st.integers(1, len(script)))
        m = data.draw(st.integers(k, len(script)))
        tools = TOOLS if data.draw(st.booleans()) else None
        kw = {"enable_thinking": data.draw(st.booleans())}
        text = render(tpl, script[:k], tools, **kw)
        later = render(tpl, script[:m], tools, **kw) if m > k else render(tpl, script[:k], tools, **kw)
        if text is None or later is None:
            return
        cb = det.char_boundaries(script[:k], tools, text, kw)
        found = [b for b in (cb.tools_end, cb.system_end, *cb.message_ends) if b is not None]
        assert cb.stable <= len(text)
        for b in found:
            assert 0 < b <= cb.stable
            assert later.startswith(text[:b]), (b, text[:b][-80:], later[max(0, b - 80): b + 40])
        # The longer request puts that message's end no earlier than this request's last boundary (usually at
        # the same offset, so one snapshot serves both).
        if m > k and m - k < det.window and script[k - 1]["role"] in ("user", "tool"):
            end = det.char_boundaries(script[:m], tools, later, kw).message_ends[k - 1]
            assert end is None or cb.message_ends[-1] is None or end >= cb.message_ends[-1]

    check()


def boundaries(name, msgs, tools=None, **kw):
    tpl = template(name)
    text = tpl.render(msgs, tools, add_generation_prompt=True, **kw)
    return text, BoundaryDetector(tpl).char_boundaries(msgs, tools, text, kw)


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize("name", sorted(set(NAMES) - NO_SYSTEM - {"mistralai-Mistral-Nemo-Instruct-2407"}))
def test_every_message_of_a_plain_chat_gets_a_boundary(name):
    text, cb = boundaries(name, CHAT)
    ends = cb.message_ends
    assert all(e is not None for e in ends) and list(ends) == sorted(ends), ends
    assert CHAT[0]["content"] in text[: ends[0]] and "Hello!" in text[: ends[2]]
    assert "Weather" in text[ends[2]:]


def test_gemma2_alternating_chat_gets_boundaries_without_a_system_message():
    text, cb = boundaries("google-gemma-2-2b-it", CHAT[1:])
    assert text[: cb.message_ends[1]].rstrip().endswith("Hello!<end_of_turn>\n<start_of_turn>user".rstrip())


def test_qwen35_reasoning_of_the_current_turn_is_not_a_boundary():
    """Qwen3.5 renders reasoning only for assistant turns after the last user message and drops it once a newer
    user message arrives: the tool-loop turn's end must not be a boundary, the user message before it must."""
    msgs = CHAT + [{"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
                    "tool_calls": [{"id": "call_1", "type": "function",
                                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text, cb = boundaries("Qwen3.5-4B", msgs, TOOLS)
    assert "I should call the tool." in text
    assert "I should call the tool." not in text[: cb.stable]
    assert "Weather in Paris?" in text[: cb.message_ends[3]]
    assert cb.message_ends[4] == cb.message_ends[5] == cb.stable


def test_mistral_nemo_tools_and_system_move_to_the_last_user_message():
    msgs = CHAT[:3] + [{"role": "user", "content": "Weather in Paris?"}]
    text, cb = boundaries("mistralai-Mistral-Nemo-Instruct-2407", msgs, TOOLS)
    assert "[AVAILABLE_TOOLS]" in text and "Be brief." in text
    assert "[AVAILABLE_TOOLS]" not in text[: cb.stable] and "Be brief." not in text[: cb.stable]
    assert "Hello!" in text[: cb.stable]  # the earlier turns stay


def test_deepseek_r1_drops_think_from_history():
    msgs = CHAT[:2] + [{"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"}]
    text, cb = boundaries("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", msgs)
    later = template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B").render(
        msgs + [{"role": "user", "content": "and?"}], None, add_generation_prompt=True)
    assert all(later.startswith(text[:e]) for e in cb.message_ends if e)


def test_only_the_first_and_the_last_window_messages_are_checked():
    msgs = [CHAT[0]] + [{"role": r, "content": f"m{i}"} for i in range(40) for r in ("user", "assistant")][:39]
    tpl = template("Qwen3.5-4B")
    text = tpl.render(msgs, None, add_generation_prompt=True)
    ends = BoundaryDetector(tpl, window=4).char_boundaries(msgs, None, text, {}).message_ends
    assert [i for i, e in enumerate(ends) if e is not None] == [0, 36, 37, 38, 39]


def test_a_template_that_rejects_every_probe_gives_no_boundaries():
    tpl = ChatTemplate("{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
                       "{{ messages[0].content }}")
    cb = BoundaryDetector(tpl).char_boundaries([CHAT[1]], None, "Hi there", {})
    assert cb.message_ends == (None,) and cb.stable == 0


def test_token_check_drops_boundaries_beyond_the_tokens_the_appends_share():
    tpl = template("Qwen3.5-4B")
    text = tpl.render(CHAT, None, add_generation_prompt=True)
    chars = [ord(c) for c in text]  # a tokenizer with one token per character (all ASCII here)
    lengths = [1] * len(chars)
    det = BoundaryDetector(tpl)
    plain = detect(det, CHAT, None, text, lengths, {}, chars, lambda t: [ord(c) for c in t])
    cb = det.char_boundaries(CHAT, None, text, {})
    assert plain.message_ends == cb.message_ends  # token offsets are character offsets here
    cut = cb.message_ends[1] + 3  # the appends' tokens part from the prompt's 3 tokens after message 1
    merged = detect(det, CHAT, None, text, lengths, {}, chars, lambda t: [ord(c) for c in t[:cut]] + [-1])
    assert merged.message_ends[:2] == cb.message_ends[:2] and merged.message_ends[2:] == (None, None)
    assert token_stable_prefix([1, 2, 3], [[1, 2, 4], [1, 2, 3, 5]]) == 2


class CountingTemplate:
    """A ChatTemplate stand-in that counts renders."""

    def __init__(self, tpl):
        self.tpl, self.renders = tpl, 0

    def render(self, *a, **kw):
        self.renders += 1
        return self.tpl.render(*a, **kw)


def test_a_resent_conversation_renders_only_its_new_messages_with_the_same_result():
    tpl = template("Qwen3.5-4B")
    msgs = [CHAT[0]] + [{"role": r, "content": f"m{i} {r}"} for i in range(6) for r in ("user", "assistant")]
    longer = msgs + [{"role": "user", "content": "one more"}]
    warm_tpl, cold_tpl = CountingTemplate(tpl), CountingTemplate(tpl)
    warm = BoundaryDetector(warm_tpl)
    for m in (msgs[:-1], longer):  # the earlier request, then the one that resends it with two new messages
        text = tpl.render(m, None, add_generation_prompt=True)
        warm_tpl.renders = 0
        got = warm.char_boundaries(m, None, text, {})
    want = BoundaryDetector(cold_tpl).char_boundaries(longer, None, text, {})
    assert got == want
    assert warm_tpl.renders < cold_tpl.renders / 2
    # A prompt that no longer starts with the remembered text is not answered from the memo.
    edited = [dict(m) for m in longer]
    edited[0]["content"] = "Be verbose."
    text = tpl.render(edited, None, add_generation_prompt=True)
    assert warm.char_boundaries(edited, None, text, {}) == BoundaryDetector(tpl).char_boundaries(edited, None, text, {})


def test_min_gap_thins_message_ends_from_the_last_one_backwards_and_keeps_the_structural_ones():
    from orchestrator.prompt.boundaries import Boundaries
    from orchestrator.reuse import spaced_stops  # the gap is a reuse rule, applied to these offsets
    b = Boundaries(tools_end=40, system_end=60, message_ends=(60, 100, 150, 200, 290, 300, 310), extra=(305,))
    assert b.positions(400) == [40, 60, 100, 150, 200, 290, 300, 305, 310]  # no gap: every offset
    # 310 (the last message end), 305 (a breakpoint), 40 and 60 (tools, system) stay; 300 and 290 are within
    # 100 tokens of 310 or 305; 200 is the first 100 below 305; 150 and 100 are within 100 of 200 or 60.
    assert spaced_stops(b, 400, min_gap=100) == [40, 60, 200, 305, 310]
    # a 310-token prompt: 310 is its end, never a position; 300 is then the last message end inside it
    assert spaced_stops(b, 310, min_gap=100) == [40, 60, 200, 300, 305]
    assert spaced_stops(Boundaries(None, None, (None, 50, None)), 400, min_gap=1000) == [50]
