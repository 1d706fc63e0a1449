"""What a rollback's replay costs with logits for every kept token (before) against the last one only (now), on
the qwen3.5-0.8b preset in the layout speculation verifies in (-ctk q8_0, reference decode kernels), and that
both leave a state the next one-token step continues from identically.

    PYTHONPATH=. .venv/bin/python bench/results/2026-12-07/replay/replay.py [--reps 7] [--context 512]

Per kept length k: the checkpoint before a 16-token verification is loaded, the KV from its position removed,
and k tokens decoded again (speculative.verify.cut + replay), timed alone; both ways interleaved, `reps` rounds
after one warm-up each. Prints each way's median seconds, their ratio, and whether the next step's logits match.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from orchestrator.engine import VERIFYING, Engine
from orchestrator.models.synth import ensure_model
from orchestrator.speculative.verify import cut


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.5-0.8b")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    e = Engine(ensure_model(args.preset), n_ctx=2048, n_batch=256, n_threads=2,
               attention=dataclasses.replace(VERIFYING, kernels="reference"))
    try:
        n = args.context
        prompt = [1000 + (41 * i + 3) % 5000 for i in range(n)]
        nxt = [1500 + (59 * i) % 5000 for i in range(17)]
        e.decode(0, prompt, 0, want_logits=False)
        start = e.save_state(0)
        step = []
        for _ in range(args.reps + 1):
            e.load_state(0, start)
            t = time.perf_counter()
            e.decode(0, nxt[:1], n)
            step.append(time.perf_counter() - t)
        one = float(np.median(step[1:]))
        print(f"{args.preset}, context {n}, one decode step {one * 1000:.1f} ms (median of {args.reps})")
        print(f"{'kept':>4} {'every row (ms)':>15} {'last row (ms)':>14} {'ratio':>6} {'steps saved':>11} next step")
        for k in (2, 4, 8, 12, 16):
            times = {True: [], False: []}
            after = {}
            for r in range(args.reps + 1):
                for every in ((True, False) if r % 2 else (False, True)):
                    e.load_state(0, start)
                    point = e.rewind_point(0)
                    e.verify(0, nxt[:16], n)
                    t = time.perf_counter()
                    item = cut(e, 0, point, n, nxt[:k])
                    e.verify(*item, every=every)
                    spent = time.perf_counter() - t
                    if r:
                        times[every].append(spent)
                    e.decode(0, nxt[k:k + 1], n + k)
                    after[every] = e.logits()
            a, b = (float(np.median(times[w])) for w in (True, False))
            same = np.array_equal(after[True], after[False])
            print(f"{k:4d} {a * 1000:15.1f} {b * 1000:14.1f} {b / a:6.3f} {(a - b) / one:11.2f} "
                  f"{'identical' if same else 'DIFFERS'}", flush=True)
    finally:
        e.close()


if __name__ == "__main__":
    main()
