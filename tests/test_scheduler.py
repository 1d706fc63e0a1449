"""The scheduler and the reuse rules on a fake engine (tests/fake_engine.py): no model, seconds for the file.

Slot choice, waiting for a shared prefix, cancellation in every phase, the after-generation choice, KV-only
models, refused restores, batched decoding and the calibration probes, each with the outputs compared to cold
runs. The fake engine marks every token computed in a too-short ubatch, so a rule that stored or restored an
inexact state would show up as a difference from the cold run. The same properties are checked end to end on
the real model in test_correctness.py, test_slots.py and test_models.py.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator import calibration
from orchestrator.cache.snapshots import SnapshotCache
from orchestrator.errors import EngineError, InvalidRequest, QueueFull, RequestCancelled, RequestTimeout
from orchestrator.cache.radix import CHECKPOINT, KV, LOGITS, common_len
from orchestrator.request import Collector, Event, EventKind, Job, Phase, SamplingParams, Slot, Task
from orchestrator.reuse import Reuse
from orchestrator.scheduler import Scheduler
from orchestrator.cache.tiers import RamTier

from .conftest import every_width
from .fake_engine import FakeEngine

MS = 4  # min_segment of these tests (the fake's exact_from)
SYSTEM = [(7 * i) % 61 + 1 for i in range(40)]  # a shared prefix; a template boundary ends it
TAILS = [[50 + i, 20, 21, 22, 23, 24, 25, 26, 27, 28 + i] for i in range(4)]


@pytest.fixture()
def make():
    """make(n_slots=2, hybrid=True, **scheduler kw) -> (engine, cache, scheduler); closed after the test."""
    made = []

    def _make(n_slots=2, hybrid=True, ram=64 << 20, hw_invariant=True, batch_decode=False, n_ctx=4096, **kw):
        eng = FakeEngine(n_seq_max=n_slots, hybrid=hybrid, exact_from=MS, batch_invariant=hw_invariant, n_ctx=n_ctx)
        eng.calibrate(MS, hw_invariant is True)
        cache = SnapshotCache([RamTier(ram)], state=eng.state)
        kw.setdefault("prefill_chunk", 16)
        kw.setdefault("prefill_chunk_alone", kw["prefill_chunk"])
        s = Scheduler(eng, cache, n_slots=n_slots, batch_widths=every_width(n_slots, batch_decode), **kw)
        made.append(s)
        return eng, cache, s

    yield _make
    for s in made:
        s.close()


def job(tokens, boundaries=(), max_tokens=6, **kw) -> Job:
    return Job(list(tokens), boundaries, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0),
               want_logits=True, **kw)


def same_as_cold(s: Scheduler, tokens, boundaries=(), max_tokens=6, **kw):
    warm = s.run(job(tokens, boundaries, max_tokens, **kw))
    cold = s.run(job(tokens, boundaries, max_tokens, use_cache=False))
    assert cold.cached_tokens == 0
    assert warm.completion_tokens == cold.completion_tokens
    assert np.array_equal(warm.first_logits, cold.first_logits)
    s.drain()
    return warm


def kinds_at(cache: SnapshotCache) -> set[tuple[str, int]]:
    return {(str(kind), len(tokens)) for kind, _tier, tokens in cache.entries()}


def submit_all(s: Scheduler, eng: FakeEngine, jobs, cancels=None) -> list:
    """Submit every job while the worker is held, so that admission sees them all at once; wait for the results
    (a Result or the error)."""
    out, done = [None] * len(jobs), [threading.Event() for _ in jobs]

    def sink_for(i):
        def sink(ev: Event) -> None:
            if ev.kind != EventKind.TEXT:
                out[i] = ev.result if ev.kind == EventKind.DONE else ev.error
                done[i].set()
        return sink

    eng.pause()
    for i, j in enumerate(jobs):
        s.submit(j, sink_for(i), cancels[i] if cancels else None)
    eng.resume()
    for d in done:
        assert d.wait(30)
    return out


# ---------------------------------------------------------------- the fake engine itself


def test_the_fake_engine_punishes_short_ubatches_and_lost_checkpoints():
    eng = FakeEngine(exact_from=MS)
    eng.calibrate(2)
    tokens = SYSTEM[:20]
    eng.decode(0, tokens, 0)
    whole = eng.logits()
    eng.clear(0)
    eng.decode(0, tokens[:17], 0, want_logits=False)
    eng.decode(0, tokens[17:], 17)  # a 3-token ubatch: below the fake's exactness threshold
    assert not np.array_equal(eng.logits(), whole)
    # A checkpoint of another prefix of the same length restores without complaint, as on llama.cpp, but what
    # follows differs; one of another length cannot be cut to the position.
    other = [t + 1 for t in tokens[:8]]
    eng.clear(0)
    eng.decode(0, other, 0, want_logits=False)
    wrong = eng.state.save(eng, 0, (CHECKPOINT,))[CHECKPOINT]
    eng.clear(0)
    eng.decode(0, tokens[:16], 0, want_logits=False)
    mine = eng.state.save(eng, 0, (KV, CHECKPOINT))
    eng.clear(0)
    eng.decode(0, tokens[:8], 0, want_logits=False)
    right = eng.state.save(eng, 0, (CHECKPOINT,))[CHECKPOINT]
    after = []
    for checkpoint in (right, wrong):
        eng.state.restore(eng, 1, 8, mine[KV], checkpoint)
        eng.decode(1, tokens[8:16], 8)
        after.append(eng.logits())
    eng.clear(0)
    eng.decode(0, tokens[:16], 0)
    assert np.array_equal(after[0], eng.logits()) and not np.array_equal(after[1], eng.logits())
    with pytest.raises(EngineError):
        eng.state.restore(eng, 1, 12, mine[KV], right)
    # Sizes like the real ones (1/64 scale): a fixed-size checkpoint, KV growing per token.
    assert len(mine[CHECKPOINT]) == 8 + eng.checkpoint_nbytes
    assert len(mine[KV]) == 8 + 4 + 16 * eng.kv_bytes_per_token + 4  # header, KV part, empty recurrent part


def test_calibration_finds_the_fakes_thresholds():
    for exact_from in (2, 8):
        eng = FakeEngine(n_seq_max=3, exact_from=exact_from, batch_invariant=exact_from == 8)
        assert calibration.measure_min_segment(eng) == exact_from
        assert calibration.check_batch_invariance(eng) is (exact_from == 8)
        rec, kv_token = calibration.state_sizes(eng)
        assert (rec, kv_token) == (eng.checkpoint_nbytes, eng.kv_bytes_per_token)


# ---------------------------------------------------------------- the rule, positions and restores


def test_shared_prefix_restores_the_boundary_and_a_repeat_restores_the_whole_prompt(make):
    eng, cache, s = make()
    a, b = SYSTEM + TAILS[0], SYSTEM + TAILS[1]
    first = same_as_cold(s, a, [len(SYSTEM)])
    assert first.cached_tokens == 0 and first.snapshots_saved == 3  # the boundary; the prompt end and its logits
    assert {(str(CHECKPOINT), len(SYSTEM)), (str(CHECKPOINT), len(a)), (str(LOGITS), len(a))} <= kinds_at(cache)
    assert same_as_cold(s, b, [len(SYSTEM)]).cached_tokens == len(SYSTEM)
    before = eng.prefilled_tokens
    again = s.run(job(b, [len(SYSTEM)]))
    s.drain()
    assert eng.prefilled_tokens == before  # nothing prefilled: sampled from the stored logits
    assert again.cached_tokens == len(b) and again.restore_source in ("live", "ram")
    same_as_cold(s, b, [len(SYSTEM)])  # the same first-step logits and tokens as the cold run


@pytest.mark.parametrize("max_tokens", [6, 1])
def test_the_prompt_end_is_saved_after_the_first_token_is_delivered(make, max_tokens):
    """The prompt end's checkpoint and logits are no part of the time to first token: stored once the first
    token went to the caller (a reply ending at its first token stores them before the after-generation work)."""
    eng, cache, s = make()
    prompt = SYSTEM + TAILS[0]
    seen, done = [], threading.Event()

    def sink(ev: Event) -> None:
        if not seen:  # the first event a caller gets: the first token, or the whole one-token reply
            seen.append(cache.contains(prompt, CHECKPOINT) or cache.contains(prompt, LOGITS))
        if ev.kind != EventKind.TEXT:
            done.set()

    s.submit(job(prompt, [len(SYSTEM)], max_tokens=max_tokens), sink)
    assert done.wait(30)
    s.drain()
    assert seen == [False]
    assert {(str(CHECKPOINT), len(prompt)), (str(LOGITS), len(prompt))} <= kinds_at(cache)
    assert same_as_cold(s, prompt, [len(SYSTEM)], max_tokens=max_tokens).cached_tokens == len(prompt)


def test_snapshot_positions_are_built_once_filtered_by_min_segment():
    eng = FakeEngine(exact_from=MS)
    eng.calibrate(MS)
    reuse = Reuse(eng, SnapshotCache([RamTier(1 << 20)], state=eng.state), [Slot(0)], checkpoint_interval=10)
    j = job(range(1, 41), boundaries=[3, 5, 12, 30, 38, 99])
    # boundaries 3 (closer than MS to the start), 5, 12, 30, 38 (beyond the last restorable position, 40 - MS =
    # 36); an interval checkpoint at 22 (10 after the boundary 12: the other stretches are shorter than 10); no
    # stop near the end: the prompt end is stored after the final call
    assert reuse.snapshot_positions(j) == [5, 12, 22, 30]
    assert reuse.snapshot_positions(j, start=20) == [30]  # from a restored position: 22 is too close
    cold = job(range(1, 41), [5, 12], use_cache=False)
    assert reuse.snapshot_positions(cold) == []  # a cold run stores nothing: it never stops
    kv = FakeEngine(hybrid=False, exact_from=MS)
    kv.calibrate(MS)
    assert Reuse(kv, SnapshotCache([RamTier(1)], state=kv.state), [Slot(0)]).snapshot_positions(j) == []


def test_a_long_tail_after_the_last_stop_gets_the_repeat_point_a_short_one_does_not():
    eng = FakeEngine(exact_from=MS)
    eng.calibrate(MS)
    reuse = Reuse(eng, SnapshotCache([RamTier(1 << 20)], state=eng.state), [Slot(0)])
    long_tail = 10 + Reuse.REPEAT_TAIL + MS  # the repeat point lies REPEAT_TAIL after the boundary at 10
    assert reuse.snapshot_positions(job(range(1, long_tail + 1), boundaries=[10])) == [10, long_tail - MS]
    short = job(range(1, long_tail), boundaries=[10])  # one token shorter: re-prefilled by a next turn instead
    assert reuse.snapshot_positions(short) == [10]


def test_the_next_turn_diverging_in_the_generation_prompt_restores_the_repeat_point(make):
    """A next turn that re-renders the last few tokens (the generation prompt) cannot restore the prompt end; after
    a long last message it restores the repeat point, min_segment before the end, and equals its cold run."""
    eng, cache, s = make()
    tool_result = [(3 * i) % 59 + 2 for i in range(Reuse.REPEAT_TAIL + 8)]
    prompt = SYSTEM + tool_result + [60, 61]  # [60, 61]: the generation prompt
    same_as_cold(s, prompt, [len(SYSTEM)])
    nxt = SYSTEM + tool_result + [60, 62, 63, 5, 6, 7, 8, 9]  # rendered otherwise from its second token on
    assert same_as_cold(s, nxt, [len(SYSTEM)]).cached_tokens == len(prompt) - MS


def test_interval_checkpoints_keep_min_gap_before_the_next_boundary():
    eng = FakeEngine(exact_from=MS)
    eng.calibrate(MS)
    cache = SnapshotCache([RamTier(1 << 20)], state=eng.state)
    j = job(range(1, 114), boundaries=[4, 49, 75])  # last restorable position 113 - MS = 109
    # interval positions count from each boundary: 14..44, then 59, 69, then 85, 95, 105
    assert Reuse(eng, cache, [Slot(0)], checkpoint_interval=10).snapshot_positions(j) == [
        4, 14, 24, 34, 44, 49, 59, 69, 75, 85, 95, 105]
    # a gap of 6: 44 goes (5 tokens before the boundary 49); 69 stays (exactly 6 before 75); boundaries are not
    # interval checkpoints and stay
    gapped = Reuse(eng, cache, [Slot(0)], checkpoint_interval=10, min_gap=6).snapshot_positions(j)
    assert gapped == [4, 14, 24, 34, 49, 59, 69, 75, 85, 95, 105]


def test_the_gap_is_applied_once_in_reuse_to_the_raw_message_ends_and_to_interval_checkpoints():
    from orchestrator.prompt.boundaries import Boundaries

    eng = FakeEngine(exact_from=MS)
    eng.calibrate(MS)
    cache = SnapshotCache([RamTier(1 << 20)], state=eng.state)
    j = job(range(1, 201), boundaries=Boundaries(tools_end=None, system_end=10, message_ends=(10, 30, 40, 60)))
    # no gap: every message end, interval checkpoints every 25 after 60 (the stretches before are shorter)
    assert Reuse(eng, cache, [Slot(0)], checkpoint_interval=25).snapshot_positions(j) == [
        10, 30, 40, 60, 85, 110, 135, 160, 185]
    # a gap of 15: the message end 30 goes (10 from 40, taken first: from the last end backwards), and so does
    # the interval checkpoint 35 of the stretch 10..40 (5 before 40); 185, 15 before the prompt's end, stays
    gapped = Reuse(eng, cache, [Slot(0)], checkpoint_interval=25, min_gap=15).snapshot_positions(j)
    assert gapped == [10, 40, 60, 85, 110, 135, 160, 185]


def test_one_chunk_end_rule_for_the_engine_and_the_scheduler():
    from orchestrator.chunks import chunk_end, chunk_sizes

    assert chunk_end(0, 100, 32, 512, MS) == 32
    assert chunk_end(0, 34, 32, 512, MS) == 34  # 2 left would be too short: the stretch fits one ubatch
    assert chunk_end(0, 514, 512, 512, MS) == 510  # it does not: stop MS before the target instead
    assert chunk_sizes(515, 512, 8) == [(0, 507), (507, 8)]


def test_a_failing_spare_allocation_drops_the_spares_and_the_worker_serves_on(make, caplog):
    eng, cache, s = make(n_slots=1)
    eng.fill_error = MemoryError("no memory for a spare")
    s.run(job([5] * 20, max_tokens=1))  # wakes the worker; it goes idle after and tries to fill
    assert s.drain(5)
    deadline = time.monotonic() + 5
    while not eng.spares_dropped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.spares_dropped and "spare checkpoint buffers" in caplog.text
    same_as_cold(s, SYSTEM + TAILS[0], [len(SYSTEM)])  # and the next requests are served as before


def test_a_cold_run_prefills_in_plain_chunks_and_a_restore_at_a_boundary_equals_it(make):
    eng, cache, s = make(n_slots=1, prefill_chunk=16, prefill_chunk_alone=16)
    sizes = []
    eng.on_decode = lambda seq, toks, pos: sizes.append(len(toks))
    prompt = SYSTEM + TAILS[0]
    s.run(job(prompt, [len(SYSTEM) - 7], use_cache=False))
    assert sizes[:3] == [16, 16, len(prompt) - 32]  # no stop at the boundary (33): the oracle never splits there
    s.drain()
    sizes.clear()
    same_as_cold(s, prompt, [33])  # stops at 33 and the repeat point, and stores
    assert 17 in sizes  # 16 + 17 = 33: the warm run did stop at the boundary
    warm = same_as_cold(s, SYSTEM[:33] + TAILS[1], [33])
    assert warm.cached_tokens == 33  # restored at 33, then prefilled: equal to the cold run that did not stop


def test_interval_checkpoints_serve_a_divergence_inside_a_long_message(make):
    eng, cache, s = make(checkpoint_interval=32)
    doc = [(11 * i) % 60 + 1 for i in range(150)]
    same_as_cold(s, doc + [9, 9, 9, 9, 9])
    changed = doc[:100] + [62] + doc[101:] + [9, 9, 9, 9, 9]
    assert same_as_cold(s, changed).cached_tokens == 96  # the last interval checkpoint before the change


# ---------------------------------------------------------------- slot choice


def test_slot_choice_prefers_live_kv_then_the_cache_key_then_an_empty_slot_then_the_least_recently_used():
    eng = FakeEngine(n_seq_max=4, exact_from=MS)
    eng.calibrate(MS)
    cache = SnapshotCache([RamTier(64 << 20)], state=eng.state)
    slots = [Slot(i) for i in range(4)]
    reuse = Reuse(eng, cache, slots)
    prompt = SYSTEM + TAILS[0]
    cache.put(prompt[:len(SYSTEM)], CHECKPOINT, b"x")
    slots[2].live, slots[2].last_used = list(prompt[:45]), 5.0  # its KV covers the boundary checkpoint
    slots[1].live, slots[1].last_used, slots[1].key = [1, 2, 3], 1.0, "agent-7"
    slots[3].live, slots[3].last_used = [4, 5, 6], 0.5

    def task(tokens, key="") -> Task:
        return Task(job(tokens, prompt_cache_key=key), lambda ev: None, threading.Event(), 0, 0)

    assert reuse.pick_slot(task(prompt), slots).seq == 2
    assert reuse.pick_slot(task([9, 9, 9, 9, 9, 9], "agent-7"), slots).seq == 1
    assert reuse.pick_slot(task([9, 9, 9, 9, 9, 9]), slots).seq == 0  # empty
    assert reuse.pick_slot(task([9, 9, 9, 9, 9, 9]), slots[1:]).seq == 3  # least recently used
    slots[0].salt = slots[2].salt = "other"  # another tenant's live KV is no reason to pick a slot
    assert reuse.pick_slot(task(prompt), slots[1:]).seq == 3


def test_kv_live_in_another_busy_slot_is_copied_and_the_request_equals_its_cold_run(make):
    eng, cache, s = make(n_slots=2)
    # The second request waits for the first to store the shared boundary, then restores it with the KV that
    # the first request's busy sequence holds, copied as bytes.
    a, b = submit_all(s, eng, [job(SYSTEM + TAILS[0], [len(SYSTEM)], max_tokens=30),
                               job(SYSTEM + TAILS[1], [len(SYSTEM)])])
    assert (a.slot, b.slot) == (0, 1)
    assert (b.cached_tokens, b.restore_source) == (len(SYSTEM), "live")
    s.drain()
    cold = s.run(job(SYSTEM + TAILS[1], [len(SYSTEM)], use_cache=False))
    assert b.completion_tokens == cold.completion_tokens and np.array_equal(b.first_logits, cold.first_logits)


# ---------------------------------------------------------------- waiting for a shared prefix


def test_requests_sharing_a_prefix_wait_for_it_and_report_the_sequential_cached_tokens(make):
    eng, cache, s = make(n_slots=3)
    jobs = [job(SYSTEM + t, [len(SYSTEM)]) for t in TAILS[:3]]
    got = submit_all(s, eng, jobs)
    assert [r.cached_tokens for r in got] == [0, len(SYSTEM), len(SYSTEM)]
    s.drain()
    for j, r in zip(jobs, got):  # and each equals its cold run
        cold = s.run(job(j.prompt_tokens, use_cache=False))
        assert r.completion_tokens == cold.completion_tokens and np.array_equal(r.first_logits, cold.first_logits)


def test_requests_that_share_nothing_or_another_salt_do_not_wait(make):
    eng, cache, s = make(n_slots=3)
    jobs = [job(SYSTEM + TAILS[0], [len(SYSTEM)]), job([62 - t for t in SYSTEM] + TAILS[1], [len(SYSTEM)]),
            job(SYSTEM + TAILS[2], [len(SYSTEM)], cache_salt="tenant-b")]
    got = submit_all(s, eng, jobs)
    assert [r.cached_tokens for r in got] == [0, 0, 0]
    assert len({r.slot for r in got}) == 3  # all three ran side by side


def test_must_wait_looks_at_what_an_earlier_request_is_about_to_store():
    eng = FakeEngine(n_seq_max=2, exact_from=MS)
    eng.calibrate(MS)
    slots = [Slot(0), Slot(1)]
    reuse = Reuse(eng, SnapshotCache([RamTier(64 << 20)], state=eng.state), slots)
    earlier = Task(job(SYSTEM + TAILS[0], [len(SYSTEM)]), lambda ev: None, threading.Event(), 0, 0)
    later = Task(job(SYSTEM + TAILS[1], [len(SYSTEM)]), lambda ev: None, threading.Event(), 1, 0)
    assert reuse.must_wait(later, [earlier])  # queued: its positions are planned by the same builder
    earlier.phase, earlier.reuse.positions, earlier.reuse.store = Phase.PREFILL, [len(SYSTEM), len(SYSTEM) + 6], True
    assert reuse.must_wait(later, [earlier])
    earlier.reuse.store = False  # admitted before a cache flush: it stores nothing, so nothing to wait for
    assert not reuse.must_wait(later, [earlier])
    earlier.reuse.store = True
    earlier.reuse.positions = [len(SYSTEM) + 6]  # the shared boundary is stored already (or was skipped)
    assert not reuse.must_wait(later, [earlier])
    earlier.phase = Phase.DECODE  # nothing more to store on the shared part
    assert not reuse.must_wait(later, [earlier])
    extends = Task(job(SYSTEM + TAILS[0] + [5, 5, 5, 5, 5, 5]), lambda ev: None, threading.Event(), 2, 0)
    assert reuse.must_wait(extends, [earlier])  # it extends the whole prompt: wait for the after-generation state
    assert not reuse.must_wait(later, [Task(job(SYSTEM + TAILS[0], [len(SYSTEM)], use_cache=False),
                                            lambda ev: None, threading.Event(), 0, 0)])  # a cold run stores nothing


# ---------------------------------------------------------------- cancellation in every phase


def test_cancel_while_queued_or_timed_out_in_the_queue(make):
    eng, cache, s = make(n_slots=1)
    cancelled = threading.Event()
    cancelled.set()
    got = submit_all(s, eng, [job(SYSTEM + TAILS[0]), job(SYSTEM + TAILS[1], timeout_s=1e-9),
                              job(SYSTEM + TAILS[2])], [None, None, cancelled])
    assert isinstance(got[1], RequestTimeout) and isinstance(got[2], RequestCancelled)
    s.drain()
    served = SYSTEM + TAILS[0] + got[0].completion_tokens + [eng.eog_id]
    assert all(list(t) == served[:len(t)] for _k, _tier, t in cache.entries())  # nothing of the others


def test_cancel_during_prefill_keeps_its_checkpoints_and_stores_no_end_state(make):
    eng, cache, s = make(n_slots=1, checkpoint_interval=16)
    tokens = [(5 * i) % 60 + 1 for i in range(100)]
    cancel = threading.Event()

    def on_decode(seq, toks, pos):
        if pos >= 48:
            cancel.set()  # the scheduler sees it before the next step

    eng.on_decode = on_decode
    done, box = threading.Event(), []
    s.submit(job(tokens), lambda ev: (box.append(ev), done.set()) if ev.kind != EventKind.TEXT else None, cancel)
    assert done.wait(30) and isinstance(box[0].error, RequestCancelled)
    s.drain()
    eng.on_decode = None
    stored = kinds_at(cache)
    assert stored and all(k == str(CHECKPOINT) for k, _ in stored) and max(n for _, n in stored) < len(tokens)
    deepest = max(n for _, n in stored)
    assert same_as_cold(s, tokens).cached_tokens == deepest


def test_cancel_during_decode_delivers_what_was_generated_and_stores_the_prompts_end(make):
    eng, cache, s = make(n_slots=1)
    tokens = SYSTEM + TAILS[0]
    cancel = threading.Event()
    done, box = threading.Event(), []

    def sink(ev):
        if ev.kind == EventKind.TEXT:
            cancel.set()  # the client goes away after the first piece of text
        else:
            box.append(ev)
            done.set()

    s.submit(job(tokens, [len(SYSTEM)], max_tokens=50), sink, cancel)
    assert done.wait(30) and box[0].kind == EventKind.DONE
    r = box[0].result
    assert 0 < len(r.completion_tokens) < 50
    s.drain()
    assert (str(KV), len(tokens)) in kinds_at(cache)  # where the prompt ends: the generated text was cut
    assert not any(k == str(KV) and n > len(tokens) for k, n in kinds_at(cache))


def test_cancel_while_storing_the_after_generation_state_does_not_stop_it(make):
    eng, cache, s = make(n_slots=1)
    tokens = SYSTEM + TAILS[0]
    cancel = threading.Event()
    done, box = threading.Event(), []

    def sink(ev):
        if ev.kind == EventKind.DONE:
            box.append(ev)
            done.set()

    eng.on_decode = lambda seq, toks, pos: cancel.set() if box else None  # the STORE phase's first chunk
    s.submit(job(tokens, [len(SYSTEM)], max_tokens=30), sink, cancel)
    assert done.wait(30)
    s.drain()
    assert cancel.is_set()
    r = box[0].result
    full = len(tokens) + len(r.completion_tokens) + (r.finish_reason == "stop")
    assert (str(KV), full) in kinds_at(cache) and (str(CHECKPOINT), full) in kinds_at(cache)


# ---------------------------------------------------------------- the after-generation choice


def test_after_generation_the_state_after_the_generated_tokens_is_stored_and_continues_exactly(make):
    eng, cache, s = make()
    prompt = SYSTEM + TAILS[0]
    first = s.run(job(prompt, [len(SYSTEM)], max_tokens=12))
    s.drain()
    generated = first.completion_tokens + ([eng.eog_id] if first.finish_reason == "stop" else [])
    nxt = prompt + generated + [3, 3, 4, 4, 5, 5]
    warm = same_as_cold(s, nxt)
    assert warm.cached_tokens == len(prompt) + len(generated)


@pytest.mark.parametrize("added", [2, MS])
def test_a_next_turn_adding_fewer_than_min_segment_tokens_restores_the_answers_repeat_point(make, monkeypatch, added):
    """Where the probe says the next request adds fewer tokens than min_segment after the answer (a short tool
    result under -fa on's 64), the after-generation re-prefill also stores a checkpoint min_segment before the
    answer's end: that request restores it, not the prompt's end, and equals its cold run. Where it adds enough,
    the answer's end serves it and nothing more is stored."""
    monkeypatch.setattr(Reuse, "REPEAT_TAIL", 8)  # short answers of the fake model suffice
    eng, cache, s = make()
    prompt = SYSTEM + TAILS[0]
    r = s.run(job(prompt, [len(SYSTEM)], max_tokens=16, restorable_after=lambda g: added))
    s.drain()
    generated = r.completion_tokens + ([eng.eog_id] if r.finish_reason == "stop" else [])
    full = len(prompt) + len(generated)
    assert full - MS - len(prompt) >= Reuse.REPEAT_TAIL  # the answer is long enough for a repeat point
    checkpoints = {n for k, n in kinds_at(cache) if k == str(CHECKPOINT)}
    assert (full - MS in checkpoints) == (added < MS) and full in checkpoints
    assert s.reuse.after_stats.answer_repeat == (added < MS)
    nxt = prompt + generated + [3, 4, 5, 6][:added]
    warm = same_as_cold(s, nxt)
    assert warm.cached_tokens == (full - MS if added < MS else full)


def test_after_generation_a_stop_string_stores_the_prompts_end(make):
    eng, cache, s = make()
    prompt = SYSTEM + TAILS[0]
    probe = s.run(job(prompt, max_tokens=6, use_cache=False))
    stop = probe.text.split()[1]  # the second generated piece: the stream stops there
    r = s.run(job(prompt, [len(SYSTEM)], max_tokens=6, stop=(stop,)))
    assert r.finish_reason == "stop"
    s.drain()
    assert {n for k, n in kinds_at(cache) if k == str(KV)} == {len(prompt)}


def test_after_generation_too_few_tokens_for_an_exact_prefill_store_the_prompts_end_on_a_kv_model(make):
    eng, cache, s = make(hybrid=False)
    prompt = SYSTEM + TAILS[0]
    s.run(job(prompt, max_tokens=1))  # one generated token: shorter than min_segment beyond the prompt
    s.drain()
    assert kinds_at(cache) == {(str(KV), len(prompt)), (str(LOGITS), len(prompt))}


def test_after_generation_of_an_identical_repeat_nothing_more_is_stored(make):
    eng, cache, s = make()
    prompt = SYSTEM + TAILS[0]
    r = s.run(job(prompt, max_tokens=8))
    s.drain()
    full = len(prompt) + len(r.completion_tokens) + (r.finish_reason == "stop")
    assert {n for k, n in kinds_at(cache) if k == str(KV)} == {full}
    stored = kinds_at(cache)
    again = s.run(job(prompt, max_tokens=8))
    assert again.completion_tokens == r.completion_tokens and again.cached_tokens == len(prompt)
    s.drain()  # the state after these tokens is stored already, and its KV covers the prompt's end
    assert kinds_at(cache) == stored


def test_after_generation_is_skipped_where_the_next_request_would_not_restore_it(make):
    eng, cache, s = make()
    prompt = SYSTEM + TAILS[0]
    seen = []

    def never(generated):
        seen.append(list(generated))
        return None

    r = s.run(job(prompt, [len(SYSTEM)], max_tokens=12, restorable_after=never))
    s.drain()
    assert seen == [r.completion_tokens + ([eng.eog_id] if r.finish_reason == "stop" else [])]
    # the prompt's KV, saved without any re-prefill
    assert {n for k, n in kinds_at(cache) if k == str(KV)} == {len(prompt)}
    st_ = s.reuse.after_stats
    assert (st_.unrestorable, st_.answer, st_.prompt_end, st_.tokens) == (1, 0, 0, 0)
    r2 = s.run(job(SYSTEM + TAILS[1], [len(SYSTEM)], max_tokens=12, restorable_after=lambda g: MS))
    s.drain()
    full = len(SYSTEM + TAILS[1]) + len(r2.completion_tokens) + (r2.finish_reason == "stop")
    assert (str(KV), full) in kinds_at(cache) and s.reuse.after_stats.answer == 1
    # the saved KV and the prompt end's checkpoint serve the prompt's extensions, exactly
    assert same_as_cold(s, prompt + [3, 3, 4, 4], [len(SYSTEM)]).cached_tokens == len(prompt)


def test_a_request_alone_prefills_in_larger_chunks_and_shares_the_cores_in_small_ones(make):
    eng, cache, s = make(n_slots=2, prefill_chunk=8, prefill_chunk_alone=64)
    sizes = []
    eng.on_decode = lambda seq, toks, pos: sizes.append((seq, len(toks)))
    long_ = [11 + (i % 40) for i in range(300)]
    r = s.run(job(long_, max_tokens=2))
    assert max(n for _, n in sizes) == 64  # alone: n_batch-sized chunks
    s.drain()
    sizes.clear()
    submit_all(s, eng, [job([7] + long_[:100], max_tokens=40, use_cache=False),
                        job([8] + long_, max_tokens=2, use_cache=False)])
    first = sizes[0][0]
    assert [n for seq, n in sizes[:2]] == [64, 37] and {seq for seq, _ in sizes[:2]} == {first}
    # two prefilling together, nothing decoding: the shorter one first, in large chunks (the other waits anyway);
    # then while it decodes, the other's chunks are small
    assert max(n for seq, n in sizes[2:12] if seq != first) == 8
    cold = s.run(job(long_, max_tokens=2, use_cache=False))
    assert r.completion_tokens == cold.completion_tokens and np.array_equal(r.first_logits, cold.first_logits)


def _prefill_chunks(eng: FakeEngine, per_token_s: float = 20e-6) -> list[tuple[int, int]]:
    """(seq, tokens) of every prefill call from now on (decode steps of one token left out), each taking
    `per_token_s` a token: a measurable prefill speed, as on a model."""
    calls: list[tuple[int, int]] = []

    def on_decode(seq, toks, pos):
        if len(toks) > 1:
            calls.append((seq, len(toks)))
            time.sleep(per_token_s * len(toks))
    eng.on_decode = on_decode
    return calls


def test_prompts_arriving_together_prefill_shortest_first_and_each_equals_its_cold_run(make):
    eng, cache, s = make(n_slots=3, prefill_chunk=8)
    calls = _prefill_chunks(eng)
    s.run(job([5] * 40, max_tokens=1, use_cache=False))  # the prefill speed is measured from here on
    s.drain()
    calls.clear()
    long_, mid, short = ([11 + (i % 40) for i in range(n)] for n in (300, 120, 24))
    out = submit_all(s, eng, [job(long_, max_tokens=2), job([9] + mid, max_tokens=2), job([8] + short, max_tokens=2)])
    seqs = [seq for seq, _ in calls]
    first = {seq: seqs.index(seq) for seq in set(seqs)}
    last = {seq: len(seqs) - 1 - seqs[::-1].index(seq) for seq in set(seqs)}
    by_len = sorted(first, key=lambda seq: sum(n for q, n in calls if q == seq))  # short, mid, long
    # each prompt's prefill is done before a longer one's resumes: the short one waits for no chunk of the others
    assert last[by_len[0]] < first[by_len[1]] and last[by_len[1]] < last[by_len[2]]
    assert first[by_len[2]] == 0 or last[by_len[0]] < first[by_len[2]]
    for r, toks in zip(out, (long_, [9] + mid, [8] + short)):
        cold = s.run(job(toks, max_tokens=2, use_cache=False))
        assert r.completion_tokens == cold.completion_tokens and np.array_equal(r.first_logits, cold.first_logits)


def test_a_long_prompt_is_not_passed_over_for_ever_by_later_short_ones(make):
    eng, cache, s = make(n_slots=2, prefill_chunk=8)
    _prefill_chunks(eng)
    s.run(job([5] * 40, max_tokens=1, use_cache=False))
    s.drain()
    rate = s.reuse.prefill.tokens_per_s
    long_task = Task(job([11 + (i % 40) for i in range(400)]), lambda ev: None, threading.Event(), 0, 0)
    short_task = Task(job([3] * 16), lambda ev: None, threading.Event(), 1, 0)
    assert s._fill_order(short_task) < s._fill_order(long_task)  # arriving together: the short one first
    # the long one has waited as long as its 400 tokens take at the measured speed: it goes before a new arrival
    long_task.clock.submitted -= 400 / rate
    assert s._fill_order(long_task) < s._fill_order(short_task)


def _phases(s: Scheduler) -> dict[int, Phase]:
    return {sl.seq: sl.task.phase for sl in s.slots if sl.task is not None}


def test_after_generation_work_runs_only_while_no_request_prefills_or_decodes(make):
    eng, cache, s = make(n_slots=2)
    log = []  # (phase of the decoding slot, phases of the others) at every prefill chunk
    eng.on_decode = lambda seq, toks, pos: log.append((_phases(s).get(seq), {
        q: ph for q, ph in _phases(s).items() if q != seq})) if len(toks) > 1 else None
    short = job(SYSTEM + TAILS[0], [len(SYSTEM)], max_tokens=20)
    long_ = job([33] + SYSTEM + TAILS[1], max_tokens=200)
    a, b = submit_all(s, eng, [short, long_])
    s.drain()
    stores = [others for phase, others in log if phase == Phase.STORE]
    assert stores, "the after-generation state was re-prefilled"
    assert all(ph not in (Phase.PREFILL, Phase.DECODE) for others in stores for ph in others.values())
    full = len(short.prompt_tokens) + len(a.completion_tokens) + (a.finish_reason == "stop")
    assert (str(KV), full) in kinds_at(cache)  # deferred, not lost


def _store_chunk_hook(s: Scheduler, then):
    """An on_decode hook that calls then() once, at the first prefill chunk of an after-generation re-prefill."""
    fired = []

    def hook(seq, toks, pos):
        if not fired and _phases(s).get(seq) == Phase.STORE and len(toks) > 1:
            fired.append(pos)
            then()
    return hook, fired


def test_a_request_arriving_during_after_generation_work_preempts_it_at_the_chunk_boundary(make):
    eng, cache, s = make(n_slots=1, prefill_chunk=8)
    prompt = SYSTEM + TAILS[0]
    other = [44, 45] + SYSTEM[5:30] + TAILS[2]
    got = []
    chunks_after = []
    hook, fired = _store_chunk_hook(s, lambda: got.append(s.submit(job(other, max_tokens=4), lambda ev: None)))
    first = job(prompt, [len(SYSTEM)], max_tokens=60)
    eng.on_decode = lambda seq, toks, pos: (hook(seq, toks, pos), fired and s.slots[seq].task.job is first
                                            and chunks_after.append(pos))
    a = s.run(first)
    assert len(a.completion_tokens) > 2 * 8, "enough generated tokens for several re-prefill chunks"
    s.drain()
    assert fired and chunks_after == fired  # the chunk in flight finished; no other after-generation chunk ran
    assert s.reuse.after_stats.preempted == 1
    # what the dropped work computed is kept as KV (so the prompt's checkpoints stay restorable), nothing beyond
    assert max(n for k, n in kinds_at(cache) if k == str(KV)) == fired[0] + 8
    eng.on_decode = None
    same_as_cold(s, other, max_tokens=4)


def test_a_request_that_extends_the_answer_takes_the_after_generation_work_over(make):
    eng, cache, s = make(n_slots=1, prefill_chunk=8)
    prompt = SYSTEM + TAILS[0]
    box, done = [], threading.Event()

    def sink(ev):
        if ev.kind == EventKind.DONE:
            box.append(ev.result)
        elif ev.kind == EventKind.ERROR:
            box.append(ev.error)
        if ev.kind != EventKind.TEXT:
            done.set()

    nxt = []

    def submit_next():
        r = box[0]
        nxt.append(prompt + r.completion_tokens + ([eng.eog_id] if r.finish_reason == "stop" else [])
                   + [3, 3, 4, 4, 5, 5, 6, 6])
        done.clear()
        s.submit(job(nxt[0], max_tokens=6), sink)

    hook, fired = _store_chunk_hook(s, submit_next)
    eng.on_decode = hook
    s.submit(job(prompt, [len(SYSTEM)], max_tokens=60), sink)
    assert done.wait(30)
    assert done.wait(30) and len(box) == 2
    a, b = box
    assert len(a.completion_tokens) > 2 * 8
    s.drain()
    eng.on_decode = None
    assert fired[0] == len(prompt)  # the re-prefill started from the prompt's end ...
    assert (b.cached_tokens, b.restore_source) == (fired[0] + 8, "live")  # ... and was taken over one chunk on
    assert s.reuse.after_stats.taken_over == 1 and s.reuse.after_stats.preempted == 0
    cold = s.run(job(nxt[0], max_tokens=6, use_cache=False))
    assert b.completion_tokens == cold.completion_tokens and np.array_equal(b.first_logits, cold.first_logits)


# ---------------------------------------------------------------- other models and faults


def test_a_kv_only_model_restores_any_shared_prefix_without_checkpoints(make):
    eng, cache, s = make(hybrid=False)
    a = SYSTEM + TAILS[0]
    b = SYSTEM[:33] + [62] + SYSTEM[34:] + TAILS[1]  # diverges mid-message, at no boundary
    same_as_cold(s, a)
    assert same_as_cold(s, b).cached_tokens == 33
    assert {k for k, _ in kinds_at(cache)} == {str(KV), str(LOGITS)}  # no checkpoints
    assert same_as_cold(s, b).cached_tokens == len(b)  # a repeat: restored whole, with its logits


def test_a_flush_forgets_the_slots_live_kv_too(make):
    eng, cache, s = make(hybrid=False, n_slots=1)
    a = SYSTEM + TAILS[0]
    same_as_cold(s, a)
    cache.clear()  # the stored entries only: a KV-only model still restores from the slot's live KV
    assert s.run(job(a)).cached_tokens == len(a) - MS
    s.drain()
    assert s.flush() > 0
    assert eng.pos_max(0) == -1 and s.slots[0].live == [] and len(cache.entries()) == 0
    again = same_as_cold(s, a)
    assert (again.cached_tokens, again.restore_source) == (0, "none")


def test_a_flush_drops_an_after_generation_re_prefill_and_its_sequence(make):
    eng, cache, s = make(n_slots=1)
    prompt = SYSTEM + TAILS[0]
    done = threading.Event()

    def sink(ev: Event) -> None:
        if ev.kind == EventKind.DONE:
            eng.pause()  # the worker stops at the re-prefill's first chunk (STORE)
            done.set()

    s.submit(job(prompt, [len(SYSTEM)], max_tokens=40), sink)
    assert done.wait(30)
    flushed = concurrent.futures.ThreadPoolExecutor(1).submit(s.flush)
    eng.resume()  # that chunk ends; the worker flushes before the next one
    assert flushed.result(30) > 0
    s.drain()
    assert s.slots[0].task is None and eng.pos_max(0) == -1
    assert cache.entries() == []  # the answer's state never stored, nor anything after the flush
    again = same_as_cold(s, prompt, [len(SYSTEM)], max_tokens=40)
    assert again.cached_tokens == 0


def test_a_request_in_flight_across_a_flush_goes_on_but_stores_and_lends_nothing(make):
    eng, cache, s = make(hybrid=False, n_slots=2)
    a = SYSTEM + TAILS[0]
    same_as_cold(s, a)
    started, results = threading.Event(), {}

    def sink_for(name):
        def sink(ev: Event) -> None:
            if ev.kind == EventKind.TEXT and name == "first" and not started.is_set():
                eng.pause()  # decoding: the worker stops at its next step
                started.set()
            elif ev.kind == EventKind.DONE:
                results[name] = ev.result
        return sink

    s.submit(job(a, max_tokens=20), sink_for("first"))  # restores its prefix (live KV or the stored entry)
    assert started.wait(30)
    busy = next(sl for sl in s.slots if sl.task is not None)
    flushed = concurrent.futures.ThreadPoolExecutor(1).submit(s.flush)
    while not s.reuse.flushes:  # queued before the worker goes on: it flushes, then admits the second request
        time.sleep(0.001)
    s.submit(job(a), sink_for("second"))
    eng.resume()
    assert flushed.result(30) > 0
    assert s.drain(30)
    assert results["second"].cached_tokens == 0  # the busy slot's live KV, from before the flush, is not lent
    assert busy.live == [] and not busy.stale and eng.pos_max(busy.seq) == -1  # cleared when its task left
    first = len(a) + len(results["first"].completion_tokens)
    assert all(n < first for k, n in kinds_at(cache) if k == str(KV))  # nothing of the first one's answer stored
    cold = s.run(job(a, max_tokens=20, use_cache=False))
    assert results["first"].completion_tokens == cold.completion_tokens  # it went on as its cold run


def test_a_restore_llama_cpp_refuses_drops_the_entries_and_the_request_continues_as_a_miss(make, caplog):
    eng, cache, s = make(n_slots=1)
    same_as_cold(s, SYSTEM + TAILS[0], [len(SYSTEM)])
    eng.fail_loads = True
    s.run(job([1, 2, 3, 4, 5, 6, 7, 8]))  # another prompt in the slot: its live KV is no help
    s.drain()
    dropped = cache.stats().dropped
    miss = s.run(job(SYSTEM + TAILS[1], [len(SYSTEM)]))
    assert (miss.cached_tokens, miss.restore_source) == (0, "none")
    assert cache.stats().dropped > dropped
    assert any("refused a snapshot restore" in r.getMessage() for r in caplog.records)
    eng.fail_loads = False
    s.drain()
    cache.check()
    cold = s.run(job(SYSTEM + TAILS[1], use_cache=False))
    assert miss.completion_tokens == cold.completion_tokens and np.array_equal(miss.first_logits, cold.first_logits)


def test_slots_decode_together_only_at_the_widths_measured_exact(make):
    """Where batching is exact at some widths only (ARM i8mm: odd ones), four generating slots decode as three
    together and one alone, and every answer equals the one decoded alone."""
    eng, cache, s = make(n_slots=4, hw_invariant=(3,), batch_decode=False)
    assert calibration.exact_batch_widths(eng) == (3,)
    s.batch_widths = (3,)
    jobs = [job([40 + i] + SYSTEM[i:] + TAILS[i % len(TAILS)], max_tokens=10, use_cache=False) for i in range(4)]
    eng.step_widths.clear()
    together = submit_all(s, eng, jobs)
    assert 3 in eng.step_widths and not {2, 4} & set(eng.step_widths)
    assert all(r.completion_tokens == s.run(j).completion_tokens for j, r in zip(jobs, together))


@pytest.mark.parametrize("hw_invariant,batch_decode", [(True, True), (False, False), (False, True)])
def test_batched_decoding_equals_decoding_alone_only_where_calibration_says_so(make, hw_invariant, batch_decode):
    eng, cache, s = make(n_slots=3, hw_invariant=hw_invariant, batch_decode=batch_decode)
    assert calibration.check_batch_invariance(eng) is hw_invariant
    jobs = [job([40 + i] + SYSTEM[i:] + TAILS[i], max_tokens=10, use_cache=False) for i in range(3)]
    together = submit_all(s, eng, jobs)
    same = [r.completion_tokens == s.run(j).completion_tokens for j, r in zip(jobs, together)]
    assert all(same) is (hw_invariant or not batch_decode)  # --decode-batching on, where it is not exact


# ---------------------------------------------------------------- random traffic against cold runs

prompts = st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=30), min_size=1, max_size=6)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts, st.data())
def test_random_traffic_equals_cold_runs_and_never_over_reports(make, parts, data):
    """Requests built from shared pieces (many common prefixes), some concurrent, some extending earlier prompts
    and outputs: every output equals its cold run, and cached_tokens never exceeds what an earlier request shared.
    """
    eng, cache, s = make(n_slots=data.draw(st.integers(1, 3)), hybrid=data.draw(st.booleans()),
                         ram=data.draw(st.sampled_from([2_000_000, 64 << 20])))
    earlier: list[list[int]] = []
    for _round in range(3):
        batch = []
        for _ in range(data.draw(st.integers(1, 3))):
            tokens = [t for p in data.draw(st.lists(st.sampled_from(parts), min_size=1, max_size=4)) for t in p]
            if earlier and data.draw(st.booleans()):
                tokens = data.draw(st.sampled_from(earlier)) + tokens
            bounds = sorted({len(p) for p in parts if len(p) < len(tokens)})
            batch.append(job(tokens + [9], bounds, max_tokens=data.draw(st.integers(1, 6))))
        got = submit_all(s, eng, batch)
        s.drain()
        for j, r in zip(batch, got):
            cold = s.run(job(j.prompt_tokens, max_tokens=j.max_tokens, use_cache=False))
            assert r.completion_tokens == cold.completion_tokens
            assert np.array_equal(r.first_logits, cold.first_logits)
            bound = max([common_len(j.prompt_tokens, e) for e in earlier] + [0])
            peers = [b.prompt_tokens for b in batch if b is not j]
            bound = max([bound] + [common_len(j.prompt_tokens, p) for p in peers])
            n = len(j.prompt_tokens)  # at most n - MS restored, or the whole of a prompt seen before
            assert r.cached_tokens <= bound and (r.cached_tokens <= max(n - MS, 0) or r.cached_tokens == n)
        earlier += [j.prompt_tokens + r.completion_tokens + ([eng.eog_id] if r.finish_reason == "stop" else [])
                    for j, r in zip(batch, got)]
        cache.check()


# ---------------------------------------------------------------- n > 1 choices from one prefill (issue 13, item 6)


def hot(tokens, boundaries=(), max_tokens=8, seed=11, **kw) -> Job:
    """A sampled (temperature 1) job: different seeds give different tokens on the fake engine."""
    return Job(list(tokens), boundaries, max_tokens=max_tokens, want_logits=True,
               sampling=SamplingParams(temperature=1.0, seed=seed), **kw)


def assert_each_is_its_cold_run(s: Scheduler, j: Job, results) -> None:
    assert [r.index for r in results] == list(range(j.n))
    for i, r in enumerate(results):
        cold = s.run(dataclasses.replace(j.choice(i), use_cache=False))
        assert cold.cached_tokens == 0 and j.choice(i).sampling.seed == j.sampling.seed + i
        assert r.completion_tokens == cold.completion_tokens, f"choice {i}"
        assert np.array_equal(r.first_logits, cold.first_logits)
        assert r.logprobs == cold.logprobs
        assert r.prompt_tokens == len(j.prompt_tokens)
    assert len({tuple(r.completion_tokens) for r in results}) > 1, "each choice samples with its own seed"


@pytest.mark.parametrize("hybrid,batch_decode", [(True, False), (True, True), (False, False)])
def test_n_choices_prefill_once_and_each_equals_the_cold_run_of_its_seed(make, hybrid, batch_decode):
    eng, cache, s = make(n_slots=3, hybrid=hybrid, batch_decode=batch_decode)
    tokens = SYSTEM + TAILS[0]
    j = hot(tokens, [len(SYSTEM)], n=3, logprobs=2, max_tokens=12, use_cache=False)
    before = eng.prefilled_tokens
    rs = s.run_choices(j)
    assert eng.prefilled_tokens - before == len(tokens)  # the prompt is computed once for the three choices
    assert len({r.slot for r in rs}) == 3
    assert all(len(r.logprobs) == len(r.completion_tokens) for r in rs)
    assert_each_is_its_cold_run(s, j, rs)


def test_n_choices_restore_once_and_only_choice_0_stores_after_generation(make):
    eng, cache, s = make(n_slots=3)
    tokens = SYSTEM + TAILS[1]
    s.run(hot(tokens, [len(SYSTEM)], seed=99))
    assert s.drain(30)
    j = hot(tokens, [len(SYSTEM)], n=3, seed=5, max_tokens=10)
    rs = s.run_choices(j)
    assert s.drain(30)
    assert all(r.cached_tokens == len(tokens) and r.restore_source == rs[0].restore_source for r in rs)
    ends = [tokens + r.completion_tokens + ([eng.eog_id] if r.finish_reason == "stop" else []) for r in rs]
    assert cache.contains(ends[0], KV)
    assert not any(cache.contains(e, KV) for e in ends[1:] if e != ends[0])
    assert_each_is_its_cold_run(s, j, rs)


def test_more_choices_than_slots_are_refused_at_submission(make):
    eng, cache, s = make(n_slots=2)
    for n in (3, 0):
        with pytest.raises(InvalidRequest) as e:
            s.submit(hot(SYSTEM, n=n), lambda ev: None)
        assert e.value.param == "n" and "--parallel 2" in str(e.value)
    assert s.queue_length == 0


def test_an_n_choice_job_waits_for_n_slots_preempts_storing_ones_and_is_not_overtaken(make):
    eng, cache, s = make(n_slots=2)
    a, b, c = SYSTEM[:24], [30 + i % 7 for i in range(24)], [9 + i % 5 for i in range(24)]
    started = []  # prompts in the order their prefill started
    eng.on_decode = lambda seq, toks, pos: started.append(tuple(toks[:8])) if pos == 0 else None
    jobs = [job(a, max_tokens=30), hot(b, n=2, seed=3, max_tokens=8), job(c, max_tokens=4)]
    boxes = [Collector(j.n) for j in jobs]
    eng.pause()
    for j, box in zip(jobs, boxes):
        s.submit(j, box)
    eng.resume()
    results = [box.wait() for box in boxes]
    assert s.drain(30)
    eng.on_decode = None
    # b needed both slots: c, arriving after it, did not take the free one while a ran
    assert started == [tuple(a[:8]), tuple(b[:8]), tuple(c[:8])]
    assert s.reuse.after_stats.preempted >= 1  # a's after-generation work made room for b's second choice
    assert_each_is_its_cold_run(s, jobs[1], results[1])


def test_cancelling_an_n_choice_job_during_prefill_cancels_every_choice(make):
    eng, cache, s = make(n_slots=3, checkpoint_interval=16)
    tokens = [(5 * i) % 60 + 1 for i in range(100)]
    cancel = threading.Event()
    eng.on_decode = lambda seq, toks, pos: cancel.set() if pos >= 48 else None
    box = Collector(3)
    s.submit(hot(tokens, n=3), box, cancel)
    with pytest.raises(RequestCancelled):
        box.wait()
    assert s.drain(30)
    eng.on_decode = None
    assert sorted(box.ends) == [0, 1, 2]
    assert all(isinstance(ev.error, RequestCancelled) for ev in box.ends.values())
    assert s.slots_busy == 0
    same_as_cold(s, tokens)


def test_cancelling_an_n_choice_job_during_decode_delivers_what_each_choice_generated(make):
    eng, cache, s = make(n_slots=3)
    cancel = threading.Event()
    ends = {}

    def sink(ev):
        if ev.kind == EventKind.TEXT:
            cancel.set()  # the client goes away after the first piece of text
        else:
            ends[ev.index] = ev

    s.submit(hot(SYSTEM + TAILS[2], n=3, max_tokens=50), sink, cancel)
    assert s.drain(30)
    assert sorted(ends) == [0, 1, 2]
    assert all(ev.kind == EventKind.DONE and len(ev.result.completion_tokens) < 50 for ev in ends.values())


def test_a_failure_of_choice_0_before_the_copy_fails_the_waiting_choices(make):
    eng, cache, s = make(n_slots=3)
    tokens = SYSTEM + TAILS[3]

    def boom(seq, toks, pos):
        if pos >= 16:
            raise EngineError("llama_decode failed")

    eng.on_decode = boom
    box = Collector(3)
    s.submit(hot(tokens, n=3), box)
    with pytest.raises(EngineError):
        box.wait()
    assert s.drain(30)
    eng.on_decode = None
    assert sorted(box.ends) == [0, 1, 2] and all(ev.kind == EventKind.ERROR for ev in box.ends.values())
    assert s.slots_busy == 0
    same_as_cold(s, tokens)


def test_a_state_copy_llama_cpp_refuses_fails_that_choice_only(make):
    eng, cache, s = make(n_slots=2)
    j = hot(SYSTEM + TAILS[0], n=2, use_cache=False)
    eng.fail_loads = True
    box = Collector(2)
    s.submit(j, box)
    assert s.drain(30)
    eng.fail_loads = False
    assert box.ends[1].kind == EventKind.ERROR and isinstance(box.ends[1].error, EngineError)
    cold = s.run(dataclasses.replace(j.choice(0), use_cache=False))
    assert box.ends[0].result.completion_tokens == cold.completion_tokens


# ---------------------------------------------------------------- tenants: a fair queue


def test_a_burst_from_one_tenant_cannot_push_another_out_of_a_full_queue(make):
    """queue_size 3, one slot: tenant A fills the slot and the queue; B's request still gets in (A's newest is
    pushed out with QueueFull, 429) and is served before A's other queued requests; a second A arrival is
    refused, since A already holds more of the queue than B."""
    eng, _, s = make(n_slots=1, queue_size=3)
    order: list[str] = []
    results: dict[str, object] = {}
    done = threading.Event()

    def sink_for(name):
        def sink(ev: Event) -> None:
            if ev.kind == EventKind.TEXT:
                return
            if ev.kind == EventKind.DONE:
                order.append(name)
            results[name] = ev.result if ev.kind == EventKind.DONE else ev.error
            if len(results) == 5:
                done.set()
        return sink

    eng.pause()
    for k in range(4):  # a0 takes the slot at the worker's next step, a1..a3 wait
        s.submit(job(TAILS[0] + [k], tenant="A"), sink_for(f"a{k}"))
    s.submit(job(TAILS[1], tenant="B"), sink_for("b"))  # full: a3, the newest of the heaviest tenant, leaves
    with pytest.raises(QueueFull):
        s.submit(job(TAILS[0] + [9], tenant="A"), sink_for("a9"))
    eng.resume()
    assert done.wait(30)
    assert isinstance(results["a3"], QueueFull)
    assert "b" in order and order.index("b") <= 1, order  # a0 may be running already; b goes before a1, a2
    assert set(order) == {"a0", "a1", "a2", "b"}


def test_without_tenants_a_full_queue_refuses_the_arrival_as_before(make):
    eng, _, s = make(n_slots=1, queue_size=2)
    eng.pause()
    try:
        for k in range(3):
            s.submit(job(TAILS[0] + [k]), Collector(1))
        with pytest.raises(QueueFull):
            s.submit(job(TAILS[0] + [7]), Collector(1))
    finally:
        eng.resume()
    s.drain()


def test_queued_tenants_are_offered_slots_round_robin(make):
    """Five of A's requests then two of B's, queued together on two slots: B's first request is among the
    first two admitted, and B's second before A's last two."""
    eng, _, s = make(n_slots=2, queue_size=16)
    starts: list[str] = []
    lock = threading.Lock()

    def sink_for(name):
        def sink(ev: Event) -> None:
            assert ev.kind != EventKind.ERROR, ev.error
            if ev.kind == EventKind.TEXT and name not in starts:
                with lock:
                    starts.append(name)
        return sink

    names = [f"a{k}" for k in range(5)] + ["b0", "b1"]
    eng.pause()
    for name in names:
        s.submit(job(TAILS[2] + [len(starts) + names.index(name) + 1], max_tokens=3, tenant=name[0]), sink_for(name))
    eng.resume()
    assert s.drain(30)
    assert sorted(starts) == sorted(names)
    assert starts.index("b0") < 2, starts
    assert starts.index("b1") < starts.index("a3"), starts
