"""W5: one Claude Code session and one Codex session, replayed as the CLIs send them, side by side.

Inputs are the CLIs' own first requests, captured with a logging server and committed:
tests/fixtures/captures/claude-code/turn1.json (Claude Code 2.1.332, `claude -p`: POST /v1/messages with its system
blocks, a `system` message at messages[1] and 12 tool schemas) and tests/fixtures/captures/codex/001.json (Codex
0.171.0, `codex exec`: POST /v1/responses with two developer messages, function, namespace and web_search tools).
Each session is `turns` requests: the first is the captured body; every later one appends one scripted assistant
tool call (Claude Code's `Bash`, Codex's `exec_command`) and its tool result of 200-1,500 tokens, as the CLI would
send them, so every system sees the same conversation. Each request asks for 100-400 tokens (drawn with a fixed
seed; greedy). Assistant turns are scripted because the synthetic model writes gibberish: what is measured is what
the server does with the CLI's prompt.

Shapes: `cli` is the body as the CLI sends it; `moved` is the same conversation with every system and developer
text moved to the front (Claude Code: messages[1] appended to `system`; Codex: the developer messages merged into
one), the shape llama-server's template path accepts (on `cli` it answers HTTP 500, "System message must be at
the beginning", on both routes).

Systems run one after another per request (rotating who goes first), each in its own freshly started process
(bench/systems.py `launch`); `reps` rounds. Per request: TTFT (first streamed delta of text, thinking or tool
input, or the opening of a content block or output item), total time, prompt and cached tokens as the server
reports them, output text. Cold references: the last
request of each session, rerun with `cache_prompt: false` on a fresh orchestrator (`--cold last`), or every
request (`--cold all`); a warm answer must equal its cold one.

    python -m bench w5 --out bench/results/<date>/w5 [--turns 8] [--reps 1] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.client import sse_events
from bench.common import add_model_args
from bench.scenarios import _words
from bench.systems import SYSTEMS, System, add_variant_args, launch, omp_policy, with_variants

ROOT = Path(__file__).resolve().parent
CAPTURES = ROOT.parent / "tests" / "fixtures" / "captures"
BASE_PORT = 18600
CLAUDE, CODEX = "claude-code", "codex"
SHAPES = ("cli", "moved")


@dataclass
class W5Req:
    """One request of a session. route: /v1/messages or /v1/responses; body: the JSON body (streamed)."""

    session: str
    shape: str
    turn: int
    route: str
    body: dict
    max_tokens: int

    @property
    def key(self) -> str:
        return f"{self.session}/{self.shape}/{self.turn}"


@dataclass
class Outcome:
    ok: bool
    status: int
    ttft_s: float
    total_s: float
    output: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    error: str = ""


def load_capture(session: str) -> dict:
    name = "turn1.json" if session == CLAUDE else "001.json"
    return json.loads((CAPTURES / session / name).read_text())["body"]


def _tool_text(rng: random.Random, tokenize, n_tokens: int, turn: int) -> str:
    return _words(rng, tokenize, n_tokens, head=f"$ exit 0 (step {turn})\n")


def claude_session(base: dict, turns: int, rng: random.Random, tokenize, budgets: list[int],
                   result_tokens=lambda rng: rng.randint(200, 1500)) -> list[dict]:
    """Claude Code request bodies, turn by turn: the captured first request, then one Bash tool_use and its
    tool_result (of `result_tokens(rng)` tokens) per turn."""
    bodies, messages = [], copy.deepcopy(base["messages"])
    for t in range(turns):
        if t:
            call_id = f"toolu_w5_{t:02d}"
            messages = messages + [
                {"role": "assistant", "content": [
                    {"type": "text", "text": f"I will run step {t} and read its output."},
                    {"type": "tool_use", "id": call_id, "name": "Bash",
                     "input": {"command": f"python -m pytest -q tests/test_step_{t}.py", "description": f"step {t}"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id,
                                              "content": _tool_text(rng, tokenize, result_tokens(rng), t)}]}]
        bodies.append(dict(copy.deepcopy(base), messages=messages, max_tokens=budgets[t], stream=True))
    return bodies


def codex_session(base: dict, turns: int, rng: random.Random, tokenize, budgets: list[int]) -> list[dict]:
    """Codex request bodies: the captured first request, then one exec_command function_call and its
    function_call_output per turn (Codex resends the whole input every turn: store false)."""
    bodies, items = [], copy.deepcopy(base["input"])
    for t in range(turns):
        if t:
            call_id = f"call_w5_{t:02d}"
            items = items + [
                {"type": "function_call", "call_id": call_id, "name": "exec_command",
                 "arguments": json.dumps({"cmd": f"python -m pytest -q tests/test_step_{t}.py"})},
                {"type": "function_call_output", "call_id": call_id,
                 "output": _tool_text(rng, tokenize, rng.randint(200, 1500), t)}]
        bodies.append(dict(copy.deepcopy(base), input=items, max_output_tokens=budgets[t], stream=True))
    return bodies


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    return "\n\n".join(p.get("text", "") for p in content)


def moved(session: str, body: dict) -> dict:
    """The same conversation with every system/developer text at the front (see the module docstring)."""
    body = copy.deepcopy(body)
    if session == CLAUDE:
        system = body.get("system") or []
        system = [{"type": "text", "text": system}] if isinstance(system, str) else list(system)
        rest = []
        for m in body["messages"]:
            if m["role"] == "system":
                system.append({"type": "text", "text": _text_of(m["content"])})
            else:
                rest.append(m)
        body["system"], body["messages"] = system, rest
        return body
    dev = [i for i in body["input"] if i.get("type") == "message" and i.get("role") in ("system", "developer")]
    rest = [i for i in body["input"] if i not in dev]
    merged = {"type": "message", "role": "developer", "content": [
        {"type": "input_text", "text": "\n\n".join(_text_of(i["content"]) for i in dev)}]}
    body["input"] = [merged] + rest
    return body


def plan(turns: int, tokenize, shapes=SHAPES) -> list[W5Req]:
    """Every request of both sessions in both shapes, in send order (session by session, turn by turn)."""
    out = []
    for session in (CLAUDE, CODEX):
        rng = random.Random(f"w5-{session}")
        budgets = [rng.randint(100, 400) for _ in range(turns)]
        make = claude_session if session == CLAUDE else codex_session
        bodies = make(load_capture(session), turns, rng, tokenize, budgets)
        route = "/v1/messages" if session == CLAUDE else "/v1/responses"
        for shape in shapes:
            for t, b in enumerate(bodies):
                out.append(W5Req(session, shape, t + 1, route, moved(session, b) if shape == "moved" else b,
                                 budgets[t]))
    return out


# Events that carry the first generated token even when it is not text a client sees: Claude Code asks for
# thinking with display "omitted", so the thinking block opens (content_block_start) with no text deltas.
FIRST_OUTPUT = ("content_block_start", "response.output_item.added")


def _delta_text(kind: str, obj: dict) -> str:
    """A streamed event's part of the answer. A thinking block's `signature_delta` is part of it: with display
    "omitted" (as Claude Code asks) the thinking travels only there (this server's signature holds it,
    server/protocols/anthropic.py `signature`), so without it a warm and a cold answer of nothing but thinking
    would compare equal whatever they thought."""
    if kind == "content_block_delta":
        d = obj.get("delta") or {}
        return d.get("text") or d.get("thinking") or d.get("partial_json") or d.get("signature") or ""
    if kind in ("response.output_text.delta", "response.reasoning_text.delta", "response.reasoning_summary_text.delta",
                "response.function_call_arguments.delta"):
        return obj.get("delta") or ""
    return ""


def _usage(kind: str, obj: dict, o: Outcome) -> None:
    if kind in ("message_start", "message_delta"):
        u = (obj.get("message") or {}).get("usage") if kind == "message_start" else obj.get("usage")
        if u and u.get("input_tokens") is not None:  # llama-server leaves the cache figures out
            read = u.get("cache_read_input_tokens") or 0
            o.prompt_tokens = u["input_tokens"] + (u.get("cache_creation_input_tokens") or 0) + read
            o.cached_tokens = read
        if u and u.get("output_tokens") is not None:
            o.output_tokens = u["output_tokens"]
    elif kind in ("response.completed", "response.incomplete"):
        u = (obj.get("response") or {}).get("usage") or {}
        if u:
            o.prompt_tokens = u.get("input_tokens")
            o.cached_tokens = (u.get("input_tokens_details") or {}).get("cached_tokens")
            o.output_tokens = u.get("output_tokens")


def send(client: httpx.Client, url: str, q: W5Req, cold: bool, timeout_s: float) -> Outcome:
    """POST one streamed request; never raises on HTTP or parse errors."""
    body = dict(q.body, temperature=0.0)  # greedy: neither API has a seed
    if cold:
        body["cache_prompt"] = False
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "unused"} if q.route == "/v1/messages" else {}
    t0 = time.perf_counter()
    o = Outcome(False, 0, 0.0, 0.0)
    out: list[str] = []
    try:
        with client.stream("POST", url + q.route, json=body, headers=headers,
                           timeout=httpx.Timeout(timeout_s, connect=10.0)) as resp:
            o.status = resp.status_code
            if resp.status_code != 200:
                resp.read()
                o.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                o.total_s = time.perf_counter() - t0
                return o
            for kind, obj in sse_events(resp):
                text = _delta_text(kind or "", obj)
                if not o.ttft_s and (text or kind in FIRST_OUTPUT):
                    o.ttft_s = time.perf_counter() - t0
                if text:
                    out.append(text)
                _usage(kind or "", obj, o)
                if kind in ("error", "response.failed"):
                    o.error = json.dumps(obj)[:200]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        o.error = repr(e)
        o.total_s = time.perf_counter() - t0
        return o
    o.total_s = time.perf_counter() - t0
    o.ttft_s = o.ttft_s or o.total_s
    o.output = "".join(out)
    o.ok = not o.error
    return o


@dataclass
class Args:
    model: Path
    threads: int = 2
    ctx: int = 32768
    timeout_s: float = 1800.0
    log_dir: Path = field(default_factory=lambda: Path("/tmp/w5-logs"))
    omp: str | None = None


def run_round(reqs: list[W5Req], systems: list[tuple[System, tuple[str, ...]]], args: Args, rnd: int,
              cold: bool = False, log=print) -> list[dict]:
    """Start every system, send each request to each system that takes its shape (rotating who goes first),
    stop them. systems: (system, the shapes it is sent)."""
    running, records = {}, []
    try:
        for i, (s, _) in enumerate(systems):
            running[s.name] = launch(s, args.model, BASE_PORT + 20 * cold + i, args.threads, args.ctx,
                                     args.log_dir, None, "W5", omp_wait_policy=args.omp)
        for r in running.values():
            r.wait_idle()
        with httpx.Client() as client:
            for idx, q in enumerate(reqs):
                takers = [(s, shapes) for s, shapes in systems if q.shape in shapes]
                k = idx % max(len(takers), 1)
                for s, _ in takers[k:] + takers[:k]:
                    o = send(client, running[s.name].url, q, cold, args.timeout_s)
                    running[s.name].wait_idle()
                    rec = {"round": rnd, "system": s.name, "cold": cold, "session": q.session, "shape": q.shape,
                           "turn": q.turn, "route": q.route, "max_tokens": q.max_tokens, **vars(o)}
                    records.append(rec)
                    log(f"r{rnd} {q.key:<22} {s.name + (' cold' if cold else ''):<22} "
                        f"{'ok ' if o.ok else 'ERR'} TTFT {o.ttft_s:7.2f} s total {o.total_s:7.2f} s prompt "
                        f"{o.prompt_tokens} cached {o.cached_tokens} {o.error[:80]}")
    finally:
        for r in running.values():
            r.stop()
    return records


def summarize(records: list[dict]) -> list[dict]:
    """Per (system, session, shape): requests served/refused, Σ TTFT and Σ request time (the session's wall, the
    answers' decoding included; medians over rounds), output tokens, cached share, and how
    many answers differ from their cold run. An empty cold answer is no reference (two empty strings compare
    equal whatever the servers did), so it is not counted as compared."""
    cold = {(r["session"], r["shape"], r["turn"]): r["output"] for r in records if r["cold"] and r["ok"] and r["output"]}
    rows = []
    keys = sorted({(r["system"], r["session"], r["shape"]) for r in records if not r["cold"]})
    for system, session, shape in keys:
        rs = [r for r in records if not r["cold"] and (r["system"], r["session"], r["shape"]) == (system, session, shape)]
        rounds = sorted({r["round"] for r in rs})
        sums = [sum(r["ttft_s"] for r in rs if r["round"] == k and r["ok"]) for k in rounds]
        walls = [sum(r["total_s"] for r in rs if r["round"] == k and r["ok"]) for k in rounds]
        ok = [r for r in rs if r["ok"]]
        prompt = sum(r["prompt_tokens"] or 0 for r in ok)
        cached = sum(r["cached_tokens"] or 0 for r in ok)
        compared = [r for r in ok if (session, shape, r["turn"]) in cold]
        differ = sum(r["output"] != cold[(session, shape, r["turn"])] for r in compared)
        rows.append({"system": system, "session": session, "shape": shape, "served": len(ok),
                     "refused": len(rs) - len(ok), "refusal": next((r["error"] for r in rs if not r["ok"]), ""),
                     "sum_ttft_s": statistics.median(sums) if sums else None, "sum_ttft_rounds": sums,
                     "sum_total_s": statistics.median(walls) if walls else None, "sum_total_rounds": walls,
                     "output_tokens": sum(r.get("output_tokens") or 0 for r in ok),
                     "cached_share": cached / prompt if prompt else None,
                     "compared": len(compared), "differ": differ})
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# W5: Claude Code and Codex sessions ({meta['turns']} turns, {meta['reps']} round(s))", "",
             f"Command: `{meta['command']}`  ", f"Model: {meta['model']}; CPU: {meta['cpu']}; load before: "
             f"{meta['load']}", "",
             "| session | shape | system | served | refused | Σ TTFT s (rounds) | Σ request s (rounds) | output tokens "
             "| cached share | differ from cold |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, wall = ("—" if r[key] is None or not r["served"] else f"{r[key]:.1f} (" + ", ".join(
            f"{x:.1f}" for x in r[rounds]) + ")" for key, rounds in (("sum_ttft_s", "sum_ttft_rounds"),
                                                                     ("sum_total_s", "sum_total_rounds")))
        share = "—" if r["cached_share"] is None else f"{100 * r['cached_share']:.0f}%"
        refused = str(r["refused"]) + (f": {r['refusal'][:60]}" if r["refused"] else "")
        lines.append(f"| {r['session']} | {r['shape']} | {r['system']} | {r['served']} | {refused} | {s} | {wall} | "
                     f"{r['output_tokens']} | {share} | "
                     f"{r['differ']} of {r['compared']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import os
    import platform
    import sys

    ap = argparse.ArgumentParser(prog="python -m bench w5", description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--cold", choices=("last", "all", "none"), default="last")
    ap.add_argument("--systems", default="orchestrator,llama-server")
    add_variant_args(ap)
    ap.add_argument("--orchestrator-shapes", default="cli,moved", help="shapes sent to orchestrator (cli, moved)")
    ap.add_argument("--omp", choices=("default", "passive"), default="default")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="the tiny preset, 2 turns: checks the harness")
    args = ap.parse_args(argv)
    from bench.render import Renderer
    from orchestrator.models.synth import ensure_model

    if args.quick:
        args.model, args.turns = args.model or ensure_model("tiny"), min(args.turns, 2)
    model = args.model or ensure_model("qwen3.5-0.8b")
    reqs = plan(args.turns, Renderer(model).tokenize)
    # llama-server is sent both shapes (it refuses the CLIs' own); orchestrator the ones --orchestrator-shapes names
    ours = tuple(args.orchestrator_shapes.split(","))
    systems = [(s, ours if s.kind == "orchestrator" else SHAPES)
               for s in with_variants(ap, args, [SYSTEMS[name] for name in args.systems.split(",")])]
    args.out.mkdir(parents=True, exist_ok=True)
    run_args = Args(model=model, threads=args.threads, log_dir=args.out / "logs", omp=omp_policy(args.omp))
    log_file = (args.out / "log.txt").open("a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    meta = {"turns": args.turns, "reps": args.reps, "model": model.name, "cpu": platform.processor() or
            _cpu_name(), "load": os.getloadavg(), "command": "python -m bench w5 " + " ".join(sys.argv[1:] if
                                                                                          argv is None else argv)}
    records: list[dict] = []
    for rnd in range(1, args.reps + 1):
        records += run_round(reqs, systems, run_args, rnd, log=log)
        (args.out / "requests.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    if args.cold != "none":
        last = max(q.turn for q in reqs)
        cold_reqs = [q for q in reqs if (args.cold == "all" or q.turn == last) and q.shape in ours]
        cold_sys = [(System("orchestrator", "orchestrator", "chat", cold=True), ours)]
        records += run_round(cold_reqs, cold_sys, run_args, 0, cold=True, log=log)
    rows = summarize(records)
    (args.out / "requests.json").write_text(json.dumps({"meta": meta, "records": records, "summary": rows},
                                                       indent=1))
    (args.out / "results.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
