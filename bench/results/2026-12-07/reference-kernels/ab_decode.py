"""Decode-step time, VERIFYING with default kernels (as served before) against reference ones, interleaved."""
import dataclasses, statistics, sys, time
from pathlib import Path
from orchestrator.engine import VERIFYING, Engine
model, steps, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engines = {k: Engine(Path(model), n_ctx=2048, n_batch=256, n_threads=2, attention=dataclasses.replace(VERIFYING, kernels=k))
           for k in ("default", "reference")}
prompt = [1000 + (41 * i) % 5000 for i in range(512)]
res = {k: [] for k in engines}
for r in range(rounds):
    for k, e in engines.items():
        e.clear(0); e.decode(0, prompt, 0)
        tok = 1234
        t = time.perf_counter()
        for i in range(steps):
            e.decode(0, [tok], 512 + i)
            tok = int(e.logits().argmax())
        res[k].append((time.perf_counter() - t) / steps * 1000)
for k, v in res.items():
    print(f"{k:9} ms/step per round {[round(x, 2) for x in v]}  sum {sum(v):.2f}")
print("reference / default (sums): %.3f" % (sum(res["reference"]) / sum(res["default"])))
