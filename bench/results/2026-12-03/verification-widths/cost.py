"""What a verification and its rollback cost against a one-token decode step (median ms of `reps` each, after a
warm-up), with n_rs_seq = 6 (the recurrent snapshots a width-7 rollback needs) and without.

    PYTHONPATH=. python bench/results/2026-12-03/verification-widths/cost.py MODEL.gguf [reps]
"""
import statistics
import sys
import time

from orchestrator.engine import Engine

model = sys.argv[1]
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
for n_rs in (0, 6):
    e = Engine(model, n_ctx=2048, n_batch=256, n_threads=2, n_seq_max=1, n_rs_seq=n_rs)
    prompt = [1000 + (37 * i) % 5000 for i in range(300)]
    e.decode(0, prompt, 0)
    base = e.save_state(0)
    n = len(prompt)

    def timed(fn):
        out = []
        for _ in range(reps):
            e.load_state(0, base)
            t = time.perf_counter(); fn(); out.append(time.perf_counter() - t)
        return statistics.median(out) * 1e3

    t = time.perf_counter(); e.load_state(0, base); e.decode(0, prompt[:256], n); prefill = time.perf_counter() - t
    row = [f"decode1 {timed(lambda: e.decode(0, [5], n)):.2f}"]
    for k in (2, 4, 7):
        row.append(f"verify{k} {timed(lambda: e.verify(0, [5] * k, n)):.2f}")
        if n_rs or not e.state.entry_kinds - {'kv'}:
            row.append(f"verify{k}+keep1 {timed(lambda: (e.verify(0, [5] * k, n), e.truncate(0, n + 1))):.2f}")
    print(f"{model.split('/')[-1]} n_rs_seq={e.n_rs_seq}: " + ", ".join(row) + f" ms; prefill of 256 {prefill * 1e3:.0f} ms",
          flush=True)
    e.close()
