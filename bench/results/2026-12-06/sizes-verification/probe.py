"""What a verification of w drafted tokens costs against one decode step, by model size: the question of whether
speculative decoding can pay on a CPU at 4B+ (issue 40). Per model: exact verification widths (calibration,
2..8, two contexts), then after a 1,024-token prefill the median of 24 one-token decode steps and of 6
verifications of each width 2..8 (the state reloaded before each), in engine.VERIFYING (the layout in which
speculation runs) and the decode step in the default layout (what speculation off serves). JSON per model.

    python probe.py MODEL [MODEL ...]
"""
import json
import statistics
import sys
import time
from pathlib import Path

from orchestrator import calibration as cal
from orchestrator.engine import VERIFYING, Attention, Engine

PROMPT = [1000 + (41 * i) % 5000 for i in range(1024)]


def steps(e: Engine, n: int) -> float:
    e.clear(0)
    e.decode(0, PROMPT, 0)
    ts = []
    for i in range(n):
        t = time.perf_counter()
        e.decode(0, [1234 + i], len(PROMPT) + i)
        ts.append(time.perf_counter() - t)
    return 1000 * statistics.median(ts[4:])


for model in sys.argv[1:]:
    out = {"model": Path(model).name}
    e = Engine(Path(model), n_ctx=2048, n_batch=512, n_threads=2, n_seq_max=1, attention=Attention())
    out["default_decode_ms"] = steps(e, 24)
    del e
    e = Engine(Path(model), n_ctx=2048, n_batch=512, n_threads=2, n_seq_max=1, attention=VERIFYING)
    t = time.perf_counter()
    out["verify_widths"] = cal.measure_verify_widths(e, max_width=8, contexts=(40, 170))
    out["widths_s"] = round(time.perf_counter() - t, 1)
    out["verifying_decode_ms"] = d = steps(e, 24)
    base = len(PROMPT) + 24
    snap = e.save_state(0)
    for w in range(2, 9):
        ts = []
        for _ in range(6):
            e.load_state(0, snap)
            t = time.perf_counter()
            e.verify(0, [1300 + j for j in range(w)], base)
            ts.append(time.perf_counter() - t)
        ms = 1000 * statistics.median(ts[1:])
        out[f"verify{w}_ms"] = round(ms, 1)
        out[f"verify{w}_steps"] = round(ms / d, 2)
    print(json.dumps(out), flush=True)
    del e
