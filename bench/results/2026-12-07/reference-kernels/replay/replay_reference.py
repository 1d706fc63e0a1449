import json, sys, collections
from pathlib import Path
from orchestrator.speculative.ngram import NgramDrafter
from orchestrator.speculative.policy import DraftLength, VerifyCosts
REF = {2: 1.881, 3: 2.14, 4: 2.277, 5: 3.864, 6: 4.189, 7: 4.804, 8: 3.955, 9: 4.723, 10: 5.179, 11: 5.611, 12: 4.842, 13: 5.997, 14: 6.621, 15: 6.927, 16: 6.592}
seqs = json.load(open(Path(__file__).with_name("seqs.json")))
def replay(P, A, widths, N=300, z=0.5, decay=0.9, show=False):
    costs = VerifyCosts(start={**REF, 0: 0.004})
    d = NgramDrafter(P + A[:1])
    pol = DraftLength(widths, costs, decay=decay, z=z)
    j, cost, drafted, acc = 1, 0.0, 0, 0
    hist = collections.Counter(); avail = collections.Counter()
    while j < N:
        dr = d.draft(widths[-1] - 1)
        avail[len(dr)] += 1
        w = pol.width(len(dr)); hist[w] += 1
        if w < 2:
            if dr: pol.shadow(dr[0] == A[j])
            cost += 1; new = [A[j]]
        else:
            k = w - 1; i = 0
            while i < k and j + i < N and dr[i] == A[j + i]: i += 1
            pol.observe(k, i); drafted += k; acc += i
            cost += costs.ratio(w) + (costs.rewind_ratio() if i < k else 0)
            new = A[j:j + i + 1]
        d.extend(new); j += len(new)
    if show: print(" widths", sorted(hist.items()), "\n avail", sorted(avail.items()))
    return N / cost, drafted, acc
for name, s in seqs.items():
    for z in (0.5, 0.0):
        for decay in (0.9, 0.95):
            r, dr, ac = replay(s["prompt"], s["answer"], tuple(range(2, 17)), z=z, decay=decay, show=(z == 0.5 and decay == 0.9))
            print(f"{name:5} z={z} decay={decay} {r:.2f}x drafted {dr} accepted {ac}")
