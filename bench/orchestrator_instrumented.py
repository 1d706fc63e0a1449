"""`python -m orchestrator` with its after-generation work timed from outside, for the W4/CHAT benchmark.

    BENCH_AFTERGEN_LOG=/tmp/ag.jsonl PYTHONPATH=<checkout> python bench/orchestrator_instrumented.py serve ...

Wraps, in whatever checkout PYTHONPATH names (so the same timing runs on main and on the commit before issue 18,
which has no counters of its own), two methods and writes one JSON line per call to $BENCH_AFTERGEN_LOG:

    {"ev": "after", "task", "t0", "t1", "cpu_s", "store", "prompt", "generated", "work", "start"}
        Reuse.after_generation: the rewind and the choice of what to re-prefill (store: whether a STORE
        follows; work: tokens of the state it re-prefills to; start: the position it re-prefills from)
    {"ev": "chunk", "task", "seq", "t0", "t1", "cpu_s", "tokens"}
        Scheduler._prefill_chunk of a task in phase STORE: one re-prefill chunk (its final chunk includes the
        snapshot save)
    {"ev": "take_over", "task", "t", "depth"}   (where the checkout has Reuse.take_over)

t0/t1/t are wall-clock epoch seconds (time.time(), the client's clock too); cpu_s is the process's CPU time
(all threads: llama.cpp's compute threads are the process's) during the call. Only the worker thread computes
then, so that is the work's CPU, plus whatever the HTTP thread did meanwhile (rendering a request that arrived).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def _progress(task):
    """Where the checkout keeps a task's work and pos: Task.reuse (TaskReuse), or the task itself before."""
    return getattr(task, "reuse", task)


def install(path: str) -> None:
    """Wrap Reuse.after_generation, Scheduler._prefill_chunk (STORE phase) and Reuse.take_over."""
    from orchestrator import reuse as reuse_mod
    from orchestrator import scheduler as sched_mod
    from orchestrator.request import Phase

    out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life
    lock = threading.Lock()

    def emit(rec: dict) -> None:
        with lock:
            out.write(json.dumps(rec) + "\n")

    orig_after = reuse_mod.Reuse.after_generation

    def after_generation(self, task):
        t0, c0 = time.time(), time.process_time()
        stored = orig_after(self, task)
        emit({"ev": "after", "task": id(task), "t0": t0, "t1": time.time(), "cpu_s": time.process_time() - c0,
              "store": bool(stored), "prompt": len(task.tokens), "generated": len(task.generated()),
              "work": len(_progress(task).work) if stored else 0,
              "start": _progress(task).pos if stored else None})
        return stored

    reuse_mod.Reuse.after_generation = after_generation

    orig_chunk = sched_mod.Scheduler._prefill_chunk

    def _prefill_chunk(self, t, chunk):
        if t.phase != Phase.STORE:
            return orig_chunk(self, t, chunk)
        t0, c0, pos = time.time(), time.process_time(), _progress(t).pos
        seq = t.slot.seq if t.slot is not None else None
        try:
            return orig_chunk(self, t, chunk)
        finally:
            emit({"ev": "chunk", "task": id(t), "seq": seq, "t0": t0, "t1": time.time(),
                  "cpu_s": time.process_time() - c0, "tokens": _progress(t).pos - pos})

    sched_mod.Scheduler._prefill_chunk = _prefill_chunk

    orig_take = getattr(reuse_mod.Reuse, "take_over", None)
    if orig_take is not None:
        def take_over(self, task, slot, depth):
            emit({"ev": "take_over", "task": id(task), "t": time.time(), "depth": depth})
            return orig_take(self, task, slot, depth)

        reuse_mod.Reuse.take_over = take_over


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # bench/ must not shadow anything
    path = os.environ.get("BENCH_AFTERGEN_LOG")
    if path:
        install(path)
    from server.__main__ import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
