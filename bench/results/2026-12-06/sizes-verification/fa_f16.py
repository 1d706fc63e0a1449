"""Are verification widths exact with flash attention over an F16 K/V cache (whose prefill takes the tiled kernel)?
measure_verify_widths on the MODEL preset with flash attention over F16/F16 and over Q8_0/F16 (engine.VERIFYING),
at contexts below and above 512 KV cells (where ggml-cpu takes its split-KV path for one query).

    python fa_f16.py tiny-q4
"""
from orchestrator.engine import Engine, Attention
from orchestrator import calibration as cal
from orchestrator.models.synth import ensure_model
import sys
m = ensure_model(sys.argv[1])
for att in (Attention(True, "f16", "f16"), Attention(True, "q8_0", "f16")):
    e = Engine(m, n_ctx=2048, n_batch=512, n_threads=2, n_seq_max=1, attention=att)
    for ctxs in ((40, 170, 300), (600,), (1000,)):
        print(att.key(), ctxs, cal.measure_verify_widths(e, 7, contexts=ctxs), flush=True)
    e.close()
