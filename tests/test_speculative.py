"""Speculative decoding (orchestrator/speculative/): drafts, draft length, and the scheduler's verification step,
on the fake engine (tests/fake_engine.py), where a verification marks its tokens like one-token steps only at the
widths its "hardware" makes exact, so any output that speculation changed differs from the run without it."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from orchestrator.cache.snapshots import SnapshotCache
from orchestrator.cache.tiers import RamTier
from orchestrator.calibration import speculation_widths
from orchestrator.errors import EngineError
from orchestrator.request import Event, EventKind, Job, SamplingParams
from orchestrator.scheduler import Scheduler
from orchestrator.speculative.ngram import NgramDrafter
from orchestrator.speculative.policy import DraftLength, VerifyCosts

from .conftest import FreeCosts, every_width
from .fake_engine import FakeEngine

MS = 4
WIDTHS = (2, 3, 4, 5, 6, 7)


def test_speculation_widths_decision():
    assert speculation_widths((2, 3, 4), "off", 6) == ()
    assert speculation_widths((2, 3, 4), "auto", 6) == (2, 3, 4)
    assert speculation_widths((2, 3, 4, 5, 6, 7), "auto", 3) == (2, 3, 4)
    assert speculation_widths((), "auto", 6) == ()
    assert speculation_widths((), "ngram", 2) == (2, 3)
    from orchestrator.calibration import describe_widths  # how the log names them
    assert describe_widths(tuple(range(2, 17)) + (20, 24)) == "2..16, 20, 24"
    assert describe_widths((3, 5, 7)) == "3, 5, 7 (odd widths: an even number of rows takes other kernels)"


# ---------------------------------------------------------------- the scheduler's verification step


@pytest.fixture()
def make():
    made = []

    def _make(widths=WIDTHS, hw=WIDTHS, hybrid=True, n_slots=3, batch_decode=False, together=False):
        eng = FakeEngine(n_seq_max=n_slots, hybrid=hybrid, exact_from=MS, n_ctx=4096, exact_widths=hw,
                         n_rs_seq=0, markov=True, n_vocab=48)  # no n_rs_seq: verifications rewind
        eng.calibrate(MS, True)
        s = Scheduler(eng, SnapshotCache([RamTier(64 << 20)], state=eng.state), n_slots=n_slots,
                      batch_widths=every_width(n_slots, batch_decode), prefill_chunk=16, prefill_chunk_alone=16,
                      verify_widths=widths, verify_together=together)
        made.append(s)
        return eng, s

    yield _make
    for s in made:
        s.close()


PROMPT = [(5 * i) % 40 + 1 for i in range(60)]


def submit(s: Scheduler, job: Job):
    """Submit `job`; returns wait(): (results by choice, TEXT events as (choice, text, logprobs) in arrival
    order), once every choice ended."""
    events, done, results = [], threading.Event(), {}

    def sink(ev: Event) -> None:
        if ev.kind == EventKind.TEXT:
            events.append((ev.index, ev.text, ev.logprobs))
        else:
            results[ev.index] = ev.result if ev.kind == EventKind.DONE else ev.error
            if len(results) == job.n:
                done.set()

    s.submit(job, sink)

    def wait():
        assert done.wait(30)
        return [results[i] for i in range(job.n)], events

    return wait


def run(s: Scheduler, job: Job):
    """submit, wait, drain: (results by choice, TEXT events)."""
    out = submit(s, job)()
    s.drain()
    return out


def outputs(results):
    return [(r.completion_tokens, r.text, r.finish_reason, r.logprobs) for r in results]


CASES = {
    "greedy": dict(sampling=SamplingParams(temperature=0.0)),
    "seeded": dict(sampling=SamplingParams(temperature=0.3, seed=11)),
    "logprobs": dict(sampling=SamplingParams(temperature=0.0), logprobs=3),
    "stop": dict(sampling=SamplingParams(temperature=0.0), stop=("w7 w",)),
    "n3": dict(sampling=SamplingParams(temperature=0.3, seed=3), n=3),
    "cold": dict(sampling=SamplingParams(temperature=0.0), use_cache=False),
}


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "kv"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_speculation_changes_nothing(make, case, hybrid):
    _, off = make(widths=(), hybrid=hybrid)
    eng, on = make(hybrid=hybrid)
    on.speculation.costs = FreeCosts()
    job = Job(PROMPT, max_tokens=60, want_logits=True, **CASES[case])
    a, a_events = run(off, job)
    b, b_events = run(on, job)
    assert outputs(a) == outputs(b)
    for i in range(job.n):  # streaming: each choice's deltas and logprobs, in the same order (choices interleave
        #                     otherwise: a verification step streams several tokens of one choice)
        assert [e for e in a_events if e[0] == i] == [e for e in b_events if e[0] == i]
    assert all(np.array_equal(x.first_logits, y.first_logits) for x, y in zip(a, b))
    assert sum(r.drafted_tokens for r in b) > 0 and sum(r.accepted_tokens for r in b) > 0
    assert all(r.drafted_tokens == 0 for r in a)
    # the after-generation store continues identically: a follow-up turn restores the same and says the same
    follow = Job(PROMPT + a[0].completion_tokens + [3, 4], max_tokens=20, want_logits=True, **CASES["greedy"])
    fa, _ = run(off, follow)
    fb, _ = run(on, follow)
    assert outputs(fa) == outputs(fb) and fa[0].cached_tokens == fb[0].cached_tokens


def test_the_check_sees_an_inexact_verification(make):
    """The same comparison with widths the hardware does not make exact: the answers differ (so the test above
    would catch a verification that is not exact, or a rollback to the wrong state)."""
    _, off = make(widths=())
    _, on = make(hw=(2,))
    job = Job(PROMPT, max_tokens=60, sampling=SamplingParams(temperature=0.0))
    assert outputs(run(off, job)[0]) != outputs(run(on, job)[0])


ODD = (3, 5, 7)  # ARM i8mm: an even number of rows takes the paired SMMLA kernel


@pytest.mark.parametrize("case", ["seeded", "n3"])  # greedy answers of the fake model accept every draft
def test_odd_widths_only_change_nothing_where_rollbacks_replay_in_odd_calls(make, case, monkeypatch):
    """Where only odd widths are exact (the fake hardware marks an even-width ubatch as other kernels), a hybrid
    verifies at odd widths only and a rollback that keeps an even number of tokens replays them as 1 + an odd
    count (speculative.verify.replay's `widths`): every ubatch of several rows is odd, and the answers are
    speculation off's."""
    import orchestrator.speculative.verify as verify

    kept, whole = [], verify.rewind
    monkeypatch.setattr(verify, "rewind", lambda engine, seq, point, pos, k, widths=None: (
        kept.append(len(k)), whole(engine, seq, point, pos, k, widths)))
    _, off = make(widths=(), hw=ODD)
    eng, on = make(widths=ODD, hw=ODD)
    on.speculation.costs = FreeCosts()
    job = Job(PROMPT, max_tokens=60, want_logits=True, **CASES[case])
    assert outputs(run(off, job)[0]) == outputs(run(on, job)[0])
    assert eng.verify_calls and all(w % 2 == 1 for w in eng.verify_calls), eng.verify_calls
    assert any(k % 2 == 0 for k in kept), kept  # some rollback kept an even count: replayed as 1 + odd


def test_the_check_sees_even_replays_where_only_odd_widths_are_exact(make, monkeypatch):
    """The same with replays in one call whatever their length: the answers differ (so the test above would catch
    a replay of an even count in one ubatch)."""
    import orchestrator.speculative.verify as verify

    whole = verify.replay
    monkeypatch.setattr(verify, "replay", lambda engine, items, widths=None: whole(engine, items))
    _, off = make(widths=(), hw=ODD)
    _, on = make(widths=ODD, hw=ODD)
    on.speculation.costs = FreeCosts()
    job = Job(PROMPT, max_tokens=60, **CASES["seeded"])
    assert outputs(run(off, job)[0]) != outputs(run(on, job)[0])


def measuring(hw) -> FakeEngine:
    """A one-sequence fake engine to measure verification widths on, exact at the widths `hw` (its hardware)."""
    e = FakeEngine(n_seq_max=1, exact_from=2, n_ctx=2048, exact_widths=hw)
    e.calibrate(2, True)
    return e


def test_measured_widths_are_the_odd_ones_where_even_ubatches_take_other_kernels(monkeypatch):
    """calibration.measure_verify_widths on hardware exact at odd widths only: (3, 5, 7), its rollback checks
    replaying even counts as 1 + an odd one; with replays in one call, the widths whose checks keep an even
    count fail; where every width is exact, 2..7 as before."""
    import orchestrator.calibration as calibration
    import orchestrator.speculative.verify as verify

    assert calibration.measure_verify_widths(measuring(ODD), 7) == ODD
    assert calibration.measure_verify_widths(measuring(WIDTHS), 7) == WIDTHS
    assert calibration.measure_verify_widths(measuring(()), 7) == ()
    assert calibration.measure_verify_widths(measuring((2, 3, 5, 7)), 7) == (2, 3)
    whole = verify.replay
    monkeypatch.setattr(verify, "replay", lambda engine, items, widths=None: whole(engine, items))
    assert calibration.measure_verify_widths(measuring(ODD), 7) != ODD


def test_widths_past_16_are_measured_at_multiples_of_4_and_replays_are_cut_into_them():
    """Past 16 the measurement tries multiples of 4 only (calibration.verify_candidates); a width that fails ends
    the run there. A rollback's replay whose length is not a width is decoded in pieces that are, the widest
    first (19 kept: 16 + 3), and goes on as the one-token path does."""
    import orchestrator.calibration as calibration
    from orchestrator.speculative.verify import cut, replay

    wide = calibration.verify_candidates(32)
    assert wide == tuple(range(2, 17)) + (20, 24, 28, 32)

    assert calibration.measure_verify_widths(measuring(wide), 32) == wide
    assert calibration.measure_verify_widths(measuring(tuple(range(2, 17)) + (20, 28, 32)), 32) == tuple(range(2, 17)) + (20,)
    e = measuring(wide)
    prompt, nxt = list(range(5, 45)), [(7 * i) % 50 + 3 for i in range(26)]
    e.decode(0, prompt, 0)
    ref = []
    for i, tok in enumerate(nxt[:20]):
        e.decode(0, [tok], len(prompt) + i)
        ref.append(e.logits())
    e.clear(0)
    e.decode(0, prompt, 0)
    point = e.rewind_point(0)
    e.verify(0, nxt[:24], len(prompt))
    e.verify_calls.clear()
    replay(e, [cut(e, 0, point, len(prompt), nxt[:19])], wide)
    assert e.verify_calls == [16, 3]
    e.decode(0, [nxt[19]], len(prompt) + 19)
    assert np.array_equal(e.logits(), ref[19])


def test_width_measurement_checks_rollbacks_in_its_first_and_last_contexts(monkeypatch):
    """The rollbacks (most of the measurement's cost) are checked after the first and the last context's prefill,
    at every width; and one that goes wrong there (here: nothing rolled back at all after the last one) refuses
    the widths, as it does in the first."""
    import orchestrator.calibration as calibration

    real, seen = calibration.rewind, []

    def spied(engine, seq, point, pos, kept, widths=None):
        seen.append((pos, len(kept)))
        real(engine, seq, point, pos, kept, widths)

    monkeypatch.setattr(calibration, "rewind", spied)
    assert calibration.measure_verify_widths(measuring(WIDTHS), 7, contexts=(40, 90, 170, 300)) == WIDTHS
    assert {pos for pos, _ in seen} == {40, 300}
    assert {k for pos, k in seen if pos == 300} == set(range(1, 7))  # keeps 1, w // 2 and w - 1 of widths 2..7
    for broken_at in (40, 300):
        monkeypatch.setattr(calibration, "rewind", lambda engine, seq, point, pos, kept, widths=None, at=broken_at:
                            None if pos == at else real(engine, seq, point, pos, kept, widths))
        assert calibration.measure_verify_widths(measuring(WIDTHS), 7, contexts=(40, 90, 170, 300)) == ()


def test_batched_decode_steps_do_not_verify(make):
    """Several slots decoding in one llama_decode call stay one row each (verification only alone)."""
    eng, s = make(batch_decode=True)
    eng.pause()
    out = []
    for seed in (1, 2):
        box = threading.Event()
        s.submit(Job(PROMPT, max_tokens=30, sampling=SamplingParams(temperature=0.8, seed=seed)),
                 lambda ev, box=box: (out.append(ev), box.set()) if ev.kind != EventKind.TEXT else None)
    calls_before = len(eng.verify_calls)
    eng.resume()
    s.drain()
    assert calls_before == 0
    _, alone = make(widths=(), batch_decode=True)
    for seed in (1, 2):
        ref = alone.run(Job(PROMPT, max_tokens=30, sampling=SamplingParams(temperature=0.8, seed=seed)))
        assert any(ev.result.completion_tokens == ref.completion_tokens for ev in out)


def together_jobs(case: str, max_tokens: int) -> list[Job]:
    """"n3": one request with three choices; "greedy3": three greedy requests, each its own prompt."""
    if case == "n3":
        return [Job(PROMPT, max_tokens=max_tokens, **CASES["n3"])]
    return [Job(PROMPT[k:] + PROMPT[:k], max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0))
            for k in (0, 7, 13)]


def run_together(s: Scheduler, jobs: list[Job]) -> list:
    """Each job's outputs, every job queued before the first step, so that their slots decode together."""
    s.engine.pause()
    waits = [submit(s, job) for job in jobs]
    s.engine.resume()
    out = [outputs(wait()[0]) for wait in waits]
    s.drain()
    return out


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "kv"])
@pytest.mark.parametrize("case", ["n3", "greedy3"])
def test_slots_decoding_together_verify_together_and_change_nothing(make, case, hybrid):
    """With `verify_together` (calibration.check_batched_verification's answer), slots that decode in one call
    verify their drafts in it (Speculation.step_group): three choices, or three requests at once, answer as
    without speculation, and some calls verified drafts of several slots."""
    _, off = make(widths=(), hybrid=hybrid, batch_decode=True)
    eng, on = make(hybrid=hybrid, batch_decode=True, together=True)
    on.speculation.costs = FreeCosts()
    jobs = together_jobs(case, 60)
    assert run_together(off, jobs) == run_together(on, jobs)
    assert any(len(c) > 1 and max(c) > 1 for c in eng.verify_many_calls)
    if hybrid and case == "n3":  # choices that rejected a draft in one step replay their kept tokens in one call
        assert any(len(c) > 1 for c in eng.replay_calls), eng.replay_calls


@pytest.mark.parametrize("case", ["n3", "greedy3"])
def test_slots_verifying_together_on_a_hybrid_stay_within_the_dense_widths(make, case):
    """On a hybrid memory llama.cpp cuts one call's sequences into pieces as long as the shortest one left
    (split_equal): 12 drafts beside a pending token are verified as 1, then 11 alone. Where the exact widths have
    a gap (here 2..7 and 12; on x86 2..16 then multiples of 4), each slot's verification in a shared call is kept
    within the widths below the gap, so that every piece is exact: answers as without speculation."""
    widths = (2, 3, 4, 5, 6, 7, 12)
    _, off = make(widths=(), hybrid=True, batch_decode=True)
    eng, on = make(widths=widths, hw=widths, hybrid=True, batch_decode=True, together=True)
    on.speculation.costs = FreeCosts()
    jobs = together_jobs(case, 80)
    assert run_together(off, jobs) == run_together(on, jobs)
    calls = eng.verify_many_calls
    assert any(len(c) > 1 and max(c) > 1 for c in calls) and max(max(c) for c in calls if len(c) > 1) <= 7
    alone = Job(PROMPT, max_tokens=80, sampling=SamplingParams(temperature=0.0))
    assert outputs(submit(on, alone)()[0]) == outputs(submit(off, alone)()[0])
    assert 12 in eng.verify_calls  # alone, a slot still verifies past the gap


def test_the_check_sees_an_inexact_batched_verification(make):
    """The same comparison where verifying in one call is not exact: the answers differ (so the test above would
    catch a batched verification that is)."""
    _, off = make(widths=(), batch_decode=True)
    eng, on = make(batch_decode=True, together=True)
    on.speculation.costs = FreeCosts()
    eng.batched_verify_exact = False
    job = Job(PROMPT, max_tokens=60, sampling=SamplingParams(temperature=0.0), n=3)
    assert outputs(run(off, job)[0]) != outputs(run(on, job)[0])


def test_a_failing_slot_in_a_verification_together_fails_alone(make, monkeypatch):
    """A request whose sampling raises inside a step verified together fails with an error; the others in that
    call answer as without speculation."""
    _, off = make(widths=(), batch_decode=True)
    eng, on = make(batch_decode=True, together=True)
    on.speculation.costs = FreeCosts()
    sample, verify_many, raised = on._sample, eng.verify_many, []

    def counted(items, every=True):
        raised.append(None if every else "other")  # a verification together is running: its sampling follows
        return verify_many(items, every)

    def failing(t, idx, logits=None):
        if t.job.tenant == "bad" and len(raised) > 2 and raised[-1] is None:
            raised[-1] = "raised"
            raise RuntimeError("injected")
        return sample(t, idx, logits)

    monkeypatch.setattr(eng, "verify_many", counted)
    for name in ("decode_step", "decode", "verify"):  # any other call: its sampling is not the one to fail
        call = getattr(eng, name)
        monkeypatch.setattr(eng, name, lambda *a, call=call, **kw: (raised.append("other"), call(*a, **kw))[1])
    monkeypatch.setattr(on, "_sample", failing)
    good = [Job(PROMPT[k:] + PROMPT[:k], max_tokens=60, sampling=SamplingParams(temperature=0.0)) for k in (0, 7)]
    bad = Job(PROMPT[13:] + PROMPT[:13], max_tokens=60, sampling=SamplingParams(temperature=0.0), tenant="bad")
    events = {}
    eng.pause()
    for name, job in (("a", good[0]), ("bad", bad), ("b", good[1])):
        on.submit(job, lambda ev, n=name: events.__setitem__(n, ev) if ev.kind != EventKind.TEXT else None)
    eng.resume()
    assert on.drain(30)
    assert events["bad"].kind == EventKind.ERROR and "raised" in raised
    assert [events[n].result.completion_tokens for n in ("a", "b")] == \
        [off.run(job).completion_tokens for job in good]


def test_a_failing_replay_together_fails_only_the_slots_in_it(make, monkeypatch):
    """Slots of one batched step that rejected drafts replay their kept tokens in one call
    (Speculation._keep_group); where llama.cpp fails that call, the choices in it end with an error, the others
    answer as without speculation, and the next request is served normally."""
    _, off = make(widths=(), batch_decode=True)
    eng, on = make(batch_decode=True, together=True)
    on.speculation.costs = FreeCosts()
    verify_many, failed = eng.verify_many, []

    def failing(items, every=True):
        if not every and len(items) > 1 and not failed:
            failed.append([seq for seq, _, _ in items])
            raise EngineError("injected replay failure")
        return verify_many(items, every)

    monkeypatch.setattr(eng, "verify_many", failing)
    job = Job(PROMPT, max_tokens=60, **CASES["n3"])  # choices that reject drafts in the same steps
    got = run(on, job)[0]
    assert failed and 2 <= len(failed[0]) < job.n  # some choices in the failed call, one outside it
    errors = [r for r in got if isinstance(r, EngineError)]
    assert len(errors) == len(failed[0]) and all("injected" in e.message for e in errors)
    expected = run(off, job)[0]
    assert [a.completion_tokens for a, b in zip(got, expected) if not isinstance(a, EngineError)] == \
        [b.completion_tokens for a, b in zip(got, expected) if not isinstance(a, EngineError)]
    assert outputs(run(on, job)[0]) == outputs(expected)  # the next request is served normally


def test_a_request_that_never_matches_rarely_verifies(make):
    """Drafts that are never accepted: the request backs off to plain decode steps."""
    eng, s = make()
    s.speculation.min_n = 1  # drafts from any earlier token
    eng.eog_id = -1  # never ends early
    job = Job(list(range(1, 47)), max_tokens=400, sampling=SamplingParams(temperature=5.0, seed=5))
    r = s.run(job)
    assert len(eng.verify_calls) <= len(r.completion_tokens) / 8


class NeverPays(VerifyCosts):
    def ratio(self, width: int) -> float:
        return 100.0


def test_drafts_not_verified_are_checked_against_the_token_decoded_next(make, monkeypatch):
    """Where no width pays, every decode step's draft is still checked: its first token against the token the step
    then gave (DraftLength.shadow), exactly the outcomes a replay of the drafter over the answer gives."""
    seen = []
    shadow = DraftLength.shadow
    monkeypatch.setattr(DraftLength, "shadow", lambda self, hit: (seen.append(hit), shadow(self, hit))[1])
    _, s = make()
    s.speculation.costs = NeverPays()
    r = s.run(Job(PROMPT, max_tokens=60, sampling=SamplingParams(temperature=0.0)))
    assert r.drafted_tokens == 0
    out, expected = r.completion_tokens, []
    drafter = NgramDrafter(PROMPT, s.speculation.min_n, s.speculation.max_n)
    for j in range(len(out) - 2):  # out[j] decoded with a draft after it; checked when out[j + 1] is decoded
        drafter.extend([out[j]])
        draft = drafter.draft(1)
        if draft:
            expected.append(draft[0] == out[j + 1])
    assert seen == expected and True in seen


def test_counts_reach_metrics(make):
    from server.metrics import Metrics

    _, s = make()
    s.speculation.costs = FreeCosts()
    r = s.run(Job(PROMPT, max_tokens=40, sampling=SamplingParams(temperature=0.0)))
    assert r.drafted_tokens >= r.accepted_tokens > 0
    m = Metrics(s.cache.stats)
    m.observe(r, r.drafted_tokens, r.accepted_tokens)
    text = m.render().decode()
    assert f"orchestrator_drafted_tokens_total {float(r.drafted_tokens)}" in text
    assert f"orchestrator_accepted_tokens_total {float(r.accepted_tokens)}" in text
