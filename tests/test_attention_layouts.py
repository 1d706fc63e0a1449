"""The attention layout (--flash-attn, -ctk, -ctv): how "auto" resolves, and the VERIFYING layout (flash attention
over a Q8_0 K cache), in which speculative verification is exact at one row per decode step on K-quant models
(engine.Attention; bench/results/2026-12-03/attention-layouts). Served there, speculation on answers as off and
the cache on as off."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest

from orchestrator import cli, kernels
from orchestrator.config import Config
from orchestrator.engine import VERIFYING, Attention, Engine
from orchestrator.errors import ModelLoadError
from orchestrator.models.synth import ensure_model
from orchestrator.request import Job
from orchestrator.runtime import Runtime

from .conftest import LOOP, SPECULATION_CASES, make_config, same_answers, spy_verify_many, verify_every_draft

# what `-ctk q8_0` serves: VERIFYING with ggml-cpu's reference kernels for decode steps and verifications
VERIFYING_REF = dataclasses.replace(VERIFYING, kernels="reference")


def layouts(*argv: str) -> tuple[Attention, ...]:
    """The layouts `python -m orchestrator serve ARGV` tries, in order."""
    import argparse

    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers(dest="command"))
    return Runtime._attention(cli._config(parser.parse_args(["serve", *argv])))


@pytest.mark.parametrize("argv, expected", [
    ((), (Attention(),)),  # VERIFYING is asked for, not the default: its prefill is slow at long contexts
    (("-fa", "off"), (Attention(),)),
    (("-fa", "on"), (Attention(True, "f16", "f16", "reference"),)),  # its one-token split-KV path skipped
    (("-fa", "on", "--decode-kernels", "default"), (Attention(True, "f16", "f16"),)),
    (("-ctk", "q8_0"), (VERIFYING_REF,)),  # a quantized cache type turns flash attention on, row-wise
    (("-ctk", "q8_0", "--decode-kernels", "default"), (VERIFYING,)),
    (("-ctk", "bf16", "-ctv", "bf16"), (Attention(True, "bf16", "bf16", "reference"),)),
    (("-fa", "off", "-ctk", "q8_0"), (Attention(False, "q8_0", "f16"),)),  # not row-wise: reference gains nothing
    (("--decode-kernels", "reference"), (Attention(kernels="reference"),)),
    (("--device", "none", "-ngl", "0"), (Attention(),)),
])
def test_the_flags_resolve_to_the_layouts_tried_in_order(monkeypatch, argv, expected):
    """Where reference matmuls still take llamafile's tinyBLAS (a build with it, the gate not installed)."""
    monkeypatch.setattr(kernels, "reference_matmuls", lambda: "tinyBLAS")
    assert layouts(*argv) == expected


@pytest.mark.parametrize("matmuls", ["vec_dot", "vec_dot, tinyBLAS gated"])
@pytest.mark.parametrize("argv, expected", [
    ((), (Attention(kernels="reference"),)),  # the default layout verifies exactly without tinyBLAS
    (("-fa", "off"), (Attention(kernels="reference"),)),
    (("--decode-kernels", "default"), (Attention(),)),
    (("-ctk", "q8_0"), (VERIFYING_REF,)),
])
def test_where_reference_matmuls_skip_tinyblas_auto_takes_them_in_the_default_layout(monkeypatch, matmuls, argv,
                                                                                      expected):
    """A ggml-cpu built with -DGGML_LLAMAFILE=OFF, or one whose tinyBLAS the gate keeps out of reference paths
    (native/tinyblas_gate.c), runs every matmul of a reference decode step or verification row by row, so
    --decode-kernels auto takes them in the default layout too, where speculation then has exact widths
    (bench/results/2026-12-07/no-llamafile, tinyblas-gate)."""
    monkeypatch.setattr(kernels, "reference_matmuls", lambda: matmuls)
    assert layouts(*argv) == expected


def test_the_gate_keeps_tinyblas_out_of_this_builds_reference_paths():
    """llama-cpp-python's own build has llamafile: the gate compiles, finds ggml-cpu's jump slot and installs
    (where this fails, the default layout is back to no exact width and speculation off at the defaults). Then
    tiny-q4 in the default layout verifies exactly at every width measured, which tinyBLAS made inexact at all."""
    from orchestrator.calibration import measure_verify_widths

    matmuls = kernels.reference_matmuls()
    assert matmuls.startswith("vec_dot, tinyBLAS gated") if kernels.has_llamafile() else matmuls == "vec_dot"
    e = Engine(ensure_model("tiny-q4"), n_ctx=1024, n_batch=64, attention=Attention(kernels="reference"))
    try:
        assert measure_verify_widths(e, 12, contexts=(40, 300)) == tuple(range(2, 13))
    finally:
        e.close()


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


def layout_pair(tmp_path_factory, **layout):
    """Yields (on, off): tiny-q4 in the attention `layout` (Config fields), speculation auto (every draft
    verified) and off, drafts of up to 11 tokens, 3 slots, one calibration file. A module fixture's body."""
    cal = tmp_path_factory.mktemp("cal") / "calibration.json"
    kw = dict(ctx_size=2048, parallel=3, calibration_file=cal, draft_max=11, **layout)
    on = verify_every_draft(Runtime.start(make_config(ensure_model("tiny-q4"), speculative="auto", **kw)))
    off = Runtime.start(make_config(ensure_model("tiny-q4"), speculative="off", **kw))
    yield on, off
    on.close()
    off.close()


@pytest.fixture(scope="module")
def verifying_pair(tmp_path_factory):
    """(on, off): tiny-q4 in the VERIFYING layout as `-ctk q8_0` asks for it (--flash-attn auto, one-row decode
    steps, reference kernels for them: --decode-kernels auto), speculation auto and off, drafts of up to 11
    tokens, 3 slots, one calibration file."""
    yield from layout_pair(tmp_path_factory, flash_attn="auto", cache_type_k="q8_0")


def test_ctk_q8_0_serves_k_quants_in_the_verifying_layout_with_speculation_on_at_one_row(verifying_pair):
    on, off = verifying_pair
    assert on.engine.attention == off.engine.attention == VERIFYING_REF  # --speculative does not change it
    assert on.scheduler.speculation.widths == tuple(range(2, 13)) and on.engine.decode_rows == 1
    assert off.scheduler.speculation.widths == () and off.engine.n_rs_seq == 0
    assert on.health()["attention"] == {"flash_attn": True, "cache_type_k": "q8_0", "cache_type_v": "f16",
                                          "decode_kernels": "reference"}
    assert on.health()["speculative_widths"] == list(range(2, 13)) and off.health()["speculative_widths"] == []


def test_verification_costs_are_measured_once_and_start_the_width_policy(verifying_pair, caplog):
    """The first start measures what each width and a rollback cost in decode steps (calibration.
    measure_verify_costs) and keeps it in the calibration file; the next start reads it back and its width policy
    starts from it (VerifyCosts.start) instead of the optimistic prior."""
    on, _ = verifying_pair
    stored = [v for k, v in json.loads(on.config.calibration_file.read_text()).items() if k.endswith(":verify_costs")]
    assert len(stored) == 1 and set(stored[0]) == {"0", *map(str, range(2, 13))}
    assert all(stored[0][str(w)] > 0 for w in range(2, 13)) and stored[0]["0"] >= 0
    with caplog.at_level(logging.INFO, logger="orchestrator"):
        rt = Runtime.start(make_config(ensure_model("tiny-q4"), speculative="auto", ctx_size=2048, parallel=3,
                                       calibration_file=on.config.calibration_file, flash_attn="auto",
                                       cache_type_k="q8_0", draft_max=11))
    try:
        assert not any("measured what verifying costs" in r.getMessage() for r in caplog.records)
        costs = rt.scheduler.speculation.costs
        assert costs.start == {int(w): c for w, c in stored[0].items() if w != "0"}
        assert costs.rewind_prior == stored[0]["0"]
    finally:
        rt.close()


@pytest.fixture(scope="module")
def default_pair(tmp_path_factory):
    """(on, off): tiny-q4 at the server's defaults (flash attention off over F16; reference kernels for decode
    steps and verifications, tinyBLAS gated out of them: --decode-kernels auto), speculation auto and off, as
    verifying_pair."""
    yield from layout_pair(tmp_path_factory, flash_attn="auto")


def test_the_default_layout_serves_speculation_with_reference_decode_kernels(default_pair):
    on, off = default_pair
    assert on.engine.attention == off.engine.attention == Attention(kernels="reference")
    assert on.scheduler.speculation.widths == tuple(range(2, 13)) and off.scheduler.speculation.widths == ()
    assert on.health()["attention"]["decode_kernels"] == "reference"


@pytest.fixture(scope="module")
def flash_pair(tmp_path_factory):
    """(on, off): tiny-q4 as `-fa on` serves it (flash attention over F16, tiled in prefill ubatches of 64 tokens
    or more; reference kernels for decode steps and verifications: --decode-kernels auto), speculation auto and
    off, as verifying_pair."""
    yield from layout_pair(tmp_path_factory, flash_attn="on")


def test_flash_attention_over_f16_is_probed_past_its_tiled_kernel():
    """ggml-cpu's flash attention over F16 takes a tiled kernel for ubatches of 64 queries or more and a one-row
    one below (Attention.tiled_queries): the 56-token probe alone reads min_segment 8, at which a 63-token ubatch
    differs from the same tokens inside a longer one. The probe past the tile finds 64, and there splits are
    exact."""
    from orchestrator import calibration

    e = Engine(ensure_model("tiny-q4"), n_ctx=512, n_batch=512, attention=Attention(True, "f16", "f16"))
    try:
        prompt = [1000 + (41 * i) % 5000 for i in range(240)]
        e.decode(0, prompt, 0)
        whole = e.logits()
        assert calibration.measure_min_segment(e) == 8  # what this layout was served at before
        assert calibration.split_delta(e, prompt, whole, 63) > 0
        assert calibration.measure_segments(e).min_segment == 64
        assert calibration.split_delta(e, prompt, whole, 64) == 0
        assert calibration.segment_key(e.attention) != e.attention.key().encode()  # a stored 8 is not read back
        assert calibration.segment_key(Attention()) == Attention().key().encode()  # other layouts keep theirs
    finally:
        e.close()


def test_fa_on_serves_speculation_with_reference_decode_kernels(flash_pair):
    on, off = flash_pair
    assert on.engine.attention == off.engine.attention == Attention(True, "f16", "f16", "reference")
    assert on.engine.min_segment == off.engine.min_segment == 64
    assert on.scheduler.speculation.widths == tuple(range(2, 13)) and off.scheduler.speculation.widths == ()


def test_a_short_turn_over_a_restored_prefix_answers_as_cold_with_fa_on(flash_pair):
    """A second turn that adds fewer tokens than the tiled kernel takes: restored where a cold prefill's ubatches
    are matched (at least min_segment tokens prefilled after the restore), its tokens and first-step logits equal
    a cold prefill's. With min_segment 8 it restored the whole first turn and prefilled the rest in a one-row
    ubatch."""
    on, _ = flash_pair
    greedy = SPECULATION_CASES["greedy"]["sampling"]
    first = on.engine.tokenize(LOOP)
    answer = on.scheduler.run(Job(first, max_tokens=8, sampling=greedy)).completion_tokens
    turn = on.engine.tokenize("<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    for second in (first + on.engine.tokenize("ok") + turn, first + answer + turn):  # the answer's own tokens too
        assert len(second) - len(first) < 64
        warm = on.scheduler.run(Job(second, max_tokens=24, want_logits=True, sampling=greedy))
        cold = on.scheduler.run(Job(second, max_tokens=24, want_logits=True, use_cache=False, sampling=greedy))
        assert np.array_equal(warm.first_logits, cold.first_logits)
        assert warm.completion_tokens == cold.completion_tokens
        assert 0 < warm.cached_tokens <= len(second) - 64 and cold.cached_tokens == 0
        on.scheduler.drain()


def test_a_short_tool_result_after_a_long_answer_restores_the_answers_repeat_point_with_fa_on(flash_pair):
    """With min_segment 64, a tool result of a few tokens cannot restore the answer's end. Where the template's
    probe says the next turn adds 14 tokens (a Qwen3.5 tool result around empty content), the after-generation
    re-prefill stores the answer's repeat point, 64 tokens before its end: the next turn restores it, not the
    prompt's end, and answers as its cold run (tokens, first-step logits)."""
    on, _ = flash_pair
    greedy = SPECULATION_CASES["greedy"]["sampling"]
    first = on.engine.tokenize(LOOP)
    r = on.scheduler.run(Job(first, max_tokens=150, sampling=greedy, restorable_after=lambda generated: 14))
    on.scheduler.drain()
    assert r.finish_reason == "length"  # the looping model does not end its turn: the answer is all 150 tokens
    end = len(first) + len(r.completion_tokens)
    second = first + r.completion_tokens + on.engine.tokenize(
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert len(second) - end < 64
    warm = on.scheduler.run(Job(second, max_tokens=8, want_logits=True, sampling=greedy))
    cold = on.scheduler.run(Job(second, max_tokens=8, want_logits=True, use_cache=False, sampling=greedy))
    assert warm.cached_tokens == end - 64 and cold.cached_tokens == 0
    assert warm.completion_tokens == cold.completion_tokens
    assert np.array_equal(warm.first_logits, cold.first_logits)
    on.scheduler.drain()


@pytest.mark.parametrize("layout", ["verifying_pair", "flash_pair", "default_pair"])
@pytest.mark.parametrize("case", sorted(SPECULATION_CASES))
def test_speculation_changes_nothing_in_the_speculating_layouts(layout, case, request):
    """Tokens, text, finish, logprobs and first-step logits with speculation equal those without, for greedy,
    seeded, logprobs, stop strings, a cold request and n = 2, with `-ctk q8_0`, with `-fa on` and at the
    defaults; the looping random model's greedy answer gets drafted and accepted, in verifications wider than the
    7 tokens that ggml-cpu's default kernels keep exact."""
    on, off = request.getfixturevalue(layout)
    job = Job(on.engine.tokenize(LOOP), max_tokens=48, want_logits=True, **SPECULATION_CASES[case])
    before = dataclasses.replace(on.scheduler.speculation.stats)
    a, _ = same_answers(on, off, job)
    if job.sampling.temperature == 0.0:  # sampled at 0.15 it may not repeat itself enough to be drafted
        assert sum(r.drafted_tokens for r in a) > 0 and sum(r.accepted_tokens for r in a) > 0
        stats = on.scheduler.speculation.stats
        assert stats.drafted - before.drafted > 6 * (stats.verifications - before.verifications)  # some > 7 wide
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


def test_reference_kernels_make_verification_exact_beyond_the_8_row_switch():
    """In VERIFYING, ggml-cpu's default kernels keep a verification exact up to 7 tokens (the tiled K-quant matmul
    takes 8+ rows); with the reference kernels for decode steps and verifications (kernels.py) every width
    measured is exact. This build must expose the switch (kernels.unavailable): a llama-cpp-python upgrade that
    drops it would silently narrow speculation back to 7."""
    from orchestrator import kernels
    from orchestrator.calibration import measure_verify_widths

    assert kernels.unavailable() is None
    widths = {}
    for att in (VERIFYING, VERIFYING_REF):
        e = Engine(ensure_model("tiny-q4"), n_ctx=1024, n_batch=64, attention=att)
        try:
            widths[att.kernels] = measure_verify_widths(e, 12, contexts=(40, 300))
        finally:
            e.close()
    assert widths == {"default": tuple(range(2, 8)), "reference": tuple(range(2, 13))}


@pytest.mark.parametrize("layout", [VERIFYING, Attention()], ids=["verifying", "default"])
def test_prefill_keeps_the_optimized_kernels_under_reference_decode_kernels(monkeypatch, layout):
    """Only decode steps and verifications switch (Engine._compute): a 60-token prefill gives the logits of the
    same layout with default kernels (made with the Hadamard rotation off, as reference contexts are: kernels.
    rotation_off), while the same 60 tokens in one ubatch under the reference kernels (a verification) give
    others. In the default layout, that is tinyBLAS (in prefill, through the gate) against the one-row kernels
    (under reference paths)."""
    prompt = [1000 + (37 * i) % 4000 for i in range(60)]
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")
    plain = Engine(ensure_model("tiny-q4"), n_ctx=256, n_batch=64, attention=layout)
    try:
        plain.decode(0, prompt, 0)
        expected = plain.logits()
    finally:
        plain.close()
    monkeypatch.delenv("LLAMA_ATTN_ROT_DISABLE")
    e = Engine(ensure_model("tiny-q4"), n_ctx=256, n_batch=64, attention=dataclasses.replace(layout,
                                                                                             kernels="reference"))
    try:
        e.decode(0, prompt, 0)
        assert np.array_equal(e.logits(), expected)
        e.clear(0)
        e.verify(0, prompt, 0)
        assert not np.array_equal(e.logits(), expected)
    finally:
        e.close()


def test_verifications_of_several_slots_in_one_call_are_exact_only_under_reference_kernels(monkeypatch):
    """calibration.check_batched_verification on tiny-q4, 4 sequences (every slot), 7-token verifications beside
    one-token steps: with the reference decode kernels every sequence gets in one call what it gets alone (and goes on
    from the same state); with the default kernels four 7-token verifications are 28 rows, which take the
    tiled matmul that none alone takes, so the check refuses them."""
    from orchestrator.calibration import check_batched_verification

    found, calls = {}, []
    for att in (VERIFYING, VERIFYING_REF):
        e = Engine(ensure_model("tiny-q4"), n_ctx=1024, n_batch=64, n_seq_max=4, attention=att)
        spied = spy_verify_many(monkeypatch, e)
        try:
            found[att.kernels] = check_batched_verification(e, 7)
        finally:
            e.close()
        calls += spied
    assert found == {"default": False, "reference": True}
    assert max(len(c) for c, _ in calls) == 4  # every slot that can decode together is checked together


def test_slots_that_decode_together_verify_their_drafts_together(verifying_pair, monkeypatch):
    """Three greedy choices of the looping prompt decode in one llama_decode call per step (batched decoding is
    exact under reference kernels); with speculation each step verifies their drafts in that call
    (Speculation.step_group, measured exact at start and kept in the calibration file), and every choice answers
    as with speculation off."""
    on, off = verifying_pair
    assert on.scheduler.speculation.together and not off.scheduler.speculation.together
    assert on.health()["speculative_together"] is True and off.health()["speculative_together"] is False
    stored = {k: v for k, v in json.loads(on.config.calibration_file.read_text()).items() if ":verify_together:" in k}
    assert list(stored.values()) == [True] and next(iter(stored)).endswith(":verify_together:12:3")
    calls = spy_verify_many(monkeypatch, on.engine)
    job = Job(on.engine.tokenize(LOOP), max_tokens=48, want_logits=True, n=3,
              sampling=SPECULATION_CASES["greedy"]["sampling"])
    a, _ = same_answers(on, off, job)
    together = [c for c, every in calls if every and len(c) > 1 and max(c) > 1]
    assert together, calls  # some step verified drafts of slots decoding together
    assert sum(r.accepted_tokens for r in a) > 0
    on.scheduler.drain()
    off.scheduler.drain()


def test_the_kernel_switch_and_the_gate_reach_the_one_ggml_cpu_llama_cpp_loaded():
    """pip installs libggml-cpu.so, .so.0 and .so.0.25.3 as copies, and libllama maps .so.0: a switch opened by
    another name mapped a second copy, and the gate then called into its tinyBLAS, whose tables only the first
    copy initialises (Gemma 3 270M wrote garbage in the default layout). After both, one copy is mapped."""
    from pathlib import Path

    import llama_cpp

    kernels._api()
    kernels.reference_matmuls()
    lib_dir = str((Path(llama_cpp.__file__).parent / "lib").resolve())
    mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
              if lib_dir in line and "/libggml-cpu.so" in line}
    assert len(mapped) == 1, mapped


def test_kernels_open_the_libraries_llama_cpp_loaded(monkeypatch, tmp_path):
    """With LLAMA_CPP_LIB_PATH set, llama_cpp loads that folder's libraries, and the kernel switch must reach
    those, not llama-cpp-python's own copy: a folder without them is reported, not silently replaced."""
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(tmp_path))
    with pytest.raises(kernels.KernelsUnavailable, match=str(tmp_path)):
        kernels._library("ggml-cpu")
    assert kernels.has_llamafile()  # cannot ask: the old answer, no exact width in the default layout
