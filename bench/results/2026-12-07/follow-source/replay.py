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
from orchestrator.speculative.policy import DraftLength, VerifyCosts

HERE = Path(__file__).parent
REF = {2: 1.881, 3: 2.14, 4: 2.277, 5: 3.864, 6: 4.189, 7: 4.804, 8: 3.955, 9: 4.723, 10: 5.179, 11: 5.611,
       12: 4.842, 13: 5.997, 14: 6.621, 15: 6.927, 16: 6.592}
REWIND = 0.004  # Gemma is attention-only: a rollback is a KV removal


def replay(prompt, answer, follow, n, widths=tuple(range(2, 17))):
    """(speedup over plain decoding, drafted, accepted) for the first n answer tokens."""
    drafter = NgramDrafter(prompt + answer[:1], follow=follow)
    policy = DraftLength(widths, VerifyCosts(start={**REF, 0: REWIND}))
    j, cost, drafted, accepted, n = 1, 0.0, 0, 0, min(n, len(answer))
    while j < n:
        draft = drafter.draft(widths[-1] - 1)
        w = policy.width(len(draft))
        if w < 2:
            if draft:
                policy.shadow(draft[0] == answer[j])
            cost, new = cost + 1, answer[j:j + 1]
        else:
            k, i = w - 1, 0
            while i < k and j + i < n and draft[i] == answer[j + i]:
                i += 1
            policy.observe(k, i)
            drafted, accepted = drafted + k, accepted + i
            cost += REF[w] + (REWIND if i < k else 0)
            new = answer[j:j + i + 1]
        drafter.extend(new)
        j += len(new)
    return n / cost, drafted, accepted


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 600
    seqs = json.loads((HERE.parent / "reference-kernels/replay/seqs.json").read_text())
    seqs.update(json.loads((HERE / "seqs-more.json").read_text()))
    print(f"{'answer':8} {'latest occurrence':>26} {'follow the source':>26}  ratio")
    for name, s in seqs.items():
        a, b = (replay(s["prompt"], s["answer"], f, n) for f in (False, True))
        print(f"{name:8} {a[0]:6.3f}x ({a[2]:3d}/{a[1]:3d} accepted) {b[0]:6.3f}x ({b[2]:3d}/{b[1]:3d} accepted)"
              f"  {b[0] / a[0]:.3f}")
