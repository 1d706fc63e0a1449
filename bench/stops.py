"""What a prefill stop costs, and which stops llama.cpp's per-token recurrent snapshots (n_rs_seq) can take without
a llama_decode call of their own (issue 30).

    python -m bench stops exact  --preset tiny --n-rs-seq 8       # (a) rollback checkpoints vs stopped ones
    python -m bench stops cost   --preset qwen3.5-0.8b --reps 7   # (b) one call vs calls split at the stops
    python -m bench stops cost   --preset qwen3.5-0.8b --tokens 752 --splits '512,240;464,17,51,212,8'  # given splits
    python -m bench stops overhead --preset qwen3.5-0.8b          # what n_rs_seq costs every prefill call
    python -m bench stops align  --preset qwen3.5-0.8b --reps 7   # (c) chunk ends moved onto a boundary
    python -m bench stops memory --preset qwen3.5-0.8b            # (d) context memory per slot by n_rs_seq

Through the engine (orchestrator/engine.py: use_extra_bufts off, flash attention off, n_ubatch = n_batch, one KV
stream per sequence), on the synthetic presets (orchestrator/models/synth.py) or --model. Each subcommand prints
one JSON object and, with --out, writes it there. Timings: medians of --reps interleaved rounds, reported as
ratios within one round (the machine is shared); `uptime` is recorded with them. Not a test.

(a) exact: for back distances d, a checkpoint saved after `llama_memory_seq_rm(seq, n - d, -1)` rolled a one-call
    prefill of n tokens back (llama_memory_recurrent::seq_rm: a pending rollback index, honoured by state_write)
    against the checkpoint of a prefill that stopped at n - d: bytes equal?, and the logits of the tail prefilled
    from each (after a restore through HybridState, as a cached request does) equal to the cold prefill's?
    Also: whether the live state at n comes back after the rollback by loading the full state saved before it,
    and what bounds d (n_rs_seq; the last call's length; decode steps after the prefill).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import llama_cpp
import numpy as np


from orchestrator.cache.radix import CHECKPOINT, KV
from orchestrator.calibration import check_rollback, measure_min_segment
from orchestrator.engine import Engine

MiB = 1 << 20


def model_path(a) -> Path:
    if a.model:
        return Path(a.model)
    from orchestrator.models.synth import ensure_model
    return ensure_model(a.preset)


def prompt(n: int, salt: int = 0) -> list[int]:
    """n deterministic token ids among ordinary vocabulary entries."""
    return [1000 + (37 * i + 11 * salt + (i * i) % 101) % 20000 for i in range(n)]


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    return {"cpu": cpu, "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
            "llama_cpp_python": llama_cpp.__version__}


def new_engine(a, n_rs_seq: int, n_seq_max: int = 1) -> Engine:
    e = Engine(model_path(a), n_ctx=a.ctx, n_batch=a.batch, n_threads=a.threads, n_seq_max=n_seq_max,
               n_rs_seq=n_rs_seq)
    e.calibrate(a.min_segment or measure_min_segment(e))
    return e


def rm(e: Engine, seq: int, p0: int) -> bool:
    return bool(llama_cpp.llama_memory_seq_rm(e.mem, seq, p0, -1))


def decode_calls(e: Engine, tokens: Sequence[int], sizes: Sequence[int], start: int = 0, logits: bool = True) -> None:
    """Prefill tokens[start:] from position `start` as llama_decode calls of the given sizes (one ubatch each)."""
    pos = start
    for i, n in enumerate(sizes):
        e.decode(0, tokens[pos:pos + n], pos, want_logits=logits and i == len(sizes) - 1)
        pos += n
    assert pos == len(tokens), (pos, len(tokens))


# ---------------------------------------------------------------------------------------------------- (a) exact

def exact(a) -> dict:
    e = new_engine(a, a.n_rs_seq)
    K, m = e.n_rs_seq, e.min_segment
    n = a.tokens
    tok = prompt(n)
    out: dict = {"n_rs_seq": K, "min_segment": m, "tokens": n, "cases": []}

    e.clear(0)
    e.decode(0, tok, 0)
    cold = e.logits()
    out["cold_one_call_equals_split"] = None
    # the same prompt in two calls (a cut at n // 2): the split rule min_segment rests on still holds with n_rs_seq
    e.clear(0)
    decode_calls(e, tok, [n // 2, n - n // 2])
    out["cold_one_call_equals_split"] = bool(np.array_equal(e.logits(), cold))

    ref0 = new_engine(a, 0) if K else None
    if ref0 is not None:  # does n_rs_seq change the numerics of a plain prefill?
        ref0.clear(0)
        ref0.decode(0, tok, 0)
        out["same_logits_as_n_rs_seq_0"] = bool(np.array_equal(ref0.logits(), cold))
        out["min_segment_n_rs_seq_0"] = measure_min_segment(ref0)
        ref0.close()

    def stopped_checkpoint(p: int) -> tuple[bytes, dict]:
        e.clear(0)
        e.decode(0, tok[:p], 0, want_logits=False)
        return e.save_state(0, partial=True), e.state.save(e, 0, (KV,))

    def tail_logits_after_restore(p: int, kv: bytes, ck: bytes) -> np.ndarray:
        e.state.restore(e, 0, p, kv, ck)
        e.decode(0, tok[p:], p)
        return e.logits()

    last_calls = [None, 4] if n > 8 else [None]
    for last in last_calls:
        sizes = [n] if last is None else [n - last, last]
        for d in sorted({1, 2, m, K, K + 1, max(1, K // 2)} | ({last, last + 1} if last else set())):
            if d < 1 or d >= n:
                continue
            p = n - d
            case = {"calls": sizes, "back": d, "pos": p}
            ck_stop, kv_stop = stopped_checkpoint(p)
            e.clear(0)
            decode_calls(e, tok, sizes)
            full_n = e.state.save(e, 0, (KV, CHECKPOINT))
            ok = rm(e, 0, p)
            case["seq_rm_ok"] = ok
            case["pos_max_after"] = e.pos_max(0)
            if ok:
                ck_rb = e.save_state(0, partial=True)
                case["bytes_equal"] = ck_rb == ck_stop
                if not case["bytes_equal"] and len(ck_rb) == len(ck_stop):
                    diff = np.frombuffer(ck_rb, np.uint8) != np.frombuffer(ck_stop, np.uint8)
                    case["bytes_differing"] = int(diff.sum())
                # continue in place: re-prefill the rolled-back tail
                if d >= m:
                    e.decode(0, tok[p:], p)
                    case["tail_in_place_equals_cold"] = bool(np.array_equal(e.logits(), cold))
                    case["restored_tail_equals_cold"] = bool(np.array_equal(
                        tail_logits_after_restore(p, kv_stop[KV], ck_rb), cold))
                # back to the state at n: load the full state saved before the rollback, then one decode step
                e.state.restore(e, 0, n, full_n[KV], full_n[CHECKPOINT])
                e.decode(0, [tok[0]], n)
                after_reload = e.logits()
                e.clear(0)
                decode_calls(e, tok, sizes)
                e.decode(0, [tok[0]], n)
                case["reload_then_decode_equals_plain"] = bool(np.array_equal(after_reload, e.logits()))
            out["cases"].append(case)
            print(json.dumps(case), flush=True)

    # a second rollback after the full state was loaded back (several checkpoints from one call)
    if K >= 2 and n > K:
        e.clear(0)
        e.decode(0, tok, 0)
        full_n = e.state.save(e, 0, (KV, CHECKPOINT))
        res = {}
        for d in (1, K):
            e.state.restore(e, 0, n, full_n[KV], full_n[CHECKPOINT])
            res[d] = rm(e, 0, n - d) and e.save_state(0, partial=True) == stopped_checkpoint(n - d)[0]
            e.clear(0)
            e.decode(0, tok, 0)
            full_n = e.state.save(e, 0, (KV, CHECKPOINT))
        e.state.restore(e, 0, n, full_n[KV], full_n[CHECKPOINT])
        ok1 = rm(e, 0, n - 1)
        ck1 = e.save_state(0, partial=True)
        e.state.restore(e, 0, n, full_n[KV], full_n[CHECKPOINT])
        okK = rm(e, 0, n - K)
        ckK = e.save_state(0, partial=True)
        out["two_rollbacks_after_reload"] = {
            "first_ok": ok1 and ck1 == stopped_checkpoint(n - 1)[0],
            "second_ok": okK and ckK == stopped_checkpoint(n - K)[0]}
        # after decode steps: the snapshots of the prefill's positions are those of the prefill still?
        e.clear(0)
        e.decode(0, tok, 0)
        e.decode(0, [tok[1]], n)
        e.decode(0, [tok[2]], n + 1)
        okd = rm(e, 0, n + 2 - 2)
        out["rollback_2_after_2_decode_steps"] = {"seq_rm_ok": okd, "bytes_equal_prefill_state": None}
        if okd:  # the state at n (after the prompt): the one from a plain prefill of the prompt?
            ck = e.save_state(0, partial=True)
            e.clear(0)
            e.decode(0, tok, 0)
            out["rollback_2_after_2_decode_steps"]["bytes_equal_prefill_state"] = ck == e.save_state(0, partial=True)
    e.close()
    # the shipped path (Engine.checkpoint_back) as calibration checks it, with 4 sequences
    e4 = Engine(model_path(a), n_ctx=1024, n_batch=a.batch, n_threads=a.threads, n_seq_max=4, n_rs_seq=K)
    e4.calibrate(m)
    out["check_rollback_4_slots"] = {"seq 3": check_rollback(e4), "seq 0": check_rollback(e4, 0)}
    e4.close()
    return out


# ---------------------------------------------------------------------------------------------------- (b) cost

def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def rounds(variants: dict, reps: int) -> dict:
    """Interleaved rounds of every variant; per variant the median seconds and the median ratio to the first."""
    names = list(variants)
    secs: dict[str, list[float]] = {k: [] for k in names}
    ratios: dict[str, list[float]] = {k: [] for k in names}
    for fn in variants.values():  # warm-up round
        fn()
    for r in range(reps):
        order = names if r % 2 == 0 else names[::-1]
        got = {k: timed(variants[k]) for k in order}
        for k in names:
            secs[k].append(got[k])
            ratios[k].append(got[k] / got[names[0]])
    return {k: {"median_s": round(statistics.median(secs[k]), 4),
                "ratio_to_first": round(statistics.median(ratios[k]), 4),
                "ratio_min": round(min(ratios[k]), 4), "ratio_max": round(max(ratios[k]), 4)} for k in names}


def cost(a) -> dict:
    out: dict = {"machine": machine(), "runs": {}}
    for K in a.n_rs_seq_list:
        e = new_engine(a, K)
        m = e.min_segment
        tok = prompt(a.tokens)
        n = len(tok)
        boundary = n - a.boundary_back
        variants = {}

        def plain(sizes):
            def run():
                e.clear(0)
                decode_calls(e, tok, sizes)
            return run

        if a.splits:  # given call structures, the first the reference of the ratios
            for sizes in a.splits:
                if sum(sizes) != n:
                    raise SystemExit(f"--splits: {sizes} sums to {sum(sizes)}, not --tokens {n}")
                variants[f"calls ({','.join(map(str, sizes))})"] = plain(sizes)
        else:
            variants[f"one call {n}"] = plain([n])
            variants[f"stop at repeat point ({n - m},{m})"] = plain([n - m, m])
            variants[f"stops ({boundary},{n - m - boundary},{m})"] = plain([boundary, n - m - boundary, m])
            variants["one call + 8-token call"] = plain([n - 8, 8])
            variants["one call + 2-token call"] = plain([n - 2, 2])
        e.clear(0)
        e.decode(0, tok, 0)
        ck_bytes = e.state_size(0, partial=True)
        if e.n_rs_seq >= m:
            def rollback(points=(n - m,) + ((boundary,) if e.n_rs_seq >= n - boundary else ())):
                def run():
                    e.clear(0)
                    e.decode(0, tok, 0)
                    full = e.state.save(e, 0, (KV, CHECKPOINT))
                    for p in points:
                        rm(e, 0, p)
                        e.save_state(0, partial=True)
                        e.state.restore(e, 0, n, full[KV], full[CHECKPOINT])
                return run
            variants["one call + rollback saves"] = rollback()

            def save_only():
                e.clear(0)
                e.decode(0, tok, 0)
                e.save_state(0, partial=True)
            variants["one call + one plain checkpoint save"] = save_only

        # a one-token decode step (generation) with this n_rs_seq
        def step():
            e.clear(0)
            e.decode(0, tok[:16], 0)
            for i in range(8):
                e.decode(0, [tok[i]], 16 + i)
        res = rounds(variants, a.reps)
        steps = rounds({"16-token prefill + 8 decode steps": step}, max(3, a.reps // 2))
        out["runs"][str(K)] = {"n_rs_seq": e.n_rs_seq, "min_segment": m, "tokens": n, "checkpoint_bytes": ck_bytes,
                               "variants": res, "decode": steps}
        print(json.dumps({K: res}), flush=True)
        e.close()
    out["machine_after"] = machine()["uptime"]
    return out


def overhead(a) -> dict:
    """What n_rs_seq costs every prefill call (the op writes the states after the call's last n_rs_seq tokens):
    one call of --tokens with each n_rs_seq of --n-rs-seq-list, in interleaved rounds, one engine each."""
    engines = {K: new_engine(a, K) for K in a.n_rs_seq_list}
    tok = prompt(a.tokens)

    def one(e):
        def run():
            e.clear(0)
            e.decode(0, tok, 0)
        return run

    res = rounds({f"n_rs_seq {K}": one(e) for K, e in engines.items()}, a.reps)
    for e in engines.values():
        e.close()
    return {"machine": machine(), "tokens": len(tok), "variants": res, "machine_after": machine()["uptime"]}


# ---------------------------------------------------------------------------------------------------- (c) align

def align(a) -> dict:
    """A prompt of --tokens with an intermediate boundary b: plain n_batch chunks and no stop, the scheduler's
    chunks with a stop at b (n_batch chunks up to b, then from b), and the same number of calls evened out. A stop
    costs a call only where ceil(b / n_batch) + ceil((n - b) / n_batch) > ceil(n / n_batch); this measures whether
    calls of other sizes but the same count cost the same (then a boundary is free wherever the count holds)."""
    e = new_engine(a, 0)
    tok = prompt(a.tokens)
    n, B = len(tok), e.n_batch
    b = a.boundary or 700

    def plain(sizes):
        def run():
            e.clear(0)
            decode_calls(e, tok, sizes)
        return run

    def chunks(total: int) -> list[int]:
        out, left = [], total
        while left > 0:
            out.append(min(B, left))
            left -= out[-1]
        return out

    base = chunks(n)
    with_stop = chunks(b) + chunks(n - b)
    even = [n // len(base) + (1 if i < n % len(base) else 0) for i in range(len(base))]
    variants = {f"no stop {base}": plain(base), f"stop at {b} {with_stop}": plain(with_stop),
                f"evened {even}": plain(even)}
    if len(base) > 1:
        one_more = chunks(base[0] - 64) + [64] + base[1:]  # a stop 64 tokens before a chunk end: one call more
        variants[f"one call more {one_more}"] = plain(one_more)
    res = rounds(variants, a.reps)
    out = {"machine": machine(), "tokens": n, "n_batch": B, "boundary": b, "variants": res}
    e.close()
    out["machine_after"] = machine()["uptime"]
    return out


# ---------------------------------------------------------------------------------------------------- (d) memory

def memory(a) -> dict:
    import psutil
    proc = psutil.Process()
    out: dict = {"machine": machine(), "n_seq_max": a.slots, "ctx_per_slot": a.ctx, "runs": []}
    for K in a.n_rs_seq_list:
        before = proc.memory_info().rss
        e = Engine(model_path(a), n_ctx=a.ctx, n_batch=a.batch, n_threads=a.threads, n_seq_max=a.slots,
                   n_rs_seq=K)
        loaded = proc.memory_info().rss
        for s in range(a.slots):  # touch every slot's memory: a prefill per slot
            e.decode(s, prompt(64, s), 0, want_logits=False)
        touched = proc.memory_info().rss
        e.decode(0, [1000, 1001], 64, want_logits=False)
        ck = e.state_size(0, partial=True)
        out["runs"].append({"n_rs_seq": e.n_rs_seq, "checkpoint_bytes": ck,
                            "rss_after_load_mib": round((loaded - before) / MiB, 1),
                            "rss_after_prefill_mib": round((touched - before) / MiB, 1),
                            "expected_extra_mib": round(K * ck * a.slots / MiB, 1)})
        print(json.dumps(out["runs"][-1]), flush=True)
        e.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["exact", "cost", "overhead", "align", "memory"])
    ap.add_argument("--preset", default="tiny", help="synthetic preset (tiny, qwen3.5-0.8b)")
    ap.add_argument("--model", default=None, help="a GGUF instead of a preset")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=None, help="prompt tokens (exact/cost: 507, align: 1200)")
    ap.add_argument("--n-rs-seq", type=int, default=8, help="exact: snapshots per sequence")
    ap.add_argument("--n-rs-seq-list", type=lambda s: [int(x) for x in s.split(",")], default=[0, 8],
                    help="cost/memory: comma-separated n_rs_seq values")
    ap.add_argument("--boundary-back", type=int, default=41, help="cost: a boundary this far before the end")
    ap.add_argument("--splits", type=lambda s: [[int(x) for x in part.split(",")] for part in s.split(";")],
                    default=None, help="cost: call structures to compare instead of the default ones, e.g. "
                                       "'512,240;240,241,267,4' (each sums to --tokens; ratios to the first)")
    ap.add_argument("--boundary", type=int, default=0, help="align: boundary position (default n_batch * 4/3)")
    ap.add_argument("--slots", type=int, default=4, help="memory: n_seq_max")
    ap.add_argument("--min-segment", type=int, default=0, help="skip measuring it (0: measure)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.tokens is None:
        a.tokens = 1200 if a.what == "align" else 507
    result = {"exact": exact, "cost": cost, "overhead": overhead, "align": align, "memory": memory}[a.what](a)
    result["command"] = "python -m bench stops " + " ".join(argv if argv is not None else sys.argv[1:])
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
