"""Replays orchestrator's n-gram drafter and width policy over recorded greedy answers of Gemma 3 270M, with and
without following the last draft's source (NgramDrafter(follow=...)), at the verification costs the calibration
measured with reference kernels (../reference-kernels/replay/replay_reference.py's REF). No model runs: the
figure is plain decode steps per token against the steps the speculative decode would have cost.

    PYTHONPATH=. python bench/results/2026-12-07/follow-source/replay.py [TOKENS]   # replay-300.txt, replay-600.txt
"""
import json
import sys
from pathlib import Path

from orchestrator.speculative.ngram import NgramDrafter
from bench.spec_policy import replay

HERE = Path(__file__).parent
REF = {2: 1.881, 3: 2.14, 4: 2.277, 5: 3.864, 6: 4.189, 7: 4.804, 8: 3.955, 9: 4.723, 10: 5.179, 11: 5.611,
       12: 4.842, 13: 5.997, 14: 6.621, 15: 6.927, 16: 6.592}
REWIND = 0.004  # Gemma is attention-only: a rollback is a KV removal


def replay_follow(prompt, answer, follow, n):
    """(speed-up over plain decoding, drafted, accepted) for the first n answer tokens (bench.spec_policy.replay)."""
    return replay(prompt, answer, n, REF, REWIND, NgramDrafter(prompt + answer[:1], follow=follow))


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 600
    seqs = json.loads((HERE.parent / "reference-kernels/replay/seqs.json").read_text())
    seqs.update(json.loads((HERE / "seqs-more.json").read_text()))
    print(f"{'answer':8} {'latest occurrence':>26} {'follow the source':>26}  ratio")
    for name, s in seqs.items():
        a, b = (replay_follow(s["prompt"], s["answer"], f, n) for f in (False, True))
        print(f"{name:8} {a[0]:6.3f}x ({a[2]:3d}/{a[1]:3d} accepted) {b[0]:6.3f}x ({b[2]:3d}/{b[1]:3d} accepted)"
              f"  {b[0] / a[0]:.3f}")
