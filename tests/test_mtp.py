"""The MTP block of the synthetic presets (synth-model --mtp) and llama.cpp's MTP head through
orchestrator/speculative/mtp.py: what a future MTP drafter stands on. The drafter itself is not built (issue 40)."""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
import pytest

from orchestrator.engine import VERIFYING, Engine
from orchestrator.models.synth import PRESETS, SynthError, ensure_model, with_mtp
from orchestrator.speculative.mtp import MtpUnavailable, NextnApi, mtp_context

PROMPT = [1000 + (41 * i) % 5000 for i in range(120)]
FOLLOW = [1500 + (59 * i) % 5000 for i in range(6)]


def test_an_mtp_preset_adds_one_block_after_the_trunk_and_keeps_the_trunk():
    base, mtp = PRESETS["qwen3.5-0.8b"], with_mtp("qwen3.5-0.8b")
    assert (mtp.name, mtp.mtp_layers) == ("qwen3.5-0.8b-mtp", 1)
    extra = {name for name, _, _ in mtp.tensor_specs()} - {name for name, _, _ in base.tensor_specs()}
    assert extra == {f"blk.24.{t}.weight" for t in (
        "nextn.enorm", "nextn.hnorm", "nextn.eh_proj", "nextn.shared_head_norm", "attn_norm", "attn_q", "attn_k",
        "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_gate", "ffn_up",
        "ffn_down")}
    assert dict((n, s) for n, s, _ in mtp.tensor_specs())["blk.24.nextn.eh_proj.weight"] == (1024, 2048)
    assert mtp.sizes().recurrent_bytes == base.sizes().recurrent_bytes  # the block is attention-only, not trunk
    assert mtp.sizes().kv_bytes_per_token == base.sizes().kv_bytes_per_token
    with pytest.raises(SynthError):
        with_mtp("tiny-attn")  # qwen3: llama.cpp has no MTP block for it


def _logits(model, load_mtp: bool, nextn: bool = False) -> list[np.ndarray]:
    e = Engine(model, n_ctx=512, n_batch=128, attention=VERIFYING, load_mtp=load_mtp)
    try:
        if nextn:
            NextnApi.load().set(e.ctx, True, False)  # every row: the target's own graph
        e.decode(0, PROMPT, 0)
        out = [e.logits()]
        for i, tok in enumerate(FOLLOW):
            e.decode(0, [tok], len(PROMPT) + i)
            out.append(e.logits())
        return out
    finally:
        e.close()


def test_the_mtp_block_and_the_hidden_state_hand_over_leave_the_targets_logits_unchanged():
    """The same trunk weights with and without the block (tiny-q4 and tiny-q4-mtp), the block loaded or not, the
    target's hidden states on for every row: the same logits, bit for bit, so MTP drafts cannot change an answer
    through the target. (For its output rows only, "masked", the 4b preset's prompt logits move by 1.4e-6:
    speculative/mtp.py.)"""
    plain, mtp = ensure_model("tiny-q4"), ensure_model(with_mtp("tiny-q4"))
    ref = _logits(plain, False)
    for got in (_logits(mtp, False), _logits(mtp, True, nextn=True)):
        assert all(np.array_equal(a, b) for a, b in zip(ref, got))


def test_the_mtp_head_drafts_from_the_targets_hidden_state():
    """One MTP step as llama.cpp's draft-mtp takes it: (token, target hidden state) at the next position in an MTP
    context; logits over the vocabulary and a hidden state of its own come back. A model without the block, or a
    load without it, refuses the context."""
    api = NextnApi.load()
    e = Engine(ensure_model(with_mtp("tiny-q4")), n_ctx=512, n_batch=128, attention=VERIFYING, load_mtp=True)
    try:
        api.set(e.ctx, True, False)
        e.decode(0, PROMPT, 0)
        n_embd = int(llama_cpp.llama_model_n_embd(e.model))
        h = np.ctypeslib.as_array(api.get_ith(e.ctx, len(PROMPT) - 1), shape=(n_embd,)).copy()  # one call: 120 < 128
        assert np.isfinite(h).all() and h.any()
        ctx = mtp_context(e.model, e.context_params, 512)
        batch = llama_cpp.llama_batch_ext_init(ctx)
        try:
            api.set(ctx, True, True)
            idx = llama_cpp.llama_batch_ext_add_token(batch, 0, FOLLOW[0])
            pos = (llama_cpp.llama_pos * 1)(len(PROMPT))
            assert llama_cpp.llama_batch_ext_set_pos(batch, idx, pos)
            embd = llama_cpp.llama_embd(h.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, n_embd)
            assert llama_cpp.llama_batch_ext_set_embd_token(batch, idx, embd)
            assert llama_cpp.llama_batch_ext_set_output_logits(batch, idx, True)
            assert llama_cpp.llama_process(ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, batch) == 0
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, 0), shape=(e.n_vocab,))
            own = np.ctypeslib.as_array(api.get_ith(ctx, 0), shape=(n_embd,))
            assert np.isfinite(logits).all() and logits.std() > 0 and np.isfinite(own).all()
        finally:
            llama_cpp.llama_batch_ext_free(batch)
            llama_cpp.llama_free(ctx)
    finally:
        e.close()
    plain = Engine(ensure_model("tiny-q4"), n_ctx=512, n_batch=128, attention=VERIFYING, load_mtp=True)
    try:
        with pytest.raises(MtpUnavailable):
            mtp_context(plain.model, plain.context_params, 512)
    finally:
        plain.close()
