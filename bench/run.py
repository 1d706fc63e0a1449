"""Side-by-side benchmark (issue 5): orchestrator vs llama-server vs llama-cpp-python's server on W1/W2/W3.

    python -m bench                    # (= python -m bench side-by-side) default scale (about 30-40 min on 2 cores), all systems and workloads
    python -m bench --quick            # a smoke run of every code path (a few minutes)
    python -m bench --compass          # the default, with W3 at 8 agents x 6 turns (issue 12)
    python -m bench --full             # the issue's full W3 scale (8 agents x 6 turns, 200-1,500-token results)
    python -m bench --systems orchestrator,llama-server --workloads W1
    python -m bench --workloads W4,CHAT --before /tmp/before   # closed loops (bench/agentloop.py), with
                                                               # orchestrator as of another checkout too

Each round of a workload runs against freshly started servers, all systems at once on their own ports, and
every request goes to each system in turn (only one computes at a time, and the next waits until the previous
server's CPU is idle), so machine drift hits all systems alike. After a workload's warm rounds, its distinct
prompts are run once more on cold variants of each system (see bench/systems.py) for the correctness check
and the prefill-speed fit behind "implied cached tokens". Writes bench/results/<date>/: requests.json (every
request), results.md, ttft_<W>.png, cached_<W>.png; server logs under logs/ (not committed).

W4 (the agent tool loop) and CHAT (a plain chat with thinking on) are closed loops: all agents at once against one
system, each appending what that server answered (bench/agentloop.py); one fresh server per run, `--loop-reps`
rounds alternating the systems. Their runs go to requests.json under "loops" and to results.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import httpx

from bench import report
from bench.client import request_body, send
from bench.common import ROOT
from bench.render import Renderer
from bench import agentloop
from bench.scenarios import Req, Scale, chat, w1, w2, w3, w4
from bench.systems import (SYSTEMS, RssSampler, Running, before_system, cold_variant,
                           launch, llama_server_binary, omp_policy, add_variant_args,
                           with_variants)

LOOPS = ("W4", "CHAT")

BASE_PORT = 18400


def missing_dependencies(systems) -> list[str]:
    """What this run needs and cannot import or find, checked before anything starts (a run that dies after
    minutes for want of matplotlib loses the part it had not saved): matplotlib for the plots, llama_cpp.server
    and its web stack for the llama-cpp-python peer, cmake and ninja to build llama-server when it is missing."""
    import importlib.util
    import shutil

    need = ["matplotlib"]
    if any(s.kind == "llama-cpp-python" for s in systems):
        need += ["llama_cpp.server", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings"]
    missing = []
    for mod in need:
        try:
            found = importlib.util.find_spec(mod) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(mod)
    if any(s.kind == "llama-server" for s in systems) and not llama_server_binary().exists():
        missing += [tool for tool in ("cmake", "ninja") if shutil.which(tool) is None]
    return missing


def default_model() -> Path:
    """The synthetic qwen3.5-0.8b Q4_K_M (built once into the user cache by orchestrator)."""
    out = subprocess.run([sys.executable, "-m", "orchestrator", "synth-model", "--preset", "qwen3.5-0.8b"],
                         check=True, capture_output=True, text=True, cwd=ROOT, timeout=900)
    return Path(out.stdout.strip().splitlines()[-1])


def _digest(text: str) -> str:
    """A short stable id of a prompt (the JSON keeps ids, not whole conversations)."""
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def log(msg: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


class Progress:
    """Counts requests sent against the total planned, with an elapsed-time estimate of what is left."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.t0 = time.monotonic()

    def step(self) -> str:
        self.done += 1
        el = time.monotonic() - self.t0
        eta = el / self.done * (self.total - self.done)
        return f"{self.done}/{self.total} ({el / 60:.1f} min, ~{eta / 60:.0f} min left)"


def run_phase(reqs: list[Req], systems, args, texts, tokens, oracle, sampler: RssSampler, prog: Progress,
              log_dir: Path, cold: bool, cache_ram: dict[str, int | None]) -> list[dict]:
    """Start `systems`, send every request to each in turn (rotating who goes first), stop them; records."""
    running: dict[str, Running] = {}
    records: list[dict] = []
    try:
        for i, s in enumerate(systems):
            port = BASE_PORT + (50 if cold else 0) + i
            t = time.monotonic()
            running[s.name] = launch(s, args.model, port, args.threads, args.scale.ctx_size, log_dir,
                                     cache_ram.get(s.kind), reqs[0].workload, omp_wait_policy=args.omp_wait_policy)
            sampler.add(s.name + ("-cold" if cold else ""), running[s.name])
            log(f"  started {s.name}{' (cold)' if cold else ''} on :{port} in {time.monotonic() - t:.1f} s")
        for r in running.values():  # none is still starting up (loading, warming up) under the first request
            r.wait_idle()
        with httpx.Client() as client:
            for idx, q in enumerate(reqs):
                order = systems[idx % len(systems):] + systems[:idx % len(systems)]
                for s in order:
                    r = running[s.name]
                    key = s.name + ("-cold" if cold else "")
                    sampler.window_start(key)
                    body = request_body(s.api, s.kind, q.body, texts[q.key], q.max_tokens, cold)
                    o = send(client, r.url, s.api, body, timeout_s=args.request_timeout)
                    rss = sampler.window_peak(key)
                    idle = r.wait_idle()
                    rec = {
                        "workload": q.workload, "round": q.round, "label": q.label, "index": q.meta["index"],
                        "system": s.name, "cold_group": s.cold_group, "cold": cold,
                        "key": _digest(q.key), "prompt_key": _digest(json.dumps(q.body, sort_keys=True)),
                        "max_tokens": q.max_tokens, "meta": q.meta, "prompt_tokens": len(tokens[q.key]),
                        "oracle": oracle.get((q.round, q.meta["index"]), 0),
                        "prompt_tokens_reported": o.prompt_tokens, "cached_reported": o.cached_tokens,
                        "ttft_s": o.ttft_s, "total_s": o.total_s, "output": o.output, "ok": o.ok,
                        "error": o.error, "rss_peak_bytes": rss, "idle_wait_s": idle,
                        "server_timings": o.server_timings,
                    }
                    records.append(rec)
                    cached = "—" if o.cached_tokens is None else o.cached_tokens
                    status = "ok" if o.ok else f"FAILED {o.error[:120]}"
                    log(f"{prog.step()} {q.round} {q.label:<18} {s.name + (' cold' if cold else ''):<24} "
                        f"TTFT {o.ttft_s:7.3f} s  total {o.total_s:7.3f} s  prompt {len(tokens[q.key]):>5} "
                        f"cached {cached!s:>5} (oracle {rec['oracle'] if not cold else '-'})  {status}")
    finally:
        for name, r in running.items():
            sampler.remove(name + ("-cold" if cold else ""))
            r.stop()
    return records


def cold_selection(reqs: list[Req], mode: str) -> list[Req]:
    """Distinct prompts to run cold: one per prompt at its largest max_tokens ('all'); 'last' keeps on W3 only
    each agent's last turn (its deepest restore, after the most evictions to disk)."""
    best: dict[str, Req] = {}
    for q in reqs:
        pk = json.dumps(q.body, sort_keys=True)
        if pk not in best or q.max_tokens > best[pk].max_tokens:
            best[pk] = q
    out = list(best.values())
    if mode == "last":
        last_turn = max((q.meta.get("turn", 0) for q in out if q.workload == "W3"), default=0)
        out = [q for q in out if q.workload != "W3" or q.meta.get("turn") == last_turn]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench [side-by-side]", description=__doc__.splitlines()[0],
                                 epilog="The other benchmarks: python -m bench --list.")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_const", dest="scale_name", const="quick", help="smoke-run scale")
    g.add_argument("--compass", action="store_const", dest="scale_name", const="compass",
                   help="the default scale with W3 at 8 agents x 6 turns (issue 12)")
    g.add_argument("--full", action="store_const", dest="scale_name", const="full", help="issue 5's full scale")
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the synthetic qwen3.5-0.8b Q4_K_M)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {', '.join(SYSTEMS)}")
    add_variant_args(ap)
    ap.add_argument("--workloads", default="W1,W2,W3")
    ap.add_argument("--cache-ram", type=int, default=4096, help="orchestrator --cache-ram on W1/W2, MiB")
    ap.add_argument("--w3-cache-ram", type=int, default=192,
                    help="orchestrator --cache-ram on W3, MiB: small enough that the disk tier serves restores")
    ap.add_argument("--cold", choices=["all", "last", "none"], default=None,
                    help="cold references: every distinct prompt (all), or on W3 only each agent's last turn "
                         "(last); default: all with --quick, else last")
    ap.add_argument("--request-timeout", type=float, default=900.0, help="seconds per request")
    ap.add_argument("--loop-reps", type=int, default=2, help="W4/CHAT: runs per system, alternating systems")
    ap.add_argument("--before", type=Path, default=None,
                    help="also run orchestrator from this checkout (e.g. `git worktree add /tmp/before "
                         "4151288`, the commit before a change) as orchestrator-before")
    ap.add_argument("--tool-choice", default=None, choices=["auto", "required"],
                    help="W4: send tool_choice (default: none sent; 'required' needs grammar-constrained calls)")
    ap.add_argument("--thinking", choices=["on", "off"], default="on",
                    help="W4: thinking on (the template's default) or off (chat_template_kwargs enable_thinking "
                         "false; orchestrator's tool-call grammar is lazy until </think> with thinking on, so "
                         "--tool-choice required forces a call only with thinking off)")
    ap.add_argument("--loop-cold", choices=["last", "none"], default=None,
                    help="W4/CHAT: after the first run of each system, send each agent's last request again "
                         "with cache_prompt false and compare (default: last with --quick, else none)")
    ap.add_argument("--omp", choices=["default", "passive"], default="default",
                    help="OpenMP wait policy of every server: OpenMP's default (spin, then sleep: what a user gets) "
                         "or passive (OMP_WAIT_POLICY=PASSIVE, for a machine shared with other jobs)")
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/<UTC date>/")
    args = ap.parse_args(argv)
    args.omp_wait_policy = omp_policy(args.omp)
    args.scale_name = args.scale_name or "default"
    args.scale = Scale.named(args.scale_name)
    args.cold = args.cold or ("all" if args.scale_name == "quick" else "last")
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        ap.error(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
    systems = with_variants(ap, args, [SYSTEMS[n] for n in names])
    workloads = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    loops = [w for w in workloads if w in LOOPS]
    workloads = [w for w in workloads if w not in LOOPS]
    args.loop_cold = args.loop_cold or ("last" if args.scale_name == "quick" else "none")
    day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    out = args.out or ROOT / "bench" / "results" / day
    out.mkdir(parents=True, exist_ok=True)
    log_dir = out / "logs"
    t_start = time.monotonic()

    missing = missing_dependencies(systems)
    if missing:
        ap.error(f"missing {', '.join(missing)}: install the bench extra first (pip install -e '.[bench]')")
    if any(s.kind == "llama-server" for s in systems) and not llama_server_binary().exists():
        log("llama-server is not built; running bench/install_llama_server.sh (several minutes on 2 cores)")
        subprocess.run(["bash", str(ROOT / "bench" / "install_llama_server.sh")], check=True)
    args.model = args.model or default_model()
    log(f"model {args.model}")
    rend = Renderer(args.model)
    pt = lambda b: len(rend.tokens(b))  # noqa: E731
    gens = {"W1": lambda: w1(rend.tokenize, args.scale, pt), "W2": lambda: w2(rend.tokenize, args.scale),
            "W3": lambda: w3(rend.tokenize, args.scale, pt)}
    plan: dict[str, list[Req]] = {w: gens[w]() for w in workloads}
    loop_plans = {w: (w4 if w == "W4" else chat)(rend.tokenize, args.scale) for w in loops}
    if "W4" in loop_plans and args.thinking == "off":
        loop_plans["W4"].chat_template_kwargs = {"enable_thinking": False}
    before = [before_system(args.before)] if args.before else []
    loop_systems = {"W4": [s for s in systems if s.kind != "llama-cpp-python"] + before,
                    "CHAT": [s for s in systems if s.kind == "orchestrator"] + before}
    systems, names = systems + before, names + [s.name for s in before]  # W1-W3 run it too
    texts: dict[str, str] = {}
    tokens: dict[str, list[int]] = {}
    oracle: dict[tuple[str, int], int] = {}
    for reqs in plan.values():
        by_round: dict[str, list[Req]] = {}
        for q in reqs:
            texts[q.key] = rend.text(q.body)
            tokens[q.key] = rend.tokens(q.body)
            by_round.setdefault(q.round, []).append(q)
        for rnd, rq in by_round.items():
            for i, (q, o) in enumerate(zip(rq, report.oracle([tokens[x.key] for x in rq]))):
                q.meta["index"] = i
                oracle[(rnd, i)] = o
    cold_groups = list({cold_variant(s).name: cold_variant(s) for s in systems}.values())
    colds = {w: (cold_selection(reqs, args.cold) if args.cold != "none" else []) for w, reqs in plan.items()}
    total = sum(len(r) for r in plan.values()) * len(systems) + sum(len(c) for c in colds.values()) * len(cold_groups)
    log(f"scale {args.scale_name}: {asdict(args.scale)}")
    for w, lp in loop_plans.items():
        log(f"{w}: {len(lp.agents)} agent(s) x {len(lp.agents[0].max_tokens)} turns at once, "
            f"{args.loop_reps} runs each of {', '.join(s.name for s in loop_systems[w])}")
    for w, reqs in plan.items():
        log(f"{w}: {len(reqs)} requests, {sum(len(tokens[q.key]) for q in reqs):,} prompt tokens; "
            f"{len(colds[w])} cold references")
    prog = Progress(total)
    meta_load = os.getloadavg()[0]
    sampler = RssSampler()
    records: list[dict] = []
    meta = {"command": "python -m bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
            "date": day, "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "load_start": meta_load, "scale_name": args.scale_name, "scale": asdict(args.scale), "model": str(args.model),
            "threads": args.threads, "ctx_size": args.scale.ctx_size, "systems": names, "omp": args.omp,
            "cold_groups": [c.name for c in cold_groups], "cold_mode": args.cold,
            "orchestrator_cache_ram_mib": {"W1": args.cache_ram, "W2": args.cache_ram, "W3": args.w3_cache_ram},
            "commands": {}, "loops": {}}
    loop_runs: list[dict] = []
    for w, lp in loop_plans.items():
        meta["loops"][w] = {
            "systems": [s.name for s in loop_systems[w]], "reps": args.loop_reps, "tool_choice": args.tool_choice,
            "cold": args.loop_cold, "before": str(args.before) if args.before else None,
            "description": loop_description(lp, args)}
    from bench.systems import command  # only for recording the exact command lines
    for w in workloads:
        for s in systems + cold_groups:
            meta["commands"][f"{w} {s.name}" + (" (cold)" if s.cold else "")] = " ".join(
                command(s, args.model, 0, args.threads, args.scale.ctx_size,
                        args.w3_cache_ram if w == "W3" else args.cache_ram, Path("$TMP"), w))
    for w in loop_plans:
        for s in loop_systems[w]:
            meta["commands"][f"{w} {s.name}"] = (f"PYTHONPATH={s.root} " if s.root else "") + " ".join(
                command(s, args.model, 0, args.threads, args.scale.w4_ctx_size, args.cache_ram, Path("$TMP"), w))

    def save() -> None:
        meta["wall_s"] = time.monotonic() - t_start
        summaries = [agentloop.summarize_run(r) for r in loop_runs]
        loops_md = agentloop.markdown(summaries, loop_runs, meta) if loop_runs else ""
        if not records:  # closed loops only
            (out / "requests.json").write_text(json.dumps({"meta": meta, "loops": {
                "summaries": summaries, "runs": loop_runs}}, indent=1))
            (out / "results.md").write_text(
                f"# Closed-loop benchmark ({meta['date']})\n\nCommand: `{meta['command']}`  \n"
                f"Scale: {meta['scale_name']}  \nModel: {meta['model']}; threads {meta['threads']}; context "
                f"{args.scale.w4_ctx_size} tokens a slot; greedy, seed 1234; wall time {meta['wall_s']:.0f} s  \n"
                f"Load average (1 min) at start {_f2(meta.get('load_start'))}, at end {_f2(meta.get('load_end'))}\n" + loops_md)
            return
        fits = report.annotate(records)
        summary = report.summarize(records, names)
        w1rows = report.w1_speedups(records, names)
        meta["wall_s"] = time.monotonic() - t_start
        meta["cold_fits"] = {g: ({"a_s": f[0], "s_per_token": f[1], "tokens_per_s": 1 / f[1]} if f else None)
                             for g, f in fits.items()}
        (out / "requests.json").write_text(json.dumps({"meta": meta, "summary": summary, "w1": w1rows,
                                                       "requests": records, "loops": {
                                                           "summaries": summaries, "runs": loop_runs}}, indent=1))
        (out / "results.md").write_text(report.markdown(summary, w1rows, records, names, meta) + loops_md)
        try:  # the data is on disk already: a failed plot must not lose the rest of the run
            report.plots(records, names, out)
        except Exception as e:  # noqa: BLE001 - any plotting failure
            log(f"plots failed ({type(e).__name__}: {e}); requests.json and results.md are complete")

    try:
        for w, reqs in plan.items():
            cache_ram = {"orchestrator": args.w3_cache_ram if w == "W3" else args.cache_ram}
            rounds: dict[str, list[Req]] = {}
            for q in reqs:
                rounds.setdefault(q.round, []).append(q)
            for rnd, rq in rounds.items():
                log(f"== {rnd}: {len(rq)} requests x {len(systems)} systems")
                records += run_phase(rq, systems, args, texts, tokens, oracle, sampler, prog, log_dir, False,
                                     cache_ram)
            if colds[w]:
                log(f"== {w} cold references: {len(colds[w])} prompts x {len(cold_groups)} systems")
                records += run_phase(colds[w], cold_groups, args, texts, tokens, oracle, sampler, prog, log_dir,
                                     True, cache_ram)
            save()
        for w, lp in loop_plans.items():
            agentloop.run_loops(lp, loop_systems[w], args, log_dir, args.loop_reps,
                                args.tool_choice if w == "W4" else None, args.loop_cold, BASE_PORT + 100, log,
                                on_run=lambda r: (loop_runs.append(r), save()))  # saved run by run
    finally:
        sampler.close()
        meta["load_end"] = os.getloadavg()[0]
        if records or loop_runs:
            save()
    log(f"done in {(time.monotonic() - t_start) / 60:.1f} min; results in {out}")
    print((out / "results.md").read_text().split("## W1")[0].split("### ")[0])
    return 0


def _f2(v) -> str:
    return "—" if v is None else f"{v:.2f}"


def loop_description(lp, args) -> str:
    """One paragraph saying what a closed-loop workload did (for results.md)."""
    sc = args.scale
    if lp.workload == "W4":
        return (f"{len(lp.agents)} agents at once, each a task of {sc.w4_turns} turns: a shared tools block of "
                f"{len(lp.tools)} schemas (~{sc.w4_tools_tokens:,} tokens), its own system text (~"
                f"{sc.w4_system_tokens} tokens) and task; max_tokens per turn {sc.w4_gen[0]}-{sc.w4_gen[1]} "
                f"(seeded per agent and turn, the same for every system); after each answer, {sc.w4_delay_s} s "
                f"later, a tool output of {sc.w4_tool[0]:,}-{sc.w4_tool[1]:,} tokens. The agent appends the "
                f"answer as returned (content, reasoning_content, tool_calls) and then the output: as `tool` "
                f"messages when the answer had tool calls, else as a user message (the random-weight model almost"
                f" never writes a well-formed call{'' if args.tool_choice else '; tool_choice not sent'}"
                f"{'; tool_choice ' + args.tool_choice if args.tool_choice else ''}). "
                f"{'Thinking on (the template' + chr(39) + 's default)' if args.thinking == 'on' else 'Thinking off'}. "
                f"Context {sc.w4_ctx_size:,} tokens a slot: orchestrator 4 slots, llama-server -np 3.")
    return (f"One conversation of {sc.chat_turns} user turns (~{sc.chat_user_tokens} tokens each), no tools, "
            f"thinking on; max_tokens per turn {sc.chat_gen[0]}-{sc.chat_gen[1]} (seeded); the next user turn "
            f"{sc.chat_delay_s} s after each answer.")


if __name__ == "__main__":
    sys.exit(main())
