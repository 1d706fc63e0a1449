"""The draft-length policy (orchestrator/speculative/policy.py, DraftLength) simulated: tokens per plain decode
step's time on patterns of draft acceptance, at fixed verification costs, against the rule it replaced.

No model runs: each step asks the policy for a width with 6 drafts available; a plain step (width 1) costs 1 and
feeds `shadow` with the first draft's outcome; a verification of width w costs `ratio[w]`, plus `rewind` when a
draft is rejected, and yields the accepted drafts + 1. A drafted token at answer position t is accepted with the
pattern's probability p(t), independently ("iid a", the forced drafts of `bench speculative --forced`), or in
alternating regions (an edit that copies 40 tokens of its prompt, then writes 40 new ones). Costs, in plain
decode steps: "0.8b", the qwen3.5-0.8b preset on 2 cores (bench/results/2026-12-04/speculative: w = 2 costs
1.85, w = 7 3.5, a rollback 1.8: a checkpoint reload and the kept tokens decoded again); "gemma", Gemma 3 270M
(0.43 a row, a rollback only a KV removal).

    python -m bench spec-policy [--tokens 300] [--answers 200] [--out FILE.json]

Prints a markdown table a cost set: the mean over `answers` seeded answers of tokens / cost (1.0 = plain
decoding), per pattern and rule. Deterministic (seeded)."""

from __future__ import annotations

import argparse
import json
import random
from typing import Callable

from orchestrator.speculative.policy import DraftLength, VerifyCosts

COSTS = {"0.8b": ({2: 1.85, 3: 2.2, 4: 2.55, 5: 2.85, 6: 3.2, 7: 3.5}, 1.8),
         "gemma": ({w: 1 + 0.43 * (w - 1) for w in range(2, 8)}, 0.05)}
PATTERNS: dict[str, Callable[[int], float]] = {
    **{f"iid {a}": (lambda t, a=a: a) for a in (1.0, 0.9, 0.85, 0.8, 0.75, 0.6, 0.5, 0.0)},
    "regions 40: 0.97 / 0.2": lambda t: 0.97 if (t // 40) % 2 == 0 else 0.2,
    "regions 15: 0.97 / 0.2": lambda t: 0.97 if (t // 15) % 2 == 0 else 0.2,
}
DRAFTS = 6


class Fixed(VerifyCosts):
    def __init__(self, ratio: dict[int, float], rewind: float) -> None:
        super().__init__()
        self._ratio, self._rewind = ratio, rewind

    def ratio(self, width: int) -> float:
        return 1.0 if width == 1 else self._ratio[width]

    def rewind_ratio(self) -> float:
        return self._rewind


class Before(DraftLength):
    """The rule before 2026-12-05: one outcome per verification, decayed 0.8, and the mean itself."""

    def __init__(self, widths, costs) -> None:
        super().__init__(widths, costs, decay=0.8, z=0.0)

    def observe(self, drafted: int, accepted: int) -> None:
        self._hits = self._hits * self.decay + accepted
        self._misses = self._misses * self.decay + (1 if accepted < drafted else 0)


def answer(policy: DraftLength, p: Callable[[int], float], n_tokens: int, rng: random.Random) -> float:
    """Tokens per plain-step time of one simulated answer of at least n_tokens, at the policy's own costs."""
    tokens, cost = 0, 0.0
    while tokens < n_tokens:
        w = policy.width(DRAFTS)
        if w == 1:
            policy.shadow(rng.random() < p(tokens))
            tokens, cost = tokens + 1, cost + 1.0
            continue
        accepted = 0
        while accepted < w - 1 and rng.random() < p(tokens + accepted):
            accepted += 1
        policy.observe(w - 1, accepted)
        tokens += accepted + 1
        cost += policy.costs.ratio(w) + (policy.costs.rewind_ratio() if accepted < w - 1 else 0.0)
    return tokens / cost


def replay(prompt: list[int], answer: list[int], n: int, costs: dict[int, float], rewind: float,
           drafter=None) -> tuple[float, int, int]:
    """A recorded greedy answer instead of a pattern: orchestrator's n-gram drafter (or `drafter`, NgramDrafter's
    interface over prompt + answer[:1]) and width policy decode the first n answer tokens, at `costs` (verification
    width -> decode steps, the widths used) and `rewind` (a rollback, in steps). Returns (n over the steps spent,
    drafted, accepted); the first answer token is the prompt's, so plain decoding gives n / (n - 1). No model runs: the replays in bench/results/2026-12-07/ (follow-source,
    spec-variants) isolate what the text and the drafter do."""
    from orchestrator.speculative.ngram import NgramDrafter

    widths = sorted(costs)
    drafter = drafter if drafter is not None else NgramDrafter(prompt + answer[:1])
    policy = DraftLength(widths, VerifyCosts(start={**costs, 0: rewind}))
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
            cost += costs[w] + (rewind if i < k else 0)
            new = answer[j:j + i + 1]
        drafter.extend(new)
        j += len(new)
    return n / cost, drafted, accepted


def simulate(n_tokens: int = 300, answers: int = 200) -> dict:
    widths = range(2, DRAFTS + 2)
    rules = {"DraftLength": DraftLength, "before": Before}
    out: dict = {}
    for cname, (ratio, rewind) in COSTS.items():
        for pname, p in PATTERNS.items():
            for rname, rule in rules.items():
                rates = [answer(rule(widths, Fixed(ratio, rewind)), p, n_tokens, random.Random(seed))
                         for seed in range(answers)]
                out.setdefault(cname, {}).setdefault(pname, {})[rname] = round(sum(rates) / len(rates), 4)
    return out


def table(results: dict) -> str:
    lines = []
    for cname, rows in results.items():
        lines += [f"costs {cname}:", "", "| acceptance | DraftLength | before |", "|---|---|---|"]
        lines += [f"| {p} | {r['DraftLength']:.3f} | {r['before']:.3f} |" for p, r in rows.items()]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench spec-policy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=300, help="tokens per simulated answer")
    ap.add_argument("--answers", type=int, default=200, help="seeded answers per pattern")
    ap.add_argument("--out", help="write the results as JSON here too")
    a = ap.parse_args(argv)
    results = simulate(a.tokens, a.answers)
    print(table(results))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"tokens": a.tokens, "answers": a.answers, "results": results}, f, indent=1)
    return 0
