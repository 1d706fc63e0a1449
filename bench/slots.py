"""Parallel slots: aggregate decode throughput, TTFT next to a long prefill, and memory per slot.

    python -m bench slots                  # synthetic qwen3.5-0.8b (built once), 2 threads
    python -m bench slots --model my.gguf --threads 4 --long-tokens 4000

Measures, in one process:
  * decode throughput: N requests (N = 1, 2, 4) with short distinct prompts generating --gen tokens each at
    once; aggregate completion tokens per second over the decode phase (first token of the first request to
    the last token of the last), with the decode steps batched into one llama_decode and one at a time (what N
    separate contexts would do: they cannot share a llama_decode call);
  * TTFT of short requests (a new ~60-token prompt, 1 token out) that arrive one after another while another
    conversation prefills --long-tokens tokens cold: p50 / p95 per configuration (1 slot: they queue behind
    the long prefill; 2 slots with several --prefill-chunk values: they are interleaved with it);
  * memory per slot: anonymous resident memory (RssAnon, so the mmapped weights do not count) added by one
    context with N sequences, against N contexts of one sequence each; and the engine's own estimate
    (recurrent state + n_ctx x KV bytes per token, from llama.cpp's state sizes).
Writes bench/results/<date>/slots.json and prints tables. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import json
import statistics
import threading
import time
from pathlib import Path

from bench.common import add_model_args, results_dir, write_json
from orchestrator import calibration
from orchestrator.cache.snapshots import SnapshotCache
from orchestrator.engine import Engine
from orchestrator.runtime import resolve_model
from orchestrator.config import Config
from orchestrator.request import Job
from orchestrator.scheduler import Scheduler
from orchestrator.cache.tiers import RamTier

MiB = 1 << 20


def rss_anon() -> int:
    """Anonymous resident bytes of this process (/proc/self/status RssAnon; Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("RssAnon not found in /proc/self/status (Linux only)")


def prompt(engine: Engine, i: int, n_words: int) -> list[int]:
    words = " ".join(f"item{i}-{k}" for k in range(n_words))
    return engine.tokenize(f"Request {i}: list these back in reverse order: {words}.")


def run_all(sched: Scheduler, jobs: list[Job]) -> list:
    """Submit all jobs at once; [(result, submit time)]."""
    done = [threading.Event() for _ in jobs]
    out: list = [None] * len(jobs)

    def sink_for(i):
        def sink(ev):
            if ev.kind != "text":
                out[i] = ev.result if ev.kind == "done" else ev.error
                done[i].set()
        return sink

    t0 = time.perf_counter()
    for i, j in enumerate(jobs):
        sched.submit(j, sink_for(i))
    for d in done:
        d.wait()
    for r in out:
        if isinstance(r, Exception):
            raise r
    return [(r, t0) for r in out]


def throughput(engine: Engine, n: int, batched: bool, gen: int) -> dict:
    sched = Scheduler(engine, SnapshotCache([RamTier(0)]), n_slots=n, batch_widths=tuple(range(2, n + 1)) if batched else ())
    try:
        jobs = [Job(prompt(engine, i, 12), max_tokens=gen, use_cache=False) for i in range(n)]
        t0 = time.perf_counter()
        results = run_all(sched, jobs)
        t_end = time.perf_counter()
        first = min(t0 + r.ttft_s for r, _ in results)
        tokens = sum(len(r.completion_tokens) for r, _ in results)
        return {"slots": n, "batched": batched, "completion_tokens": tokens,
                "decode_tok_s": round((tokens - n) / (t_end - first), 2)}
    finally:
        sched.close()


def ttft_next_to_prefill(engine: Engine, slots: int, chunk: int, long_tokens: int, shorts: int) -> dict:
    sched = Scheduler(engine, SnapshotCache([RamTier(0)]), n_slots=slots, prefill_chunk=chunk)
    try:
        words = max(1, long_tokens // 4)
        long_job = Job(prompt(engine, 999, words)[:long_tokens], max_tokens=1, use_cache=False)
        done = threading.Event()
        box: list = []
        sched.submit(long_job, lambda ev: (box.append(ev), done.set()) if ev.kind != "text" else None)
        time.sleep(0.5)
        ttfts = []
        for i in range(shorts):
            if done.is_set():
                break
            r = sched.run(Job(prompt(engine, i, 12), max_tokens=1, use_cache=False))
            ttfts.append(r.ttft_s)
        done.wait()
        long_r = box[0].result
        ttfts.sort()
        return {"slots": slots, "prefill_chunk": chunk, "long_prompt_tokens": long_r.prompt_tokens,
                "long_ttft_s": round(long_r.ttft_s, 3), "short_requests": len(ttfts),
                "short_ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
                "short_ttft_p95_s": round(ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))], 3) if ttfts else None}
    finally:
        sched.close()


def memory(path: Path, n: int, n_ctx: int, threads: int, min_segment: int) -> dict:
    base = rss_anon()
    one = Engine(path, n_ctx=n_ctx, n_threads=threads, n_seq_max=n)
    one.calibrate(min_segment)
    rec, kv_token = calibration.state_sizes(one)
    grown_one = rss_anon() - base
    one.close()
    base = rss_anon()
    many = [Engine(path, n_ctx=n_ctx, n_threads=threads, n_seq_max=1) for _ in range(n)]
    grown_many = rss_anon() - base
    for e in many:
        e.close()
    return {"slots": n, "n_ctx_per_slot": n_ctx,
            "one_context_mib_per_slot": round(grown_one / n / MiB, 1),
            "n_contexts_mib_per_slot": round(grown_many / n / MiB, 1),
            "estimate_mib_per_slot": round((rec + n_ctx * kv_token) / MiB, 1),
            "recurrent_mib": round(rec / MiB, 2), "kv_kib_per_token": round(kv_token / 1024, 2)}


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--gen", type=int, default=48, help="tokens generated per request in the throughput runs")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the throughput runs (median)")
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--shorts", type=int, default=12, help="short requests sent during the long prefill")
    ap.add_argument("--chunks", default="64,128,256,512", help="--prefill-chunk values to try with 2 slots")
    ap.add_argument("--parts", default="memory,throughput,ttft",
                    help="which measurements to run; the others are kept from an earlier slots.json")
    ap.add_argument("--ctx-size", type=int, default=8192)
    ap.add_argument("--out", type=Path, default=results_dir())
    a = ap.parse_args(argv)
    path = resolve_model(dataclasses.replace(Config(), model=a.model))

    parts = set(a.parts.split(","))
    out_file = a.out / "slots.json"
    result = json.loads(out_file.read_text()) if out_file.is_file() else {}
    engine = Engine(path, n_ctx=a.ctx_size, n_threads=a.threads, n_seq_max=4)
    engine.calibrate(calibration.measure_min_segment(engine))  # once
    print(f"min_segment: {engine.min_segment}", flush=True)
    result.update({"model": str(path), "threads": a.threads, "min_segment": engine.min_segment})
    if "memory" in parts:
        result["memory"] = [memory(path, n, a.ctx_size, a.threads, engine.min_segment) for n in (1, 4)]
        print(table(result["memory"]), flush=True)
    if "throughput" in parts:
        result["batch_invariant"] = calibration.check_batch_invariance(engine)
        print(f"batch-invariant decoding on this model: {result['batch_invariant']}", flush=True)
        configs = [(1, False), (2, False), (2, True), (4, False), (4, True)]
        runs: dict = {c: [] for c in configs}
        for _round in range(a.repeats):  # interleaved, so that machine drift hits every configuration alike
            for n, batched in configs:
                runs[(n, batched)].append(throughput(engine, n, batched, a.gen))
                print(runs[(n, batched)][-1], flush=True)
        tput = []
        for c in configs:
            row = dict(runs[c][0])
            row["decode_tok_s"] = statistics.median(r["decode_tok_s"] for r in runs[c])
            row["runs_tok_s"] = [r["decode_tok_s"] for r in runs[c]]
            tput.append(row)
        for row in tput:
            row["speedup_vs_1_slot"] = round(row["decode_tok_s"] / tput[0]["decode_tok_s"], 2)
        result["throughput"] = tput
    if "ttft" in parts:
        ttft = [ttft_next_to_prefill(engine, 1, 128, a.long_tokens, a.shorts)]
        print(ttft[-1], flush=True)
        for chunk in (int(c) for c in a.chunks.split(",")):
            ttft.append(ttft_next_to_prefill(engine, 2, chunk, a.long_tokens, a.shorts))
            print(ttft[-1], flush=True)
        result["ttft_next_to_long_prefill"] = ttft
    engine.close()
    for key in ("memory", "throughput", "ttft_next_to_long_prefill"):
        if result.get(key):
            print("\n" + table(result[key]))
    write_json(out_file, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
