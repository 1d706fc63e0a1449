"""Closed-loop, concurrent workloads (W4, the agent tool loop; CHAT, a plain chat with thinking on): the runner,
its analysis and its report section.

Unlike W1-W3 (scripted assistant turns, one request at a time, every request sent to each system in turn), a
closed loop runs all its agents at once against one system, and each agent appends what that server actually
answered (the assistant message as returned: content, reasoning_content, tool_calls) and then its reply (a tool
output 0.2 s later, or the next user turn; scenarios.follow_up), so conversations depend on the system. One run =
one freshly started server, one pass of the plan, the server stopped; runs of different systems alternate
(rotating who goes first) for `reps` rounds, so drift on this shared machine hits all alike.

Measured per run (times in seconds, sizes in tokens; epoch wall clock on both sides):
  per agent task: wall time from its first request to its last answer (tool waits included), Σ TTFT;
  per request: TTFT (first chunk carrying text, as bench/client.py), total, completion and cached tokens (as the
      server reports them), decode rate (completion - 1) / (total - TTFT);
  per server: CPU seconds of its process tree; for orchestrator, /metrics (its after-generation counters among
      them) and /v1/cache/stats at the end.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import httpx

from bench.client import SEED, sse_chunks
from bench.scenarios import LoopPlan, answer_message, follow_up

# ---------------------------------------------------------------------------------------------- streaming


class StreamAccumulator:
    """Rebuilds the assistant message from streamed chat chunks (OpenAI deltas: content, reasoning_content,
    tool_calls by index) and keeps usage, timings and the finish reason."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict] = {}
        self.usage: dict | None = None
        self.timings: dict | None = None
        self.finish_reason: str | None = None

    def feed(self, obj: dict) -> bool:
        """Take one chunk; True when it carried generated text (reasoning, content or tool-call text)."""
        if obj.get("usage"):
            self.usage = obj["usage"]
        if obj.get("timings"):
            self.timings = obj["timings"]
        text = False
        for ch in obj.get("choices") or []:
            if ch.get("finish_reason"):
                self.finish_reason = ch["finish_reason"]
            d = ch.get("delta") or {}
            if d.get("reasoning_content"):
                self.reasoning.append(d["reasoning_content"])
                text = True
            if d.get("content"):
                self.content.append(d["content"])
                text = True
            for tc in d.get("tool_calls") or []:
                c = self.calls.setdefault(tc.get("index", 0), {"id": "", "type": "function",
                                                                "function": {"name": "", "arguments": ""}})
                if tc.get("id"):
                    c["id"] = tc["id"]
                f = tc.get("function") or {}
                if f.get("name"):
                    c["function"]["name"] += f["name"]
                    text = True
                if f.get("arguments"):
                    c["function"]["arguments"] += f["arguments"]
                    text = True
        return text

    def message(self) -> dict:
        """The assistant message as returned (scenarios.answer_message)."""
        return answer_message("".join(self.content), "".join(self.reasoning),
                              [self.calls[i] for i in sorted(self.calls)])

    def text(self) -> str:
        """Everything generated, for comparing with a cold run."""
        calls = "".join(c["function"]["name"] + c["function"]["arguments"] for _, c in sorted(self.calls.items()))
        return "".join(self.reasoning) + "".join(self.content) + calls

    def completion_tokens(self) -> int | None:
        if self.usage and self.usage.get("completion_tokens") is not None:
            return int(self.usage["completion_tokens"])
        if self.timings and self.timings.get("predicted_n") is not None:
            return int(self.timings["predicted_n"])
        return None

    def prompt_tokens(self) -> int | None:
        if self.usage and self.usage.get("prompt_tokens") is not None:
            return int(self.usage["prompt_tokens"])
        if self.timings and "prompt_n" in self.timings:
            return int(self.timings["prompt_n"]) + int(self.timings.get("cache_n", 0))
        return None

    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            return int(details["cached_tokens"])
        if self.timings and self.timings.get("cache_n") is not None:
            return int(self.timings["cache_n"])
        return None


@dataclass
class Turn:
    """One request of one agent (times: `sent` epoch seconds, the rest seconds from it)."""

    agent: int
    turn: int
    sent: float
    max_tokens: int
    n_messages: int
    prompt_key: str
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    total_s: float = 0.0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    tool_calls: int = 0
    finish_reason: str | None = None
    output: str = ""
    message: dict = field(default_factory=dict)


def _digest(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def stream_chat(client: httpx.Client, url: str, body: dict, timeout_s: float, turn: Turn) -> Turn:
    """POST a streamed chat request and fill `turn` from its chunks (never raises on HTTP or parse errors)."""
    acc = StreamAccumulator()
    t0 = time.perf_counter()
    turn.sent = time.time()
    ttft = None
    try:
        with client.stream("POST", url + "/v1/chat/completions", json=body,
                           timeout=httpx.Timeout(timeout_s, connect=10.0)) as resp:
            if resp.status_code != 200:
                resp.read()
                turn.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                turn.total_s = time.perf_counter() - t0
                return turn
            for obj in sse_chunks(resp, t0, timeout_s):
                if acc.feed(obj) and ttft is None:
                    ttft = time.perf_counter() - t0
    except (httpx.HTTPError, TimeoutError, json.JSONDecodeError) as e:
        turn.error = repr(e)
        turn.total_s = time.perf_counter() - t0
        return turn
    turn.total_s = time.perf_counter() - t0
    turn.ttft_s = ttft if ttft is not None else turn.total_s
    turn.ok = True
    turn.prompt_tokens, turn.cached_tokens = acc.prompt_tokens(), acc.cached_tokens()
    turn.completion_tokens = acc.completion_tokens()
    turn.message = acc.message()
    turn.tool_calls = len(acc.calls)
    turn.finish_reason = acc.finish_reason
    turn.output = acc.text()
    return turn


def request_body(plan: LoopPlan, messages: list[dict], max_tokens: int, tool_choice: str | None,
                 cache_prompt: bool = True) -> dict:
    """Greedy, seeded, streamed with usage; tools and tool_choice on tool loops."""
    body: dict = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "seed": SEED,
                  "stream": True, "stream_options": {"include_usage": True}, "cache_prompt": cache_prompt}
    if plan.tools:
        body["tools"] = plan.tools
        if tool_choice:
            body["tool_choice"] = tool_choice
    if plan.chat_template_kwargs:
        body["chat_template_kwargs"] = plan.chat_template_kwargs
    return body


def first_messages(plan: LoopPlan, agent_index: int) -> list[dict]:
    a = plan.agents[agent_index]
    msgs = [{"role": "system", "content": a.system}] if a.system else []
    return msgs + [{"role": "user", "content": a.task}]


def run_agent(url: str, plan: LoopPlan, agent_index: int, tool_choice: str | None, timeout_s: float,
              start: threading.Barrier, out: dict) -> None:
    """One agent's task: every turn a request, then (after delay_s) its answer and reply appended."""
    a = plan.agents[agent_index]
    msgs = first_messages(plan, agent_index)
    turns: list[Turn] = []
    body: dict = {}
    with httpx.Client() as client:
        start.wait()
        t_start = time.time()
        for t, mt in enumerate(a.max_tokens):
            body = request_body(plan, msgs, mt, tool_choice)
            turn = stream_chat(client, url, body, timeout_s, Turn(a.agent, t + 1, 0.0, mt, len(msgs), _digest(msgs)))
            turns.append(turn)
            if not turn.ok or t + 1 == len(a.max_tokens):
                break
            time.sleep(plan.delay_s)
            msgs = msgs + follow_up(turn.message, a.replies[t], plan.follow, f"call_{a.agent}_{t + 1}")
        t_end = time.time()
    out[a.agent] = {"agent": a.agent, "start": t_start, "end": t_end, "wall_s": t_end - t_start,
                    "turns": [vars(x) for x in turns], "last_body": body}


# ---------------------------------------------------------------------------------------------- analysis


def decode_rate(turns: Sequence[dict]) -> float | None:
    """Decode tokens/s as agents feel it: Σ(completion - 1) / Σ(total - TTFT) over requests that decoded."""
    toks = secs = 0.0
    for t in turns:
        c = t.get("completion_tokens")
        if t.get("ok") and c and c > 1 and t["total_s"] > t["ttft_s"]:
            toks += c - 1
            secs += t["total_s"] - t["ttft_s"]
    return toks / secs if secs > 0 else None


def summarize_run(run: dict) -> dict:
    """Per-run figures: task wall times, Σ TTFT, decode rates, tokens, CPU; orchestrator's after-generation
    counters (/metrics) when read."""
    agents = run["agents"]
    turns = [t for a in agents for t in a["turns"]]
    ok = all(t["ok"] for t in turns) and all(len(a["turns"]) == run["turns_planned"] for a in agents)
    comp = sum(t.get("completion_tokens") or 0 for t in turns)
    makespan = (max(a["end"] for a in agents) - min(a["start"] for a in agents)) if agents else 0.0
    out = {
        "workload": run["workload"], "system": run["system"], "rep": run["rep"], "ok": ok,
        "requests": len(turns), "failed": sum(not t["ok"] for t in turns),
        "task_wall_s": [a["wall_s"] for a in agents],
        "task_wall_mean_s": statistics.fmean(a["wall_s"] for a in agents) if agents else None,
        "task_wall_max_s": max((a["wall_s"] for a in agents), default=None),
        "task_ttft_sum_s": [sum(t["ttft_s"] for t in a["turns"]) for a in agents],
        "ttft_sum_s": sum(t["ttft_s"] for t in turns),
        "decode_tok_s": decode_rate(turns),
        "aggregate_tok_s": comp / makespan if makespan > 0 else None,
        "completion_tokens": comp,
        "prompt_tokens": sum(t.get("prompt_tokens") or 0 for t in turns),
        "cached_tokens": sum(t.get("cached_tokens") or 0 for t in turns),
        "tool_calls": sum(t.get("tool_calls") or 0 for t in turns),
        "server_cpu_s": run.get("server_cpu_s"),
        "cold_checked": len(run.get("cold", [])), "cold_equal": sum(c["equal"] for c in run.get("cold", [])),
    }
    after = {k: v for k, v in (run.get("metrics") or {}).items() if k.startswith("orchestrator_after_generation")}
    if after:
        out["after"] = after
    return out


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def aggregate(summaries: Sequence[dict], workload: str, systems: Sequence[str]) -> list[dict]:
    """Median over repetitions per system, and ratios of the medians to llama-server's and the best peer's."""
    rows = []
    for s in systems:
        rs = [x for x in summaries if x["workload"] == workload and x["system"] == s]
        if not rs:
            continue
        rows.append({"system": s, "reps": len(rs), "ok": all(r["ok"] for r in rs),
                     **{k: _median(r[k] for r in rs) for k in ("task_wall_mean_s", "task_wall_max_s", "ttft_sum_s",
                                                                "decode_tok_s", "aggregate_tok_s",
                                                                "completion_tokens", "prompt_tokens",
                                                                "cached_tokens", "server_cpu_s")},
                     "per_rep": rs})
    peers = [r for r in rows if r["system"].startswith("llama-server")]
    for r in rows:
        for key in ("task_wall_mean_s", "ttft_sum_s"):
            ls = next((p for p in peers if p["system"] == "llama-server"), None)
            best = min((p[key] for p in peers if p[key] is not None), default=None)
            r[f"{key}_vs_llama_server"] = (r[key] / ls[key]) if ls and ls[key] and r[key] is not None else None
            r[f"{key}_vs_best_peer"] = (r[key] / best) if best and r[key] is not None else None
    return rows


# ---------------------------------------------------------------------------------------------- report


def _f(v, fmt="{:.2f}", none="—") -> str:
    return none if v is None else fmt.format(v)


def markdown(summaries: Sequence[dict], runs: Sequence[dict], meta: dict) -> str:
    """The W4 / CHAT sections of results.md."""
    lines: list[str] = []
    for wl in [w for w in ("W4", "CHAT") if any(s["workload"] == w for s in summaries)]:
        systems = list(dict.fromkeys(s["system"] for s in summaries if s["workload"] == wl))
        rows = aggregate(summaries, wl, systems)
        spec = meta.get("loops", {}).get(wl, {})
        title = ("W4: the agent tool loop" if wl == "W4" else "CHAT: a plain chat with thinking on")
        lines += ["", f"## {title}", "", spec.get("description", ""), "",
                  "Medians over repetitions (each repetition: a fresh server, all agents at once); per-repetition "
                  "values in brackets. Task wall: from an agent's first request to its last answer, tool waits "
                  "included, mean over agents; Σ TTFT over all requests of the run; decode tok/s: Σ(completion − 1)"
                  " / Σ(total − TTFT) per request; aggregate: all completion tokens / time until the last agent "
                  "finished; CPU: the server process's CPU seconds in the run.", "",
                  "| system | reps | task wall s | slowest task s | Σ TTFT s | decode tok/s | aggregate tok/s | "
                  "completion tok | prompt tok | cached tok | server CPU s | wall vs llama-server | "
                  "Σ TTFT vs llama-server | wall vs best peer | Σ TTFT vs best peer | cold-equal |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            reps = r["per_rep"]

            def br(key, fmt="{:.1f}"):
                return "[" + ", ".join(_f(x[key], fmt) for x in reps) + "]"

            fail = "" if r["ok"] else " (failures)"
            cold = sum(x["cold_equal"] for x in reps), sum(x["cold_checked"] for x in reps)
            lines.append(
                f"| {r['system']}{fail} | {r['reps']} | {_f(r['task_wall_mean_s'], '{:.1f}')} "
                f"{br('task_wall_mean_s')} | {_f(r['task_wall_max_s'], '{:.1f}')} | {_f(r['ttft_sum_s'], '{:.1f}')} "
                f"{br('ttft_sum_s')} | {_f(r['decode_tok_s'], '{:.1f}')} {br('decode_tok_s')} | "
                f"{_f(r['aggregate_tok_s'], '{:.1f}')} | {_f(r['completion_tokens'], '{:,.0f}')} | "
                f"{_f(r['prompt_tokens'], '{:,.0f}')} | {_f(r['cached_tokens'], '{:,.0f}')} | "
                f"{_f(r['server_cpu_s'], '{:.0f}')} | {_f(r['task_wall_mean_s_vs_llama_server'], '{:.2f}×')} | "
                f"{_f(r['ttft_sum_s_vs_llama_server'], '{:.2f}×')} | {_f(r['task_wall_mean_s_vs_best_peer'], '{:.2f}×')}"
                f" | {_f(r['ttft_sum_s_vs_best_peer'], '{:.2f}×')} | "
                f"{f'{cold[0]}/{cold[1]}' if cold[1] else '—'} |")
        ag = [s for s in summaries if s["workload"] == wl and s.get("after")]
        if ag:
            lines += ["", f"### {wl}: after-generation work, per run", "",
                      "orchestrator's /metrics at the end of the run (orchestrator_after_generation…).", "",
                      "| system | rep | after_generation counters |", "|---|---|---|"]
            for s in ag:
                counters = ", ".join(f"{k.replace('orchestrator_after_generation', '') or 'total'}={v:g}"
                                     for k, v in sorted(s["after"].items()))
                lines.append(f"| {s['system']} | {s['rep']} | {counters} |")
        first = {}
        for run in runs:
            if run["workload"] == wl:
                first.setdefault(run["system"], run)
        if first:
            names = list(first)
            lines += ["", f"### {wl}: every request of the first repetition", "",
                      "TTFT s / cached tokens / completion tokens (of max_tokens) per system; ⚙ = the answer "
                      "had tool calls.", "",
                      "| agent | turn | max_tokens | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
            keys = sorted({(t["agent"], t["turn"], t["max_tokens"]) for r in first.values() for a in r["agents"]
                           for t in a["turns"]})
            for ag_, tn, mt in keys:
                cells = []
                for n in names:
                    t = next((t for a in first[n]["agents"] for t in a["turns"]
                              if (t["agent"], t["turn"]) == (ag_, tn)), None)
                    if t is None:
                        cells.append("—")
                    elif not t["ok"]:
                        cells.append("failed")
                    else:
                        cells.append(f"{t['ttft_s']:.2f} / {_f(t['cached_tokens'], '{}')} / "
                                     f"{_f(t['completion_tokens'], '{}')}{' ⚙' if t['tool_calls'] else ''}")
                lines.append(f"| {ag_} | {tn} | {mt} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- running


def parse_metrics(text: str, prefixes: Sequence[str] = ("orchestrator_after_generation",
                                                        "orchestrator_request_phase_seconds_sum")) -> dict:
    """Prometheus text lines whose name starts with one of `prefixes`: {name{labels}: value}."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(tuple(prefixes)):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


def run_once(system, plan: LoopPlan, rep: int, args, port: int, log_dir: Path, tool_choice: str | None,
             cold: str, log) -> dict:
    """One run: start `system`, run every agent of `plan` at once, (cold-check,) read its counters, stop it."""
    from bench.systems import launch

    t = time.monotonic()
    r = launch(system, args.model, port, args.threads, args.scale.w4_ctx_size, log_dir, args.cache_ram,
               plan.workload, omp_wait_policy=getattr(args, "omp_wait_policy", None))
    log(f"  started {system.name} on :{port} in {time.monotonic() - t:.1f} s")
    r.wait_idle()  # done starting up (loading, warming up) before the agents start
    run: dict = {"workload": plan.workload, "system": system.name, "rep": rep,
                 "turns_planned": len(plan.agents[0].max_tokens), "tool_choice": tool_choice}
    try:
        r.wait_idle()
        cpu0 = r.cpu_s()
        out: dict = {}
        barrier = threading.Barrier(len(plan.agents))
        threads = [threading.Thread(target=run_agent, args=(r.url, plan, i, tool_choice, args.request_timeout,
                                                            barrier, out), daemon=True)
                   for i in range(len(plan.agents))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        run["agents"] = [out[k] for k in sorted(out)]
        r.wait_idle()  # after-generation work of the last answers finishes before the counters are read
        run["server_cpu_s"] = r.cpu_s() - cpu0
        if system.kind == "orchestrator":
            with httpx.Client(timeout=10.0) as c:
                run["metrics"] = parse_metrics(c.get(r.url + "/metrics").text)
                try:
                    run["cache_stats"] = c.get(r.url + "/v1/cache/stats").json()
                except (httpx.HTTPError, ValueError):
                    run["cache_stats"] = None
        if cold == "last":
            run["cold"] = []
            with httpx.Client() as client:
                for a in run["agents"]:
                    body = dict(a["last_body"], cache_prompt=False)
                    last = a["turns"][-1]
                    got = stream_chat(client, r.url, body, args.request_timeout,
                                      Turn(a["agent"], last["turn"], 0.0, body["max_tokens"], 0, ""))
                    run["cold"].append({"agent": a["agent"], "equal": got.ok and got.output == last["output"],
                                        "ttft_s": got.ttft_s})
        for a in run["agents"]:
            w = sum(t["ttft_s"] for t in a["turns"])
            log(f"    agent {a['agent']}: {len(a['turns'])} turns in {a['wall_s']:.1f} s, Σ TTFT {w:.1f} s, "
                f"{sum(t['completion_tokens'] or 0 for t in a['turns'])} completion tokens"
                + ("" if all(t["ok"] for t in a["turns"]) else
                   f"  FAILED {next(t['error'] for t in a['turns'] if not t['ok'])[:160]}"))
    finally:
        r.stop()
    for a in run["agents"]:
        a.pop("last_body", None)
    return run


def run_loops(plan: LoopPlan, systems: Sequence, args, log_dir: Path, reps: int, tool_choice: str | None,
              cold: str, base_port: int, log, on_run=None) -> list[dict]:
    """`reps` rounds; in each, every system runs the plan once, the order rotating between rounds."""
    runs = []
    for rep in range(1, reps + 1):
        k = (rep - 1) % len(systems)
        for i, s in enumerate(list(systems[k:]) + list(systems[:k])):
            log(f"== {plan.workload} rep {rep}/{reps}: {s.name}")
            run = run_once(s, plan, rep, args, base_port + i, log_dir, tool_choice, cold if rep == 1 else "none",
                           log)
            runs.append(run)
            if on_run:
                on_run(run)
    return runs
