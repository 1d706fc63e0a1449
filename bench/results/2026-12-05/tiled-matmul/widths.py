import sys, time, json, os
import numpy as np
from pathlib import Path
from orchestrator.engine import Engine, VERIFYING
e = Engine(Path(sys.argv[1]), n_ctx=2048, n_batch=512, n_threads=2, n_seq_max=1, attention=VERIFYING)
prompt = [1000 + (41 * i) % 5000 for i in range(512)]
e.decode(0, prompt, 0)
snap = e.save_state(0)
res = {}
for w in list(range(1, 17)):
    ts = []
    for r in range(7):
        e.load_state(0, snap)
        t = time.perf_counter()
        if w == 1: e.decode(0, [1300], 512)
        else: e.verify(0, [1300 + j for j in range(w)], 512)
        ts.append(time.perf_counter() - t)
    res[w] = round(1000 * float(np.median(ts[2:])), 1)
print(os.environ.get("GGML_CPU_TILED_MM"), res)
