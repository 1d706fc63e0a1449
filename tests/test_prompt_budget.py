"""Bounds on the prompt work a request makes, without a model: nesting (a 400 naming the field, never a
RecursionError), the render limit of the chat template (a template that repeats the caller's text stops at it),
the caller's breakpoints (only the last four are placed: linear in the conversation) and the one-pass byte
offsets. The routes' own answers to the same bodies are in test_fuzz_routes.py and test_hostile.py."""

from __future__ import annotations

import time

import pytest

from orchestrator.config import Config
from orchestrator.errors import InvalidRequest
from orchestrator.prompt.boundaries import MAX_BREAKPOINTS, BoundaryDetector, byte_offsets
from orchestrator.prompt.control import CUT
from orchestrator.prompt.template import ChatTemplate, templates_dir
from server.validate import MAX_NESTING, body_fields, check_nesting, check_prompt_size


def nested(depth: int):
    v: object = "x"
    for k in range(depth - 1):
        v = [v] if k % 2 else {"k": v}
    return v


def test_nesting_up_to_the_limit_passes_and_one_more_level_is_a_400_naming_the_field():
    check_nesting({"tools": nested(MAX_NESTING)})
    with pytest.raises(InvalidRequest) as e:
        check_nesting({"model": "m", "chat_template_kwargs": nested(MAX_NESTING + 1)})
    assert e.value.param == "chat_template_kwargs"


def test_nine_hundred_fifty_levels_are_refused_without_recursion():
    with pytest.raises(InvalidRequest) as e:
        check_nesting({"messages": [{"role": "user", "content": nested(950)}]})
    assert e.value.param == "messages"


def test_a_value_referenced_many_times_counts_every_time():
    cfg = Config(cache_ram_mib=0, max_prompt_kib=64)
    big = "x" * 40_000
    check_prompt_size([("messages[0]", [big])], cfg)
    with pytest.raises(InvalidRequest) as e:
        check_prompt_size([("messages[0]", [big]), ("messages[1].content[0]", [big, big])], cfg)
    assert e.value.param == "messages[1].content[0]"
    assert body_fields({"a": 1}, ("a", "b")) == [("a", 1), ("b", None)]


def test_a_template_that_repeats_the_callers_text_stops_at_its_render_limit():
    source = "{% for m in messages %}{% for k in range(1000) %}{{ m.content }}{% endfor %}{% endfor %}"
    t = ChatTemplate(source, max_chars=100_000)
    assert len(t.render([{"role": "user", "content": "y" * 100}])) == 100_000
    started = time.perf_counter()
    with pytest.raises(InvalidRequest) as e:
        t.render([{"role": "user", "content": "y" * 10_000}])  # would be 10 MB
    assert e.value.param == "messages" and "renders to more than 100000 characters" in e.value.message
    assert time.perf_counter() - started < 5


def qwen() -> ChatTemplate:
    return ChatTemplate((templates_dir() / "qwen3.5.jinja").read_text(encoding="utf-8"))


def test_only_the_last_breakpoints_are_placed():
    t = qwen()
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} text"} for i in range(11)]
    text = t.render(messages, add_generation_prompt=True, enable_thinking=False)
    marks = [(i, 4) for i in range(0, len(messages), 2)]  # in user messages: the template rewrites assistant ones
    cb = BoundaryDetector(t).char_boundaries(messages, None, text, {"enable_thinking": False}, marks)
    placed = [x for x in cb.extra if x is not None]
    assert cb.extra[: len(marks) - MAX_BREAKPOINTS] == (None,) * (len(marks) - MAX_BREAKPOINTS)
    assert len(placed) == MAX_BREAKPOINTS
    assert all(text[: x].endswith("turn") for x in placed), [text[x - 8: x] for x in placed]


def test_breakpoints_on_every_turn_cost_about_what_the_conversation_costs():
    t = qwen()
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "w " * 20}
                for i in range(801)]
    kw = {"enable_thinking": False}
    text = t.render(messages, add_generation_prompt=True, **kw)

    def timed(marks):
        started = time.perf_counter()
        BoundaryDetector(t).char_boundaries(messages, None, text, kw, marks)
        return time.perf_counter() - started

    without = timed(())
    with_marks = timed([(i, 5) for i in range(len(messages))])
    assert with_marks < 3 * without + 1.0, (with_marks, without)


def test_byte_offsets_in_one_pass_match_the_definition():
    text = f"ab{CUT}cé€{CUT}{CUT}d𝄞e"
    offsets = [0, 3, None, 9, 1, len(text), 6]
    want = [None if c is None else len(text[:c].replace(CUT, "").encode()) for c in offsets]
    assert byte_offsets(text, offsets) == want
