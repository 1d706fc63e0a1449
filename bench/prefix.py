"""Time to first token with and without a shared system+tools prefix, and the cost of taking snapshots.

    python -m bench prefix                       # synthetic qwen3.5-0.8b (built once), 2 threads
    python -m bench prefix --model my.gguf --threads 4 --repeats 5

Measures, in one process, alternating so that machine drift hits every variant alike:
  * cold TTFT: a prompt of a ~2,000-token system+tools prefix and a user line, nothing cached;
  * warm TTFT: the same prefix with a different ~30-token user tail, after the first request was served;
  * snapshot overhead: the time a cold request spends saving snapshots (boundaries and end of prompt), over the
    rest of its time to first token; and, as a cross-check that includes drift, its prefill against the same
    prefill with the cache off (same chunking, nothing saved).
Writes bench/results/<date>/prefix.json and prints a table. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from bench.common import add_model_args, results_dir, write_json
from bench.workloads import agent_system_prompt, agent_tools
from orchestrator.config import Config
from orchestrator.request import Job, SamplingParams
from orchestrator.runtime import Runtime

TAILS = [
    "Please look at the failing test in tests/test_cache.py and tell me which assertion fails and why it fails now.",
    "Summarise the open pull requests that touch the scheduler, and list the reviewers who have not replied yet.",
    "Which functions in orchestrator/engine.py call llama_decode, and do any of them skip chunking the batch?",
    "Draft a commit message for the change that bounds the snapshot cache by bytes instead of by entry count.",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=1500,
                    help="system text size; with the tools block the shared prefix is about 2,000 tokens")
    ap.add_argument("--out", type=Path, default=results_dir())
    a = ap.parse_args(argv)

    rt = Runtime.start(Config(model=a.model, ctx_size=8192, batch_size=512, threads=a.threads, cache_ram_mib=4096))
    system = agent_system_prompt(rt.engine.tokenize, a.system_tokens)
    tools = agent_tools()

    def job(tail: str, use_cache: bool) -> tuple[Job, object]:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": tail}]
        p = rt.prompts.chat(msgs, tools, {})
        return Job(p.tokens, p.boundaries, max_tokens=1, sampling=SamplingParams(), use_cache=use_cache), p

    rows = []
    for r in range(a.repeats):
        rt.cache.clear()
        j_cold, p_cold = job(TAILS[0], True)
        cold = rt.scheduler.run(j_cold)  # cold, snapshots taken
        j_warm, p_warm = job(TAILS[1 + r % 3], True)
        warm = rt.scheduler.run(j_warm)
        j_off, _ = job(TAILS[0], False)
        off = rt.scheduler.run(j_off)  # cold, no snapshots
        rows.append({
            "repeat": r, "prompt_tokens": len(p_cold.tokens), "warm_prompt_tokens": len(p_warm.tokens),
            "system_end": p_warm.boundaries.system_end,
            "cold_ttft_s": cold.ttft_s, "warm_ttft_s": warm.ttft_s, "warm_cached_tokens": warm.cached_tokens,
            "cold_prefill_with_snapshots_s": cold.prefill_s + cold.restore_s, "cold_prefill_no_cache_s": off.prefill_s,
            "snapshots_saved": cold.snapshots_saved, "cold_snapshot_s": cold.snapshot_s,
            "snapshot_overhead": cold.snapshot_s / (cold.ttft_s - cold.snapshot_s),
        })
        print(f"repeat {r}: cold TTFT {cold.ttft_s:.3f}s, warm TTFT {warm.ttft_s:.3f}s "
              f"(cached {warm.cached_tokens}/{len(p_warm.tokens)}), no-cache prefill {off.prefill_s:.3f}s", flush=True)

    med = {k: statistics.median(r[k] for r in rows) for k in
           ("cold_ttft_s", "warm_ttft_s", "cold_prefill_with_snapshots_s", "cold_prefill_no_cache_s")}
    cache_stats = rt.cache.stats()
    summary = {
        "model": rt.engine.info.name, "threads": a.threads, "prompt_tokens": rows[0]["prompt_tokens"],
        "warm_cached_tokens": rows[0]["warm_cached_tokens"], **med,
        "ttft_speedup": med["cold_ttft_s"] / med["warm_ttft_s"],
        # time spent saving snapshots over the rest of the cold request's time to first token
        "snapshot_overhead": statistics.median(r["snapshot_overhead"] for r in rows),
        "prefill_with_vs_without_snapshots": med["cold_prefill_with_snapshots_s"] / med["cold_prefill_no_cache_s"] - 1,
        "snapshot_bytes_per_cold_request": cache_stats.ram_bytes, "rows": rows, "load_average": os.getloadavg(),
    }
    print("\n| model | prompt tokens | cached on warm | cold TTFT | warm TTFT | speedup | snapshot overhead |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {summary['model']} | {summary['prompt_tokens']} | {summary['warm_cached_tokens']} | "
          f"{med['cold_ttft_s']:.3f} s | {med['warm_ttft_s']:.3f} s | {summary['ttft_speedup']:.1f}x | "
          f"{summary['snapshot_overhead']:+.1%} ({summary['prefill_with_vs_without_snapshots']:+.1%} A/B) |")
    write_json(a.out / "prefix.json", summary)
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
