# As run from /tmp/x: PYTHONPATH=<repo> python pf.py N REPS (see README.md).
import sys, time
from bench.common import load_engine
from bench.engine_gap import engine_prefill
n, reps = int(sys.argv[1]), int(sys.argv[2])
path, engine = load_engine(None, 2, n + 64, 512, calibrate="off")
toks = [1000 + (i * 7919) % 100000 for i in range(n)]
for r in range(reps):
    time.sleep(1)
    print(f"{engine_prefill(engine, toks):.3f}", flush=True)
