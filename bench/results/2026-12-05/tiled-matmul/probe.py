"""Probe: verify widths, min_segment, batch widths and speed under GGML_CPU_TILED_MM env settings."""
import json, os, sys, time
import numpy as np
from pathlib import Path
from orchestrator.engine import Engine, VERIFYING, Attention
from orchestrator import calibration as cal

model, layout = sys.argv[1], sys.argv[2]
att = VERIFYING if layout == "verifying" else Attention()
e = Engine(Path(model), n_ctx=2048, n_batch=512, n_threads=2, n_seq_max=4, attention=att)
out = {"env": {k: os.environ.get(k) for k in ("GGML_CPU_TILED_MM", "GGML_CPU_TILED_MM_FORCE")}, "layout": layout}
t = time.perf_counter(); out["verify_widths"] = cal.measure_verify_widths(e, max_width=int(os.environ.get("MAXW", "16")), contexts=(40, 170, 300)); out["t_verify"] = time.perf_counter() - t
try:
    out["batch"] = cal.batch_deltas(e)
except Exception as ex:
    out["batch"] = repr(ex)
out["min_segment"] = cal.measure_min_segment(e)
# speed: prefill 256 and 1-token decode steps
prompt = [1000 + (41 * i) % 5000 for i in range(512)]
e.clear(0); t = time.perf_counter(); e.decode(0, prompt, 0); out["prefill_tps"] = 512 / (time.perf_counter() - t)
ts = []
for i in range(40):
    t = time.perf_counter(); e.decode(0, [1234 + i], 512 + i); ts.append(time.perf_counter() - t)
out["decode_ms"] = 1000 * float(np.median(ts[5:]))
snap = e.save_state(0)
for w in (4, 8, 16):
    ts = []
    for r in range(6):
        e.load_state(0, snap)
        t = time.perf_counter(); e.verify(0, [1300 + j for j in range(w)], 552); ts.append(time.perf_counter() - t)
    out[f"verify{w}_ms"] = 1000 * float(np.median(ts[1:]))
print(json.dumps(out, default=str))
