"""Flash attention over F16 K/V: are prefill splits whose chunks all have >= 64 tokens (ggml-cpu's tiled FA path)
bit-identical? And with reference kernels for decode steps and verifications, which widths are exact?"""
import dataclasses, sys
import numpy as np
from pathlib import Path
from orchestrator.engine import Attention, Engine
from orchestrator import calibration as cal
model = sys.argv[1]
att = Attention(True, "f16", "f16", "reference")
e = Engine(Path(model), n_ctx=2048, n_batch=512, n_threads=2, attention=att)
e.min_segment = 2
prompt = [1000 + (41 * i) % 5000 for i in range(600)]
def last(splits):
    e.clear(0); pos = 0
    for n in splits:
        e.decode(0, prompt[pos:pos + n], pos); pos += n
    return e.logits()
whole = last([600])
for splits in [[n, 600 - n] for n in (64, 65, 66, 72, 80, 96, 99)] + [[600 - n, n] for n in (65, 66, 72, 80, 96)]:
    d = float(np.abs(last(splits) - whole).max())
    print(splits, "exact" if d == 0 else f"max|d| {d:.2e}", flush=True)
print("verify widths (ref decode):", cal.measure_verify_widths(e, 12, contexts=(40, 170, 300, 700)))
