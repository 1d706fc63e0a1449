"""W4 / CHAT closed loops of the benchmark (bench/agentloop.py, bench/scenarios.py): the plan, what the client
appends, the stream accumulator, the after-generation analysis, the report and the launch commands.

No servers, no model, no timing assertions: times here are made-up inputs, not measurements.
"""

from pathlib import Path

from bench import agentloop
from bench.scenarios import Scale, chat, follow_up, w4
from bench.systems import SYSTEMS, before_system, command, np_flag


def tok(text: str) -> list[str]:
    """A stand-in tokenizer: one token a whitespace-separated word."""
    return text.split()


def test_w4_plan_follows_the_scale_and_is_the_same_every_time():
    sc = Scale()
    plan = w4(tok, sc)
    assert plan.workload == "W4" and plan.follow == "tool" and plan.delay_s == 0.2
    assert len(plan.agents) == 3 and [a.agent for a in plan.agents] == [1, 2, 3]
    for a in plan.agents:
        assert len(a.max_tokens) == 6 and all(100 <= m <= 400 for m in a.max_tokens)
        assert len(a.replies) == 5  # the last turn's answer ends the task
        for r in a.replies:
            body = r.split(": ", 1)[1]
            assert 200 - 2 <= len(tok(body)) <= 1500
    assert len({a.system for a in plan.agents}) == 3  # each its own system text
    assert sum(len(tok(str(t))) for t in plan.tools) > 1000  # one shared tools block
    again = w4(tok, sc)
    assert [a.max_tokens for a in again.agents] == [a.max_tokens for a in plan.agents]
    assert [a.replies for a in again.agents] == [a.replies for a in plan.agents]
    assert len({tuple(a.max_tokens) for a in plan.agents}) == 3  # drawn per agent and turn


def test_chat_plan_is_one_conversation_of_user_turns():
    sc = Scale(chat_turns=4)
    plan = chat(tok, sc)
    assert plan.follow == "user" and plan.tools is None and len(plan.agents) == 1
    a = plan.agents[0]
    assert len(a.max_tokens) == 4 and len(a.replies) == 3 and a.task.startswith("Question 1")


def test_follow_up_sends_tool_messages_only_after_tool_calls():
    call = {"id": "c7", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ans = {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [call, dict(call, id="")]}
    msgs = follow_up(ans, "OUT", "tool", "call_1_1")
    assert msgs[0] is ans
    assert msgs[1] == {"role": "tool", "tool_call_id": "c7", "content": "OUT"}
    assert msgs[2] == {"role": "tool", "tool_call_id": "call_1_1_1", "content": ""}
    text = {"role": "assistant", "content": "hi", "reasoning_content": "r"}
    assert follow_up(text, "OUT", "tool", "x") == [text, {"role": "user", "content": "OUT"}]
    assert follow_up(ans, "next?", "user", "x")[1:] == [{"role": "user", "content": "next?"}]


def test_stream_accumulator_rebuilds_the_answer_and_the_counts():
    acc = agentloop.StreamAccumulator()
    assert acc.feed({"choices": [{"delta": {"role": "assistant"}}]}) is False  # no text: not the first token
    assert acc.feed({"choices": [{"delta": {"reasoning_content": "think "}}]}) is True
    acc.feed({"choices": [{"delta": {"reasoning_content": "more"}}]})
    acc.feed({"choices": [{"delta": {"content": "Hello"}}]})
    acc.feed({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_a", "function": {"name": "grep"}}]}}]})
    acc.feed({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"x\":"}}]}}]})
    acc.feed({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}}]})
    acc.feed({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    acc.feed({"choices": [], "usage": {"prompt_tokens": 900, "completion_tokens": 42,
                                       "prompt_tokens_details": {"cached_tokens": 800}}})
    m = acc.message()
    assert m == {"role": "assistant", "content": "Hello", "reasoning_content": "think more",
                 "tool_calls": [{"id": "call_a", "type": "function",
                                 "function": {"name": "grep", "arguments": "{\"x\": 1}"}}]}
    assert acc.text() == "think moreHellogrep{\"x\": 1}"
    assert (acc.prompt_tokens(), acc.cached_tokens(), acc.completion_tokens()) == (900, 800, 42)
    assert acc.finish_reason == "tool_calls"
    # llama-server without usage details: its timings say the same
    ls = agentloop.StreamAccumulator()
    ls.feed({"choices": [{"delta": {"content": "x"}}], "timings": {"prompt_n": 100, "cache_n": 700,
                                                                     "predicted_n": 9}})
    assert (ls.prompt_tokens(), ls.cached_tokens(), ls.completion_tokens()) == (800, 700, 9)
    assert ls.message() == {"role": "assistant", "content": "x"}


def _turn(agent, turn, sent, ttft, total, prompt, cached, comp, ok=True):
    return {"agent": agent, "turn": turn, "sent": sent, "ttft_s": ttft, "total_s": total, "prompt_tokens": prompt,
            "cached_tokens": cached, "completion_tokens": comp, "ok": ok, "tool_calls": 0, "max_tokens": 128}


def _run(system, rep, walls, ttfts, workload="W4"):
    agents = []
    for i, (w, t) in enumerate(zip(walls, ttfts), start=1):
        agents.append({"agent": i, "start": 100.0, "end": 100.0 + w, "wall_s": w,
                       "turns": [_turn(i, 1, 100.0, t, t + 10.0, 2000, 0, 101)]})
    return {"workload": workload, "system": system, "rep": rep, "turns_planned": 1, "agents": agents,
            "server_cpu_s": 50.0}


def test_summary_aggregate_and_report():
    runs = [_run("orchestrator", 1, [30.0, 40.0], [1.0, 2.0]), _run("llama-server", 1, [60.0, 80.0], [4.0, 4.0]),
            _run("orchestrator", 2, [50.0, 50.0], [3.0, 3.0]), _run("llama-server", 2, [70.0, 70.0], [4.0, 6.0]),
            _run("llama-server-tuned", 1, [40.0, 60.0], [2.0, 4.0])]
    sums = [agentloop.summarize_run(r) for r in runs]
    s0 = sums[0]
    assert s0["ok"] and s0["task_wall_mean_s"] == 35.0 and s0["task_wall_max_s"] == 40.0 and s0["ttft_sum_s"] == 3.0
    assert abs(s0["decode_tok_s"] - 200 / 20.0) < 1e-9          # (101 - 1) tokens in 10 s, twice
    assert abs(s0["aggregate_tok_s"] - 202 / 40.0) < 1e-9       # all tokens / until the last agent finished
    rows = {r["system"]: r for r in agentloop.aggregate(sums, "W4", ["orchestrator", "llama-server",
                                                                      "llama-server-tuned"])}
    assert rows["orchestrator"]["task_wall_mean_s"] == 42.5       # median of 35 and 50
    assert rows["llama-server"]["task_wall_mean_s"] == 70.0
    assert abs(rows["orchestrator"]["task_wall_mean_s_vs_llama_server"] - 42.5 / 70.0) < 1e-9
    assert abs(rows["orchestrator"]["task_wall_mean_s_vs_best_peer"] - 42.5 / 50.0) < 1e-9  # tuned is the best peer
    assert abs(rows["orchestrator"]["ttft_sum_s_vs_llama_server"] - 4.5 / 9.0) < 1e-9
    failed = _run("orchestrator", 3, [1.0], [1.0])
    failed["agents"][0]["turns"][0]["ok"] = False
    assert agentloop.summarize_run(failed)["ok"] is False
    runs[0]["metrics"] = {'orchestrator_after_generation_total{outcome="answer"}': 3.0,
                          "orchestrator_request_phase_seconds_sum": 9.0}
    sums = [agentloop.summarize_run(r) for r in runs]
    assert sums[0]["after"] == {'orchestrator_after_generation_total{outcome="answer"}': 3.0}
    assert "after" not in sums[1]
    md = agentloop.markdown(sums, runs, {"loops": {"W4": {"description": "d"}}})
    assert "## W4: the agent tool loop" in md
    assert '| orchestrator | 1 | _total{outcome="answer"}=3 |' in md
    assert "| orchestrator | 2 | 42.5 [35.0, 50.0] |" in md
    assert "0.61×" in md  # 42.5 / 70


def test_parse_metrics_keeps_the_after_generation_counters():
    text = ("# HELP orchestrator_after_generation_seconds x\n"
            "orchestrator_after_generation_seconds_total 1.5\n"
            'orchestrator_after_generation_total{outcome="answer"} 3.0\n'
            "orchestrator_prompt_tokens_total 99.0\n")
    assert agentloop.parse_metrics(text) == {"orchestrator_after_generation_seconds_total": 1.5,
                                            'orchestrator_after_generation_total{outcome="answer"}': 3.0}


def test_w4_commands_give_every_slot_the_same_context():
    m = Path("/m.gguf")
    ls = command(SYSTEMS["llama-server"], m, 1, 2, 12288, None, Path("/t"), "W4")
    assert ls[ls.index("-c") + 1] == str(3 * 12288) and np_flag(ls) == 3
    tuned = command(SYSTEMS["llama-server-tuned"], m, 1, 2, 12288, None, Path("/t"), "W4")
    assert tuned[tuned.index("-c") + 1] == str(3 * 12288) and "--ctx-checkpoints" in tuned and "-sps" not in tuned
    w1 = command(SYSTEMS["llama-server"], m, 1, 2, 8192, None, Path("/t"), "W1")
    assert w1[w1.index("-c") + 1] == "8192" and np_flag(w1) == 0  # W1-W3 unchanged: automatic slots
    orch = command(SYSTEMS["orchestrator"], m, 1, 2, 12288, 4096, Path("/t"), "W4")
    assert orch[1:4] == ["-m", "orchestrator", "serve"]
    assert orch[orch.index("-c") + 1] == "12288"
    assert before_system(Path("/tmp/b")).root == "/tmp/b"


def test_request_body_sends_tools_tool_choice_and_template_kwargs_only_where_asked():
    plan = w4(tok, Scale.named("quick"))
    msgs = agentloop.first_messages(plan, 0)
    assert [m["role"] for m in msgs] == ["system", "user"]
    b = agentloop.request_body(plan, msgs, 77, None)
    assert b["max_tokens"] == 77 and b["temperature"] == 0.0 and b["cache_prompt"] is True
    assert b["tools"] is plan.tools and "tool_choice" not in b and "chat_template_kwargs" not in b
    plan.chat_template_kwargs = {"enable_thinking": False}
    b = agentloop.request_body(plan, msgs, 77, "required", cache_prompt=False)
    assert b["tool_choice"] == "required" and b["chat_template_kwargs"] == {"enable_thinking": False}
    assert b["cache_prompt"] is False
    c = chat(tok, Scale.named("quick"))
    assert "tools" not in agentloop.request_body(c, agentloop.first_messages(c, 0), 5, "required")
