"""Which of the MTP hand-over settings leave the target's logits unchanged: max |Δ| against a plain load, per step
(prompt logits, then 4 decode steps). python masked.py <qwen3.5-4b-mtp.gguf>"""
import sys, numpy as np
from pathlib import Path
from orchestrator.engine import VERIFYING, Engine
from orchestrator.speculative.mtp import NextnApi
M = Path(sys.argv[1])
prompt = [1000 + (41 * i) % 5000 for i in range(300)]
follow = [1500 + (59 * i) % 5000 for i in range(4)]
def run(load_mtp, nextn):
    e = Engine(M, n_ctx=2048, n_batch=512, n_threads=2, attention=VERIFYING, load_mtp=load_mtp)
    if nextn: NextnApi.load().set(e.ctx, True, nextn != "unmasked")
    e.decode(0, prompt, 0); out = [e.logits()]
    for i, t in enumerate(follow):
        e.decode(0, [t], 300 + i); out.append(e.logits())
    e.close(); return out
a = run(False, False)
for name, args in (("again", (False, False)), ("mtp loaded", (True, False)), ("mtp+nextn masked", (True, "masked")),
                   ("mtp+nextn unmasked", (True, "unmasked"))):
    b = run(*args)
    print(name, [float(np.max(np.abs(x - y))) for x, y in zip(a, b)], flush=True)
