"""Batched verification: are the logits of several sequences' verifications (and decode steps) in ONE llama_decode
call those each gives alone? (issue 40: W4's three generating slots decode batched, where nothing is verified.)

    python probe.py MODEL [layout ...]       # layouts: verifying_ref, verifying, fa_on_ref, default

Per layout: three sequences prefilled with different prompts (170, 300, 600 tokens), their next tokens the
model's own greedy continuation. Alone: each sequence's k_s tokens as one verification (one token: a decode
step), from a state restored before. Batched: the same tokens of all three in one llama_batch, increasing seq
ids (llama.cpp's split_equal then packs min(k_s) tokens of each sequence per ubatch). Prints max |Δlogit| per
case over every row; 0.0 is bit-identical.
"""
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np

from orchestrator.engine import VERIFYING, Attention, Engine

LAYOUTS = {"verifying_ref": Attention(True, "q8_0", "f16", "reference"), "verifying": VERIFYING,
           "fa_on_ref": Attention(True, "f16", "f16", "reference"), "default": Attention()}
CASES = [(1, 1, 1), (4, 4, 4), (4, 1, 1), (1, 4, 1), (5, 3, 1), (8, 8, 8), (16, 2, 1), (9, 9, 0), (12, 0, 5)]


def greedy(e: Engine, seq: int, pos: int, first: int, n: int) -> list[int]:
    out = [first]
    for i in range(n - 1):
        e.decode(seq, [out[-1]], pos + i)
        out.append(int(np.argmax(e.logits(-1))))
    return out


def main() -> None:
    model = Path(sys.argv[1])
    for name in sys.argv[2:] or list(LAYOUTS):
        att = LAYOUTS[name]
        e = Engine(model, n_ctx=4096, n_batch=512, n_threads=2, n_seq_max=3, attention=att)
        e.min_segment = 64 if att.tiled_queries else 8
        lens = (170, 300, 600)
        saved, conts, ends = [], [], []
        for s, n in enumerate(lens):
            prompt = [1000 + (37 * i + 101 * s) % 5000 for i in range(n)]
            e.decode(s, prompt, 0)
            first = int(np.argmax(e.logits(-1)))
            saved.append(e.save_state(s))
            conts.append(greedy(e, s, n, first, 17))
            ends.append(n)
        for s in range(3):
            e.load_state(s, saved[s])
        started = time.time()
        for ks in CASES:
            alone = []
            for s, k in enumerate(ks):
                if not k:
                    alone.append(None)
                    continue
                toks = conts[s][:k]
                if k == 1:
                    e.decode(s, toks, ends[s])
                    alone.append([e.logits(-1)])
                else:
                    e.verify(s, toks, ends[s])
                    alone.append([e.logits(i) for i in range(k)])
                e.load_state(s, saved[s])
            b = llama_cpp.llama_batch_init(64, 0, 3)
            rows = []
            for s, k in enumerate(ks):
                for i in range(k):
                    j = b.n_tokens
                    b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = conts[s][i], ends[s] + i, 1, 1
                    b.seq_id[j][0] = s
                    b.n_tokens += 1
                    rows.append((s, i, j))
            rc = e._compute(b, step=True)
            assert rc == 0, rc
            worst = max(float(np.max(np.abs(e.logits(j) - alone[s][i]))) for s, i, j in rows)
            llama_cpp.llama_batch_free(b)
            for s in range(3):
                e.load_state(s, saved[s])
            print(f"{name:14s} widths {ks}: max |dlogit| {worst:.3g}", flush=True)
        print(f"{name}: {time.time() - started:.1f} s", flush=True)
        e.close()


if __name__ == "__main__":
    main()
