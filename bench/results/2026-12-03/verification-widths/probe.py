"""Verification widths probe: does one ubatch of k tokens of one sequence give the logits of k one-token decode
steps, and does the state after keeping j+1 of them (llama_memory_seq_rm + n_rs_seq rollback) continue exactly?

    python bench/results/2026-12-03/verification-widths/probe.py MODEL.gguf [n_rs_seq] [warm]

warm: one-token decode steps between the prefill and the verification (0: verify right after the prefill).
"""
import sys

import llama_cpp
import numpy as np

from orchestrator.engine import Engine

model, R = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8
WARM = int(sys.argv[3]) if len(sys.argv) > 3 else 0
e = Engine(model, n_ctx=2048, n_batch=512, n_threads=2, n_seq_max=1, n_rs_seq=R)
words = "def f(x):\n    return x * 3 + 1\n" * 20
prompt = e.tokenize("<|im_start|>user\nRepeat:\n" + words + "<|im_end|>\n<|im_start|>assistant\n")
K, M = 8, 6


def prefill():
    e.clear(0)
    e.decode(0, prompt, 0)
    return e.logits()


# path A: one token at a time, K + M steps (greedy), WARM steps first
t = int(np.argmax(prefill()))
seq, LA = [], []
for i in range(WARM + K + M):
    seq.append(t)
    e.decode(0, [t], len(prompt) + i)
    LA.append(e.logits())
    t = int(np.argmax(LA[-1]))
base = len(prompt) + WARM  # position of the first verified token


def warm_state():
    prefill()
    for i in range(WARM):
        e.decode(0, [seq[i]], len(prompt) + i)


def verify(k):
    b = e._batch
    for i in range(k):
        b.token[i] = seq[WARM + i]; b.pos[i] = base + i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1
    b.n_tokens = k
    assert llama_cpp.llama_decode(e.ctx, b) == 0
    return [e.logits(i) for i in range(k)]


print(f"{model.split('/')[-1]} n_rs_seq={e.n_rs_seq} warm={WARM}")
for k in range(2, K + 1):
    warm_state()
    LB = verify(k)
    per = [float(np.max(np.abs(LA[WARM + i] - LB[i]))) for i in range(k)]
    line = f"  k={k}: logits per position " + ",".join("0" if d == 0 else f"{d:.0e}" for d in per)
    if e.n_rs_seq >= k:  # keep j+1 of the k tokens, continue M one-token steps, compare with path A
        after = []
        for j in range(k):
            warm_state()
            verify(k)
            keep = base + j + 1
            ok = llama_cpp.llama_memory_seq_rm(e.mem, 0, keep, -1)
            d = 0.0
            for s in range(M):
                e.decode(0, [seq[WARM + j + 1 + s]], keep + s)
                d = max(d, float(np.max(np.abs(e.logits() - LA[WARM + j + 1 + s]))))
            after.append("0" if ok and d == 0 else (f"{d:.0e}" if ok else "refused"))
        line += " | continuation after keeping j+1=" + ",".join(after)
    print(line, flush=True)
