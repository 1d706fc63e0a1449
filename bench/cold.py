"""Cold requests, orchestrator against llama-server, interleaved and repeated: issue 30's "every cold request
within 1.02x of llama-server's TTFT", with the repetitions one side-by-side run does not have.

    python -m bench cold                        # W1-W3's cold requests, 5 rounds, synthetic qwen3.5-0.8b
    python -m bench cold --reps 7 --workloads W1
    python -m bench cold --workloads W2 --variant rs8="--rs-snapshots 8"   # an orchestrator with more flags too
    python -m bench cold --repeat --max-tokens 16 --variant nocache=--no-cache  # issue 30's whole "done when"

The cold requests are those of W1-W3 (bench/scenarios.py) that share no token with an earlier request of their
round: W1's A of each round (507 and 2,066 tokens), W2's first turn (746), W3's first agent's first turn (2,180).
Both servers (and each --variant orchestrator) run at once with the side-by-side benchmark's flags (bench/systems.py), caches on, as they serve
a workload. Each round sends every cold request to both, in a new random order, each made new to both caches by
a round-numbered tag at the start of its first tool's description or first message (so each server does its usual cold work: orchestrator its
snapshot stops, llama-server its checkpoints), and waits until both are idle between requests. TTFT as the
side-by-side benchmark measures it (bench/client.py). Prints, per request and orchestrator, the median TTFT against
llama-server's, the ratio of medians and the per-round ratios' range; writes bench/results/<date>/cold/cold.json.

With --repeat, each system gets every cold request a second time right after its first (the exact repeat, W1's D):
its TTFT against llama-server's repeat, and its answer against the same system's cold answer. Each orchestrator
variant's cold answer is also compared with plain orchestrator's (a `--no-cache` variant makes that the
cache-off reference), so one run holds cold TTFT, repeat TTFT and cached == cold. Greedy answers of
--max-tokens tokens; TTFT is still the first streamed token. Not a test.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
from pathlib import Path

import httpx

from bench.client import request_body, send
from bench.common import add_model_args, results_dir, write_json
from bench.render import Renderer
from bench.report import oracle
from bench.run import default_model
from bench.scenarios import Req, Scale, w1, w2, w3
from bench.systems import SYSTEMS, add_variant_args, launch, omp_policy, with_variants

PEER = "llama-server"


def cold_requests(rend: Renderer, scale: Scale, workloads: list[str]) -> list[Req]:
    """The requests of `workloads` whose oracle is 0 (no token shared with an earlier request of their round),
    one per distinct prompt."""
    pt = lambda b: len(rend.tokens(b))  # noqa: E731
    gens = {"W1": lambda: w1(rend.tokenize, scale, pt), "W2": lambda: w2(rend.tokenize, scale),
            "W3": lambda: w3(rend.tokenize, scale, pt)}
    out: dict[str, Req] = {}
    for w in workloads:
        by_round: dict[str, list[Req]] = {}
        for q in gens[w]():
            by_round.setdefault(q.round, []).append(q)
        for reqs in by_round.values():
            for q, o in zip(reqs, oracle([rend.tokens(x.body) for x in reqs])):
                if o == 0:
                    out.setdefault(rend.text(q.body), q)
    return list(out.values())


def fresh(body: dict, tag: str) -> dict:
    """`body` with `tag` at the start of what the prompt starts with (the first tool's description where there are
    tools: Qwen3.5's template writes them before the system text; else the first message): new to every cache,
    the rest unchanged."""
    body = copy.deepcopy(body)
    if body.get("tools"):
        fn = body["tools"][0]["function"]
        fn["description"] = f"{tag} {fn.get('description', '')}"
    else:
        first = body["messages"][0]
        first["content"] = f"{tag}\n{first['content']}"
    return body


def _kind(run: dict) -> str:
    return run.get("kind", "cold")  # runs written before --repeat existed have no kind


def summarize(runs: list[dict], systems: list[str]) -> list[dict]:
    """Per request, kind ("cold" or "repeat") and system other than llama-server: median TTFT (s) against
    llama-server's of the same request and kind, the ratio of medians and of sums, the per-round ratios' range.
    `runs`: the run records main() writes (round, request, system, kind, ttft_s, prompt_tokens, output)."""
    out = []
    for key in dict.fromkeys(r["request"] for r in runs):
        for kind in dict.fromkeys(_kind(r) for r in runs if r["request"] == key):
            sel = {n: sorted((r for r in runs if r["request"] == key and _kind(r) == kind
                              and r["system"] == n), key=lambda r: r["round"]) for n in systems}
            t = {n: [r["ttft_s"] for r in rs] for n, rs in sel.items()}
            for name in [n for n in systems if n != PEER and t[n] and t[PEER]]:
                per_round = [x / y for x, y in zip(t[name], t[PEER])]
                row = {"request": key, "kind": kind, "system": name,
                       "prompt_tokens": sel[name][0]["prompt_tokens"],
                       "ttft_s": statistics.median(t[name]), "peer_s": statistics.median(t[PEER]),
                       "ratio_of_sums": sum(t[name]) / sum(t[PEER]), "ratio_min": min(per_round),
                       "ratio_max": max(per_round)}
                row["ratio"] = row["ttft_s"] / row["peer_s"]
                out.append(row)
    return out


def answer_checks(runs: list[dict], systems: list[str]) -> list[dict]:
    """cached == cold, per request: every repeat answer of every system (llama-server too) against its own cold
    answer of the same round, and every other orchestrator's cold answer against plain orchestrator's. Rows:
    request, kind, system, against (a system name), answers compared, differ (count)."""
    cold = {(r["round"], r["request"], r["system"]): r["output"] for r in runs if _kind(r) == "cold"}
    out = []
    for key in dict.fromkeys(r["request"] for r in runs):
        for name in systems:
            mine = [r for r in runs if r["request"] == key and r["system"] == name]
            checks = [("repeat", name, [r for r in mine if _kind(r) == "repeat"])]
            if name not in ("orchestrator", PEER) and "orchestrator" in systems:
                checks.append(("cold", "orchestrator", [r for r in mine if _kind(r) == "cold"]))
            for kind, against, rs in checks:
                if rs:
                    out.append({"request": key, "kind": kind, "system": name, "against": against,
                                "answers": len(rs),
                                "differ": sum(r["output"] != cold[(r["round"], key, against)] for r in rs)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--workloads", default="W1,W2,W3")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--port", type=int, default=8420)
    ap.add_argument("--omp", choices=["default", "passive"], default="default")
    add_variant_args(ap, peer=False)
    ap.add_argument("--repeat", action="store_true",
                    help="send each cold request a second time to the same system (the exact repeat)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    model = a.model or default_model()
    scale = Scale.named("default")
    rend = Renderer(model)
    reqs = cold_requests(rend, scale, [w.strip().upper() for w in a.workloads.split(",")])
    out = a.out or results_dir() / "cold"
    systems = {s.name: s for s in with_variants(ap, a, [SYSTEMS["orchestrator"], SYSTEMS[PEER]])}
    servers = {}
    for i, s in enumerate(systems.values()):
        servers[s.name] = launch(s, model, a.port + i, a.threads, scale.ctx_size, out / "logs",
                                 4096 if s.kind == "orchestrator" else None, omp_wait_policy=omp_policy(a.omp))
    runs: list[dict] = []
    rng = random.Random(0)

    def one(client: httpx.Client, name: str, body: dict, q: Req, rnd: int, kind: str):
        s, srv = systems[name], servers[name]
        srv.wait_idle()
        o = send(client, srv.url, s.api, request_body(s.api, s.kind, body, "", a.max_tokens, False))
        if not o.ok:
            raise RuntimeError(f"{name} failed {q.workload} {q.label} ({kind}): {o.error[:200]}")
        print(f"round {rnd} {q.workload} {q.round} {q.label:<16} {name:<24} {kind:<6} TTFT {o.ttft_s:7.3f} s "
              f"prompt {o.prompt_tokens} cached {o.cached_tokens}", flush=True)
        return o

    try:
        with httpx.Client() as client:
            for rnd in range(a.reps + 1):  # round 0 warms both and is not counted
                for i, q in enumerate(reqs):
                    body = fresh(q.body, f"Run {rnd}.{i}.")
                    order = list(systems)
                    rng.shuffle(order)
                    for name in order:
                        for kind in ("cold", "repeat") if a.repeat else ("cold",):
                            o = one(client, name, body, q, rnd, kind)
                            if rnd:
                                runs.append({"round": rnd, "workload": q.workload, "request": f"{q.round} {q.label}",
                                             "system": name, "kind": kind, "ttft_s": o.ttft_s,
                                             "prompt_tokens": o.prompt_tokens, "cached_tokens": o.cached_tokens,
                                             "output": o.output, "timings": o.server_timings})
    finally:
        for srv in servers.values():
            srv.stop()
    summary = summarize(runs, list(systems))
    print(f"\n{'request':<28} {'kind':<6} {'system':<24} {'tokens':>6} {'TTFT s':>8} {PEER + ' s':>15} {'ratio':>6}"
          f"  per round")
    for row in summary:
        print(f"{row['request']:<28} {row['kind']:<6} {row['system']:<24} {row['prompt_tokens']:>6} "
              f"{row['ttft_s']:8.3f} {row['peer_s']:15.3f} {row['ratio']:6.3f}  "
              f"{row['ratio_min']:.3f}-{row['ratio_max']:.3f}")
    answers = answer_checks(runs, list(systems))
    for row in answers:
        print(f"{row['request']:<28} {row['kind']:<6} {row['system']:<24} against {row['against']}: "
              f"{row['differ']} of {row['answers']} answers differ")
    write_json(out / "cold.json", {"model": str(model), "threads": a.threads, "reps": a.reps, "omp": a.omp,
                                   "systems": {n: list(s.extra) for n, s in systems.items()}, "peer": PEER,
                                   "max_tokens": a.max_tokens, "repeat": a.repeat, "summary": summary,
                                   "answers": answers, "runs": runs})
    return 0
