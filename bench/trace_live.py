"""Replay a slice of a Mooncake trace against real servers side by side: token hit rate, cached tokens and TTFT.

`python -m bench trace-live --trace synthetic_trace.jsonl --limit 60 --block-tokens 32 --out DIR`

The simulated replay (`python -m bench trace`) runs the whole hour through the real cache over a stand-in engine;
this one sends a slice that fits one 2-core machine to the real servers (orchestrator and llama-server, each as
`bench/systems.py` starts it), one request at a time in trace order, each request to every system in turn.

A request becomes a chat body: its blocks grouped into messages as the simulated replay groups them
(`TracePrompts.message_ends`, "turn" mode: a message ends where two requests' block paths fork or a request
ends), every message a user message (a role that depends on nothing, so a shared prefix renders to the same
tokens in every request; a system message first would leave a one-message request without the user query
Qwen3.5's template requires). A block is `--block-tokens`
tokens' worth of words drawn from a generator seeded by its id (so the same id is the same text in every request;
the trace's 512-token blocks shrink so that a 12k-token request is about 750 tokens here), the last block cut in
proportion to the request's input length. Answers are greedy, `min(--max-output, output_length / scale)` tokens.

The ceiling of the slice is counted in the tokens the server's template gives each body (`bench.render`): each
request's longest common prefix with any earlier request, the prefix an infinite exact-prefix cache could
restore. Hit rate = Σ cached ÷ Σ prompt tokens as each server reports them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx

from bench.client import request_body, send
from bench.common import add_model_args, results_dir
from bench.systems import SYSTEMS, launch
from bench.trace import BLOCK, Scale, TracePrompts, TraceRequest, load_trace

PORT = 19300
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]


def block_words(block: int, n: int) -> list[str]:
    """`n` pseudo-words for block id `block`: the same id gives the same words in every request and run."""
    rng = random.Random(block)
    return ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n)]


def bodies(requests: list[TraceRequest], block_tokens: int, max_output: int) -> list[dict]:
    """One chat body per request (see the module docstring); about two words per three tokens of a block."""
    prompts = TracePrompts(requests, Scale(BLOCK // block_tokens if BLOCK % block_tokens == 0 else 16))
    words = max(1, block_tokens * 2 // 3)
    out = []
    for r in requests:
        ends = set(prompts.message_ends(r)) | {len(r.hash_ids) - 1}
        last_share = (r.input_length - BLOCK * (len(r.hash_ids) - 1)) / BLOCK
        messages, text = [], []
        for j, h in enumerate(r.hash_ids):
            n = words if j < len(r.hash_ids) - 1 else max(1, round(words * last_share))
            text += block_words(h, n)
            if j in ends:
                messages.append({"role": "user", "content": " ".join(text)})
                text = []
        scaled_output = r.output_length * block_tokens // BLOCK
        out.append({"messages": messages, "max_tokens": max(1, min(max_output, scaled_output))})
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def slice_ceiling(token_lists: list[list[int]]) -> list[int]:
    """Per request, its longest common token prefix with any earlier request (an infinite cache's restore)."""
    return [max((common_prefix(t, u) for u in token_lists[:i]), default=0) for i, t in enumerate(token_lists)]


def summarize(rows: list[dict], systems: list[str], ceilings: list[int], prompts: list[int]) -> dict:
    total, ceil = sum(prompts), sum(ceilings)
    out = {"requests": len(prompts), "prompt_tokens": total, "ceiling_tokens": ceil, "ceiling": ceil / total}
    for s in systems:
        mine = [r[s] for r in rows if s in r]
        ok = [m for m in mine if m["ok"]]
        cached = sum(m["cached_tokens"] or 0 for m in ok)
        prompt = sum(m["prompt_tokens"] or 0 for m in ok)
        out[s] = {"ok": len(ok), "failed": len(mine) - len(ok), "cached_tokens": cached, "prompt_tokens": prompt,
                  "hit_rate": cached / prompt if prompt else 0.0,
                  "of_ceiling": cached / prompt / (ceil / total) if prompt and ceil else 0.0,
                  "ttft_sum_s": sum(m["ttft_s"] for m in ok), "total_sum_s": sum(m["total_s"] for m in ok)}
    return out


def markdown(summary: dict, systems: list[str], meta: dict) -> str:
    lines = [f"# Mooncake slice against real servers: {meta['trace']}, {summary['requests']} requests", "",
             f"Command: `{meta['command']}`  ", f"Model: {meta['model']}; CPU: {meta['cpu']}; load before: "
             f"{meta['load']}", "", f"Slice ceiling (infinite exact-prefix cache, orchestrator's tokens): "
             f"{summary['ceiling_tokens']:,} of {summary['prompt_tokens']:,} prompt tokens = {summary['ceiling']:.1%}",
             "", "| system | requests ok | prompt tokens | cached tokens | hit rate | of ceiling | Σ TTFT s | "
             "Σ request s |", "|---|---|---|---|---|---|---|---|"]
    for s in systems:
        m = summary[s]
        lines.append(f"| {s} | {m['ok']} (failed {m['failed']}) | {m['prompt_tokens']:,} | {m['cached_tokens']:,} | "
                     f"{m['hit_rate']:.1%} | {m['of_ceiling']:.1%} | {m['ttft_sum_s']:.1f} | {m['total_sum_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import platform

    from bench.render import Renderer
    from bench.w5 import _cpu_name
    from orchestrator.models.synth import ensure_model

    ap = argparse.ArgumentParser(prog="python -m bench trace-live", description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--trace", type=Path, required=True, help="Mooncake jsonl trace")
    ap.add_argument("--limit", type=int, default=60, help="the first N requests (default 60)")
    ap.add_argument("--block-tokens", type=int, default=32, help="tokens a 512-token block becomes (divides 512)")
    ap.add_argument("--max-output", type=int, default=8, help="answer tokens at most")
    ap.add_argument("--systems", default="orchestrator,llama-server,llama-server-tuned", help=", ".join(SYSTEMS))
    ap.add_argument("--ctx", type=int, default=16384, help="context per slot")
    ap.add_argument("--port", type=int, default=PORT)
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/<date>/trace-live")
    args = ap.parse_args(argv)
    if BLOCK % args.block_tokens:
        ap.error("--block-tokens must divide 512")
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown systems {unknown}; choose from {sorted(SYSTEMS)}")
    model = args.model or ensure_model("qwen3.5-0.8b")
    out_dir = args.out or results_dir() / "trace-live"
    out_dir.mkdir(parents=True, exist_ok=True)
    requests = load_trace(args.trace, args.limit)
    chats = bodies(requests, args.block_tokens, args.max_output)
    renderer = Renderer(model)
    token_lists = [renderer.tokens(c) for c in chats]
    ceilings = slice_ceiling(token_lists)
    meta = {"trace": args.trace.name, "limit": args.limit, "block_tokens": args.block_tokens, "model": model.name,
            "cpu": _cpu_name() or platform.processor(), "load": os.getloadavg(),
            "command": "python -m bench trace-live " + " ".join(sys.argv[1:] if argv is None else argv)}
    running = {}
    rows: list[dict] = []
    try:
        for i, s in enumerate(systems):
            running[s] = launch(SYSTEMS[s], model, args.port + i, args.threads, args.ctx, out_dir / "logs",
                                workload="trace")
        with httpx.Client() as client:
            for k, chat in enumerate(chats):
                row = {"request": k, "prompt_tokens_rendered": len(token_lists[k]), "ceiling_tokens": ceilings[k]}
                for s in systems:
                    running[s].wait_idle()
                    body = request_body("chat", SYSTEMS[s].kind, {"messages": chat["messages"]}, "",
                                        chat["max_tokens"], cold=False)
                    o = send(client, running[s].url, "chat", body, 1800.0)
                    row[s] = {"ok": o.ok, "error": o.error, "ttft_s": o.ttft_s, "total_s": o.total_s,
                              "prompt_tokens": o.prompt_tokens, "cached_tokens": o.cached_tokens}
                    print(f"{k:4d} {s:20s} prompt {o.prompt_tokens} cached {o.cached_tokens} (ceiling "
                          f"{ceilings[k]}) TTFT {o.ttft_s:6.2f} s {o.error[:80]}", flush=True)
                rows.append(row)
                time.sleep(0.1)
    finally:
        for r in running.values():
            r.stop()
    summary = summarize(rows, systems, ceilings, [len(t) for t in token_lists])
    (out_dir / "requests.json").write_text(json.dumps({"meta": meta, "summary": summary, "requests": rows}, indent=1))
    text = markdown(summary, systems, meta)
    (out_dir / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
