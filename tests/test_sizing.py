"""The context size chosen when --ctx-size is not given (orchestrator/sizing.py): the model's training context,
reduced to what half the memory left beside the weights and the cache budget holds for every slot."""

from __future__ import annotations

import logging

from orchestrator.config import Config
from orchestrator.runtime import Runtime
from orchestrator.sizing import MIN_CTX, STEP, MiB, fit_context

GiB = 1024 * MiB


def test_the_training_context_where_memory_holds_it():
    fit = fit_context(32768, 12288, 19 * MiB, 4, 64 * GiB, 600 * MiB, 8 * GiB)
    assert fit.ctx_size == 32768 and fit.fits
    assert "set by the model's training context" in fit.describe()


def test_memory_reduces_it_in_steps_and_every_slot_gets_its_share():
    args = dict(n_ctx_train=262144, kv_bytes_per_token=12288, recurrent_bytes=19 * MiB, available_bytes=8 * GiB,
                model_bytes=500 * MiB, cache_bytes=2 * GiB)
    one, four = fit_context(slots=1, **args), fit_context(slots=4, **args)
    for fit in (one, four):
        share = (8 * GiB - 500 * MiB - 2 * GiB) / 2
        per_slot = fit.recurrent_bytes + fit.ctx_size * fit.kv_bytes_per_token
        assert fit.ctx_size % STEP == 0 and fit.slots * per_slot <= share
        assert fit.slots * (per_slot + STEP * fit.kv_bytes_per_token) > share  # the largest step that fits
    assert four.ctx_size < one.ctx_size < 262144
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
        assert any("tokens per slot, set by" in r.getMessage() for r in caplog.records)
    finally:
        rt.close()
