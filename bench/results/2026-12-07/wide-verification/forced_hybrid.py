"""The hybrid path: the qwen3.5-0.8b preset (random weights) with drafts forced to its own greedy answer, corrupted
at RATE, verified in widths up to 16 against widths up to 32 (past 16: 20, 24, 28, 32) in ONE runtime
(--draft-max 31, `-ctk q8_0` with reference decode kernels: bench.speculative's start_runtime), alternating per
round, so both share the measured costs and the weights' placement. A rejected draft on a hybrid reloads the
checkpoint and replays the kept tokens: the costs the width policy weighs.

    PYTHONPATH=. python bench/results/2026-12-07/wide-verification/forced_hybrid.py ROUNDS TOKENS RATE,RATE"""
import sys
import tempfile
from pathlib import Path

import bench.speculative
from bench.speculative import force, generate, prompts, start_runtime
from orchestrator.models.synth import ensure_model

bench.speculative.CALIBRATION = Path(tempfile.mkdtemp()) / "calibration.json"  # widths measured by this code
rounds, tokens, rates = int(sys.argv[1]), int(sys.argv[2]), [float(r) for r in sys.argv[3].split(",")]
rt = start_runtime(ensure_model("qwen3.5-0.8b"), "auto", 2, 31)
spec = rt.scheduler.speculation
wide, state = spec.widths, spec.state
narrow = tuple(w for w in wide if w <= 16)
print("widths", wide, "costs", {w: round(c, 2) for w, c in spec.costs.start.items()} if hasattr(spec.costs, "start") else "")
text = prompts(150)["free"]
spec.widths = ()
off = generate(rt, "off", "free", text, "chatml", tokens)
sums = {}
for rnd in range(rounds):
    for rate in rates:
        for name, ws in (("16", narrow), ("32", wide)):
            spec.widths, spec.state = ws, state
            force(spec, off["tokens"], rate, off["prompt_tokens"])
            out = generate(rt, f"r{rnd} {rate:.2f} {name}", "free", text, "chatml", tokens)
            assert out["tokens"] == off["tokens"], "answer differs from speculation off"
            sums.setdefault((rate, name), []).append(out["decode_tps"])
print("off decode tokens/s", round(off["decode_tps"], 2))
for rate in rates:
    a, b = sums[(rate, "16")], sums[(rate, "32")]
    print(f"corrupt {rate:.2f}: up to 16 {[round(x, 2) for x in a]}, up to 32 {[round(x, 2) for x in b]}, "
          f"ratio of sums {sum(b) / sum(a):.3f}; answers equal speculation off")
rt.close()
