"""Bytes held by the snapshot cache for a long agent conversation, against whole-state snapshots.

    python -m bench memory                     # synthetic qwen3.5-0.8b, 20 messages, ~8,000 tokens

Runs a 20-message conversation (about 400 tokens a message) turn by turn through the scheduler with a large RAM
budget, then compares the bytes the cache holds (recurrent checkpoints at every boundary, KV only where a
branch ends) with what whole-state snapshots (KV + recurrent) at every boundary would hold. Also reports the
checkpoint-interval trade-off: per interval, checkpoints and bytes added per 8,000 tokens, time spent saving
them, and the prefill a mid-message divergence costs on average (half an interval).
Writes bench/results/<date>/memory.json.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

from bench.common import add_model_args, results_dir, write_json
from orchestrator.config import MiB, Config
from orchestrator.cache.radix import CHECKPOINT, KV
from orchestrator.request import Job, SamplingParams
from orchestrator.runtime import Runtime
from orchestrator.reuse import spaced_stops

WORDS = ("the cache holds a snapshot of the recurrent state at every message boundary so that a later request "
         "restores it and prefills only the rest of its prompt while the server keeps serving other agents").split()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--messages", type=int, default=20)
    ap.add_argument("--words", type=int, default=380, help="words per message (about 400 tokens)")
    ap.add_argument("--out", type=Path, default=results_dir())
    a = ap.parse_args(argv)
    rng = random.Random(0)
    msgs = [{"role": "system", "content": "You are an agent. " + " ".join(rng.choice(WORDS) for _ in range(a.words))}]
    for i in range(a.messages - 1):
        role = "user" if i % 2 == 0 else "assistant"
        msgs.append({"role": role, "content": " ".join(rng.choice(WORDS) for _ in range(a.words))})
    results = {}
    for interval in (0, 512, 128):
        rt = Runtime.start(Config(model=a.model, ctx_size=16384, batch_size=512, threads=a.threads,
                                  cache_ram_mib=16384, checkpoint_interval=interval))
        eng = rt.engine
        positions: set[int] = set()
        t_prefill = n_prefilled = 0.0
        snapshot_s = 0.0
        for k in range(1, len(msgs), 2):  # requests end with a user message
            p = rt.prompts.chat(msgs[: k + 1], None, {})
            r = rt.scheduler.run(Job(p.tokens, p.boundaries, max_tokens=4, sampling=SamplingParams()))
            positions |= set(spaced_stops(p.boundaries, len(p.tokens), rt.config.snapshot_min_gap))
            t_prefill += r.prefill_s
            n_prefilled += r.prompt_tokens - r.cached_tokens
            snapshot_s += r.snapshot_s
            print(f"interval {interval}: request {k // 2 + 1}: {r.prompt_tokens} tokens, cached {r.cached_tokens}",
                  flush=True)
        rt.scheduler.drain()
        n_total = len(p.tokens)
        # Whole-state size at depth d: the checkpoint plus d tokens of KV (measured on this engine).
        eng.clear(0)
        eng.decode(0, p.tokens[:512], 0, want_logits=False)
        parts = eng.state.save(eng, 0, (KV, CHECKPOINT))
        kv512, rec = parts[KV], parts[CHECKPOINT]
        eng.clear(0)
        eng.decode(0, p.tokens[:1024], 0, want_logits=False)
        kv1024 = eng.state.save(eng, 0, (KV,))[KV]
        kv_per_token = (len(kv1024) - len(kv512)) / 512
        whole = sum(len(rec) + len(kv512) + kv_per_token * (d - 512) for d in positions)
        s = rt.cache.stats()
        results[interval] = {
            "conversation_tokens": n_total, "boundaries": len(positions), "held_bytes": s.ram_bytes,
            "held_entries": s.entries_by_kind, "whole_state_bytes_at_boundaries": whole,
            "ratio": s.ram_bytes / whole, "checkpoint_bytes": len(rec), "kv_bytes_per_token": kv_per_token,
            "prefill_tokens_per_s": n_prefilled / t_prefill, "snapshot_s": snapshot_s,
        }
        rt.close()
    r0, r1 = results[0], results[128]
    save_ms = 1e3 * r1["snapshot_s"] / max(1, r1["held_entries"].get(CHECKPOINT, 1))
    tradeoff = []
    for interval in (128, 256, 512, 1024, 2048):
        n = 8000 // interval
        tradeoff.append({"interval": interval, "checkpoints_per_8k": n, "mib_per_8k": n * r1["checkpoint_bytes"] / MiB,
                         "save_ms_per_8k": n * save_ms,
                         "avg_reprefill_s_on_divergence": interval / 2 / r1["prefill_tokens_per_s"]})
    out = {"model": "synthetic qwen3.5-0.8b" if a.model is None else str(a.model), "by_interval": results,
           "interval_tradeoff": tradeoff, "load_average": os.getloadavg()}
    print(f"\n{r0['conversation_tokens']} tokens, {r0['boundaries']} boundaries; checkpoint {r0['checkpoint_bytes'] / MiB:.1f}"
          f" MiB, KV {r0['kv_bytes_per_token'] / 1024:.1f} KiB/token")
    print("| checkpoint interval | bytes held | whole states at every boundary | ratio |")
    print("|---|---|---|---|")
    for interval, r in results.items():
        print(f"| {interval or 'off'} | {r['held_bytes'] / MiB:.0f} MiB | {r['whole_state_bytes_at_boundaries'] / MiB:.0f} MiB"
              f" | {r['ratio']:.0%} |")
    print("\n| interval | checkpoints / 8k tokens | MiB / 8k | save ms / 8k | avg re-prefill on a mid-message divergence |")
    print("|---|---|---|---|---|")
    for t in tradeoff:
        print(f"| {t['interval']} | {t['checkpoints_per_8k']} | {t['mib_per_8k']:.0f} | {t['save_ms_per_8k']:.0f} | "
              f"{t['avg_reprefill_s_on_divergence']:.2f} s |")
    write_json(a.out / "memory.json", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
