"""Verification cost with the gate's exact matmuls against ggml's row-by-row reference path, in one process.

    PYTHONPATH=. python bench/results/2026-12-07/exact-matmuls/ab.py MODEL CONTEXT ROUNDS

One engine in the default layout with reference decode kernels (as served); a CONTEXT-token prompt, then per
round and per path (`orchestrator_exact_use(0)`: ggml row by row; `(7)`: the exact F16, Q4_K and Q6_K matmuls)
the median of 10 one-token decode steps and of 4 verifications of 4, 8 and 16 tokens, each from the same saved
state. Prints each round and Σ over rounds with the rounds' range, then Σ exact ÷ Σ row by row per width. In one
process because between processes the same step moved up to ±15% on the 2-core EPYC (weights' placement)."""
import ctypes
import sys
import time
from pathlib import Path

import numpy as np

from orchestrator import kernels as K
from orchestrator.engine import Attention, Engine

model, N, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
print(K.reference_matmuls())
lib = ctypes.CDLL(str(K._gate_library()))
e = Engine(model, n_ctx=N + 256, n_batch=512, n_threads=2, n_seq_max=1, attention=Attention(kernels="reference"))
prompt = [1000 + (41 * i) % 5000 for i in range(N)]
for s in range(0, N, 512):
    e.decode(0, prompt[s:s + 512], s, want_logits=False)
snap = e.save_state(0)
res: dict[str, dict[int, list[float]]] = {}
for r in range(rounds):
    for mode, mask in (("rows", 0), ("exact", 7)):
        lib.orchestrator_exact_use(mask)
        ts = {}
        e.load_state(0, snap)
        t = []
        for i in range(12):
            t0 = time.perf_counter()
            e.decode(0, [1234 + i], N + i)
            t.append(time.perf_counter() - t0)
        ts[1] = float(np.median(t[2:]))
        for w in (4, 8, 16):
            t = []
            for _ in range(5):
                e.load_state(0, snap)
                t0 = time.perf_counter()
                e.verify(0, [1300 + j for j in range(w)], N)
                t.append(time.perf_counter() - t0)
            ts[w] = float(np.median(t[1:]))
        for w, v in ts.items():
            res.setdefault(mode, {}).setdefault(w, []).append(v)
        print(r, mode, {w: round(v * 1000, 1) for w, v in ts.items()}, flush=True)
for mode in res:
    print(mode, {w: f"{1000 * sum(v):.1f}ms [{1000 * min(v):.1f}-{1000 * max(v):.1f}]" for w, v in res[mode].items()})
print("ratio exact/rows", {w: round(sum(res["exact"][w]) / sum(res["rows"][w]), 3) for w in res["rows"]})
print("steps (exact)", {w: round(sum(res["exact"][w]) / sum(res["exact"][1]), 2) for w in res["rows"]})
print("steps (rows)", {w: round(sum(res["rows"][w]) / sum(res["rows"][1]), 2) for w in res["rows"]})
