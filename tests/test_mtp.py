"""The MTP block of the synthetic presets (synth-model --mtp), llama.cpp's MTP head through
orchestrator/speculative/mtp.py, and --speculative mtp: drafts from the head change no answer."""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
import pytest

from orchestrator.engine import VERIFYING, Engine
from orchestrator.models.synth import PRESETS, SynthError, ensure_model, with_mtp
from orchestrator.request import Job, SamplingParams
from orchestrator.speculative.mtp import MtpHead, MtpUnavailable, NextnApi, mtp_context

from .conftest import (LOOP, SPECULATION_CASES, FreeCosts, make_config, same_answers, speculation_pair,
                       spy_verify_many)

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


def test_the_engine_keeps_each_sequences_last_hidden_state_until_its_state_changes():
    """last_hidden is the row of the last token decoded for that sequence (another sequence's decode in between
    does not move it), equal to the hidden state a one-call decode computes there, and gone after a load, a
    clear or a truncation elsewhere."""
    e = Engine(ensure_model(with_mtp("tiny-q4")), n_ctx=512, n_batch=128, n_seq_max=2, attention=VERIFYING,
               load_mtp=True)
    try:
        assert e.nextn is not None and e.last_hidden(0) is None
        e.decode(0, PROMPT, 0)  # 120 tokens: one call
        pos, h = e.last_hidden(0)
        assert pos == len(PROMPT) - 1 and np.array_equal(h, e.hidden(len(PROMPT) - 1))
        saved = e.save_state(0)
        e.decode(1, PROMPT[:50], 0)
        assert e.last_hidden(0)[0] == pos and np.array_equal(e.last_hidden(0)[1], h)
        e.verify(0, FOLLOW[:3], len(PROMPT))
        assert e.last_hidden(0)[0] == len(PROMPT) + 2
        e.load_state(0, saved)
        assert e.last_hidden(0) is None
        e.decode(0, FOLLOW[:1], len(PROMPT))
        assert e.last_hidden(0)[0] == len(PROMPT)
        e.clear(0)
        assert e.last_hidden(0) is None
    finally:
        e.close()
    plain = Engine(ensure_model("tiny-q4"), n_ctx=512, n_batch=128, attention=VERIFYING, load_mtp=True)
    try:  # no block: no hidden states asked for, the target's graph untouched
        plain.decode(0, PROMPT, 0)
        assert plain.nextn is None and plain.last_hidden(0) is None
        with pytest.raises(MtpUnavailable):
            MtpHead(plain)
    finally:
        plain.close()


def test_the_head_keeps_the_entries_up_to_the_confirmed_token_and_restarts_on_a_gap():
    """draft(k) leaves the sequence's entries ending at the confirmed token (chained guesses removed); the same
    entry drafts the same token; catch_up queues entries, added with the next draft in its call or by flush; an
    entry that does not follow restarts the sequence there; another sequence is untouched throughout."""
    e = Engine(ensure_model(with_mtp("tiny-q4")), n_ctx=512, n_batch=128, n_seq_max=2, attention=VERIFYING,
               load_mtp=True)
    head = MtpHead(e, n_batch=4)
    span = lambda seq: (llama_cpp.llama_memory_seq_pos_min(head.mem, seq), llama_cpp.llama_memory_seq_pos_max(head.mem, seq))
    try:
        e.decode(0, PROMPT, 0)
        p, h = e.last_hidden(0)
        first = head.draft(0, p + 1, FOLLOW[0], h, 3)
        assert len(first) == 3 and head.next[0] == p + 2 and span(0) == (p + 1, p + 1)
        assert head.draft(0, p + 1, FOLLOW[0], h, 1) == first[:1]  # the same entry again: the same first draft
        head.catch_up(1, 10, FOLLOW[:2], [h, h])
        head.flush(1)
        assert span(1) == (10, 11)
        e.verify(0, FOLLOW[:4], p + 1)
        rows = [e.hidden(j) for j in range(4)]
        head.catch_up(0, p + 2, FOLLOW[1:3], rows[:2])
        assert span(0) == (p + 1, p + 1)  # queued
        head.draft(0, p + 4, FOLLOW[3], rows[2], 2)  # the queue and the draft's entry in one call
        assert span(0) == (p + 1, p + 4) and head.next[0] == p + 5
        head.catch_up(0, p + 5, FOLLOW[:4], rows)  # n_batch 4: three queued entries are added at once
        assert span(0) == (p + 1, p + 7) and head._queue[0][0] == p + 8
        head.catch_up(0, p + 20, FOLLOW[:1], rows[:1])  # not following: it replaces the queue, then restarts
        head.flush(0)
        assert span(0) == (p + 20, p + 20)
        assert span(1) == (10, 11)
        head.restart(1)
        assert span(1)[1] == -1 and 1 not in head.next
    finally:
        head.close()
    head = MtpHead(e, n_batch=4, n_ctx=16)
    try:  # positions past the head's n_ctx cells: the oldest entries make room
        head.catch_up(0, 1000, list(range(100, 140)), [h] * 40)
        head.flush(0)
        assert span(0) == (1024, 1039)
        assert len(head.draft(0, 1040, FOLLOW[0], h, 2)) == 2 and span(0) == (1026, 1040)  # the chained one's room
        # a 40-token prompt read in chunks of 12, 20 and 8 (the first chunk's first token without a hidden state):
        # only the last 16 entries are ever added, the first chunk not at all
        head.restart(0)
        added = []
        head.catch_up = lambda seq, pos, toks, hs: added.append((pos, len(toks), len(hs)))
        for pos, n in ((0, 12), (12, 20), (32, 8)):
            head.read_prompt(0, pos, list(range(pos, pos + n)), [None if pos == 0 else h] + [h] * (n - 1), 40)
        assert added == [(24, 8, 8), (32, 8, 8)]
        added.clear()
        head.read_prompt(0, 0, list(range(10)), [None] + [h] * 9, 10)  # a short prompt: all but the first entry
        assert added == [(1, 9, 9)]
    finally:
        head.close()
        e.close()


@pytest.fixture(scope="module")
def mtp_pair(tmp_path_factory):
    """(on, off): tiny-q4-mtp with --speculative mtp and off, 2 slots (conftest.speculation_pair)."""
    yield from speculation_pair(tmp_path_factory, ensure_model(with_mtp("tiny-q4")), "mtp", 2)


@pytest.mark.parametrize("case", sorted(SPECULATION_CASES))
def test_mtp_drafts_change_nothing(mtp_pair, case):
    """--speculative mtp against off: tokens, text, finish, logprobs, first-step logits, for every sampling case;
    the head's drafts are verified (random weights: almost none accepted)."""
    on, off = mtp_pair
    assert on.scheduler.speculation.mtp is not None and on.scheduler.speculation.widths == (2, 3, 4, 5, 6, 7)
    job = Job(on.engine.tokenize(LOOP), max_tokens=40, want_logits=True, **SPECULATION_CASES[case])
    a, _ = same_answers(on, off, job)
    assert sum(r.drafted_tokens for r in a) > 0


class _Forced:
    """The head, run as usual (its entries, its logits), but drafting `answer` (the cold continuation from
    `start`), every `every`-th draft replaced by another token: acceptance, catch-up after accepted drafts and
    the rollback of rejected ones all happen."""

    def __init__(self, head, answer, start, every):
        self.head, self.answer, self.start, self.every, self.n = head, answer, start, every, 0

    def __getattr__(self, name):
        return getattr(self.head, name)

    def draft(self, seq, pos, token, h, k):
        real = self.head.draft(seq, pos, token, h, k)
        out = []
        for j in range(k):
            i = pos + 1 + j - self.start
            self.n += 1
            tok = self.answer[i] if i < len(self.answer) else real[j]
            out.append(tok + 1 if self.n % self.every == 0 else tok)
        return out


def test_accepted_mtp_drafts_and_their_rollback_change_nothing(mtp_pair):
    """Drafts forced to the answer without speculation (one in five corrupted): most are accepted, the head's
    entries are caught up from the verification's hidden states, rejections roll back, and the answer, its
    logprobs and first-step logits are those of speculation off, as is a second request on the same slot."""
    on, off = mtp_pair
    spec = on.scheduler.speculation
    prompt = on.engine.tokenize(LOOP)
    job = Job(prompt, max_tokens=40, want_logits=True, logprobs=1, sampling=SamplingParams(temperature=0.0))
    want = off.scheduler.run(job)
    real = spec.mtp
    spec.mtp = _Forced(real, want.completion_tokens, len(prompt), every=5)
    try:
        a, _ = same_answers(on, off, job)
        assert a[0].accepted_tokens > 10 and a[0].drafted_tokens > a[0].accepted_tokens
        a, _ = same_answers(on, off, Job(prompt[:-3], max_tokens=20, want_logits=True,
                                  sampling=SamplingParams(temperature=0.0)))
    finally:
        spec.mtp = real


def test_speculative_mtp_needs_an_mtp_block(tmp_path):
    from orchestrator.errors import ModelLoadError
    from orchestrator.runtime import Runtime


    with pytest.raises(ModelLoadError, match="no MTP block"):
        Runtime.start(make_config(ensure_model("tiny-q4"), speculative="mtp", decode_rows=2, ctx_size=1024,
                                  calibration_file=tmp_path / "cal.json"))


def test_a_failing_head_costs_drafts_not_the_answer(mtp_pair, caplog):
    """llama.cpp failing the head's call (here: every draft) is logged, the head's sequence restarts, and the
    request goes on without drafts, answering as with speculation off."""
    on, off = mtp_pair
    spec = on.scheduler.speculation
    real = spec.mtp

    class Failing(_Forced):
        def draft(self, *a):
            raise MtpUnavailable("the MTP head's llama_process returned -3 at position 9")

    spec.mtp = Failing(real, [], 0, 1)
    try:
        job = Job(on.engine.tokenize(LOOP), max_tokens=24, want_logits=True, sampling=SamplingParams(temperature=0.0))
        with caplog.at_level("WARNING", logger="orchestrator.speculative.verify"):
            a, _ = same_answers(on, off, job)
        assert a[0].drafted_tokens == 0 and a[0].finish_reason == "length"
        assert any("restarts" in r.getMessage() for r in caplog.records)
    finally:
        spec.mtp = real


def test_the_head_follows_decode_steps_batched_over_slots(mtp_pair):
    """Two choices decoding together in one llama_decode per step never verify, but the head still gets each
    one's entries (its sequences cover the answer, not restarted at the next step alone), and the answers are
    those of speculation off batched the same way."""
    on, off = mtp_pair
    head = on.scheduler.speculation.mtp
    job = Job(on.engine.tokenize(LOOP), max_tokens=40, n=2, sampling=SamplingParams(temperature=0.15, top_k=20, seed=5))
    for rt in (on, off):
        rt.scheduler.batch_widths = (2,)
    try:
        a, _ = same_answers(on, off, job)
    finally:
        for rt in (on, off):
            rt.scheduler.batch_widths = ()
    n = len(job.prompt_tokens)
    for seq in (0, 1):
        head.flush(seq)
        lo, hi = (llama_cpp.llama_memory_seq_pos_min(head.mem, seq), llama_cpp.llama_memory_seq_pos_max(head.mem, seq))
        assert lo <= n + 1 and hi >= n + 30, (seq, lo, hi)


def test_the_head_reads_the_prompt_from_where_its_prefill_starts(mtp_pair):
    """A cold prompt: the head's entries start at position 1 (the pair (x_1, h_0)) and cover the prompt; the next
    turn, restored from the cache up to a depth, starts them after the restored prefix (no hidden state before
    it)."""
    on, _ = mtp_pair
    head = on.scheduler.speculation.mtp

    def spans():
        for seq in (0, 1):
            head.flush(seq)
        return [(llama_cpp.llama_memory_seq_pos_min(head.mem, s), llama_cpp.llama_memory_seq_pos_max(head.mem, s))
                for s in (0, 1)]

    prompt = on.engine.tokenize("<|im_start|>user\n" + "omega psi chi " * 40 + "<|im_end|>\n<|im_start|>assistant\n")
    r = on.scheduler.run(Job(prompt, max_tokens=12, sampling=SamplingParams(temperature=0.0)))
    on.scheduler.drain()
    assert r.cached_tokens == 0 and any(lo == 1 and hi >= len(prompt) - 1 for lo, hi in spans())
    longer = prompt + on.engine.tokenize("<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    r = on.scheduler.run(Job(longer, max_tokens=12, sampling=SamplingParams(temperature=0.0)))
    on.scheduler.drain()
    assert 0 < r.cached_tokens < len(longer)
    assert any(lo == r.cached_tokens + 1 and hi >= len(longer) - 1 for lo, hi in spans()), spans()


@pytest.mark.parametrize("drafts", ["mtp", "draft"])
def test_slots_decoding_together_verify_model_drafts_together(tmp_path, monkeypatch, drafts):
    """In the layout `-ctk q8_0` serves (reference decode kernels: verifying several slots in one call measured
    exact at start), three greedy choices decode in one llama_decode call per step and verify their drafts from
    the MTP head (forced to the answer, one in five corrupted: accepted, rejected and rolled back) or from a
    draft model (tiny-q4 drafting for itself) in that call too (Speculation.step_group), and answer as with
    speculation off."""
    from orchestrator.runtime import Runtime

    model = ensure_model(with_mtp("tiny-q4")) if drafts == "mtp" else ensure_model("tiny-q4")
    extra = dict(speculative="mtp") if drafts == "mtp" else dict(speculative="auto", model_draft=model,
                                                                   draft_window=256)
    kw = dict(ctx_size=2048, parallel=3, calibration_file=tmp_path / "cal.json", flash_attn="auto",
              cache_type_k="q8_0", draft_max=7)
    on = Runtime.start(make_config(model, **kw, **extra))
    off = Runtime.start(make_config(model, speculative="off", **kw))
    try:
        spec = on.scheduler.speculation
        spec.costs = FreeCosts()
        assert spec.together and spec.widths == tuple(range(2, 9))
        prompt = on.engine.tokenize(LOOP)
        job = Job(prompt, max_tokens=40, want_logits=True, n=3, sampling=SamplingParams(temperature=0.0))
        if drafts == "mtp":
            want = off.scheduler.run(Job(prompt, max_tokens=40, sampling=SamplingParams(temperature=0.0)))
            spec.mtp = _Forced(spec.mtp, want.completion_tokens, len(prompt), every=5)
        calls = spy_verify_many(monkeypatch, on.engine)
        a, _ = same_answers(on, off, job)
        assert any(every and len(c) == 3 and max(c) > 1 for c, every in calls), calls
        assert sum(r.accepted_tokens for r in a) > 0
        if drafts == "mtp":
            assert any(not every and len(c) > 1 for c, every in calls), calls  # rejections replayed together
    finally:
        on.close()
        off.close()
