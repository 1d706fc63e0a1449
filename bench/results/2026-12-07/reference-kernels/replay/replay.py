import json, sys, collections
from pathlib import Path
from orchestrator.speculative.ngram import NgramDrafter
from orchestrator.speculative.policy import DraftLength, VerifyCosts
ALL = {2: 31.0, 3: 35.3, 4: 36.4, 5: 61.6, 6: 70.1, 7: 69.2}
STEP = 17.2
class Fixed(VerifyCosts):
    def __init__(s, r, rw): super().__init__(); s._r, s._rw = r, rw
    def ratio(s, w): return 1.0 if w == 1 else s._r[w]
    def rewind_ratio(s): return s._rw
costs = Fixed({w: v / STEP for w, v in ALL.items()}, 0.05)
seqs = json.load(open(str(Path(__file__).with_name("seqs.json"))))
N = int(sys.argv[1]) if len(sys.argv) > 1 else 300

def replay(P, A, classes, widths=(2,3,4,5,6,7)):
    d = NgramDrafter(P + A[:1])
    pols = collections.defaultdict(lambda: DraftLength(widths, costs))
    j, cost, drafted, acc, ver = 1, 0.0, 0, 0, 0
    stats = collections.Counter()
    while j < N:
        d.tokens  # prompt + A[:j]
        dr, n = d.draft_n(6) if hasattr(d, 'draft_n') else (d.draft(6), 0)
        key = classes(n)
        pol = pols[key]
        w = pol.width(len(dr))
        if w < 2:
            if dr: pol.shadow(dr[0] == A[j])
            cost += 1; new = [A[j]]
        else:
            k = w - 1
            i = 0
            while i < k and j + i < N and dr[i] == A[j + i]: i += 1
            pol.observe(k, i); drafted += k; acc += i; ver += 1
            stats[(key, 'd')] += k; stats[(key, 'a')] += i
            cost += costs.ratio(w) + (costs.rewind_ratio() if i < k else 0)
            new = A[j:j + i + 1]
        d.extend(new); j += len(new)
    return N / cost, drafted, acc, ver, dict(stats)

import orchestrator.speculative.ngram as ng
def draft_n(self, k):
    toks, end = self.tokens, len(self.tokens)
    for n in self.lengths:
        if end <= n: continue
        gram = toks[end - n:end]
        at = self._last[n].get(hash(tuple(gram)))
        if at is not None and toks[at - n:at] == gram:
            return toks[at:min(at + k, end)], n
    return [], 0
ng.NgramDrafter.draft_n = draft_n
rules = {"one": lambda n: 0, "long/short": lambda n: n >= 8, "per n": lambda n: n}
for name, s in seqs.items():
    for r, c in rules.items():
        rate, dr, ac, ver, st = replay(s["prompt"], s["answer"], c)
        print(f"{name:5} {r:10} {rate:.3f}x  drafted {dr} accepted {ac} verifications {ver}", st if r != "one" else "")
