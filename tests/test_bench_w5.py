"""W5's plan (bench/w5.py) without servers: the sessions are the CLIs' captured requests grown turn by turn, and the
`moved` shape only moves system and developer texts to the front."""

from __future__ import annotations

import json

from bench import w5


def tokenize(text: str) -> list[int]:  # about a token a word: sizes only steer the tool results' lengths
    return text.split()


def test_each_turn_resends_the_previous_request_plus_one_tool_round():
    reqs = w5.plan(4, tokenize)
    for session, items in ((w5.CLAUDE, "messages"), (w5.CODEX, "input")):
        cli = [q for q in reqs if q.session == session and q.shape == "cli"]
        assert [q.turn for q in cli] == [1, 2, 3, 4]
        assert cli[0].body[items] == w5.load_capture(session)[items]  # turn 1 is the captured request
        for before, after in zip(cli, cli[1:]):
            assert after.body[items][:len(before.body[items])] == before.body[items]
            assert len(after.body[items]) == len(before.body[items]) + 2  # a call and its result
        assert all(100 <= q.max_tokens <= 400 and q.body["stream"] for q in cli)


def test_moved_puts_every_system_text_first_and_keeps_the_rest_in_order():
    claude = w5.load_capture(w5.CLAUDE)
    assert [m["role"] for m in claude["messages"]][:2] == ["user", "system"]  # what Claude Code sends
    moved = w5.moved(w5.CLAUDE, claude)
    assert [m["role"] for m in moved["messages"]] == [m["role"] for m in claude["messages"] if m["role"] != "system"]
    assert moved["system"][-1]["text"] == w5._text_of(claude["messages"][1]["content"])
    codex = w5.load_capture(w5.CODEX)
    moved = w5.moved(w5.CODEX, codex)
    roles = [i.get("role") for i in moved["input"]]
    assert roles[0] == "developer" and "developer" not in roles[1:]
    texts = [w5._text_of(i["content"]) for i in codex["input"] if i.get("role") == "developer"]
    assert w5._text_of(moved["input"][0]["content"]) == "\n\n".join(texts)
    assert json.dumps(moved["input"][1:]) == json.dumps([i for i in codex["input"] if i.get("role") != "developer"])


def test_an_omitted_thinking_blocks_signature_is_part_of_the_compared_answer():
    """Claude Code asks for thinking with display "omitted": the block's only content is its signature_delta,
    which holds the thinking (server/protocols/anthropic.py), so W5's warm-against-cold comparison must see it."""
    sig = {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "orchestrator1.eA"}}
    assert w5._delta_text("content_block_delta", sig) == "orchestrator1.eA"
    text = {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "hi"}}
    assert w5._delta_text("content_block_delta", text) == "hi"
    assert w5._delta_text("content_block_start", {"content_block": {"type": "thinking"}}) == ""


def test_an_empty_cold_answer_is_not_counted_as_compared():
    def rec(turn, cold, output):
        return {"system": "orchestrator", "session": w5.CLAUDE, "shape": "cli", "turn": turn, "round": 0 if cold else 1,
                "cold": cold, "ok": True, "output": output, "ttft_s": 1.0, "total_s": 3.0, "prompt_tokens": 10,
                "cached_tokens": 0, "output_tokens": 5, "error": ""}
    rows = w5.summarize([rec(1, False, ""), rec(1, True, ""), rec(2, False, "a"), rec(2, True, "b")])
    assert (rows[0]["compared"], rows[0]["differ"]) == (1, 1)
    # the session's wall and output: its warm requests only, summed per round
    assert (rows[0]["sum_ttft_s"], rows[0]["sum_total_s"], rows[0]["output_tokens"]) == (2.0, 6.0, 10)
