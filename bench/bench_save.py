"""What one snapshot save costs on the prefill's critical path (issue 12, item 2: snapshot overhead <= 2%).

    python bench/bench_save.py                  # synthetic qwen3.5-0.8b, 2 threads, 600 tokens held
    python bench/bench_save.py --model my.gguf --tokens 2000 --reps 15

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
import json
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import llama_cpp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.cache.radix import EntryKind  # noqa: E402
from orchestrator.cache.tiers import RamTier  # noqa: E402
from orchestrator.config import Config  # noqa: E402
from orchestrator.engine import PARTIAL, Engine  # noqa: E402
from orchestrator.runtime import resolve_model  # noqa: E402

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the synthetic qwen3.5-0.8b)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=600, help="tokens the sequence holds when saved")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)

    path = resolve_model(Config(model=a.model, threads=a.threads))
    engine = Engine(path, n_ctx=max(4096, a.tokens + 64), n_batch=512, n_threads=a.threads)
    words = " ".join(f"w{i % 997} item{i}" for i in range(a.tokens))
    engine.decode(0, engine.tokenize(words)[: a.tokens], 0, want_logits=False)
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
    out = a.out or Path(__file__).resolve().parent / "results" / str(date.today()) / "save.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": str(path), "threads": a.threads, "tokens": a.tokens, "reps": a.reps,
                               "checkpoint_bytes": size, "full_bytes": full, "median_ms": med,
                               "rows_s": rows, "load_average": os.getloadavg()[0]}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
