"""Cold prefill in this process's llama.cpp (llama-cpp-python's shared libraries, through orchestrator's Engine)
against llama-server's own prompt timing, interleaved: is a prefill gap in the library build or in the server?

    python -m bench engine-gap                          # synthetic qwen3.5-0.8b, 2 threads, 512/1024/2048 tokens
    python -m bench engine-gap --sizes 746,2066 --reps 7

One Engine in this process and one llama-server (bench/install_llama_server.sh; the flags of the side-by-side
benchmark's cold variant: n_batch = n_ubatch 512, flash attention off, repacking off, one slot, no prompt
cache), the same token ids, each size prefilled cold in chunks of n_batch by both, in a new random order each
repetition. The engine's time is the wall time of its llama_decode calls; llama-server's is its own
`timings.prompt_ms` (prompt processing only, no HTTP) and, beside it, the request's wall time. Between runs
both sit idle for --idle seconds so neither's OpenMP threads still spin while the other runs. Prints medians
and the engine/server ratio per size; writes bench/results/<date>/engine_gap.json. Not a test.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import httpx

from bench.common import add_model_args, filler_tokens, load_engine, results_dir, write_json
from bench.systems import SYSTEMS, cold_variant, launch


def engine_prefill(engine, tokens: list[int]) -> float:
    """Seconds to prefill `tokens` cold in calls of n_batch tokens, the last with logits."""
    engine.clear(0)
    start = time.perf_counter()
    for pos in range(0, len(tokens), engine.n_batch):
        end = min(pos + engine.n_batch, len(tokens))
        engine.decode(0, tokens[pos:end], pos, want_logits=end == len(tokens))
    return time.perf_counter() - start


def server_prefill(client: httpx.Client, url: str, tokens: list[int]) -> tuple[float, float]:
    """(llama-server's prompt_ms / 1000, the request's wall seconds) for `tokens`, uncached, one token out."""
    start = time.perf_counter()
    r = client.post(url + "/completion", json={"prompt": tokens, "n_predict": 1, "cache_prompt": False,
                                               "temperature": 0})
    wall = time.perf_counter() - start
    r.raise_for_status()
    timings = r.json()["timings"]
    if timings["prompt_n"] != len(tokens):
        raise RuntimeError(f"llama-server prefilled {timings['prompt_n']} of {len(tokens)} tokens")
    return timings["prompt_ms"] / 1000, wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--sizes", default="512,1024,2048", help="prompt lengths in tokens")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--idle", type=float, default=1.0, help="seconds between runs")
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",")]
    ctx = max(sizes) + 64
    path, engine = load_engine(a.model, a.threads, ctx, 512, calibrate="off")
    out = a.out or results_dir() / "engine_gap"
    server = launch(cold_variant(SYSTEMS["llama-server"]), path, a.port, a.threads, ctx,
                    out / "logs", omp_wait_policy=None)
    rows: dict[int, dict[str, list[float]]] = {n: {"engine": [], "server": [], "server_wall": []} for n in sizes}
    rng = random.Random(0)
    try:
        with httpx.Client(timeout=600) as client:
            for rep in range(a.reps + 1):  # the first round warms both and is not counted
                runs = [(n, who) for n in sizes for who in ("engine", "server")]
                rng.shuffle(runs)
                for n, who in runs:
                    tokens = filler_tokens(engine, n)
                    time.sleep(a.idle)
                    if who == "engine":
                        s = engine_prefill(engine, tokens)
                        if rep:
                            rows[n]["engine"].append(s)
                    else:
                        s, wall = server_prefill(client, server.url, tokens)
                        if rep:
                            rows[n]["server"].append(s)
                            rows[n]["server_wall"].append(wall)
    finally:
        server.stop()
    print(f"{'tokens':>7} {'engine s':>9} {'server s':>9} {'ratio':>6}  (ratios per round: min-max)")
    summary = {}
    for n, r in rows.items():
        e, s = statistics.median(r["engine"]), statistics.median(r["server"])
        per_round = [x / y for x, y in zip(r["engine"], r["server"])]
        summary[n] = {"engine_s": e, "server_s": s, "ratio": e / s, "ratio_min": min(per_round),
                      "ratio_max": max(per_round)}
        print(f"{n:7d} {e:9.3f} {s:9.3f} {e / s:6.3f}  ({min(per_round):.3f}-{max(per_round):.3f})")
    write_json(out / "engine_gap.json", {"model": str(path), "threads": a.threads, "reps": a.reps, "runs": {
        str(n): r for n, r in rows.items()}, "summary": {str(n): v for n, v in summary.items()}})
    return 0
