"""The last stop of a prompt taken back from its final prefill call (llama.cpp's per-token recurrent snapshots,
n_rs_seq: Engine.checkpoint_back) instead of a llama_decode call of its own, and calibration turning that off
where it is not bit-identical (issue 30)."""

from __future__ import annotations

import pytest

from orchestrator import calibration
from orchestrator.engine import Engine
from orchestrator.request import Job

from .conftest import assert_same_as_cold

MESSAGES = [{"role": "system", "content": "You are a terse assistant for a build system."},
            {"role": "user", "content": "Which targets depend on the code generator?"}]


def spy(rt, monkeypatch) -> tuple[list[tuple[int, int]], list[int]]:
    """(prefill calls as (start, end) positions, positions taken back) of the runtime's engine from now on."""
    calls, backs = [], []
    decode, back = rt.engine.decode, rt.engine.checkpoint_back

    def decode_spy(seq, tokens, pos, *args, **kwargs):
        calls.append((pos, pos + len(tokens)))
        return decode(seq, tokens, pos, *args, **kwargs)

    def back_spy(seq, pos):
        backs.append(pos)
        return back(seq, pos)

    monkeypatch.setattr(rt.engine, "decode", decode_spy)
    monkeypatch.setattr(rt.engine, "checkpoint_back", back_spy)
    return calls, backs


# The next turn: the template renders the answered generation prompt otherwise, so the prompt diverges after
# the user message's end, the first prompt's last stop (its prompt end is no prefix)
NEXT = MESSAGES + [{"role": "assistant", "content": "The parser and the docs."},
                   {"role": "user", "content": "And which are slow?"}]


def last_stop(turn, rt) -> int:
    """The last snapshot position of a turn's prompt (its last message end here)."""
    return rt.scheduler.reuse.snapshot_positions(
        Job(turn.tokens, turn.boundaries, use_cache=True))[-1]


def test_the_last_stop_is_taken_back_not_a_stop_and_equals_cold(start, monkeypatch):
    rt = start(rs_snapshots=8)
    assert rt.engine.n_rs_seq == 8 and rt.engine.rollback  # checked bit-identical at start on this CPU
    calls, backs = spy(rt, monkeypatch)
    first = assert_same_as_cold(rt, MESSAGES)
    n, p = len(first.tokens), last_stop(first, rt)
    assert n < 256 and n - p <= 8  # one call for the whole prompt (n_batch 256): a call ending at p is a stop
    assert backs == [p]
    assert all(end != p for _, end in calls)
    # the next turn restores the taken-back checkpoint, equal to cold
    nxt = assert_same_as_cold(rt, NEXT)
    assert nxt.tokens[:p] == first.tokens[:p] and nxt.tokens[:n] != first.tokens
    assert nxt.result.cached_tokens == p


def test_without_snapshots_the_last_stop_is_a_stop(start, monkeypatch):
    rt = start(rs_snapshots=0)
    assert rt.engine.n_rs_seq == 0 and not rt.engine.rollback
    calls, backs = spy(rt, monkeypatch)
    first = assert_same_as_cold(rt, MESSAGES)
    assert backs == [] and any(end == last_stop(first, rt) for _, end in calls)


def test_calibration_turns_rollback_off_where_not_bit_identical(start, monkeypatch):
    real = Engine.checkpoint_back

    def one_early(self, seq, pos):  # a snapshot one token off: not what a prefill stopped at pos saved
        return real(self, seq, pos - 1)

    monkeypatch.setattr(Engine, "checkpoint_back", one_early)
    rt = start(rs_snapshots=8)
    assert rt.engine.n_rs_seq == 8 and not rt.engine.rollback
    calls, backs = spy(rt, monkeypatch)
    first = assert_same_as_cold(rt, MESSAGES)
    assert backs == [] and any(end == last_stop(first, rt) for _, end in calls)


@pytest.fixture(scope="module")
def engine(tiny_model):
    e = Engine(tiny_model, n_ctx=256, n_batch=64, n_threads=2, n_seq_max=2, n_rs_seq=4)
    e.calibrate(2)
    yield e
    e.close()


def test_checkpoint_back_bounds_and_bytes(engine):
    """Only positions inside the sequence's last prefill call and within n_rs_seq of its end: llama.cpp itself
    rolls back silently to a stale snapshot beyond (a call writes the states of its own last tokens only, a
    decode step its newest only)."""
    tokens = [1000 + 7 * i for i in range(20)]
    engine.clear(1)
    engine.decode(1, tokens[:17], 0, want_logits=False)
    stopped = engine.save_state(1, partial=True)
    engine.clear(1)
    engine.decode(1, tokens[:14], 0, want_logits=False)
    engine.decode(1, tokens[14:], 14, want_logits=False)  # the last call: positions 14..19
    assert [p for p in range(12, 21) if engine.can_roll_back(1, p)] == [16, 17, 18, 19]
    full = engine.save_state(1)
    assert engine.checkpoint_back(1, 17) == stopped
    assert engine.save_state(1) == full  # left at the call's end
    assert not engine.can_roll_back(1, 18)  # one take-back per call
    with pytest.raises(ValueError):
        engine.checkpoint_back(1, 18)
    engine.decode(1, tokens[:4], 20, want_logits=False)
    engine.decode_step([(1, tokens[0], 24)])
    assert not engine.can_roll_back(1, 24)
    engine.clear(1)


def test_check_rollback_passes_here_and_fails_on_a_wrong_snapshot(engine, monkeypatch):
    assert calibration.check_rollback(engine) and calibration.check_rollback(engine, 0)
    real = Engine.checkpoint_back
    monkeypatch.setattr(Engine, "checkpoint_back", lambda self, seq, pos: real(self, seq, pos - 1))
    assert not calibration.check_rollback(engine)
