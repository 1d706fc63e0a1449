"""Attention layouts against context length: prefill and decode tokens/s at each context, flash attention off over
F16 (the default) against engine.VERIFYING (flash attention, K cache Q8_0: exact speculative verification).

`python -m bench layouts [--contexts 1024,4096,12288] [--reps 2] [--model GGUF]`

One engine per layout and round (layouts interleaved in each round), n_ctx the largest context + 1,024, n_batch
512, one sequence. The prompt (random token ids, seeded) is prefilled in 512-token calls from position 0; each
call's time gives the prefill rate at its context. At each of `--contexts` the state is saved, 32 one-token decode
steps are timed, and the state is loaded back before the prefill goes on. Reported per layout and context: the
cold prefill up to it (s and tokens/s), the rate of the 512-token call that starts there, and decode tokens/s,
each summed over rounds with the per-round spread.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

from bench.common import add_model_args, results_dir

DECODE_STEPS = 32
CALL = 512


def one_pass(model: Path, layout: str, contexts: list[int], threads: int) -> dict:
    """Prefill to max(contexts) + CALL in CALL-token calls, decode DECODE_STEPS tokens at each context."""
    from orchestrator.engine import VERIFYING, Attention, Engine

    attention = VERIFYING if layout == "verifying" else Attention()
    top = max(contexts)
    e = Engine(model, n_ctx=top + 2 * CALL, n_batch=CALL, n_threads=threads, n_seq_max=1, attention=attention)
    try:
        e.calibrate(8)
        rng = random.Random(1)
        toks = [rng.randrange(1000, 100000) for _ in range(top + CALL + DECODE_STEPS)]
        out: dict[int, dict] = {}
        elapsed, pos = 0.0, 0
        while pos <= top:
            if pos in contexts:
                state = e.save_state(0)
                t = time.perf_counter()
                for i in range(DECODE_STEPS):
                    e.decode(0, [toks[pos + i]], pos + i)
                decode_s = time.perf_counter() - t
                e.clear(0)
                e.load_state(0, state)
                out[pos] = {"cold_prefill_s": elapsed, "decode_s": decode_s}
            t = time.perf_counter()
            e.decode(0, toks[pos:pos + CALL], pos, want_logits=False)
            dt = time.perf_counter() - t
            if pos in out:
                out[pos]["call_s"] = dt
            elapsed += dt
            pos += CALL
        return out
    finally:
        e.close()


def main(argv: list[str] | None = None) -> int:
    import platform

    from bench.w5 import _cpu_name
    from orchestrator.models.synth import ensure_model

    ap = argparse.ArgumentParser(prog="python -m bench layouts", description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--contexts", default="1024,4096,12288", help="token counts, multiples of 512")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/<date>/layouts")
    args = ap.parse_args(argv)
    contexts = sorted(int(c) for c in args.contexts.split(","))
    if any(c % CALL for c in contexts):
        ap.error("--contexts must be multiples of 512")
    model = args.model or ensure_model("qwen3.5-0.8b")
    layouts = ("default", "verifying")
    runs: dict[str, list[dict]] = {lay: [] for lay in layouts}
    for r in range(args.reps):
        for lay in (layouts if r % 2 == 0 else layouts[::-1]):
            got = one_pass(model, lay, contexts, args.threads)
            runs[lay].append(got)
            print(f"round {r + 1} {lay}: " + "; ".join(
                f"{c}: cold {v['cold_prefill_s']:.1f} s, call {CALL / v['call_s']:.1f} tok/s, decode "
                f"{DECODE_STEPS / v['decode_s']:.1f} tok/s" for c, v in got.items()), flush=True)
    lines = ["| layout | context | cold prefill to it s (rounds) | prefill tok/s there (rounds) | "
             "decode tok/s there (rounds) |", "|---|---|---|---|---|"]
    summary: dict = {}
    for lay in layouts:
        for c in contexts:
            rows = [run[c] for run in runs[lay]]
            cold = sum(x["cold_prefill_s"] for x in rows)
            call = len(rows) * CALL / sum(x["call_s"] for x in rows)
            dec = len(rows) * DECODE_STEPS / sum(x["decode_s"] for x in rows)
            summary.setdefault(lay, {})[c] = {"cold_prefill_s": cold / len(rows), "prefill_tps": call,
                                              "decode_tps": dec}
            colds = ", ".join(f"{x['cold_prefill_s']:.1f}" for x in rows)
            calls = ", ".join(f"{CALL / x['call_s']:.1f}" for x in rows)
            decs = ", ".join(f"{DECODE_STEPS / x['decode_s']:.1f}" for x in rows)
            lines.append(f"| {lay} | {c} | {cold / len(rows):.1f} ({colds}) | {call:.1f} ({calls}) | {dec:.1f} "
                         f"({decs}) |")
    ratio = ["", "| context | cold prefill verifying ÷ default (time) | prefill rate default ÷ verifying | "
             "decode rate default ÷ verifying |", "|---|---|---|---|"]
    for c in contexts:
        d, v = summary["default"][c], summary["verifying"][c]
        ratio.append(f"| {c} | {v['cold_prefill_s'] / d['cold_prefill_s']:.2f} | "
                     f"{d['prefill_tps'] / v['prefill_tps']:.2f} | {d['decode_tps'] / v['decode_tps']:.2f} |"
                     if d["cold_prefill_s"] else f"| {c} | — | {d['prefill_tps'] / v['prefill_tps']:.2f} | "
                     f"{d['decode_tps'] / v['decode_tps']:.2f} |")
    meta = {"model": model.name, "cpu": _cpu_name() or platform.processor(), "threads": args.threads,
            "load": os.getloadavg(), "command": "python -m bench layouts " + " ".join(sys.argv[1:] if argv is None else argv)}
    text = "\n".join([f"Command: `{meta['command']}`  ", f"Model {meta['model']}, CPU {meta['cpu']}, "
                      f"{args.threads} threads, load before {meta['load']}", ""] + lines + ratio) + "\n"
    out = args.out or results_dir() / "layouts"
    out.mkdir(parents=True, exist_ok=True)
    (out / "layouts.json").write_text(json.dumps({"meta": meta, "runs": runs, "summary": summary}, indent=1))
    (out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
