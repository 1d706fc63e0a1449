"""Reproduce the W3 correctness failure found by `python -m bench`: a cached response differs from the cold one.

    python bench/repro_w3_mismatch.py [--cache-ram MiB]    # about 3 minutes on 2 cores

Starts one orchestrator server (synthetic qwen3.5-0.8b, 2 threads, context 8,192, a fresh disk tier), sends the
default-scale W3 fleet (3 agents x 3 turns, interleaved, 8 tokens each, greedy, seed 1234), then sends each
agent's last turn again with `cache_prompt: false` to the same server and prints whether the texts match.
Measured on 2026-11-29 (before the parallel-slot merge), with --cache-ram 192 (restores from disk) and 4096
(restores from RAM) alike: agent 1 turn 3 and agent 2 turn 3 differ from their cold runs from the 7th token
on, agent 3 turn 3 matches. After merging the parallel-slot scheduler the committed run
(bench/results/2026-11-29) found no difference on these three; run this to check a server version.
Exit status 1 if any differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.client import request_body, send  # noqa: E402
from bench.render import Renderer  # noqa: E402
from bench.run import default_model  # noqa: E402
from bench.scenarios import Scale, w3  # noqa: E402
from bench.systems import SYSTEMS, launch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-ram", type=int, default=192, help="orchestrator --cache-ram, MiB")
    ap.add_argument("--port", type=int, default=18700)
    a = ap.parse_args()
    model = default_model()
    r = Renderer(model)
    reqs = w3(r.tokenize, Scale.named("default"), lambda b: len(r.tokens(b)))
    run = launch(SYSTEMS["orchestrator"], model, a.port, 2, 8192, Path("/tmp/repro_w3_logs"), a.cache_ram, "W3")
    warm: dict[str, str] = {}
    bad = 0
    try:
        with httpx.Client() as c:
            for q in reqs:
                o = send(c, run.url, "chat", request_body("chat", "orchestrator", q.body, "", q.max_tokens, False))
                run.wait_idle()
                warm[q.label] = o.output
                print(f"{q.label}: cached {o.cached_tokens} {o.output!r}", flush=True)
            last = max(q.meta["turn"] for q in reqs)
            for q in [q for q in reqs if q.meta["turn"] == last]:
                o = send(c, run.url, "chat", request_body("chat", "orchestrator", q.body, "", q.max_tokens, True))
                run.wait_idle()
                same = o.output == warm[q.label]
                bad += not same
                print(f"{q.label} cold: {o.output!r} {'MATCH' if same else 'DIFFERS'}", flush=True)
    finally:
        run.stop()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
