"""Whether slots verify together on ARM i8mm (under qemu-user): calibration.check_batched_verification over 4
slots at the widest odd width, in `-ctk q8_0` with reference kernels, after the odd-ubatch calibration the runtime
does. Run on the host:

    python tools/aarch64/check.py exec --variant i8mm --models-dir ~/.cache/orchestrator/models -- \
        bench/results/2026-12-07/aarch64-odd-widths/together.py /models/MODEL.gguf OUT.json
"""
import dataclasses
import json
import sys
import time
from pathlib import Path

from orchestrator import calibration
from orchestrator.engine import Attention, Engine

model, out_path = Path(sys.argv[1]), Path(sys.argv[2])
t = time.perf_counter()
e = Engine(model, n_ctx=1024, n_batch=256, n_threads=2, n_seq_max=4,
           attention=Attention(True, "q8_0", "f16", kernels="reference"))
try:
    m, odd = dataclasses.astuple(calibration.measure_segments(e))
    e.calibrate(m, odd=odd)
    out = {"model": model.name, "min_segment": m, "odd_ubatches": odd,
           "together_width_9": calibration.check_batched_verification(e, 9)}
finally:
    e.close()
out["seconds"] = round(time.perf_counter() - t, 1)
out_path.write_text(json.dumps(out, indent=1))
print(json.dumps(out), flush=True)
