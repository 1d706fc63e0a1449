"""What running llama.cpp's grammar in a grammar process (orchestrator/grammar_guard.py) costs: the child's start
(vocabulary load) and RSS, and one token's mask there against the same grammar sampler's apply in process (CPU
seconds). `python -m bench grammar-guard [--preset tiny] [--out FILE.json]`."""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import llama_cpp
import numpy as np

from orchestrator.grammar_guard import GrammarLimits, GrammarPool
from orchestrator.models.synth import ensure_model
from orchestrator.output.grammar import _Rules
from orchestrator.sampling import TOKEN_DATA, candidates, grammar_sampler

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
          "required": ["city", "days"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench grammar-guard", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    model = ensure_model(a.preset)
    rules = _Rules()
    gbnf = rules.text(rules.json(SCHEMA, "response", "x"), "x")
    text = '{"city": "Paris", "days": 3}'

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    m = llama_cpp.llama_model_load_from_file(str(model).encode(), params)
    vocab = llama_cpp.llama_model_get_vocab(m)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    ids = []
    buf = (llama_cpp.llama_token * 64)()
    n = llama_cpp.llama_tokenize(vocab, text.encode(), len(text.encode()), buf, 64, False, True)
    ids = list(buf[:n])

    sampler = grammar_sampler(vocab, gbnf)
    data = np.zeros(n_vocab, dtype=TOKEN_DATA)
    in_process = []
    for tok in ids:
        data["id"] = np.arange(n_vocab)
        data["logit"] = 0
        t = time.process_time()
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(candidates(data)))
        in_process.append(time.process_time() - t)
        llama_cpp.llama_sampler_accept(sampler, tok)

    pool = GrammarPool(model, GrammarLimits(token_s=60.0), keep=1)
    t = time.perf_counter()
    proc = pool.take()
    start_s = time.perf_counter() - t
    with open(f"/proc/{proc.proc.pid}/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    pool.give(proc, True)
    g = pool.open(gbnf)
    child_cpu, child_wall = [], []
    for tok in ids:
        c, t = g._proc.cpu_s(), time.perf_counter()
        g.mask()
        child_wall.append(time.perf_counter() - t)
        child_cpu.append(g._proc.cpu_s() - c)
        g.accept(tok)
    g.close()
    pool.close()
    out = {"preset": a.preset, "n_vocab": n_vocab, "tokens": len(ids), "child_start_s": round(start_s, 3),
           "child_rss_mib": round(rss_kib / 1024, 1),
           "mask_in_process_cpu_ms_median": round(1000 * float(np.median(in_process)), 2),
           "mask_child_cpu_ms_median": round(1000 * float(np.median(child_cpu)), 2),
           "mask_child_wall_ms_median": round(1000 * float(np.median(child_wall)), 2),
           "loadavg": open("/proc/loadavg").read().split()[:3]}
    print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
