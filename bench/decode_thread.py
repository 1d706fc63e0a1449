"""One-token decode step time by which threads call llama_decode (why engine_thread.EngineThread exists).

    python -m bench decode-thread             # synthetic qwen3.5-0.8b, 2 threads
    python -m bench decode-thread --model my.gguf --steps 60

Three runs of --steps one-token decode steps after a 20-token prompt, each in a fresh process (a libgomp team,
once made for a thread, lasts as long as the thread), median step time:

    main         load, calibrate and decode on the main thread
    one thread   load, calibrate and decode on one other thread (what the server does: Runtime.start)
    two threads  load and calibrate on the main thread, decode on another (what the server did before)

Not a test: figures depend on the machine (and on OMP_WAIT_POLICY, left as the environment sets it).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import ROOT, add_model_args, load_engine


def load(model: Path | None, threads: int):
    return load_engine(model, threads, 4096, n_seq_max=4, calibrate="auto")[1]


def steps(engine, n: int) -> float:
    """Median seconds of n one-token decode steps after a 20-token prompt on sequence 0."""
    engine.clear(0)
    engine.decode(0, [1000 + i for i in range(20)], 0, want_logits=False)
    times = []
    for i in range(n):
        t = time.perf_counter()
        engine.decode(0, [5000 + i], 20 + i)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def one(mode: str, model: Path | None, threads: int, n: int) -> float:
    out: list[float] = []
    if mode == "main":
        return steps(load(model, threads), n)
    if mode == "one-thread":
        t = threading.Thread(target=lambda: out.append(steps(load(model, threads), n)))
    else:
        engine = load(model, threads)
        t = threading.Thread(target=lambda: out.append(steps(engine, n)))
    t.start()
    t.join()
    return out[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--mode", choices=["main", "one-thread", "two-threads"], help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.mode:
        print(one(a.mode, a.model, a.threads, a.steps))
        return 0
    for mode in ("main", "one-thread", "two-threads"):
        cmd = [sys.executable, "-m", "bench", "decode-thread", "--mode", mode, "--threads", str(a.threads), "--steps", str(a.steps)]
        if a.model:
            cmd += ["--model", str(a.model)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
        s = float(res.stdout.strip().splitlines()[-1])
        print(f"{mode:12} {s * 1e3:6.1f} ms per one-token step ({1 / s:.1f} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
