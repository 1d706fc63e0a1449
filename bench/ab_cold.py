"""Cold TTFT, orchestrator against llama-server, interleaved A/B (issue 12, item 2).

    python bench/ab_cold.py                 # synthetic qwen3.5-0.8b, 2 threads, 5 repetitions
    python bench/ab_cold.py --reps 7 --model my.gguf
    python bench/ab_cold.py --variant "chunk128=--prefill-chunk-alone 128" --variant "gap256=--snapshot-min-gap 256"

Two prompts, each made cold on every repetition by a nonce at the start of the system message (so neither
server has any prefix of it), sent with max_tokens 1 and streamed; TTFT is measured by the client:

    single  one user message of about --tokens tokens (2,000)
    conv    a system message and 19 alternating user/assistant messages of about 100 tokens each (a snapshot
            boundary every message for orchestrator)

Both servers run at once on their own ports with the flags of bench/systems.py (llama-server: --no-repack,
-fa off, -b/-ub 512, its defaults otherwise); each request waits until both processes are idle; the order of
the systems rotates by one every repetition. `--variant NAME=FLAGS` adds an orchestrator started with more
flags (each is one more server in the same interleaving). Prints per-prompt medians and the median of the
per-repetition ratios (each orchestrator / llama-server), with the load average; writes bench/results/<date>/ab_cold.json. The
machine is shared: read the ratio together with the spread and the load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import uuid
from datetime import date
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.client import request_body, send  # noqa: E402
from bench.run import default_model  # noqa: E402
from bench.systems import SYSTEMS, launch, omp_policy, orchestrator_variants, write_ab  # noqa: E402


def _text(seed: int, n_words: int) -> str:
    return " ".join(f"w{(seed * 7919 + i * 31) % 997} item{i}" for i in range(n_words))


def prompts(nonce: str, tokens: int) -> dict[str, dict]:
    """The two chat bodies (messages only), each made unique by `nonce` (and its name: neither shares a prefix
    with the other). Sizes: a generated word ("w12 item34") is about 7.3 Qwen3.5 tokens."""
    def system(name: str) -> dict:
        return {"role": "system", "content": f"{nonce}-{name}. You are a careful assistant."}
    single = [system("single"), {"role": "user", "content": _text(1, int(tokens / 7.3))}]
    per_message = int(tokens / 20 / 7.3)
    conv = [system("conv")] + [{"role": "user" if i % 2 == 0 else "assistant", "content": _text(i + 2, per_message)}
                               for i in range(19)]
    return {"single": {"messages": single}, "conv": {"messages": conv}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--port", type=int, default=18600)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--omp", choices=["passive", "default"], default="passive",
                    help="OpenMP wait policy of both servers (bench.systems.omp_policy; default passive, as before)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="one more orchestrator, started with FLAGS (e.g. 'gap256=--snapshot-min-gap 256')")
    a = ap.parse_args(argv)
    model = a.model or default_model()
    log_dir = ROOT / "bench" / "results" / "logs"
    systems = [SYSTEMS["orchestrator"], SYSTEMS["llama-server"]]
    try:
        systems += orchestrator_variants(a.variant)
    except ValueError as e:
        ap.error(str(e))
    running = []
    rows: list[dict] = []
    try:
        for i, s in enumerate(systems):
            running.append(launch(s, model, a.port + i, a.threads, a.ctx, log_dir, omp_wait_policy=omp_policy(a.omp)))
        with httpx.Client() as client:
            for rep in range(a.reps + 1):  # repetition 0 warms both servers up and is not counted
                bodies = prompts(uuid.uuid4().hex[:12], a.tokens)
                order = running[rep % len(running):] + running[: rep % len(running)]  # each in each place
                for name, chat in bodies.items():
                    for r in order:
                        for other in running:
                            other.wait_idle()
                        body = request_body("chat", r.system.kind, chat, "", 1, cold=False)
                        out = send(client, r.url, "chat", body)
                        if not out.ok:
                            raise RuntimeError(f"{r.system.name}: {out.error}")
                        if rep:
                            rows.append({"rep": rep, "prompt": name, "system": r.system.name, "ttft_s": out.ttft_s,
                                         "prompt_tokens": out.prompt_tokens, "cached_tokens": out.cached_tokens,
                                         "load": os.getloadavg()[0]})
                        print(f"rep {rep} {name:6} {r.system.name:22} ttft {out.ttft_s:6.2f} s  prompt "
                              f"{out.prompt_tokens} cached {out.cached_tokens}  load {os.getloadavg()[0]:.1f}",
                              file=sys.stderr)
    finally:
        for r in running:
            r.stop()
    summary: dict[str, dict] = {}
    for name in ("single", "conv"):
        peer = {x["rep"]: x["ttft_s"] for x in rows if x["prompt"] == name and x["system"] == "llama-server"}
        summary[name] = {"llama_server_median_s": statistics.median(peer.values())}
        for s in systems:
            if s.kind != "orchestrator":
                continue
            ours = {x["rep"]: x["ttft_s"] for x in rows if x["prompt"] == name and x["system"] == s.name}
            ratios = [ours[k] / peer[k] for k in ours if k in peer]
            summary[name][s.name] = {"median_s": statistics.median(ours.values()),
                                     "ratio_median": statistics.median(ratios), "ratios": ratios}
            print(f"{name:6}: {s.name} {statistics.median(ours.values()):.2f} s, llama-server "
                  f"{summary[name]['llama_server_median_s']:.2f} s (medians of {len(ratios)}); ratio per "
                  f"repetition: median {statistics.median(ratios):.3f}, {min(ratios):.3f}..{max(ratios):.3f}")
    out = a.out or ROOT / "bench" / "results" / str(date.today()) / "ab_cold.json"
    write_ab(out, systems, rows, summary, model=str(model), threads=a.threads, reps=a.reps, omp=a.omp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
