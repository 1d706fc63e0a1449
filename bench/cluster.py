"""Fleet over replicas: prefilled tokens and summed TTFT per routing policy, with and without the Redis tier.

    python -m bench cluster                       # the tiny synthetic model
    python -m bench cluster --model qwen3.5-0.8b  # the synthetic 0.8B shape (slow on 2 cores)

8 agents x 4 turns sharing a 2,000-token tools block (examples/cluster.py's `Fleet`: each turn appends a tool
call and its result), over 2 replicas of one slot and one thread each, behind SMG, for: round-robin, round-robin
+ Redis, SMG cache_aware, SMG cache_aware + Redis; and one replica serving the whole fleet alone (the oracle:
what the fleet prefills when nothing is lost to routing). Requests go one at a time in the same order in every
configuration. Every answer is checked against a cold run (cache_prompt false) on a replica of its own.

Writes bench/results/<date>/cluster.json and cluster.png (matplotlib, the [bench] extra) and prints a table with
each configuration's prefill as a multiple of the oracle's. Not a test: TTFT depends on the machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from bench.common import ROOT, results_dir, write_json


def load_cluster():
    spec = importlib.util.spec_from_file_location("cluster_example", ROOT / "examples" / "cluster.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


C = load_cluster()
CONFIGS = (("round_robin", False), ("round_robin", True), ("cache_aware", False), ("cache_aware", True))


def run(model: Path, agents: int, turns: int, tools_tokens: int, max_tokens: int) -> dict:
    """Every configuration's records, and the cold answers they are checked against."""
    import httpx

    out: dict = {"agents": agents, "turns": turns, "tools_tokens": tools_tokens, "model": str(model), "runs": {}}
    with C.Cluster(model, n_replicas=1) as one:
        one.start_replica(0, remote=False)
        oracle = C.run_fleet(one.replica_url(0), agents, turns, tools_tokens, max_tokens)
        with httpx.Client(timeout=3600) as client:
            fleet = C.Fleet(agents, tools_tokens, max_tokens)
            cold = {(r["agent"], r["turn"]): C.ask(client, one.replica_url(0), r["messages"], fleet.tools,
                                                   max_tokens, use_cache=False)["text"] for r in oracle}
    out["runs"]["one replica (oracle)"] = oracle
    for policy, remote in CONFIGS:
        name = ("SMG cache_aware" if policy == "cache_aware" else "round-robin") + (" + Redis" if remote else "")
        print(f"running {name} ...", flush=True)
        with C.Cluster(model) as cluster:
            cluster.start(policy, remote)
            out["runs"][name] = C.run_fleet(cluster.router_url, agents, turns, tools_tokens, max_tokens)
    for name, records in out["runs"].items():
        wrong = [(r["agent"], r["turn"]) for r in records if r["text"] != cold[(r["agent"], r["turn"])]]
        out.setdefault("differs_from_cold", {})[name] = wrong
        for r in records:
            r.pop("messages", None)
    return out


def summary(out: dict) -> list[dict]:
    oracle = C.prefilled(out["runs"]["one replica (oracle)"])
    rows = []
    for name, records in out["runs"].items():
        pre = C.prefilled(records)
        rows.append({"config": name, "prefilled": pre, "x_oracle": pre / max(oracle, 1),
                     "ttft_s": sum(r["ttft_ms"] for r in records) / 1e3,
                     "remote_restores": sum(r["tier"] == "remote" for r in records),
                     "differs_from_cold": len(out["differs_from_cold"][name])})
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["config"] for r in rows]
    a.barh(names, [r["prefilled"] for r in rows], color="tab:blue")
    a.set_xlabel("prompt tokens prefilled (not restored)")
    b.barh(names, [r["ttft_s"] for r in rows], color="tab:orange")
    b.set_xlabel("sum of time to first token, s")
    b.set_yticklabels([])
    for ax in (a, b):
        ax.invert_yaxis()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="a GGUF path or a synthetic preset name (default tiny)")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tools-tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--out", type=Path, default=results_dir())
    a = ap.parse_args(argv)
    model = Path(a.model)
    if not model.is_file():
        from orchestrator.models.synth import ensure_model

        model = ensure_model(a.model)
    out = run(model, a.agents, a.turns, a.tools_tokens, a.max_tokens)
    rows = summary(out)
    out["summary"] = rows
    write_json(a.out / "cluster.json", out)
    print(f"{'configuration':<26} {'prefilled':>10} {'x oracle':>9} {'sum TTFT s':>11} {'from Redis':>11} "
          f"{'!= cold':>8}")
    for r in rows:
        print(f"{r['config']:<26} {r['prefilled']:>10} {r['x_oracle']:>9.2f} {r['ttft_s']:>11.2f} "
              f"{r['remote_restores']:>11} {r['differs_from_cold']:>8}")
    try:
        plot(rows, a.out / "cluster.png", f"{a.agents} agents x {a.turns} turns, {a.tools_tokens}-token tools "
                                          f"block, 2 replicas ({Path(out['model']).name.split('-random')[0]})")
    except ImportError as e:
        print(f"no plot ({e}); the figures are in {a.out / 'cluster.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
