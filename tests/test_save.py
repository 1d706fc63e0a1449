"""Snapshot saves on the tiny model: the bytes llama.cpp writes reach the RAM tier as they are (no copy), spare
checkpoint buffers faulted in while idle hold exactly what a save into new memory holds, and the parts of a full
save cut out of the engine's kept buffer are the parts of the whole state."""

from __future__ import annotations

import time

import numpy as np
import pytest

from orchestrator.cache.radix import CHECKPOINT, KV
from orchestrator.cache.tiers import RamTier
from orchestrator.engine import Engine
from orchestrator.state import HEADER

from .conftest import assert_same_as_cold


@pytest.fixture(scope="module")
def engine(tiny_model):
    e = Engine(tiny_model, n_ctx=2048, n_batch=256, n_threads=2, n_seq_max=2)
    yield e
    e.close()


def _prefill(e: Engine, seq: int, n: int, first: int = 0) -> list[int]:
    tokens = e.tokenize(" ".join(f"w{(first + i) % 97} item{i}" for i in range(n)))[:n]
    e.clear(seq)
    e.decode(seq, tokens, 0, want_logits=False)
    return tokens


def test_a_checkpoint_save_is_kept_by_the_ram_tier_as_the_object_llama_cpp_wrote(engine):
    _prefill(engine, 0, 40)
    data = engine.save_state(0, partial=True)
    assert type(data) is bytes and len(data) == engine.state_size(0, partial=True)
    assert data == bytes(engine.save_state_view(0, partial=True))
    ram = RamTier(1 << 30)
    assert ram.put("k", [1, 2], CHECKPOINT, data)
    assert ram.get("k").payload is data  # no copy into new memory


def test_spares_hold_what_a_save_into_new_memory_holds_and_are_taken_once(engine):
    reserved = engine.keep_spares(2)
    try:
        assert reserved == 2 * engine.spares.size > HEADER
        assert engine.fill_spare() and engine.fill_spare() and not engine.fill_spare()
        assert len(engine.spares) == 2
        _prefill(engine, 0, 40)
        fresh = bytes(engine.save_state_view(0, partial=True))
        first = engine.save_state(0, partial=True)  # into a spare
        assert len(engine.spares) == 1 and first == fresh
        full = engine.save_state(0)  # another size: new memory, the last spare stays
        assert len(engine.spares) == 1 and len(full) > len(first)
        _prefill(engine, 0, 60, first=5)
        second = engine.save_state(0, partial=True)
        assert len(engine.spares) == 0 and second != first  # each spare is handed out once
        assert first == fresh  # and what was handed out earlier never changes
        third = engine.save_state(0, partial=True)  # none left: new memory, the same bytes
        assert third == second and third is not second
    finally:
        engine.keep_spares(0)
    assert engine.spares.target == 0 and not engine.fill_spare()


def test_a_full_save_cut_from_the_kept_buffer_gives_two_loadable_states(engine):
    assert engine.state.split_layout and 0 < len(engine.state.empty_recurrent) < 4096
    _prefill(engine, 0, 50)
    full = engine.save_state(0)
    parts = engine.state.save(engine, 0, (KV, CHECKPOINT))
    assert all(type(p) is bytes for p in parts.values())
    ckpt = engine.save_state(0, partial=True)
    assert parts[CHECKPOINT] == ckpt
    # the KV entry is the whole state with an empty sequence's recurrent part in place of this one's
    kv = parts[KV]
    assert kv.endswith(engine.state.empty_recurrent)
    assert full == kv[:len(kv) - len(engine.state.empty_recurrent)] + ckpt[HEADER:]
    # and they restore, each read where it lies, into another sequence: the state that a prefill of the same
    # tokens leaves there, byte for byte (a state names its sequence and KV stream, so it is compared in place)
    engine.state.restore(engine, 1, 50, kv, parts[CHECKPOINT])
    restored = engine.save_state(1)
    _prefill(engine, 1, 50)
    assert restored == engine.save_state(1)
    nxt = engine.tokenize(" next")
    engine.decode(0, nxt * 8, 50)
    want = engine.logits()
    engine.decode(1, nxt * 8, 50)
    assert np.array_equal(engine.logits(), want)


def test_only_the_entries_asked_are_built(engine):
    _prefill(engine, 0, 30)
    assert set(engine.state.save(engine, 0, (KV,))) == {KV}
    assert set(engine.state.save(engine, 0, (CHECKPOINT,))) == {CHECKPOINT}


def test_parts_lying_in_the_kept_buffer_are_copied_out_before_the_join_overwrites_them(engine):
    tokens = _prefill(engine, 0, 30)
    kv = engine.state.save(engine, 0, (KV,))[KV]
    kv_part = kv[HEADER:len(kv) - len(engine.state.empty_recurrent)]
    ckpt = engine.save_state_view(0, partial=True)  # the checkpoint, in the kept buffer
    # header + KV part + recurrent part: writing the KV part at offset 8 would overwrite the checkpoint's body
    # before it is copied, were it not copied out first
    engine.load_state(1, (ckpt[:HEADER], kv_part, ckpt[HEADER:]))
    engine.decode(0, tokens[:8], 30)
    want = engine.logits()
    engine.decode(1, tokens[:8], 30)
    assert np.array_equal(engine.logits(), want)


def test_a_state_copied_through_the_kept_buffer_continues_exactly(engine):
    tokens = _prefill(engine, 0, 30)
    engine.load_state(1, engine.save_state_view(0))  # read where it was written: no copy
    assert engine.pos_max(1) == len(tokens) - 1
    engine.decode(0, tokens[:8], len(tokens))
    want = engine.logits()
    engine.decode(1, tokens[:8], len(tokens))
    assert np.array_equal(engine.logits(), want)


def test_an_idle_server_fills_its_spares_out_of_the_ram_budget_and_serves_exactly(start):
    rt = start(cache_ram_mib=256, spare_checkpoints=3)
    spares = rt.engine.spares
    assert 0 < spares.target <= 3 and spares.target * spares.size <= 256 * 2**20 // 8
    assert rt.cache.budget_bytes == 256 * 2**20 - spares.target * spares.size
    deadline = time.monotonic() + 30
    while len(spares) < spares.target and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(spares) == spares.target
    messages = [{"role": "system", "content": "You are terse. " * 20},
                {"role": "user", "content": " ".join(f"w{i % 53} item{i}" for i in range(60))}]
    warm = assert_same_as_cold(rt, messages)
    assert warm.result.cached_tokens == 0 and warm.result.snapshots_saved >= 2
    assert spares.taken >= 2  # the warm run's checkpoint saves went into spares (the cold run stores nothing)
    report = rt.cache_report()["spare_checkpoints"]
    assert report["target"] == spares.target and report["taken"] == spares.taken
    assert report["bytes"] == report["kept"] * spares.size
