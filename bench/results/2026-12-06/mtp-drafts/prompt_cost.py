"""What the MTP head's reading of a prompt costs against the target's prefill of it (issue 40).

    python bench/results/2026-12-06/mtp-drafts/prompt_cost.py MODEL.gguf [--tokens 2048,6144] [--reps 3]

MODEL: a `synth-model --preset qwen3.5-0.8b --mtp` file or a real Qwen3.5 GGUF with an MTP block. One engine,
loaded as `--speculative mtp` loads it (load_mtp, hidden states of every row) in the layout where verification is
exact (engine.VERIFYING), and one MtpHead as the scheduler makes it. Per prompt length and round, interleaved:

* `prefill_s`: Engine.decode of the whole prompt into a cleared sequence, no hidden states asked for (what a
  request pays with speculation off or without the head reading the prompt);
* `prefill_hidden_s`: the same with `hidden=[]`: the hidden state of every token copied out for the head;
* `head_s`: the head reading those entries as the scheduler hands them over (`Speculation.prefilled`: one
  `MtpHead.read_prompt` per prefill chunk, which reads the last n_ctx = 4096 of the prompt only), then `flush`.

Prints one JSON object: per length, each list over the rounds, and the sums' ratios head ÷ prefill and
(prefill_hidden - prefill) ÷ prefill.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from orchestrator.chunks import chunk_sizes
from orchestrator.engine import VERIFYING, Engine
from orchestrator.speculative.mtp import MtpHead


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", default="2048,6144")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    lengths = [int(n) for n in a.tokens.split(",")]
    e = Engine(a.model, n_ctx=max(lengths) + 16, n_batch=512, n_threads=2, attention=VERIFYING, load_mtp=True)
    head = MtpHead(e)
    out: dict = {"model": a.model.name, "n_batch": e.n_batch, "min_segment": e.min_segment, "head_n_ctx": head.n_ctx,
                 "lengths": {}}
    for n in lengths:
        out["lengths"][n] = {"prefill_s": [], "prefill_hidden_s": [], "head_s": []}
    for _ in range(a.reps):
        for n in lengths:
            row = out["lengths"][n]
            prompt = [1000 + (41 * i) % 50000 for i in range(n)]
            e.clear(0)
            t = time.perf_counter()
            e.decode(0, prompt, 0, want_logits=True)
            row["prefill_s"].append(time.perf_counter() - t)
            e.clear(0)
            chunks, hidden = [], []
            t = time.perf_counter()
            for start, size in chunk_sizes(n, e.n_batch, e.min_segment):  # the scheduler's prefill chunks
                h: list = []
                e.decode(0, prompt[start:start + size], start, want_logits=start + size == n, hidden=h)
                chunks.append((start, size))
                hidden.append(h)
            row["prefill_hidden_s"].append(time.perf_counter() - t)
            head.restart(0)
            t = time.perf_counter()
            for (start, size), h in zip(chunks, hidden):
                head.read_prompt(0, start, prompt[start:start + size], h, n)
            head.flush(0)
            row["head_s"].append(time.perf_counter() - t)
            print(n, {k: round(v[-1], 3) for k, v in row.items()}, flush=True)
    for n, row in out["lengths"].items():
        p = sum(row["prefill_s"])
        row["head_vs_prefill"] = sum(row["head_s"]) / p
        row["hidden_copy_vs_prefill"] = (sum(row["prefill_hidden_s"]) - p) / p
        row["prefill_tps"] = n * len(row["prefill_s"]) / p
    head.close()
    e.close()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
