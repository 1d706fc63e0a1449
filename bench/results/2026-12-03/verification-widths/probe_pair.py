"""Is the k-token verification exact against a decode step that is itself a 2-token ubatch (the token, then a
copy of it that is rolled back with llama_memory_seq_rm + n_rs_seq)? If the attention kernel switch between
n_tokens = 1 (ggml_vec_dot_f16) and n_tokens >= 2 (llamafile tinyBLAS) is the cause of the differences, this
baseline makes every width below the weight-matmul switch exact.

    python bench/results/2026-12-03/verification-widths/probe_pair.py MODEL.gguf
"""
import sys

import llama_cpp
import numpy as np

from orchestrator.engine import Engine

model = sys.argv[1]
e = Engine(model, n_ctx=2048, n_batch=512, n_threads=2, n_seq_max=1, n_rs_seq=8)
prompt = e.tokenize("<|im_start|>user\nRepeat:\n" + "def f(x):\n    return x * 3 + 1\n" * 20
                    + "<|im_end|>\n<|im_start|>assistant\n")
K = 8


def run(tokens, pos):
    b = e._batch
    for i, t in enumerate(tokens):
        b.token[i] = t; b.pos[i] = pos + i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1
    b.n_tokens = len(tokens)
    assert llama_cpp.llama_decode(e.ctx, b) == 0
    return [e.logits(i) for i in range(len(tokens))]


e.clear(0); e.decode(0, prompt, 0)
t = int(np.argmax(e.logits())); p = len(prompt); seq, LA = [], []
for i in range(K):  # path A': each step a 2-token ubatch [t, t], the second rolled back
    seq.append(t)
    LA.append(run([t, t], p + i)[0])
    assert llama_cpp.llama_memory_seq_rm(e.mem, 0, p + i + 1, -1)
    t = int(np.argmax(LA[-1]))
print(f"{model.split('/')[-1]}: verification of k tokens against 2-token decode steps")
for k in range(2, K + 1):
    e.clear(0); e.decode(0, prompt, 0)
    LB = run(seq[:k], p)
    per = [float(np.max(np.abs(LA[i] - LB[i]))) for i in range(k)]
    print(f"  k={k}: " + ",".join("0" if d == 0 else f"{d:.0e}" for d in per), flush=True)
