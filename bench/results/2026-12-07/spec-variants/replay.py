"""Replays orchestrator's n-gram drafter and width policy (widths 2..16, 20, 24, 28, 32) over texts.json's answers
at the verification costs the calibration measured for Gemma 3 270M on this machine (COSTS, in decode steps): the
speed-up over plain decoding each text would give, on orchestrator's own answer and on llama-server's answer to
the same prompt. No model runs, so there is no noise: the figure isolates what the text does to the drafts.

    PYTHONPATH=. python bench/results/2026-12-07/spec-variants/replay.py [TOKENS]    # replay.txt
"""
import json
import sys
from pathlib import Path

from bench.spec_policy import replay

HERE = Path(__file__).parent
COSTS = {2: 1.82, 3: 2.322, 4: 2.35, 5: 3.614, 6: 4.01, 7: 4.415, 8: 3.26, 9: 4.615, 10: 4.987, 11: 5.268,
         12: 4.238, 13: 5.663, 14: 5.845, 15: 5.986, 16: 5.559, 20: 6.525, 24: 7.487, 28: 8.637, 32: 9.412}
REWIND = 0.004  # attention-only: a rollback is a KV removal


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    texts = json.loads((HERE / "texts.json").read_text())
    print(f"{'prompt':7} {'equal':>5} {'on our answer':>24} {'on llama-server':>24}  ratio")
    for name, d in texts.items():
        a, b = (replay(d["prompt"], d[who], n, COSTS, REWIND) for who in ("ours", "llama_server"))
        print(f"{name:7} {str(d['ours'] == d['llama_server']):>5} {a[0]:6.3f}x ({a[2]:3d}/{a[1]:3d} accepted) "
              f"{b[0]:6.3f}x ({b[2]:3d}/{b[1]:3d} accepted)  {b[0] / a[0]:.3f}")
