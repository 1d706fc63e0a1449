"""The context size chosen when --ctx-size is not given (orchestrator/sizing.py): the model's training context,
reduced to what half the memory left beside the weights and the cache budget holds for every slot."""

from __future__ import annotations

import logging

import pytest

from orchestrator.config import Config, default_cache_ram_mib
from orchestrator.models.synth import PADDED_VOCAB_SIZE, PRESETS
from orchestrator.runtime import Runtime
from orchestrator.sizing import AGENT_CTX, LIVE_CHECKPOINTS, MIN_CTX, OVERHEAD, SHARE, STEP, MiB, compute_sizes, fit_context

from .conftest import make_config

GiB = 1024 * MiB


def test_the_training_context_where_memory_holds_it():
    fit = fit_context(32768, 12288, 19 * MiB, 4, 64 * GiB, 600 * MiB, 8 * GiB)
    assert fit.ctx_size == 32768 and fit.fits
    assert "set by the model's training context" in fit.describe()


def test_memory_reduces_it_in_steps_and_every_slot_gets_its_share():
    args = dict(n_ctx_train=262144, kv_bytes_per_token=12288, recurrent_bytes=19 * MiB, available_bytes=6 * GiB,
                model_bytes=500 * MiB, cache_bytes=0, compute_bytes_per_token=18432, compute_floor_bytes=485 * MiB)
    one, four = fit_context(slots=1, **args), fit_context(slots=4, **args)
    for fit in (one, four):
        share = (6 * GiB - 500 * MiB - OVERHEAD) * SHARE - 485 * MiB
        used = fit.slots * fit.slot_bytes + fit.ctx_size * fit.compute_bytes_per_token
        assert fit.ctx_size % STEP == 0 and used <= share
        assert used + STEP * (fit.slots * fit.kv_bytes_per_token + fit.compute_bytes_per_token) > share  # largest step
        assert fit.planned_bytes <= fit.available_bytes
    assert four.ctx_size < one.ctx_size < 262144 and four.slots == 4  # an explicit slot count is kept
    assert "set by memory" in four.describe() and "4 slots" in four.describe()


def test_a_machine_too_small_gets_the_floor_and_says_so():
    fit = fit_context(262144, 1 << 20, 0, 4, 2 * GiB, 1 * GiB, 1 * GiB)
    assert fit.ctx_size == MIN_CTX and not fit.fits
    assert fit_context(2048, 1 << 20, 0, 4, 1 * GiB, 1 * GiB, 1 * GiB).ctx_size == 2048  # never above training


def test_a_runtime_without_ctx_size_fits_its_context_and_logs_the_arithmetic(tiny_model, caplog):
    caplog.set_level(logging.INFO)
    rt = Runtime.start(Config(model=tiny_model, parallel=1, cache_ram_mib=64, threads=2, batch_size=256))
    try:
        assert rt.config.ctx_size == rt.n_ctx >= MIN_CTX
        assert rt.n_ctx <= rt.engine.info.n_ctx_train
        assert any("tokens per slot, 1 slot, set by" in r.getMessage() for r in caplog.records)
    finally:
        rt.close()


def test_speculation_counts_each_slots_rollback_checkpoint_where_memory_sets_the_context(tiny_model, monkeypatch):
    """A verification on a recurrent memory keeps the slot's state from before it (Engine.rewind_point), one
    buffer per slot verified in one call: where memory sets the context, that is one more recurrent state per
    slot out of the share, so the context is smaller by about slots x state / (KV + compute bytes per token)."""
    from types import SimpleNamespace

    from orchestrator import runtime as runtime_module
    from orchestrator.engine import Attention

    cfg = make_config(tiny_model, parallel=4, ctx_size=None, cache_enabled=False)
    available = tiny_model.stat().st_size + OVERHEAD + GiB // 2  # memory, not the training context, sets it
    monkeypatch.setattr(runtime_module.psutil, "virtual_memory", lambda: SimpleNamespace(available=available))
    plain = Runtime._fit_context(cfg, tiny_model, 0, Attention())
    verifying = Runtime._fit_context(cfg, tiny_model, 0, Attention(), rewind=True)
    assert plain.limit == verifying.limit == "memory" and plain.recurrent_bytes > 0
    assert verifying.recurrent_bytes == 2 * plain.recurrent_bytes
    per_token = 4 * plain.kv_bytes_per_token + plain.compute_bytes_per_token
    expected = 4 * plain.recurrent_bytes / per_token
    assert abs(plain.ctx_size - verifying.ctx_size - expected) <= STEP


# ------------------------------------------------------------------ the defaults at size (issue 42 item 5)
# A laptop with 16 GiB: what psutil calls available at start is the 16 GiB less the OS and what else runs.
LAPTOP_AVAILABLE = {"a quiet laptop": 14 * GiB, "an editor and a browser open": 12 * GiB, "a busy one": 10 * GiB}


def laptop_fit(preset: str, available: int, n_rs: int = 0, slots_auto: bool = True):
    """fit_context as Runtime._fit_context calls it at the server's defaults (4 slots unless memory says fewer,
    --cache-ram a quarter of available, n_batch 512, the GGUF's 262,144-token training context), with the preset's
    sizes from its shapes (llama.cpp's measured ones add under 0.01%: docs/operations.md)."""
    pre = PRESETS[preset]
    z = pre.sizes()
    heads = pre.num_attention_heads
    floor, per_token = compute_sizes(512, PADDED_VOCAB_SIZE, heads)
    cache = default_cache_ram_mib(available) * MiB
    return fit_context(262144, z.kv_bytes_per_token, z.recurrent_bytes * (1 + n_rs), Config().parallel, available,
                       z.q4_k_m_tensor_bytes, cache, per_token, floor, slots_auto, z.recurrent_bytes), cache


@pytest.mark.parametrize("where", sorted(LAPTOP_AVAILABLE))
@pytest.mark.parametrize("n_rs", [0, 6])  # 6: the rollback snapshots of speculation at its widest (draft_max + 1)
def test_a_4b_on_a_16_gib_laptop_neither_swaps_nor_evicts_the_live_session(where, n_rs):
    available = LAPTOP_AVAILABLE[where]
    fit, cache = laptop_fit("qwen3.5-4b", available, n_rs)
    z = PRESETS["qwen3.5-4b"].sizes()
    assert fit.fits and not fit.problem
    # no swap: weights + cache budget + process + compute buffer + every slot's KV and states fit what is available
    assert fit.planned_bytes <= available
    # the live session is not evicted: the RAM tier holds a slot filled to its context, with its latest checkpoints
    assert cache >= fit.ctx_size * z.kv_bytes_per_token + LIVE_CHECKPOINTS * z.recurrent_bytes
    # and it has room to grow: Claude Code's first request alone is 11.8k tokens; at 14 GiB a 64k session fits
    assert fit.ctx_size >= (AGENT_CTX if available >= 14 * GiB and n_rs == 0 else 32768)
    assert fit.slots == 1 and "fewer than 65536 tokens" in fit.describe()  # 4 slots of 16-24k each would not
    # what the rule before gave here (4 slots sharing half of what the weights and the cache leave, the compute
    # buffer not counted): under 32k tokens a slot, so one session outgrew its slot after a few turns
    old = ((available - z.q4_k_m_tensor_bytes - cache) * 0.5 / 4 - z.recurrent_bytes * (1 + n_rs)) // z.kv_bytes_per_token
    assert old < 32768 and fit.ctx_size > 1.3 * old


def test_an_explicit_parallel_keeps_its_slots_and_still_fits():
    fit, _ = laptop_fit("qwen3.5-4b", 12 * GiB, slots_auto=False)
    assert fit.slots == 4 and fit.fits and fit.planned_bytes <= 12 * GiB and MIN_CTX <= fit.ctx_size < AGENT_CTX


@pytest.mark.parametrize("where", sorted(LAPTOP_AVAILABLE))
def test_a_9b_on_a_16_gib_laptop_fits_with_a_shorter_context(where):
    available = LAPTOP_AVAILABLE[where]
    fit, cache = laptop_fit("qwen3.5-9b", available)
    assert fit.fits and fit.planned_bytes <= available and fit.slots == 1
    assert MIN_CTX <= fit.ctx_size < AGENT_CTX  # 7.7k to 46k: below an agent's 64k


@pytest.mark.parametrize("where", sorted(LAPTOP_AVAILABLE))
def test_a_27b_on_a_16_gib_laptop_is_refused_a_fit_and_says_why(where):
    available = LAPTOP_AVAILABLE[where]
    fit, _ = laptop_fit("qwen3.5-27b", available)
    assert not fit.fits and fit.planned_bytes > available
    assert "weights (15.4 GiB)" in fit.problem and "smaller model" in fit.problem
    assert "WARNING" in fit.describe()
