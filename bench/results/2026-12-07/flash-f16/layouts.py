"""Flash attention over F16 (`-fa on`) with reference decode kernels, and with --all also with the default ones,
against the default layout (flash attention off over F16): min_segment as measured now, exact verification widths
(reference kernels only), and, interleaved over rounds, cold prefill of a long prompt and one-token decode steps
after it. Usage: python layouts.py MODEL [CONTEXT] [ROUNDS] [--all]"""
import sys, time
from pathlib import Path
import numpy as np
from orchestrator.engine import Attention, Engine
from orchestrator import calibration as cal

model, ctx, rounds = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 4096, \
    int(sys.argv[3]) if len(sys.argv) > 3 else 3
layouts = {"fa0/f16 (default)": Attention(False, "f16", "f16"),
           "fa1/f16/ref": Attention(True, "f16", "f16", "reference")}
if "--all" in sys.argv:
    layouts["fa1/f16 (default kernels)"] = Attention(True, "f16", "f16")
engines = {}
for name, att in layouts.items():
    e = Engine(model, n_ctx=ctx + 256, n_batch=512, n_threads=2, attention=att)
    t = time.perf_counter(); seg = cal.measure_segments(e)
    print(f"{name}: min_segment {seg.min_segment} (measured in {time.perf_counter() - t:.1f} s)", flush=True)
    e.calibrate(seg.min_segment)
    if att.kernels == "reference":
        t = time.perf_counter()
        w = cal.measure_verify_widths(e, 16)
        print(f"{name}: exact verification widths {w} (measured in {time.perf_counter() - t:.1f} s)", flush=True)
    engines[name] = e
prompt = [1000 + (41 * i) % 5000 for i in range(ctx)]
steps = 32
res = {n: {"prefill": [], "decode": []} for n in engines}
for r in range(rounds):
    for name, e in engines.items():
        e.clear(0)
        t = time.perf_counter(); e.decode(0, prompt, 0); pf = time.perf_counter() - t
        tok = int(np.argmax(e.logits()))
        t = time.perf_counter()
        for i in range(steps):
            e.decode(0, [tok], ctx + i); tok = int(np.argmax(e.logits()))
        dc = (time.perf_counter() - t) / steps
        res[name]["prefill"].append(ctx / pf); res[name]["decode"].append(dc * 1000)
        print(f"round {r + 1} {name}: prefill {ctx / pf:.1f} tokens/s, decode {dc * 1000:.1f} ms/step", flush=True)
base = "fa0/f16 (default)"
for name in engines:
    p, d = res[name]["prefill"], res[name]["decode"]
    print(f"{name}: prefill {min(p):.1f}-{max(p):.1f} tokens/s (sum-time ratio vs default "
          f"{sum(1 / x for x in res[base]['prefill']) / sum(1 / x for x in p):.3f}x), decode {min(d):.1f}-{max(d):.1f} ms/step "
          f"(speed ratio vs default {sum(res[base]['decode']) / sum(d):.3f}x)")
