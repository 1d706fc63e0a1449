"""Time calibration.measure_verify_widths(engine, 16) on a probe engine as the runtime makes it (-ctk q8_0, reference
decode kernels, 1,024-token context, 2 threads), counting the engine's decode and verify calls and their tokens.

    PYTHONPATH=. python bench/results/2026-12-07/width-calibration-cost/widths_time.py PRESET [MAX_WIDTH]"""
import sys, time
from orchestrator import calibration
from orchestrator.engine import Engine, Attention
from orchestrator.models.synth import ensure_model
preset = sys.argv[1]
att = Attention(True, "q8_0", "f16", "reference")
e = Engine(ensure_model(preset), n_ctx=1024, n_batch=512, n_threads=2, attention=att, use_extra_bufts=False)
calls = {"decode": 0, "verify": 0, "rows": 0}
for name in ("decode", "verify"):
    f = getattr(e, name)
    def wrap(seq, toks, pos, *a, _f=f, _n=name, **k):
        calls[_n] += 1; calls["rows"] += len(toks)
        return _f(seq, toks, pos, *a, **k)
    setattr(e, name, wrap)
t = time.perf_counter()
w = calibration.measure_verify_widths(e, int(sys.argv[2]) if len(sys.argv) > 2 else 16)
dt = time.perf_counter() - t
print(preset, "widths", w, f"{dt:.1f} s", calls)
e.close()
