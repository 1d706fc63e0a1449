"""Default layout (flash attention off over F16) with reference kernels for decode steps and verifications:
which verification widths are exact? Prefill is untouched (default kernels), so min_segment is as measured today."""
import sys, time
from pathlib import Path
from orchestrator.engine import Attention, Engine
from orchestrator import calibration as cal
model = sys.argv[1]
for kern in ("default", "reference"):
    att = Attention(False, "f16", "f16", kern)
    e = Engine(Path(model), n_ctx=2048, n_batch=512, n_threads=2, attention=att)
    e.min_segment = 2
    t = time.time()
    print(kern, "verify widths:", cal.measure_verify_widths(e, 12, contexts=(40, 170, 300, 700)), f"{time.time()-t:.1f}s", flush=True)
    e.close() if hasattr(e, "close") else None
