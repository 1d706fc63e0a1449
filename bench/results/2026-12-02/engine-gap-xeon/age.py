# As run: PYTHONPATH=<repo> python age.py 1024 10 (alone), then age.py 1024 8 beside an idle llama-server (see README.md).
# one long-lived engine against a fresh C process per round (pf.c, 2 reps, the second counted), no llama-server
import random, subprocess, sys, time
from bench.common import load_engine
from bench.engine_gap import engine_prefill
n, rounds = int(sys.argv[1]), int(sys.argv[2])
path, engine = load_engine(None, 2, n + 64, 512, calibrate="off")
toks = [1000 + (i * 7919) % 100000 for i in range(n)]
rng = random.Random(1)
for r in range(rounds):
    out = {}
    for who in rng.sample(["engine", "c"], 2):
        time.sleep(1)
        if who == "engine":
            out[who] = engine_prefill(engine, toks)
        else:
            out[who] = float(subprocess.run(["/tmp/x/pf", str(path), str(n), "2"], capture_output=True, text=True).stdout.split()[-1])
    print(r, f"engine {out['engine']:.3f} c {out['c']:.3f} engine/c {out['engine']/out['c']:.3f}", flush=True)
