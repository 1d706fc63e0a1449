"""Scheduler: N slots (sequences of one llama.cpp context) served by one worker thread that owns the engine.
It holds queueing, admission order and stepping. What is restored and stored, where a prefill stops and what a
flush drops are the reuse rules' (reuse.py); idle-time memory work is the engine side's (memory.IdleWork).

Admission is one step of the worker, oldest request first, so the cached_tokens a request reports are the tokens
actually restored: a request that would reuse a snapshot an earlier one is about to store waits for it
(`Reuse.must_wait`); the others get a slot (`Reuse.choose`) and their deepest reusable prefix (`Reuse.admit`).
Each step is then one decode step for every generating slot (one llama_decode call for all when the model is
batch-invariant: calibration.check_batch_invariance) and one prefill chunk for the prefill that would finish
first (`_fill_order`), of at most `prefill_chunk` tokens and ending where `Reuse.chunk_end` says. After the
result, the slot re-prefills the state after generation (STORE, `Reuse.after_generation`) only while no
request decodes or prefills; a request arriving meanwhile takes it over or preempts it at a chunk boundary.
The worker never waits for a grammar process (grammar_guard.py): a request whose grammar has not answered when
its token is due keeps that step's logits and sits out the decode steps until it has (`_sample`, `_resume`),
the same token either way; when nothing else can run, the worker waits on the grammars' pipes (`_pause`).

A cancelled request leaves its slot at the next step (one cancelled while decoding gets what it generated);
past its deadline, RequestTimeout; a full queue, QueueFull (HTTP 429). A job of n > 1 choices waits, with the
requests queued after it, for n slots; its prompt is prefilled once and copied (`Reuse.fork`). A job with
`use_cache=False` is a cold run, the correctness oracle: slot cleared, plain chunks, nothing read or stored.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import os
import select
import threading
import time
from typing import Mapping

import numpy as np

from .cache.snapshots import SnapshotCache
from .engine import Engine
from .engine_thread import EngineThread
from .errors import EngineError, OrchestratorError, QueueFull
from .memory import IdleWork
from .request import Collector, Event, EventKind, Job, Phase, Result, RetryAfter, Sink, Slot, Task
from .reuse import PrefillRate, Reuse
from .sampling import token_logprob
from .speculative.policy import VerifyCosts
from .speculative.verify import Speculation

log = logging.getLogger("orchestrator.scheduler")


class _Condition(threading.Condition):
    """The scheduler's condition, whose every notify_all also writes a byte to a pipe (`fileno`): the worker
    waits on it with select beside the grammar processes' pipes (`Scheduler._pause`), so that an arrival, a
    flush or a close wakes it at once there too."""

    def __init__(self) -> None:
        super().__init__()
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def notify_all(self) -> None:
        super().notify_all()
        try:
            os.write(self._write, b"\0")
        except OSError:  # full (nobody selected on it for a while: it is readable anyway) or closed
            pass

    def fileno(self) -> int:
        return self._read

    def clear(self) -> None:
        """Read what the notifications wrote."""
        try:
            while os.read(self._read, 4096):
                pass
        except OSError:
            pass

    def close(self) -> None:
        """Close the pipe; a second call does nothing (Runtime.close may run twice)."""
        fds, self._read, self._write = (self._read, self._write), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)


def decode_groups(n: int, widths: tuple[int, ...]) -> list[int]:
    """How `n` generating slots (in sequence order) share decode steps: the largest allowed width that fits, then
    again, a slot alone where none does (`widths`: batch widths measured exact, 2..; empty: all alone).

    >>> decode_groups(4, (2, 3, 4)), decode_groups(4, (3, 5, 7)), decode_groups(9, (2, 3, 4, 5, 6, 7)), decode_groups(2, ())
    ([4], [3, 1], [7, 2], [1, 1])
    """
    groups = []
    while n:
        width = max((w for w in widths if w <= n), default=1)
        groups.append(width)
        n -= width
    return groups

class Scheduler:
    """Bounded queue + worker thread over `n_slots` engine sequences and one snapshot cache.

    Args:
        engine: an Engine with n_seq_max >= n_slots, calibrated (min_segment).
        cache: the snapshot cache.
        checkpoint_interval, snapshot_min_gap: tokens (0 = off), the reuse rules' (`Reuse`).
        n_slots: concurrent requests (sequences 0..n_slots-1).
        queue_size: most requests waiting for a slot; more are refused with QueueFull.
        timeout_s: default per-request limit in seconds from submission (0 = none).
        prefill_chunk: most prompt tokens in one step while others wait or compute (an arrival waits for it);
            prefill_chunk_alone: the same while no request decodes or waits (0: n_batch; fewer weight passes).
        batch_widths: how many generating slots may share one llama_decode call (`decode_groups`); only widths
            where that is bit-identical to decoding alone (calibration.exact_batch_widths), or cached and
            concurrent outputs may differ from cold. Empty: every slot decodes alone.
        prefill_tps: measured prompt tokens/s (calibration.prefill_rate; None: from the first chunk on), refined
            by every chunk: a shared tier's fetch-or-recompute choice reads it.
        driver: the thread to run the worker loop on, shut down on close: the one that made the engine's earlier
            llama_decode calls, since calls from a second thread are slower (engine_thread.EngineThread); None: a
            new one.
        verify_widths: speculative decoding's verification widths (calibration.measure_verify_widths and
            `speculation`); empty: off. A request verifies drafts in a step where it decodes alone in its
            llama_decode call, and in a batched decode step of several slots where `verify_together`.
        verify_together: slots decoding in one llama_decode call verify their drafts in it
            (calibration.check_batched_verification measured it exact; Speculation.step_group); False: batched
            decode steps stay one row per slot.
        drafts: where drafts come from, "ngram", "mtp" or "draft" (speculative.verify.Speculation);
        draft_model: the drafting model for "draft" (speculative.draft.DraftModel), closed with the scheduler.
        verify_costs: verification and rollback costs in decode steps measured at start
            (calibration.measure_verify_costs), what the width policy weighs until it has timed its own.

    submit() never blocks on compute; events reach `sink` from the worker thread, so the sink must be
    thread-safe (the server wraps asyncio's call_soon_threadsafe). A failing job gets an ERROR event (`_fail`); the
    worker goes on.
    """

    def __init__(self, engine: Engine, cache: SnapshotCache, checkpoint_interval: int = 0, n_slots: int = 1,
                 queue_size: int = 64, timeout_s: float = 0.0, prefill_chunk: int = 128, prefill_chunk_alone: int = 0,
                 batch_widths: tuple[int, ...] = (), prefill_tps: float | None = None,
                 driver: EngineThread | None = None, snapshot_min_gap: int = 0,
                 verify_widths: tuple[int, ...] = (), drafts: str = "ngram", draft_model=None,
                 verify_costs: Mapping[int, float] | None = None, verify_together: bool = False) -> None:
        if not 1 <= n_slots <= engine.n_seq_max:
            raise ValueError(f"n_slots must be 1..{engine.n_seq_max} (the engine's sequences), got {n_slots}")
        self.engine = engine
        self.cache = cache
        self.slots = [Slot(seq) for seq in range(n_slots)]
        self.reuse = Reuse(engine, cache, self.slots, checkpoint_interval, PrefillRate(prefill_tps),
                           min_gap=snapshot_min_gap)
        self.min_segment = self.reuse.min_segment
        self.checkpoint_interval = checkpoint_interval
        self.queue_size = queue_size
        self.timeout_s = timeout_s
        self.prefill_chunk = self.reuse.chunk_size(prefill_chunk)
        self.prefill_chunk_alone = max(self.reuse.chunk_size(prefill_chunk_alone or engine.n_batch), self.prefill_chunk)
        self.batch_widths = batch_widths
        self.speculation = Speculation(engine, verify_widths, drafts=drafts, draft_model=draft_model,
                                       costs=VerifyCosts(start=verify_costs), together=verify_together)
        self._waiting: collections.deque[Task] = collections.deque()
        self._cond = _Condition()
        self._order = itertools.count()
        self._admissions = itertools.count()
        self._admitted: dict[str, int] = {}  # tenant -> when it last got a slot (`_fair_order`)
        self._retry = RetryAfter()
        self._closed = False
        self._idle = IdleWork(engine)
        self._driver = driver or EngineThread()
        self._worker_done = self._driver.submit(self._worker)

    # ------------------------------------------------------------------ public

    def submit(self, job: Job, sink: Sink, cancel: threading.Event | None = None) -> threading.Event:
        """Queue a job; returns its cancel flag (set it to stop the job at the next step). Raises ContextOverflow,
        OrchestratorError (empty prompt), InvalidRequest (`Job.check`), QueueFull (`queue_size` requests waiting;
        its `retry_after` in seconds)."""
        job.check(self.engine.n_ctx, len(self.slots))
        cancel = cancel or threading.Event()
        with self._cond:
            if self._closed:
                raise OrchestratorError("the server is shutting down")
            idle = sum(s.task is None for s in self.slots)
            pushed_out = None
            if len(self._waiting) >= self.queue_size + idle:
                pushed_out = self._make_room(job.tenant)
            limit = self.timeout_s if job.timeout_s is None else job.timeout_s
            self._waiting.append(Task(job, sink, cancel, next(self._order), limit))
            self._cond.notify_all()
        if pushed_out is not None:
            pushed_out.deliver(Event(EventKind.ERROR, error=QueueFull(
                len(self._waiting), self._retry.seconds(len(self._waiting), len(self.slots)))))
        return cancel

    def _make_room(self, tenant: str) -> Task:
        """A full queue and an arrival from `tenant`: the newest queued request of the tenant that holds the most
        of the queue leaves it (its caller gets QueueFull, 429), if that tenant holds more than `tenant` would
        with the arrival; else the arrival is refused (QueueFull raised). So a burst from one tenant fills the
        queue only while nobody else waits, and never pushes another tenant out (longest-queue drop). Called
        with the lock held; returns the task pushed out, for the caller to tell outside the lock."""
        held = collections.Counter(t.job.tenant for t in self._waiting)
        heaviest, count = held.most_common(1)[0]
        if count <= held[tenant] + 1:
            raise QueueFull(len(self._waiting), self._retry.seconds(len(self._waiting), len(self.slots)))
        victim = max((t for t in self._waiting if t.job.tenant == heaviest), key=lambda t: t.order)
        self._waiting.remove(victim)
        victim.phase = Phase.DONE
        return victim

    def run(self, job: Job) -> Result:
        """Submit and wait (for tests, benchmarks and the CLI): choice 0's result. Raises the job's error."""
        return self.run_choices(job)[0]

    def run_choices(self, job: Job) -> list[Result]:
        """Submit and wait for all job.n results, by choice. Raises the first error (the others are cancelled)."""
        box = Collector(job.n)
        return box.wait(self.submit(job, box))

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no job is queued or in a slot (after-generation snapshots included). False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._waiting and not self._active(), timeout)

    def flush(self, timeout: float = 60.0) -> int:
        """POST /v1/cache/flush: `Reuse.flush`, by the worker between two steps; returns the entries dropped.
        Raises OrchestratorError when the server is shutting down or after `timeout` s (`FlushRequests.wait`)."""
        with self._cond:
            if self._closed:
                raise OrchestratorError("the server is shutting down")
            done = self.reuse.flushes.add()
            self._cond.notify_all()
        return self.reuse.flushes.wait(done, timeout)

    @property
    def queue_length(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiting)

    @property
    def slots_busy(self) -> int:
        """Slots serving a request (prefill, decode, or storing its after-generation snapshot)."""
        return sum(s.task is not None for s in self.slots)

    def close(self) -> None:
        """Stop the worker; queued and running jobs get an error. A second call does nothing (Runtime.close may
        run twice: the engine thread is gone by then)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        try:
            self._worker_done.result(timeout=30)
        except concurrent.futures.TimeoutError:
            log.warning("the scheduler's worker did not stop within 30 s")
        else:
            self._cond.close()
            self._driver.submit(self.speculation.close).result()  # the engine thread made its context
        self._driver.shutdown()

    # ------------------------------------------------------------------ worker

    def _active(self) -> list[Task]:
        return [s.task for s in self.slots if s.task is not None]

    def _worker(self) -> None:
        while True:
            with self._cond:
                idle = not self._closed and not self._waiting and not self._active()
                if idle:
                    self._cond.notify_all()  # wake drain()
            if idle and self._idle.fill():  # an arrival waits for at most one buffer
                continue
            with self._cond:
                while not self._closed and not self._waiting and not self._active() and not self.reuse.flushes:
                    self._cond.notify_all()  # wake drain()
                    self._cond.wait(self._idle.interval_s)
                    self._idle.trim()
                if self._closed:
                    break
            try:
                self.reuse.flushes.carry_out(lambda: self.reuse.flush(self._release))
                self._expire()
                self._admit()
                if not self._step():
                    self._pause()
                self._idle.trim()
            except Exception:  # noqa: BLE001 - the worker must survive anything; tasks fail on their own paths
                log.exception("scheduler step failed")
                for task in self._active():
                    self._fail(task, EngineError("internal error in the scheduler; see the server log"))
        with self._cond:
            pending, self._waiting = list(self._waiting), collections.deque()
        self.reuse.flushes.refuse(OrchestratorError("the server is shutting down"))
        for task in pending + self._active():
            self._fail(task, OrchestratorError("the server is shutting down"))

    def _pause(self) -> None:
        """Nothing to compute this step (requests wait on others' snapshots or on their grammars): wait 10 ms at
        most, for a notification (an arrival, a flush, a release) or an answer of an awaited grammar process
        (its pipe readable): select over those pipes."""
        pipes = [fd for t in self._active() if t.held is not None and (fd := t.sampler.fileno()) is not None]
        if not pipes:
            with self._cond:
                self._cond.wait(0.01)
            return
        try:
            select.select([self._cond.fileno()] + pipes, [], [], 0.01)
        except (OSError, ValueError):  # a pipe closed meanwhile: the next step's poll says why
            pass
        self._cond.clear()  # after the select: a notification since the last step wakes it at once

    def _expire(self) -> None:
        """Drop cancelled and timed-out requests, queued or running."""
        now = time.perf_counter()
        with self._cond:
            gone = [t for t in self._waiting if t.expired(now)]
            for t in gone:
                self._waiting.remove(t)
        for t in gone:
            t.deliver(Event(EventKind.ERROR, error=t.stop_error(now)))
        for t in self._active():
            if t.delivered:
                continue  # storing its after-generation snapshot: not the caller's time any more
            if t.expired(now):
                if t.phase == Phase.DECODE and t.cancel.is_set():
                    self._finish(t)  # deliver what was generated; the caller is gone or done
                else:
                    self._fail(t, t.stop_error(now))

    # ------------------------------------------------------------------ admission

    def _admit(self) -> None:
        """Start waiting requests, oldest first, unless one must wait for an earlier one's snapshot
        (`Reuse.must_wait`). A STORE slot is not busy for them: taken over or preempted (`Reuse.choose`)."""
        with self._cond:
            queued = self._fair_order(list(self._waiting))
        for task in queued:
            free, storing = self._room()
            if len(free) + len(storing) < task.job.n:
                return  # oldest first: an n-choice job is not overtaken while it waits for n slots
            if self.reuse.must_wait(task, self._active() + queued):
                continue
            with self._cond:
                self._waiting.remove(task)
            self._admitted[task.job.tenant] = next(self._admissions)
            for t in [task] + task.fork():  # choice 0 first: it picks the slot that restores most
                if task.phase == Phase.DONE:
                    break  # choice 0 failed: the others are never placed
                self._guard(t, self._place, t, *self._room())

    def _fair_order(self, queued: list[Task]) -> list[Task]:
        """The queued tasks in the order they are offered slots: round robin over tenants (`Job.tenant`). A
        tenant's k-th queued request ranks after the slots it already holds plus k; on a tie the tenant admitted
        least recently goes first, then arrival order. One tenant's burst does not make the others wait behind
        all of it."""
        running = collections.Counter(t.job.tenant for t in self._active() if t.phase != Phase.STORE)
        tenants = set(running) | {t.job.tenant for t in queued}
        self._admitted = {k: v for k, v in self._admitted.items() if k in tenants}  # bounded by who is here
        seen: collections.Counter = collections.Counter()
        ranked = []
        for t in queued:  # in arrival order
            tenant = t.job.tenant
            ranked.append((running[tenant] + seen[tenant], self._admitted.get(tenant, -1), t.order, t))
            seen[tenant] += 1
        return [r[-1] for r in sorted(ranked, key=lambda r: r[:3])]

    def _room(self) -> tuple[list[Slot], list[Slot]]:
        """(free slots, slots storing an after-generation state: never busy for a waiting request)."""
        return ([s for s in self.slots if s.task is None],
                [s for s in self.slots if s.task is not None and s.task.phase == Phase.STORE])

    def _place(self, task: Task, free: list[Slot], storing: list[Slot]) -> None:
        """Bind the task to the slot `Reuse.choose` picks (a STORE task there is taken over or preempted) and
        restore its deepest reusable prefix, in this one step (what is reported as cached was restored)."""
        slot, depth = self.reuse.choose(task, free, storing)
        if slot.task is not None:
            if not depth:
                self.reuse.preempt(slot.task)
            self._release(slot.task)
        task.slot, slot.task = slot, task
        self.speculation.admitted(task)
        slot.key = task.job.prompt_cache_key
        task.clock.admitted = time.perf_counter()
        if task.index:  # choice i > 0: its state comes from choice 0's once prefilled (_prefilled)
            task.phase = Phase.FORK
            return
        if depth:
            self.reuse.take_over(task, slot, depth)
        else:
            self.reuse.admit(task, slot)
        task.clock.restored = time.perf_counter()
        task.phase = Phase.PREFILL

    # ------------------------------------------------------------------ steps

    def _step(self) -> bool:
        """One decode step and one prefill chunk; False when there was nothing to compute. A STORE re-prefill
        gets a chunk only when no request decodes or prefills (an arrival waits at most for that chunk).

        A request whose grammar had not answered when its token was due holds that step's logits (`_sample`)
        and sits out the decode steps; each step first samples those whose grammar has answered since, which
        then decode with the others."""
        active = self._active()
        awaiting = [t for t in active if t.phase == Phase.DECODE and t.held is not None]
        for t in awaiting:
            self._guard(t, self._resume, t)
        awaiting = [t for t in awaiting if t.phase == Phase.DECODE and t.held is not None]
        decoding = [t for t in active if t.phase == Phase.DECODE and t.pending is not None]
        if decoding:
            self._decode(decoding)
        filling = [t for t in active if t.phase == Phase.PREFILL]
        if not filling and not decoding and not awaiting:
            filling = [t for t in active if t.phase == Phase.STORE]
        if filling:
            task = min(filling, key=self._fill_order)
            # Small chunks while others decode or wait (for a slot, or for their grammar: as when they decode);
            # other prefills wait for this one either way (_fill_order).
            alone = task.phase == Phase.PREFILL and not decoding and not awaiting and not self._waiting
            self._guard(task, self._prefill_chunk, task, self.prefill_chunk_alone if alone else self.prefill_chunk)
        return bool(decoding or filling)

    def _fill_order(self, t: Task) -> tuple[float, int]:
        """Which prefill advances first: the one that would finish first had it been served alone since it was
        submitted (seconds: submission + tokens left ÷ measured tokens/s; the older on a tie; before any
        measurement, arrival order): shortest-remaining-first among prompts that arrive together, and none
        waits for ever."""
        rate = self.reuse.prefill.tokens_per_s
        if not rate:
            return t.clock.submitted, t.order
        return t.clock.submitted + (len(t.reuse.work) - t.reuse.pos) / rate, t.order

    def _guard(self, task: Task, fn, *args) -> None:
        """Run one request's step; its failure fails that request only."""
        try:
            fn(*args)
        except OrchestratorError as e:
            self._fail(task, e)
        except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
            log.exception("request failed")
            self._fail(task, EngineError(f"internal error: {e}"))

    def _decode(self, tasks: list[Task]) -> None:
        """One decode step for the generating slots, in groups of `decode_groups` (one llama_decode each, in which
        the slots may verify drafts: `_decode_one` alone, Speculation.step_group together), then sample."""
        tasks.sort(key=lambda t: t.slot.seq)
        start = 0
        for width in decode_groups(len(tasks), self.batch_widths):
            group, start = tasks[start:start + width], start + width
            if width == 1:
                self._guard(group[0], self._decode_one, group[0])
                continue
            try:
                if self.speculation.step_group(group, self._sample, self._guard):
                    continue
                self.speculation.batched(group)
                self.engine.decode_step([(t.slot.seq, t.pending, t.pending_pos) for t in group])
            except EngineError as e:
                for t in group:
                    self._fail(t, e)
                continue
            for i, t in enumerate(group):
                self._guard(t, self._sample, t, i)

    def _decode_one(self, t: Task) -> None:
        if self.speculation.step(t, self._sample):  # drafts verified in one ubatch, or False: nothing done
            return
        started = time.perf_counter()
        self.engine.decode(t.slot.seq, [t.pending], t.pending_pos)
        self.speculation.costs.observe(1, time.perf_counter() - started)  # what a verification is weighed against
        self._sample(t, -1)

    def _prefill_chunk(self, t: Task, chunk: int) -> None:
        """Prefill the task's next chunk of at most `chunk` tokens (`Reuse.chunk_end`); at the end of its work,
        go on to decoding (or, in STORE, store the branch end and release the slot)."""
        work, pos = t.reuse.work, t.reuse.pos
        if pos == len(work):  # restored whole with its logits (Reuse.plans): nothing to prefill
            self._prefilled(t)
            return
        end = self.reuse.chunk_end(t, chunk)
        final = end == len(work)
        # live is extended only after a chunk is decoded; a failed decode clears the sequence.
        started = time.perf_counter()
        hidden = self.speculation.hidden_for(t) if t.phase == Phase.PREFILL else None  # where an MTP head reads it
        self.engine.decode(t.slot.seq, work[pos:end], pos, want_logits=final and t.phase == Phase.PREFILL,
                           hidden=hidden)
        self.speculation.prefilled(t, pos, work[pos:end], hidden)
        self.reuse.prefilled(t, end, time.perf_counter() - started)
        if not final:
            return
        if t.phase == Phase.STORE:
            self.reuse.store_finished(t)
            self._release(t)
            return
        self._prefilled(t)

    def _prefilled(self, t: Task) -> None:
        t.clock.prefilled = time.perf_counter()
        forks = [c for c in t.choices if c.phase == Phase.FORK]
        for c in forks:  # state copies first: choice 0's end of generation may rewind its sequence
            self._guard(c, self.reuse.fork, t, c)
            if c.phase == Phase.FORK:
                self.speculation.forked(t, c)
        for c in [c for c in forks if c.phase == Phase.FORK] + [t]:  # all from the same logits, untouched by copies
            self._guard(c, self._start, c)
        self._guard(t, self.reuse.store_prompt_end, t)  # after the first tokens: not in their time

    def _start(self, t: Task) -> None:
        """Sample the first token from the prompt's logits (the last prefill call's, or those restored with the
        whole prompt) and go on to decoding."""
        restored = t.reuse.logits
        if t.job.want_logits:
            t.first_logits = self.engine.logits() if restored is None else restored.copy()
        t.sampler = self.engine.sampler(t.job.sampling, t.deadline)
        t.phase = Phase.DECODE
        self._sample(t, -1, restored)  # now: the next llama_decode overwrites the engine's logits

    def _sample(self, t: Task, idx: int, logits: np.ndarray | None = None) -> None:
        """Sample the next token from the logits at batch index `idx` of the last llama_decode, or from `logits`.
        When the task's grammar has not answered yet (`Sampler.ready`), nothing waits for it: a copy of those
        logits is held (`Task.held`; the next llama_decode overwrites the engine's) and the task sits out the
        decode steps until its grammar answers (`_resume`). Sampling the copy gives the same token and logprobs
        (`Sampler.sample`, `token_logprob`): nothing about the output depends on when the grammar answered."""
        if not t.sampler.ready():
            t.held = self.engine.logits(idx) if logits is None else logits.copy()
            t.pending = None  # decoded already: the next decode step is the held token's
            return
        tok = t.sampler.sample(idx, logits)
        if t.clock.first_token is None:
            t.clock.first_token = time.perf_counter()
        eog = self.engine.is_eog(tok)
        if t.logprobs is not None and not eog:
            t.logprobs.append(self.engine.logprob(tok, t.job.logprobs, idx) if logits is None
                              else token_logprob(logits, tok, t.job.logprobs))
        delta, done = t.take(tok, eog, b"" if eog else self.engine.piece(tok), self.engine.n_ctx)
        if delta:
            t.sink(t.text_event(delta))
        if done:
            self._finish(t)

    def _resume(self, t: Task) -> None:
        """Sample a task's held logits once its grammar has answered (then it decodes with the others)."""
        if t.sampler.ready():
            logits, t.held = t.held, None
            self._sample(t, -1, logits)

    # ------------------------------------------------------------------ completion

    def _finish(self, t: Task) -> None:
        """Deliver the result, then store the state after generation (or at the end of the prompt)."""
        result = t.conclude(time.perf_counter())
        self._retry.observe(result.total_s)
        t.deliver(Event(EventKind.DONE, result=result))
        if self.reuse.after_generation(t):
            t.phase = Phase.STORE
        else:
            self._release(t)

    def _fail(self, t: Task, err: OrchestratorError) -> None:
        """End a task with an error. Checkpoints stored so far stay valid; the sequence keeps what was prefilled
        (a valid state at `pos`, and `live` says so) unless llama.cpp failed, which clears it."""
        if t.sampler is not None:
            t.sampler.close()
        if t.slot is not None and isinstance(err, EngineError):
            self.reuse.reset(t.slot)
        t.deliver(Event(EventKind.ERROR, error=err))
        if t.slot is not None:
            self._release(t)
        for c in t.choices:  # choices waiting for this one's prompt state never get it
            if c.phase == Phase.FORK:
                self._fail(c, err)

    def _release(self, t: Task) -> None:
        slot = t.slot
        if slot is not None and slot.task is t:
            slot.task = None
            slot.last_used = time.perf_counter()
            self.reuse.released(slot)
        t.phase = Phase.DONE
        with self._cond:
            self._cond.notify_all()
