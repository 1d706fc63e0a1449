"""MTP probe (issue 40): does llama-cpp-python 0.3.36 run Qwen3.5's multi-token-prediction head, does asking the
target for its hidden states change the target's logits, and what does one MTP draft step cost against one
target decode step?

    python probe.py MODEL.gguf [--steps 64]      # a `synth-model --preset ... --mtp` file or a real Qwen3.5 GGUF

The hidden-state hand-over (llama_set_embeddings_nextn, llama_get_embeddings_nextn_ith) is llama.cpp's C++ staging
API, called by its mangled names (orchestrator/speculative/mtp.py). The MTP flow follows common/speculative.cpp's draft-mtp (qwen35: one head):
the MTP context decodes (token x_{p+1}, target hidden state h_p) at position p+1 and its logits draft x_{p+2};
chained drafts feed its own hidden state back.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np

from orchestrator.engine import VERIFYING, Engine
from orchestrator.speculative.mtp import NextnApi, mtp_context

API = NextnApi.load()
set_nextn, get_nextn_ith = API.set, API.get_ith


def engine(model: Path, load_mtp: bool) -> Engine:
    return Engine(model, n_ctx=2048, n_batch=512, n_threads=2, attention=VERIFYING, load_mtp=load_mtp)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--steps", type=int, default=64)
    a = ap.parse_args()
    out: dict = {"model": a.model.name}
    prompt = [1000 + (41 * i) % 5000 for i in range(300)]
    follow = [1500 + (59 * i) % 5000 for i in range(a.steps)]

    # 1. the target's logits without the MTP layers loaded, and with them loaded and hidden states on
    ref = engine(a.model, False)
    out["n_layer_nextn"] = int(llama_cpp.llama_model_n_layer_nextn(ref.model))
    ref.decode(0, prompt, 0)
    want = [ref.logits()]
    t_plain = []
    for i, tok in enumerate(follow):
        t = time.perf_counter()
        ref.decode(0, [tok], len(prompt) + i)
        t_plain.append(time.perf_counter() - t)
        want.append(ref.logits())
    ref.close()

    tgt = engine(a.model, True)
    # hidden states of every row ("unmasked"): the target's graph as without them (llama.cpp's default graph takes
    # the output rows after the final norm; "masked" takes them before the last layer's residual and FFN)
    set_nextn(tgt.ctx, True, False)
    n_embd = int(llama_cpp.llama_model_n_embd(tgt.model))
    mtp = mtp_context(tgt.model, tgt.context_params, 2048)
    set_nextn(mtp, True, True)
    batch = llama_cpp.llama_batch_ext_init(mtp)
    pos = (llama_cpp.llama_pos * 1)()

    def mtp_step(token: int, h: np.ndarray, p: int, logits: bool) -> np.ndarray | None:
        llama_cpp.llama_batch_ext_clear(batch)
        idx = llama_cpp.llama_batch_ext_add_token(batch, 0, token)
        pos[0] = p
        llama_cpp.llama_batch_ext_set_pos(batch, idx, pos)
        e = llama_cpp.llama_embd(h.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, n_embd)
        assert llama_cpp.llama_batch_ext_set_embd_token(batch, idx, e)
        llama_cpp.llama_batch_ext_set_output_logits(batch, idx, logits)
        rc = llama_cpp.llama_process(mtp, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, batch)
        if rc != 0:
            raise RuntimeError(f"llama_process(MTP) returned {rc}")
        # the MTP head's own hidden state, which a chained draft feeds back (none without an output row)
        return np.ctypeslib.as_array(get_nextn_ith(mtp, 0), shape=(n_embd,)).copy() if logits else None

    tgt.decode(0, prompt, 0)
    got = [tgt.logits()]
    # unmasked rows are indexed by batch index (no negative index): the prompt is one llama_decode call here
    h = np.ctypeslib.as_array(get_nextn_ith(tgt.ctx, len(prompt) - 1), shape=(n_embd,)).copy()
    t_mtp_catch, t_mtp_draft, drafts_hit = [], [], 0
    for i, tok in enumerate(follow):
        p = len(prompt) + i
        # draft one token at p + 1 from (x_p = tok, h_{p-1}) and time it (logits over the vocabulary)
        t = time.perf_counter()
        mtp_step(tok, h, p, True)
        t_mtp_draft.append(time.perf_counter() - t)
        draft = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(mtp, 0), shape=(tgt.n_vocab,))))
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(mtp), 0, p, -1)  # the draft is not confirmed
        tgt.decode(0, [tok], p)
        got.append(tgt.logits())
        drafts_hit += int(i + 1 < len(follow) and draft == follow[i + 1])
        t = time.perf_counter()
        mtp_step(tok, h, p, False)  # the confirmed pair, no logits: the catch-up
        t_mtp_catch.append(time.perf_counter() - t)
        h = np.ctypeslib.as_array(get_nextn_ith(tgt.ctx, 0), shape=(n_embd,)).copy()  # h_p, for the next step
    out["target_logits_identical"] = all(np.array_equal(x, y) for x, y in zip(want, got))
    out["max_abs_diff"] = float(max(np.max(np.abs(x - y)) for x, y in zip(want, got)))
    med = lambda ts: 1000 * float(np.median(ts[4:]))
    out["decode_ms"] = med(t_plain)
    out["mtp_draft_ms"] = med(t_mtp_draft)
    out["mtp_catch_up_ms"] = med(t_mtp_catch)
    out["draft_over_decode"] = out["mtp_draft_ms"] / out["decode_ms"]
    out["catch_up_over_decode"] = out["mtp_catch_up_ms"] / out["decode_ms"]
    out["drafts_matching_the_forced_next_token"] = drafts_hit
    llama_cpp.llama_batch_ext_free(batch)
    llama_cpp.llama_free(mtp)
    tgt.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
