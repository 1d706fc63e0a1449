# As run: PYTHONPATH=<repo> python tokens.py 1024 4 (see README.md).
import sys, time
from bench.common import load_engine, filler_tokens
from bench.engine_gap import engine_prefill
n, reps = int(sys.argv[1]), int(sys.argv[2])
path, engine = load_engine(None, 2, n + 64, 512, calibrate="off")
sets = {"synthetic": [1000 + (i * 7919) % 100000 for i in range(n)], "filler": filler_tokens(engine, n)}
res = {k: [] for k in sets}
for r in range(reps + 1):
    for k, toks in sets.items():
        time.sleep(1)
        s = engine_prefill(engine, toks)
        if r: res[k].append(round(s, 3))
for k, v in res.items(): print(k, v, round(sum(v), 2))
