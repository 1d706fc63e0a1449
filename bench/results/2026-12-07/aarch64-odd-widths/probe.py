"""Speculative verification on ARM i8mm, under qemu-user: which widths are exact in the speculation layout
(`-ctk q8_0`, reference decode kernels), and speculation on against off with forced drafts that get rejected at
every position (every draft verified at the widest exact width it fills, so rollbacks keep odd and even counts). Run on the host:

    python tools/aarch64/check.py exec --variant i8mm --models-dir ~/.cache/orchestrator/models -- \
        bench/results/2026-12-07/aarch64-odd-widths/probe.py /models/MODEL.gguf OUT.json

Writes OUT.json (a path under the repository: it is mounted read-write at /repo). A third argument `unsplit`
replays every rollback in one ubatch, as before odd widths (the measurement only)."""
import json
import sys
import time
from pathlib import Path

import numpy as np

from orchestrator import calibration
from orchestrator.engine import Attention, Engine

model, out_path = Path(sys.argv[1]), Path(sys.argv[2])
unsplit = sys.argv[3:] == ["unsplit"]  # rollbacks replay in one ubatch whatever their length (as before)
out: dict = {"model": model.name, "unsplit": unsplit}
if unsplit:
    import orchestrator.speculative.verify as verify

    whole_replay = verify.replay
    verify.replay = lambda engine, items, widths=None: whole_replay(engine, items)
t = time.perf_counter()
att = Attention(True, "q8_0", "f16", kernels="reference")
e = Engine(model, n_ctx=1024, n_batch=256, n_threads=2, n_seq_max=1, attention=att)
try:
    # what one verification of w tokens gives against w one-token steps after a 40-token prompt
    prompt = [1000 + (41 * i) % 5000 for i in range(40)]
    nxt = [1500 + (59 * i) % 5000 for i in range(9)]
    e.decode(0, prompt, 0)
    start = e.save_state(0)
    ref = []
    for i, tok in enumerate(nxt):
        e.decode(0, [tok], 40 + i)
        ref.append(e.logits())
    deltas = {}
    for w in range(2, 9):
        e.load_state(0, start)
        e.verify(0, nxt[:w], 40)
        deltas[w] = max(float(np.max(np.abs(e.logits(i) - ref[i]))) for i in range(w))
    out["verify_max_abs_delta"] = deltas
    e.clear(0)
    out["measured_widths"] = list(calibration.measure_verify_widths(e, 9, contexts=(40, 90)))
finally:
    e.close()
out["seconds_widths"] = round(time.perf_counter() - t, 1)
print(json.dumps(out), flush=True)
if unsplit:
    out_path.write_text(json.dumps(out, indent=1))
    sys.exit(0)

# speculation on against off through the runtime, with forced drafts (bench.speculative.run_forced)
import orchestrator.speculative.verify as verify  # noqa: E402
from bench import speculative as spec  # noqa: E402
from orchestrator.speculative.policy import DraftLength  # noqa: E402

# every draft verified at the widest exact width it fills, whatever it costs: rollbacks at every keep count
DraftLength.width = lambda self, available: max((w for w in self.widths if w <= available + 1), default=1)

spec.CALIBRATION = Path("/tmp/aarch64-odd-calibration.json")
kept = []
whole = verify.rewind
verify.rewind = lambda engine, seq, point, pos, k, widths=None: (kept.append(len(k)),
                                                                   whole(engine, seq, point, pos, k, widths))
t = time.perf_counter()
texts = {k: v for k, v in spec.prompts(24).items() if k in ("edit", "free")}
runs = spec.run_forced(model, "auto", texts, "chatml", 40, 2, 8, [("forced25", 0.25), ("forced50", 0.5)])
out["runtime_widths"] = runs["off"]["widths"]
out["forced"] = {name: {g: {"tokens": r[g]["tokens"] == runs["off"][g]["tokens"], "drafted": r[g]["drafted"],
                            "accepted": r[g]["accepted"]} for g in texts} for name, r in runs.items() if name != "off"}
out["identical"] = all(v["tokens"] for r in out["forced"].values() for v in r.values())
out["rollbacks_kept"] = kept
out["rollbacks_even"] = sum(1 for k in kept if k % 2 == 0)
out["seconds_runtime"] = round(time.perf_counter() - t, 1)
out_path.write_text(json.dumps(out, indent=1))
print(json.dumps({k: v for k, v in out.items() if k != "rollbacks_kept"}), flush=True)
