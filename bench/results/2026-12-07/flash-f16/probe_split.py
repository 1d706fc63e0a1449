"""The bug this run fixed: flash attention over F16 measured min_segment 8 with the 56-token probe, while a 240-token
prompt split at 8..63 tokens differs from it whole (64 and up: exact). Flash attention off, for comparison. Run on
36b5a6d~1 (before the fix) it prints min_segment 8 for both; the split deltas do not depend on the fix.
Usage: python probe_split.py MODEL"""
import sys, time
import numpy as np
from pathlib import Path
from orchestrator.engine import Attention, Engine
from orchestrator import calibration as cal
model = sys.argv[1]
for att in (Attention(True, "f16", "f16"), Attention(False, "f16", "f16")):
    e = Engine(Path(model), n_ctx=2048, n_batch=512, n_threads=2, attention=att)
    t = time.time(); ms = cal.measure_min_segment(e); print(att.key(), "min_segment", ms, f"{time.time()-t:.1f}s")
    e.min_segment = 2
    prompt = [1000 + (41 * i) % 5000 for i in range(240)]
    for m in (ms, 24, 40, 63, 64, 100):
        print("  split", m, cal.split_delta(e, prompt, None if False else (e.clear(0), e.decode(0, prompt, 0), e.logits())[2], m), flush=True)
