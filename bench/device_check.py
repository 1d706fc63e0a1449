"""Cached-equals-cold and speed on whatever device the installed llama-cpp-python offloads to (issue 29).

Run by bench/cuda_check.sh (a lent NVIDIA machine; once on lavapipe: bench/results/2026-12-01/vulkan/) with the
Python whose llama_cpp was built for that backend; on the CPU build it checks the CPU (and `--dry-run` checks its
own steps in seconds, tests/test_device_check.py). Per preset, with every layer offloaded (-ngl all) unless told:

  layout          the backend and devices (orchestrator/devices.Offload), llama_print_system_info
  calibration     min_segment (calibration.measure_min_segment) and batch invariance at 4 slots (2 in a dry run)
                  (calibration.check_batch_invariance), as the server measures them at start
  shared_prefix   a W1-style run through the whole runtime: N chats sharing a system prompt (and with --tools two
                  tool schemas), each run
                  with the cache (restoring the shared prefix) and cold; cached_tokens, max |Δ first-step logit|,
                  greedy-token agreement (max_tokens each), TTFT warm and cold
  save_restore    llama_state_seq_get/set_data_ext of a `--prefix-tokens` sequence: ms and MiB/s (median of 5)
  cross_layout    a state saved under the full offload, loaded into engines of other layouts (CPU only, half the
                  layers, KV on the host): does llama.cpp take it, and does continuing from it equal a cold
                  prefill under that layout (what state_fingerprint must refuse when it does not)
  speed           (--speed) cold prefill tokens/s of `--prefix-tokens`, warm TTFT on that shared prefix (restore +
                  a 24-token tail + first logits), decode tokens/s with 1 and 4 slots

Writes <out>/<preset>.json and prints a summary line per section. Exit status 0 even when cached != cold (that is
a result, recorded); 1 when a step fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llama_cpp  # noqa: E402

from bench.workloads import agent_system_prompt, agent_tools  # noqa: E402
from orchestrator import calibration  # noqa: E402
from orchestrator.config import MiB, Config  # noqa: E402
from orchestrator.engine import Engine  # noqa: E402
from orchestrator.models.synth import ensure_model  # noqa: E402
from orchestrator.request import Job, SamplingParams  # noqa: E402
from orchestrator.runtime import Runtime  # noqa: E402

QUESTIONS = ["Which module owns the snapshot cache?", "Run the tests for the scheduler.", "Why does prefill stop "
             "at message ends?", "Find where min_segment is measured.", "Summarise section 3 in one line.",
             "List the tools you can call.", "What does rule 4 forbid?", "Search for 'restore' in the cache code."]


def question(i: int) -> str:
    return f"{QUESTIONS[i % len(QUESTIONS)]} (ticket {1000 + 37 * i})"


def layout(engine: Engine) -> dict:
    o = engine.offload
    return {"backend": o.backend, "devices": [{"name": d.name, "backend": d.backend, "description": d.description,
                                               "memory_total_mib": d.memory_total // MiB} for d in o.devices],
            "n_gpu_layers": o.n_gpu_layers, "n_layers": o.n_layers, "kv_offload": o.kv_offload,
            "describe": o.describe(), "system_info": llama_cpp.llama_print_system_info().decode()}


def check_calibration(path: Path, a) -> dict:
    slots = 2 if a.dry_run else 4
    e = Engine(path, n_ctx=1024, n_batch=256, n_threads=a.threads, n_seq_max=slots, n_gpu_layers=a.ngl)
    try:
        out = {"layout": layout(e), "slots": slots}
        t = time.perf_counter()
        try:
            out["min_segment"] = (calibration.measure_min_segment(e, (2, 8)) if a.dry_run
                                  else calibration.measure_min_segment(e))
        except Exception as x:  # EngineError: no size is exact on this device
            out["min_segment"], out["min_segment_error"] = None, str(x)
        e.calibrate(out["min_segment"] or 2)
        out["batch_invariant"] = calibration.check_batch_invariance(e)
        out["seconds"] = round(time.perf_counter() - t, 2)
        return out
    finally:
        e.close()


def check_shared_prefix(path: Path, a) -> dict:
    cfg = Config(model=path, ctx_size=a.prefix_tokens + 512, batch_size=256, threads=a.threads,
                 cache_ram_mib=1024, checkpoint_interval=0, parallel=1, n_gpu_layers=a.ngl)
    rt = Runtime.start(cfg)
    try:
        system = agent_system_prompt(rt.engine.tokenize, a.prefix_tokens)
        tools = agent_tools() if a.tools else None
        rows = []
        for i in range(a.prompts):
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": question(i)}]
            prompt = rt.prompts.chat(msgs, tools, {})
            runs = {}
            for use_cache in (True, False):
                job = Job(prompt_tokens=prompt.tokens, boundaries=prompt.boundaries,
                          max_tokens=a.max_tokens, sampling=SamplingParams(temperature=0.0), use_cache=use_cache,
                          want_logits=True)
                runs[use_cache] = rt.scheduler.run(job)
                rt.scheduler.drain()
            warm, cold = runs[True], runs[False]
            rows.append({"prompt_tokens": warm.prompt_tokens, "cached_tokens": warm.cached_tokens,
                         "max_abs_dlogit": float(np.abs(warm.first_logits - cold.first_logits).max()),
                         "same_tokens": warm.completion_tokens == cold.completion_tokens,
                         "ttft_warm_ms": round(warm.ttft_s * 1e3, 2), "ttft_cold_ms": round(cold.ttft_s * 1e3, 2)})
        later = rows[1:] or rows  # the first request finds nothing cached
        return {"min_segment": rt.engine.min_segment, "prompts": len(rows), "max_tokens": a.max_tokens,
                "bit_identical_first_logits": sum(r["max_abs_dlogit"] == 0 for r in rows),
                "greedy_agreement": sum(r["same_tokens"] for r in rows),
                "max_abs_dlogit": max(r["max_abs_dlogit"] for r in rows),
                "median_cached_tokens": statistics.median(r["cached_tokens"] for r in later),
                "median_ttft_warm_ms": statistics.median(r["ttft_warm_ms"] for r in later),
                "median_ttft_cold_ms": statistics.median(r["ttft_cold_ms"] for r in rows), "rows": rows}
    finally:
        rt.close()


def prefix_tokens(engine: Engine, n: int) -> list[int]:
    words = " ".join(f"w{i % 997} item{i}" for i in range(n))
    return engine.tokenize(words)[:n]


def check_save_restore(path: Path, a) -> dict:
    e = Engine(path, n_ctx=a.prefix_tokens + 64, n_batch=256, n_threads=a.threads, n_gpu_layers=a.ngl)
    try:
        tokens = prefix_tokens(e, a.prefix_tokens)
        e.decode(0, tokens, 0, want_logits=False)
        saves, loads, state = [], [], b""
        for _ in range(5):
            t = time.perf_counter()
            state = e.save_state(0)
            saves.append(time.perf_counter() - t)
            t = time.perf_counter()
            e.load_state(0, state)
            loads.append(time.perf_counter() - t)
        size = len(state)
        save_s, load_s = statistics.median(saves), statistics.median(loads)
        return {"tokens": len(tokens), "state_mib": round(size / MiB, 2), "save_ms": round(save_s * 1e3, 2),
                "restore_ms": round(load_s * 1e3, 2), "save_mib_s": round(size / MiB / save_s, 1),
                "restore_mib_s": round(size / MiB / load_s, 1)}
    finally:
        e.close()


def check_cross_layout(path: Path, a) -> dict:
    """Save under the full offload, load under each other layout, continue with a tail, compare with cold."""
    n_ctx = 1024
    src = Engine(path, n_ctx=n_ctx, n_batch=256, n_threads=a.threads, n_gpu_layers=-1)
    try:
        tokens = prefix_tokens(src, 200)
        head, tail = tokens[:160], tokens[160:]
        src.decode(0, head, 0, want_logits=False)
        state = src.save_state(0)
        src.decode(0, tail, len(head))
        src_logits = src.logits()
        half = max(1, src.offload.n_layers // 2)
        out = {"saved_under": src.offload.describe(), "state_bytes": len(state), "layouts": [],
               "note": "" if src.offload.devices else "no offload device on this build: every layout is the CPU"}
        layouts = [("cpu", {"n_gpu_layers": 0}), ("half", {"n_gpu_layers": half}),
                   ("kv_on_host", {"n_gpu_layers": -1, "kv_offload": False}), ("same", {"n_gpu_layers": -1})]
        for name, kw in layouts[::3] if a.dry_run else layouts:
            dst = Engine(path, n_ctx=n_ctx, n_batch=256, n_threads=a.threads, **kw)
            try:
                row = {"layout": name, "describe": dst.offload.describe()}
                dst.decode(0, tokens, 0)
                cold = dst.logits()
                try:
                    dst.load_state(0, state)
                    dst.decode(0, tail, len(head))
                    warm = dst.logits()
                    row.update(loads=True, equals_cold_there=bool(np.array_equal(warm, cold)),
                               max_abs_dlogit_vs_cold_there=float(np.abs(warm - cold).max()),
                               equals_saving_layout=bool(np.array_equal(warm, src_logits)))
                except Exception as x:  # EngineError: llama.cpp refused the state
                    row.update(loads=False, error=str(x))
                row["cold_equals_saving_layout"] = bool(np.array_equal(cold, src_logits))
                out["layouts"].append(row)
            finally:
                dst.close()
        return out
    finally:
        src.close()


def check_speed(path: Path, a) -> dict:
    e = Engine(path, n_ctx=a.prefix_tokens + 256, n_batch=512, n_threads=a.threads, n_seq_max=4,
               n_gpu_layers=a.ngl)
    try:
        e.calibrate(2)
        tokens = prefix_tokens(e, a.prefix_tokens + 24)
        prefix, tail = tokens[:a.prefix_tokens], tokens[a.prefix_tokens:]
        e.decode(0, prefix[:64], 0, want_logits=False)  # warm-up: first-call allocations, pipelines
        e.clear(0)
        t = time.perf_counter()
        e.decode(0, prefix, 0, want_logits=False)
        cold_s = time.perf_counter() - t
        state = e.save_state(0)
        ttfts = []
        for _ in range(5):
            t = time.perf_counter()
            e.load_state(0, state)
            e.decode(0, tail, len(prefix))
            e.logits()
            ttfts.append(time.perf_counter() - t)
        out = {"prefix_tokens": len(prefix), "cold_prefill_tokens_s": round(len(prefix) / cold_s, 1),
               "warm_ttft_ms": round(statistics.median(ttfts) * 1e3, 2), "warm_tail_tokens": len(tail)}
        steps = a.decode_steps
        for slots in (1, 4):
            for s in range(slots):
                e.load_state(s, state)
            pos = len(prefix)
            t = time.perf_counter()
            for k in range(steps):
                if slots == 1:
                    e.decode(0, [tail[k % len(tail)]], pos + k)
                else:
                    e.decode_step([(s, tail[(k + s) % len(tail)], pos + k) for s in range(slots)])
            out[f"decode_tokens_s_{slots}_slots"] = round(slots * steps / (time.perf_counter() - t), 1)
            for s in range(slots):
                e.clear(s)
        return out
    finally:
        e.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", action="append", help="synthetic preset(s) (default: tiny, tiny-q4)")
    p.add_argument("--out", type=Path, required=True, help="directory for <preset>.json")
    p.add_argument("-ngl", "--n-gpu-layers", dest="ngl", type=int, default=-1, help="layers offloaded (-1: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=50, help="chats of the shared-prefix run")
    p.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per chat")
    p.add_argument("--prefix-tokens", type=int, default=256, help="shared system prompt / saved prefix, tokens")
    p.add_argument("--tools", action="store_true", help="the shared prefix also holds two tool schemas (~600 tokens)")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--speed", action="store_true", help="also the speed section")
    p.add_argument("--sections", default="calibration,shared_prefix,save_restore,cross_layout",
                   help="comma-separated sections to run")
    p.add_argument("--dry-run", action="store_true",
                   help="every step at toy sizes on the tiny preset (3 chats, 64-token prefix, 4 decode steps, 2 "
                        "slots, min_segment sizes 2 and 8, 2 layouts)")
    a = p.parse_args(argv)
    if a.dry_run:
        a.preset, a.prompts, a.prefix_tokens, a.decode_steps, a.max_tokens = ["tiny"], 3, 64, 4, 2
        a.speed = True
    sections = [s for s in a.sections.split(",") if s] + (["speed"] if a.speed else [])
    checks = {"calibration": check_calibration, "shared_prefix": check_shared_prefix,
              "save_restore": check_save_restore, "cross_layout": check_cross_layout, "speed": check_speed}
    a.out.mkdir(parents=True, exist_ok=True)
    failed = False
    for preset in a.preset or ["tiny", "tiny-q4"]:
        path = ensure_model(preset)
        result = {"preset": preset, "model": str(path), "llama_cpp": llama_cpp.__version__,
                  "argv": sys.argv[1:] if argv is None else argv}
        for name in sections:
            t = time.perf_counter()
            try:
                result[name] = checks[name](path, a)
            except Exception as x:
                failed = True
                result[name] = {"error": f"{type(x).__name__}: {x}"}
            summary = {k: v for k, v in result[name].items() if not isinstance(v, (list, dict))}
            print(f"{preset} {name} ({time.perf_counter() - t:.1f} s): {json.dumps(summary)}", flush=True)
            (a.out / f"{preset}.json").write_text(json.dumps(result, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
