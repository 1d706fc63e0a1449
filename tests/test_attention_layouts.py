"""The attention layout (--flash-attn, -ctk, -ctv): how "auto" resolves, and the VERIFYING layout (flash attention
over a Q8_0 K cache), in which speculative verification is exact at one row per decode step on K-quant models
(engine.Attention; bench/results/2026-12-03/attention-layouts). Served there, speculation on answers as off and
the cache on as off."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from orchestrator import cli
from orchestrator.config import Config
from orchestrator.engine import VERIFYING, Attention, Engine
from orchestrator.errors import ModelLoadError
from orchestrator.models.synth import ensure_model
from orchestrator.request import Job
from orchestrator.runtime import Runtime

from .conftest import LOOP, SPECULATION_CASES, make_config, same_answers, verify_every_draft


def layouts(*argv: str) -> tuple[Attention, ...]:
    """The layouts `python -m orchestrator serve ARGV` tries, in order."""
    import argparse

    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers(dest="command"))
    return Runtime._attention(cli._config(parser.parse_args(["serve", *argv])))


@pytest.mark.parametrize("argv, expected", [
    ((), (Attention(),)),  # VERIFYING is asked for, not the default: its prefill is slow at long contexts
    (("-fa", "off"), (Attention(),)),
    (("-fa", "on"), (Attention(True, "f16", "f16"),)),
    (("-ctk", "q8_0"), (VERIFYING,)),  # a quantized cache type turns flash attention on
    (("-ctk", "bf16", "-ctv", "bf16"), (Attention(True, "bf16", "bf16"),)),
    (("-fa", "off", "-ctk", "q8_0"), (Attention(False, "q8_0", "f16"),)),
    (("--device", "none", "-ngl", "0"), (Attention(),)),
])
def test_the_flags_resolve_to_the_layouts_tried_in_order(argv, expected):
    assert layouts(*argv) == expected


def test_a_layout_llama_cpp_refuses_is_an_error_naming_the_flag():
    with pytest.raises(ModelLoadError, match="needs flash attention"):
        Runtime._attention(Config(cache_ram_mib=0, flash_attn="off", cache_type_v="q8_0"))
    with pytest.raises(ValueError, match="unknown KV cache type"):
        Attention(True, "q3_k", "f16")


def test_a_q8_0_k_cache_holds_about_half_the_bytes_of_f16():
    """The KV bytes per token that sizing counts come from the layout served (calibration.state_sizes)."""
    from orchestrator.calibration import state_sizes

    sizes = {}
    for att in (Attention(), VERIFYING):
        e = Engine(ensure_model("tiny-q4"), n_ctx=256, n_batch=64, attention=att)
        try:
            sizes[att] = state_sizes(e)[1]
        finally:
            e.close()
    f16, q8 = sizes[Attention()], sizes[VERIFYING]
    assert 0.7 * f16 < q8 < 0.8 * f16  # K in Q8_0 (34 bytes per 32 values), V in F16


@pytest.fixture(scope="module")
def verifying_pair(tmp_path_factory):
    """(on, off): tiny-q4 in the VERIFYING layout as `-ctk q8_0` asks for it (--flash-attn auto, one-row decode
    steps), speculation auto and off, 3 slots, one calibration file."""
    cal = tmp_path_factory.mktemp("cal") / "calibration.json"
    kw = dict(ctx_size=2048, parallel=3, calibration_file=cal, flash_attn="auto", cache_type_k="q8_0")
    on = verify_every_draft(Runtime.start(make_config(ensure_model("tiny-q4"), speculative="auto", **kw)))
    off = Runtime.start(make_config(ensure_model("tiny-q4"), speculative="off", **kw))
    yield on, off
    on.close()
    off.close()


def test_ctk_q8_0_serves_k_quants_in_the_verifying_layout_with_speculation_on_at_one_row(verifying_pair):
    on, off = verifying_pair
    assert on.engine.attention == off.engine.attention == VERIFYING  # --speculative does not change the layout
    assert on.scheduler.speculation.widths == (2, 3, 4, 5, 6, 7) and on.engine.decode_rows == 1
    assert off.scheduler.speculation.widths == () and off.engine.n_rs_seq == 0
    assert on.health()["attention"] == {"flash_attn": True, "cache_type_k": "q8_0", "cache_type_v": "f16"}
    assert on.health()["speculative_widths"] == [2, 3, 4, 5, 6, 7] and off.health()["speculative_widths"] == []


def test_verification_costs_are_measured_once_and_start_the_width_policy(verifying_pair, caplog):
    """The first start measures what each width and a rollback cost in decode steps (calibration.
    measure_verify_costs) and keeps it in the calibration file; the next start reads it back and its width policy
    starts from it (VerifyCosts.start) instead of the optimistic prior."""
    on, _ = verifying_pair
    stored = [v for k, v in json.loads(on.config.calibration_file.read_text()).items() if k.endswith(":verify_costs")]
    assert len(stored) == 1 and set(stored[0]) == {"0", "2", "3", "4", "5", "6", "7"}
    assert all(stored[0][w] > 0 for w in "234567") and stored[0]["0"] >= 0
    with caplog.at_level(logging.INFO, logger="orchestrator"):
        rt = Runtime.start(make_config(ensure_model("tiny-q4"), speculative="auto", ctx_size=2048, parallel=3,
                                       calibration_file=on.config.calibration_file, flash_attn="auto",
                                       cache_type_k="q8_0"))
    try:
        assert not any("measured what verifying costs" in r.getMessage() for r in caplog.records)
        costs = rt.scheduler.speculation.costs
        assert costs.start == {int(w): c for w, c in stored[0].items() if w != "0"}
        assert costs.rewind_prior == stored[0]["0"]
    finally:
        rt.close()


@pytest.mark.parametrize("case", sorted(SPECULATION_CASES))
def test_speculation_at_one_row_changes_nothing_in_the_verifying_layout(verifying_pair, case):
    """Tokens, text, finish, logprobs and first-step logits with speculation equal those without, for greedy,
    seeded, logprobs, stop strings, a cold request and n = 2; the looping random model's greedy answer gets drafted
    and accepted."""
    on, off = verifying_pair
    job = Job(on.engine.tokenize(LOOP), max_tokens=48, want_logits=True, **SPECULATION_CASES[case])
    a, _ = same_answers(on, off, job)
    if job.sampling.temperature == 0.0:  # sampled at 0.15 it may not repeat itself enough to be drafted
        assert sum(r.drafted_tokens for r in a) > 0 and sum(r.accepted_tokens for r in a) > 0
    on.scheduler.drain()
    off.scheduler.drain()


def test_a_restored_prefix_answers_as_a_cold_prefill_in_the_verifying_layout(verifying_pair):
    """The cache's property in this layout: a second turn over a stored first one (restored) gives the tokens and
    first-step logits of the same prompt prefilled cold."""
    on, _ = verifying_pair
    first = on.engine.tokenize(LOOP)
    on.scheduler.run(Job(first, max_tokens=8, sampling=SPECULATION_CASES["greedy"]["sampling"]))
    second = first + on.engine.tokenize("ok<|im_end|>\n<|im_start|>user\nagain " * 3 +
                                        "<|im_end|>\n<|im_start|>assistant\n")
    warm = on.scheduler.run(Job(second, max_tokens=24, want_logits=True, sampling=SPECULATION_CASES["greedy"]["sampling"]))
    cold = on.scheduler.run(Job(second, max_tokens=24, want_logits=True, use_cache=False,
                                sampling=SPECULATION_CASES["greedy"]["sampling"]))
    assert warm.cached_tokens >= len(first) - 8 and cold.cached_tokens == 0
    assert warm.completion_tokens == cold.completion_tokens
    assert np.array_equal(warm.first_logits, cold.first_logits)
    on.scheduler.drain()
