"""Cold prefill speed by chunk size and ubatch: what `--prefill-chunk` and `--batch-size` cost (issue 12, item 2).

    python -m bench prefill                        # synthetic qwen3.5-0.8b, 2 threads, 2,000 tokens
    python -m bench prefill --model my.gguf --tokens 4000 --reps 7

One process, one prompt of --tokens tokens, prefilled cold (sequence cleared) in every configuration, the
configurations interleaved in a new random order each repetition (the machine is shared and noisy):

  * n_batch (= n_ubatch: one llama_decode call is one ubatch) x prefill chunk (tokens per call), as the
    scheduler feeds a lone request;
  * `split`: the same prompt stopped every --split tokens, as snapshot positions stop a conversation of
    messages of that length (a 20-message conversation of ~100-token messages).

Checks on the way that every configuration gives bit-identical last-position logits (any split into ubatches
of at least min_segment tokens is exact: engine.py "Numerics"), and prints median seconds and tokens/s per
configuration, relative to the fastest. Writes bench/results/<date>/prefill.json. Not a test.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np


from bench.common import add_model_args, filler_tokens, load_engine, results_dir, write_json
from orchestrator.engine import Engine


def prefill(engine: Engine, tokens: list[int], chunk: int, stops: list[int]) -> tuple[float, float, np.ndarray]:
    """Wall seconds and CPU seconds (all threads of this process) to prefill `tokens` cold in calls of at most
    `chunk` tokens, also stopping at `stops`; and the last position's logits. On a loaded machine CPU seconds
    move much less than wall seconds (they count the work, not the wait for a core)."""
    engine.clear(0)
    bounds = sorted({*stops, len(tokens)})
    cpu = time.process_time()
    start = time.perf_counter()
    pos = 0
    for stop in bounds:
        while pos < stop:
            end = min(pos + chunk, stop)
            engine.decode(0, tokens[pos:end], pos, want_logits=end == len(tokens))
            pos = end
    return time.perf_counter() - start, time.process_time() - cpu, engine.logits()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--split", type=int, default=100, help="tokens between stops of the 'split' rows")
    ap.add_argument("--batches", default="512,1024", help="n_batch values (n_ubatch = n_batch)")
    ap.add_argument("--chunks", default="128,256,512,1024", help="prefill chunk sizes (capped at n_batch)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)

    engines = {}
    for nb in (int(x) for x in a.batches.split(",")):
        path, engines[nb] = load_engine(a.model, a.threads, max(4096, a.tokens + 64), nb, calibrate="off")
    tokens = filler_tokens(next(iter(engines.values())), a.tokens)
    configs = [(nb, c, False) for nb in engines for c in (int(x) for x in a.chunks.split(",")) if c <= nb]
    configs += [(nb, nb, True) for nb in engines]
    times: dict[str, list[float]] = {}
    cpu_times: dict[str, list[float]] = {}
    reference = None
    rng = random.Random(0)
    for rep in range(a.reps + 1):  # the first round warms caches and is not counted
        order = configs[:]
        rng.shuffle(order)
        for nb, chunk, split in order:
            stops = list(range(a.split, len(tokens), a.split)) if split else []
            s, c, logits = prefill(engines[nb], tokens, chunk, stops)
            if reference is None:
                reference = logits
            if not np.array_equal(logits, reference):
                print(f"NOT bit-identical: n_batch {nb}, chunk {chunk}, split {split}: max |d| "
                      f"{np.abs(logits - reference).max()}", file=sys.stderr)
                return 1
            if rep:
                name = f"n_batch={nb} chunk={chunk}" + (f" split={a.split}" if split else "")
                times.setdefault(name, []).append(s)
                cpu_times.setdefault(name, []).append(c)
        print(f"round {rep}/{a.reps} done", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in times.items()}
    cmed = {k: statistics.median(v) for k, v in cpu_times.items()}
    best, cbest = min(med.values()), min(cmed.values())
    print(f"{len(tokens)} tokens, {a.threads} threads, {a.reps} reps, interleaved; all logits bit-identical; "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{'configuration':36} {'wall s':>7} {'tok/s':>6} {'vs best':>7} {'min..max':>12} {'cpu s':>7} {'vs best':>7}")
    for k, m in sorted(cmed.items(), key=lambda kv: kv[1]):
        print(f"{k:36} {med[k]:7.2f} {len(tokens) / med[k]:6.1f} {med[k] / best:7.3f} "
              f"{min(times[k]):5.1f}..{max(times[k]):<5.1f} {m:7.2f} {m / cbest:7.3f}")
    write_json(a.out or results_dir() / "prefill.json",
               {"model": str(path), "tokens": len(tokens), "threads": a.threads, "reps": a.reps, "seconds": times,
                "cpu_seconds": cpu_times, "median_s": med, "median_cpu_s": cmed, "load_average": os.getloadavg()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
