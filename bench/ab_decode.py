"""Aggregate decode throughput, orchestrator against llama-server -np 4, interleaved A/B (issue 12, item 5).

    python -m bench ab-decode                      # synthetic qwen3.5-0.8b, 2 threads, 1 and 4 busy slots
    python -m bench ab-decode --gen 128 --reps 5 --variant "batched=--decode-batching on"
    python -m bench ab-decode --busy 1 --context 4000 --ctx 12288   # decode after a 4,000-token prompt

For each number of busy slots N (--busy, default 1,4), each system gets N streamed requests at once: short
distinct prompts (about 40 tokens, new every repetition so no cache is involved), greedy, --gen tokens each.
Aggregate decode tokens/s = Σ (completion tokens − 1) ÷ (last request's last token − first request's first
token): the time all N decode together, prefill excluded. Systems run at once on their own ports and take turns
(the order rotates every repetition), each round after all are idle. `--variant NAME=FLAGS` adds an orchestrator
started with more flags: `--decode-batching on` is the batched decode that gives up the guarantee that an answer
does not depend on the requests decoding next to it (orchestrator/calibration.py measures whether batching is
bit-identical on the model; when it is not, slots decode one at a time by default).

Servers run with OpenMP's default wait policy unless `--omp passive` (the side-by-side bench's setting, which
favours llama-server's prefill on a shared machine but halves one-token decode speed). llama-server runs with -np 4 and -c 4 × --ctx (so each slot has --ctx), --no-repack, -fa off, -b/-ub 512, and
ignores EOS so every request decodes --gen tokens; orchestrator stops at EOS (the random model rarely emits
it), which the token counts account for. Writes bench/results/<date>/ab_decode.json. Not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

from bench.common import RESULTS, results_dir
from bench.client import request_body, send
from bench.run import default_model
from bench.systems import SYSTEMS, System, launch, orchestrator_variants, write_ab


WORDS = ("the sea at night is dark and the light of the moon falls on the water while a ship moves slowly "
         "past the harbour where old men sit and talk about the weather").split()


def burst(url: str, kind: str, n: int, gen: int, nonce: str, context: int = 0) -> dict:
    """N concurrent streamed chat requests of `gen` tokens after `context` filler words each; their aggregate
    decode rate and each one's figures."""
    results: list[tuple[float, object]] = [None] * n  # type: ignore[list-item]

    def one(i: int) -> None:
        filler = " ".join(WORDS[(i + k * 7) % len(WORDS)] for k in range(context))
        chat = {"messages": [{"role": "user", "content": f"{nonce} request {i}: {filler} Now write a long story "
                              f"about the number {i * 7919 % 1000} and the colour of the sea at night."}]}
        body = request_body("chat", kind, chat, "", gen, cold=True)
        if kind == "llama-server":
            body["ignore_eos"] = True
        with httpx.Client() as client:
            t0 = time.perf_counter()
            results[i] = (t0, send(client, url, "chat", body))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _, out in results:
        if not out.ok:
            raise RuntimeError(out.error)
    first = min(t0 + out.ttft_s for t0, out in results)
    last = max(t0 + out.total_s for t0, out in results)
    tokens = [out.completion_tokens or 0 for _, out in results]
    decoded = sum(max(k - 1, 0) for k in tokens)
    return {"tokens": tokens, "decode_s": last - first, "tok_s": decoded / (last - first) if last > first else 0.0,
            "prompt_tokens": [out.prompt_tokens for _, out in results], "ttft_s": [out.ttft_s for _, out in results]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gen", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--busy", default="1,4", help="numbers of slots decoding at once")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--context", type=int, default=0, metavar="WORDS",
                    help="filler words before each request's text (about a token each): decode at a long context")
    ap.add_argument("--port", type=int, default=18700)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="one more orchestrator, started with FLAGS (e.g. 'batched=--decode-batching on')")
    ap.add_argument("--omp", choices=["passive", "default"], default="default",
                    help="OMP_WAIT_POLICY of every server: PASSIVE (as the side-by-side bench runs them) or OpenMP's "
                         "default (threads spin a while between graph nodes, then sleep: one-token decode steps "
                         "took 23 ms instead of 43 on the 0.8b on 2 cores)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    busy = [int(x) for x in a.busy.split(",")]
    model = a.model or default_model()
    systems = [SYSTEMS["orchestrator"], System("llama-server", "llama-server", "chat", extra=("-np", "4"))]
    try:
        systems += orchestrator_variants(a.variant)
    except ValueError as e:
        ap.error(str(e))
    log_dir = RESULTS / "logs"
    running, rows = [], []
    try:
        for i, s in enumerate(systems):
            running.append(launch(s, model, a.port + i, a.threads, a.ctx, log_dir,
                                  omp_wait_policy="PASSIVE" if a.omp == "passive" else None))
        for rep in range(a.reps + 1):  # repetition 0 warms every server up and is not counted
            order = running[rep % len(running):] + running[: rep % len(running)]
            for n in busy:
                for r in order:
                    for other in running:
                        other.wait_idle()
                    m = burst(r.url, r.system.kind, n, a.gen, uuid.uuid4().hex[:12], a.context)
                    print(f"rep {rep} busy {n} {r.system.name:24} {m['tok_s']:6.2f} tok/s  tokens {m['tokens']}  "
                          f"load {os.getloadavg()[0]:.1f}", file=sys.stderr)
                    if rep:
                        rows.append({"rep": rep, "busy": n, "system": r.system.name, **m,
                                     "load": os.getloadavg()[0]})
    finally:
        for r in running:
            r.stop()
    summary: dict[str, dict] = {}
    for n in busy:
        summary[str(n)] = {}
        for s in systems:
            rates = [x["tok_s"] for x in rows if x["busy"] == n and x["system"] == s.name]
            summary[str(n)][s.name] = {"median_tok_s": statistics.median(rates), "min": min(rates), "max": max(rates)}
        peer = summary[str(n)]["llama-server"]["median_tok_s"]
        for s in systems:
            m = summary[str(n)][s.name]
            print(f"busy {n}: {s.name:24} {m['median_tok_s']:6.2f} tok/s (median of {a.reps}, "
                  f"{m['min']:.2f}..{m['max']:.2f}), {m['median_tok_s'] / peer:.2f}x llama-server")
    out = a.out or results_dir() / "ab_decode.json"
    write_ab(out, systems, rows, summary, model=str(model), threads=a.threads, gen=a.gen, reps=a.reps, omp=a.omp,
             context=a.context)
    return 0


if __name__ == "__main__":
    sys.exit(main())
