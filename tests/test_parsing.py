"""Qwen3.5 output parsing and incremental stop strings, on fixed strings."""

import json
import random

import pytest

from orchestrator.output.parsing import StreamParser, parse_output
from orchestrator.output.formats import QWEN35
from orchestrator.output.reply import Reply
from orchestrator.output.stops import TextStream

CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"metric\": true}\n</parameter>\n</function>\n</tool_call>")

CASES = [
    # (generated text, prompt opened <think>, reasoning, content, tool call names)
    ("I should check.\n</think>\n\nIt is sunny.", True, "I should check.", "It is sunny.", []),
    ("\nLet me look it up.\n</think>\n\nChecking.\n\n" + CALL, True, "Let me look it up.", "Checking.", ["get_weather"]),
    ("still thinking when cut off", True, "still thinking when cut off", "", []),
    ("<think>\nshort\n</think>\n\nAnswer.", False, "short", "Answer.", []),
    ("Plain answer.", False, None, "Plain answer.", []),
    (CALL + "\n" + CALL.replace("get_weather", "search_files"), False, None, "", ["get_weather", "search_files"]),
    ("Broken <tool_call>\n<function=x>\nno end", False, None, "Broken <tool_call>\n<function=x>\nno end", []),
]


@pytest.mark.parametrize("text,opens,reasoning,content,names", CASES)
def test_parse_output(text, opens, reasoning, content, names):
    out = parse_output(text, opens)
    assert out.reasoning == reasoning
    assert out.content == content
    assert [c["function"]["name"] for c in out.tool_calls] == names


def test_tool_call_arguments_keep_json_types():
    (call,) = parse_output(CALL, False).tool_calls
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3, "opts": {"metric": True}}
    assert call["type"] == "function" and call["id"].startswith("call_")


@pytest.mark.parametrize("text,opens,reasoning,content,names", CASES)
def test_stream_parser_adds_up_to_parse_output(text, opens, reasoning, content, names):
    rng = random.Random(len(text))
    for _ in range(20):
        p = StreamParser(opens)
        pieces, i = [], 0
        while i < len(text):
            j = i + rng.randint(1, 5)
            pieces += p.push(text[i:j])
            i = j
        rest, calls = p.finish()
        pieces += rest
        assert "".join(s for k, s in pieces if k == "reasoning") == (reasoning or "")
        assert "".join(s for k, s in pieces if k == "content") == content
        assert [c["function"]["name"] for c in calls] == names


def test_text_stream_stop_string_across_pieces_and_utf8():
    s = TextStream(stop=("STOP",))
    out = "".join(s.push(p) for p in [b"ab", b"cS", b"TO", b"Pxyz"])
    assert out + s.finish() == "abc" and s.stopped
    s = TextStream()
    euro = "€".encode()
    assert s.push(euro[:1]) == "" and s.push(euro[1:]) == "€"
    assert s.finish() == ""


def test_text_stream_holds_back_possible_stop_prefix_then_releases():
    s = TextStream(stop=("</end>",))
    assert s.push(b"hello </e") == "hello "
    assert s.push(b"nter") == "</enter"
    assert s.finish() == ""


def test_a_tool_call_cut_by_the_budget_is_dropped_and_an_ended_one_stays_text():
    """Issue 39: a forced call cut by max_tokens came back as raw <tool_call> markup in the message text. Cut
    (finish_reason length): the partial call is dropped, whole and streamed alike; ended there by the model:
    its text stays content (nothing is invented)."""
    text = "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    reply = Reply(QWEN35, tools, False)
    cut = reply.parse(text, cut=True)
    assert (cut.content, cut.tool_calls) == ("Checking.", [])
    assert reply.parse(text).content == text
    for is_cut, want in ((True, "Checking."), (False, text)):
        parser = reply.stream()
        pieces = [p for k in range(0, len(text), 7) for p in parser.push(text[k:k + 7])]
        rest, calls = parser.finish(is_cut)
        assert "".join(t for kind, t in pieces + rest if kind == "content") == want and calls == []
