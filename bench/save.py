"""What one snapshot save costs on the prefill's critical path (issue 12, item 2: snapshot overhead <= 2%).

    python -m bench save                  # synthetic qwen3.5-0.8b, 2 threads, 600 tokens held
    python -m bench save --model my.gguf --tokens 2000 --reps 15

A prefill stops at every snapshot position and saves a checkpoint (the recurrent state, fixed size) before it
goes on; the RAM tier then keeps it. In one process, interleaved, medians of --reps, each kept alive like a cache
entry (new memory every time, as in a cold run that fills the cache):
  * engine      Engine.save_state(partial) then the RAM tier's put: what the server does now;
  * bytearray   llama.cpp writing into a new bytearray that the RAM tier copies into bytes (the code before);
  * floor       llama.cpp writing into one buffer already written (no new memory: the copy alone).
and the same for a full save cut into its KV and checkpoint parts (HybridState.save: the after-generation and
preemption saves). Writes bench/results/<date>/save.json. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import llama_cpp

from bench.common import add_model_args, filler_tokens, load_engine, results_dir, write_json
from orchestrator.cache.radix import EntryKind
from orchestrator.cache.tiers import RamTier
from orchestrator.engine import PARTIAL

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--tokens", type=int, default=600, help="tokens the sequence holds when saved")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)

    path, engine = load_engine(a.model, a.threads, max(4096, a.tokens + 64))
    engine.decode(0, filler_tokens(engine, a.tokens), 0, want_logits=False)
    ram = RamTier(1 << 40)
    kept: list = []
    size = llama_cpp.llama_state_seq_get_size_ext(engine.ctx, 0, PARTIAL)
    floor_buf = bytearray(size)
    counter = iter(range(1 << 30))

    def keep(payload) -> None:
        ram.put(f"e{next(counter)}", (), EntryKind.CHECKPOINT, payload)

    def engine_path() -> None:
        keep(engine.save_state(0, partial=True))

    def bytearray_path() -> None:
        out = bytearray(size)
        buf = (ctypes.c_uint8 * size).from_buffer(out)
        llama_cpp.llama_state_seq_get_data_ext(engine.ctx, buf, size, 0, PARTIAL)
        del buf
        keep(bytes(out))

    def floor() -> None:
        buf = (ctypes.c_uint8 * size).from_buffer(floor_buf)
        llama_cpp.llama_state_seq_get_data_ext(engine.ctx, buf, size, 0, PARTIAL)
        del buf

    def full_parts() -> None:
        for kind, payload in engine.state.save(engine, 0, (EntryKind.KV, EntryKind.CHECKPOINT)).items():
            ram.put(f"e{next(counter)}", (), kind, payload)

    cases = {"engine": engine_path, "bytearray": bytearray_path, "floor": floor, "full_parts": full_parts}
    rows: dict[str, list[float]] = {k: [] for k in cases}
    for rep in range(a.reps + 1):  # the first round warms up and is not counted
        for name, fn in cases.items():
            t = time.perf_counter()
            fn()
            if rep:
                rows[name].append(time.perf_counter() - t)
        if ram.bytes > 2048 * MiB:  # entries leave, as evicted ones would; new saves still get new memory
            ram.close()
            kept.clear()
    med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    full = engine.state_size(0)
    print(f"checkpoint {size / MiB:.1f} MiB, full state {full / MiB:.1f} MiB ({a.tokens} tokens); {a.reps} reps; "
          f"load {os.getloadavg()[0]:.1f}")
    for k, v in med.items():
        print(f"{k:11} {v:7.2f} ms (min {min(rows[k]) * 1e3:.2f})")
    write_json(a.out or results_dir() / "save.json",
               {"model": str(path), "threads": a.threads, "tokens": a.tokens, "reps": a.reps,
                "checkpoint_bytes": size, "full_bytes": full, "median_ms": med, "rows_s": rows,
                "load_average": os.getloadavg()[0]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
