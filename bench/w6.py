"""W6: one Claude Code session grown past 64k tokens, a server restart halfway, a RAM budget a quarter of its bytes.

The session is W5's Claude Code session (bench/w5.py `claude_session`: the captured first request, then per turn
one scripted Bash tool_use and its tool_result, sent as the CLI sends them) with tool results of 200-5,000 tokens,
drawn log-uniformly (most outputs short, a few long; seeded), and `--max-tokens` per answer (greedy). It runs
until both `--turns` turns are done and the prompt has reached `--min-tokens` tokens (as the server counts them).
One orchestrator serves it (`-np 1`, `-c` of `--ctx` tokens), with a disk tier in a directory of its own and
`--cache-ram` set to a quarter of the bytes the session is expected to store (`stored_estimate`: a checkpoint
per `--checkpoint-interval` tokens and two per turn, plus the last prompt's KV; the bytes it did store are
recorded); after turn `--restart-at` the server is stopped and a new one started on the same disk tier, which must
bring the session back. Per turn: TTFT, prompt, cached and new (prompt - cached) tokens, the share of the
previous request restored, the server's RSS (peak during the turn, and once idle), the disk tier's bytes on disk
and /v1/cache/stats. The last turn is then sent to a fresh cold server (`--cache-ram 0`, `cache_prompt: false`)
and its answer compared with the warm one (the streamed text, thinking signature included: w5 `_delta_text`).

    python -m bench w6 --out bench/results/<date>/w6 [--turns 40] [--min-tokens 65536] [--max-tokens 8]
    python -m bench w6 --out bench/results/<date>/w6 --rescore    # the summary again, from requests.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import httpx

from bench import w5
from bench.common import add_model_args
from bench.systems import SYSTEMS, RssSampler, System, launch, omp_policy

PORT = 18700


def result_tokens(rng: random.Random, lo: int = 200, hi: int = 5000) -> int:
    """A tool result's length in tokens: log-uniform on [lo, hi] (median about 1,000 for 200-5,000)."""
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def bodies(tokenize, turns: int, max_tokens: int, lo: int, hi: int) -> list[dict]:
    """The session's request bodies: W5's Claude Code session with results of lo-hi tokens (result_tokens)."""
    rng = random.Random("w6-claude-code")
    return w5.claude_session(w5.load_capture(w5.CLAUDE), turns, rng, tokenize, [max_tokens] * turns,
                             lambda r: result_tokens(r, lo, hi))


def stored_estimate(tokens: int, turns: int, recurrent: int, kv_per_token: int, interval: int = 512) -> int:
    """Bytes the cache is expected to hold for a session of `tokens` tokens over `turns` turns: a checkpoint every
    `interval` tokens inside long messages and two per turn (message ends), and the KV of the deepest prompt."""
    return (tokens // interval + 2 * turns) * recurrent + tokens * kv_per_token


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def turn_record(t: int, o: w5.Outcome, prev_prompt: int | None, rss_peak: int, rss_idle: int, disk: int,
                stats: dict, server: int) -> dict:
    cached = o.cached_tokens or 0
    prompt = o.prompt_tokens or 0
    return {"turn": t, "server": server, "ok": o.ok, "error": o.error, "ttft_s": o.ttft_s, "total_s": o.total_s,
            "prompt_tokens": prompt, "cached_tokens": cached, "new_tokens": prompt - cached,
            "cached_share": cached / prompt if prompt else None,
            "restored_of_previous": cached / prev_prompt if prev_prompt else None,
            "rss_peak_bytes": rss_peak, "rss_idle_bytes": rss_idle, "disk_dir_bytes": disk,
            "cache": {k: stats.get(k) for k in ("ram_entries", "ram_bytes", "ram_budget_bytes", "disk_entries",
                                                "disk_bytes", "evictions", "spills", "promotions", "dropped")},
            "output": o.output}


def flatness(rows: list[dict]) -> dict:
    """Least squares over the warm turns (not the first, not a turn that restored nothing):
    TTFT = a + b new + q new context + r context, with new the turn's new tokens and context the tokens restored
    (all in thousands; b in s per 1k new tokens, q in s per 1k new tokens per 1k of context, r in s per 1k of
    context). b + q context is the prefill of a new token at that context (its attention reads the whole context,
    in any server, cold or warm); r is what the session's length costs by itself (a re-prefill would put about a
    second per 1k tokens there on the 0.8b preset), and r_share_of_last_ttft its part of the last turn's TTFT."""
    import numpy as np

    warm = [r for r in rows[1:] if r["ok"] and r["cached_tokens"]]
    if len(warm) < 5:
        return {"turns_fitted": len(warm)}
    new = np.array([r["new_tokens"] / 1e3 for r in warm])
    ctx = np.array([r["cached_tokens"] / 1e3 for r in warm])
    x = np.c_[np.ones_like(new), new, new * ctx, ctx]
    y = np.array([r["ttft_s"] for r in warm])
    (a, b, q, c), *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ np.array([a, b, q, c])
    last = rows[-1]
    return {"turns_fitted": len(warm), "a_s": a, "b_s_per_1k_new": b, "q_s_per_1k_new_per_1k_context": q,
            "r_s_per_1k_context": c, "r2": 1 - float(resid @ resid) / float(((y - y.mean()) ** 2).sum()),
            "max_abs_residual_s": float(abs(resid).max()),
            "r_share_of_last_ttft": c * last["cached_tokens"] / 1e3 / last["ttft_s"] if last["ttft_s"] else None}


def write(out: Path, rows: list[dict], meta: dict) -> str:
    """Scores the run (flatness, restored_95) into meta and writes requests.json and results.md under out."""
    meta["flatness"] = flatness(rows)
    meta["restored_95"] = all((r["restored_of_previous"] or 0) >= 0.95 for r in rows[1:])
    (out / "requests.json").write_text(json.dumps({"meta": meta, "turns": rows}, indent=1, default=float))
    text = markdown(rows, meta) + "\n" + json.dumps({k: meta[k] for k in ("cold_last", "flatness", "restored_95",
                                                                          "stored_bytes")}, indent=1, default=float)
    (out / "results.md").write_text(text)
    return text


def markdown(rows: list[dict], meta: dict) -> str:
    out = [f"# W6 ({meta.get('system', 'orchestrator')}): one Claude Code session, {len(rows)} turns, restart after turn "
           f"{meta['restart_at']}", "",
           f"Command: `{meta['command']}`  ", f"Model: {meta['model']}; CPU: {meta['cpu']}; load before: {meta['load']}; "
           f"--cache-ram {meta['cache_ram_mib']} MiB (estimate of stored bytes {meta['stored_estimate_mib']} MiB)", "",
           "| turn | server | TTFT s | prompt | cached | new | cached share | of previous | RSS peak MiB | RSS idle MiB | "
           "RAM tier MiB | disk MiB | spills |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["cache"]
        prev = "—" if r["restored_of_previous"] is None else f"{100 * r['restored_of_previous']:.1f}%"
        out.append(f"| {r['turn']} | {r['server']} | {r['ttft_s']:.2f} | {r['prompt_tokens']} | {r['cached_tokens']} | "
                   f"{r['new_tokens']} | {100 * (r['cached_share'] or 0):.1f}% | {prev} | {r['rss_peak_bytes'] / 2**20:.0f} | "
                   f"{r['rss_idle_bytes'] / 2**20:.0f} | {(c['ram_bytes'] or 0) / 2**20:.0f} | "
                   f"{r['disk_dir_bytes'] / 2**20:.0f} | {c['spills']} |" + (f" {r['error'][:60]}" if r["error"] else ""))
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    import platform
    import sys

    ap = argparse.ArgumentParser(prog="python -m bench w6", description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--turns", type=int, default=40, help="at least this many turns")
    ap.add_argument("--min-tokens", type=int, default=65536, help="and at least this many prompt tokens")
    ap.add_argument("--result-tokens", default="200,5000", help="tool result lengths, lo,hi tokens")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--restart-at", type=int, default=20)
    ap.add_argument("--ctx", type=int, default=90112)
    ap.add_argument("--cache-ram", type=int, default=None, help="MiB (default: a quarter of stored_estimate)")
    ap.add_argument("--port", type=int, default=PORT, help="the first server's port (the next ones follow)")
    ap.add_argument("--omp", choices=("default", "passive"), default="default")
    ap.add_argument("--system", choices=("orchestrator", "llama-server", "llama-server-tuned"), default="orchestrator",
                    help="the server (a peer runs with one slot, its own cache flags, no cold comparison)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rescore", action="store_true",
                    help="run nothing: score --out's requests.json again and rewrite its results.md")
    args = ap.parse_args(argv)
    if args.rescore:
        run = json.loads((args.out / "requests.json").read_text())
        print(write(args.out, run["turns"], run["meta"]))
        return 0
    from bench.render import Renderer
    from orchestrator.models.synth import PRESETS, ensure_model

    model = args.model or ensure_model("qwen3.5-0.8b")
    lo, hi = map(int, args.result_tokens.split(","))
    llm = Renderer(model).llm  # uncached tokenize: Renderer's cache would keep every partial tool result
    plan = bodies(lambda text: llm.tokenize(text.encode(), add_bos=False, special=True), 2 * args.turns + 20,
                  args.max_tokens, lo, hi)
    sizes = PRESETS["qwen3.5-0.8b"].sizes()  # the byte sizes only steer the RAM budget; the real ones are recorded
    est = stored_estimate(args.min_tokens, args.turns, sizes.recurrent_bytes, sizes.kv_bytes_per_token)
    cache_ram = args.cache_ram or est // 4 // 2**20
    args.out.mkdir(parents=True, exist_ok=True)
    disk = Path(tempfile.mkdtemp(prefix="w6-disk-"))
    flags = ("-np", "1", "--timeout", "0", "--cache-disk-dir", str(disk), "--cache-disk", "65536")
    warm_sys, cold_sys = System("orchestrator", "orchestrator", "chat", extra=flags), \
        System("orchestrator", "orchestrator", "chat", cold=True, extra=("-np", "1", "--timeout", "0"))
    ours = args.system == "orchestrator"
    if not ours:  # the peer as bench/systems.py starts it, one slot, sent the shape its template takes (w5.moved:
        # the system text moved to the front); no disk tier, no cache stats, no cold run
        peer = SYSTEMS[args.system]
        warm_sys = dataclasses.replace(peer, extra=peer.extra + ("-np", "1"), workload_extra=())
    meta = {"model": model.name, "cpu": w5._cpu_name() or platform.processor(), "load": os.getloadavg(),
            "system": args.system, "restart_at": args.restart_at, "cache_ram_mib": cache_ram, "stored_estimate_mib": est // 2**20,
            "command": "python -m bench w6 " + " ".join(sys.argv[1:] if argv is None else argv)}
    omp = omp_policy(args.omp)

    def start(system: System, port: int):
        r = launch(system, model, port, args.threads, args.ctx, args.out / "logs", cache_ram, "W6", 1800.0, omp)
        r.wait_idle()
        return r

    rows: list[dict] = []
    sampler = RssSampler()
    server = 1
    running = start(warm_sys, args.port)
    try:
        with httpx.Client() as client:
            for t, body in enumerate(plan, 1):
                q = w5.W5Req(w5.CLAUDE, "cli", t, "/v1/messages", body, args.max_tokens) if ours else \
                    w5.W5Req(w5.CLAUDE, "moved", t, "/v1/messages", w5.moved(w5.CLAUDE, body), args.max_tokens)
                sampler.add("o", running)
                sampler.window_start("o")
                o = w5.send(client, running.url, q, False, 1800.0)
                peak = sampler.window_peak("o")
                running.wait_idle()
                stats = client.get(running.url + "/v1/cache/stats", timeout=30).json() if ours else {}
                prev = rows[-1]["prompt_tokens"] if rows else None
                rows.append(turn_record(t, o, prev, max(peak, running.rss()), running.rss(), dir_bytes(disk), stats, server))
                r = rows[-1]
                print(f"turn {t:3d} s{server} TTFT {o.ttft_s:7.2f} s prompt {r['prompt_tokens']:6d} cached "
                      f"{r['cached_tokens']:6d} new {r['new_tokens']:5d} RSS {r['rss_idle_bytes'] / 2**20:6.0f} MiB disk "
                      f"{r['disk_dir_bytes'] / 2**20:6.0f} MiB {o.error[:80]}", flush=True)
                (args.out / "requests.json").write_text(json.dumps({"meta": meta, "turns": rows}, indent=1))
                if not o.ok or (t >= args.turns and r["prompt_tokens"] >= args.min_tokens):
                    break
                if t == args.restart_at:
                    sampler.remove("o")
                    running.stop(grace_s=600.0)  # a stopped server writes its RAM snapshots to the disk tier
                    server += 1
                    running = start(warm_sys, args.port + server)
        last = w5.W5Req(w5.CLAUDE, "cli", len(rows), "/v1/messages", plan[len(rows) - 1], args.max_tokens)
        meta["stored_bytes"] = (rows[-1]["cache"]["ram_bytes"] or 0) + (rows[-1]["cache"]["disk_bytes"] or 0)
        running.stop()
        if ours:
            cold_run = start(cold_sys, args.port + 50)
            try:
                with httpx.Client() as client:
                    cold = w5.send(client, cold_run.url, last, True, 7200.0)
            finally:
                cold_run.stop()
    finally:
        sampler.close()
        running.stop()
        shutil.rmtree(disk, ignore_errors=True)
    meta["cold_last"] = {"ok": cold.ok, "ttft_s": cold.ttft_s, "prompt_tokens": cold.prompt_tokens,
                         "output": cold.output, "equal": cold.ok and bool(cold.output) and
                         cold.output == rows[-1]["output"]} if ours else None
    text = write(args.out, rows, meta)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
