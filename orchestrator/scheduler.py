"""Scheduler: N slots (sequences of one llama.cpp context) served by one worker thread that owns the engine.
Queueing, admission order and stepping; what is restored and stored is the reuse rules' business (reuse.py).

A request waits in a bounded queue until a slot is free. Admission is one step of the worker, oldest request
first, so the lookup, the restore and the cached_tokens the request reports are the tokens actually restored:
a request that would reuse a snapshot an earlier one is about to store waits for it (`Reuse.must_wait`); the
others get a slot (`Reuse.pick_slot`) and their deepest reusable prefix (`Reuse.admit`).

Then the worker loops over steps; each step is

  * one decode step for every slot that is generating: their next tokens go into one llama_decode call when
    the model is batch-invariant (calibration.check_batch_invariance), else one call per slot;
  * one prefill chunk for one prefilling slot, the one that would finish first (`_fill_order`: shortest
    remaining first among prompts that arrive together, never passed over for ever): at most `prefill_chunk`
    tokens, never crossing a snapshot position and never shorter than min_segment. A long prefill thus
    advances between other conversations' tokens instead of stalling them; alone, it takes
    `prefill_chunk_alone` (n_batch) a step.

After the result is delivered, the slot re-prefills and stores the state after generation (phase STORE,
`Reuse.after_generation`), in chunks like any prefill, but only while no request is decoding or prefilling.
A request that arrives meanwhile takes the STORE slot over when it extends what was computed so far, or
preempts it at the chunk boundary when no slot is free: after-generation work never makes a request wait
longer than one chunk.

Cancellation and limits: a cancelled request (client gone) leaves its slot at the next step (one cancelled while
decoding gets what it generated); past its deadline (`timeout_s`), RequestTimeout; a full queue, QueueFull
(HTTP 429). Checkpoints stored before a cancellation stay valid; a cancelled prefill's end state is not stored.

A job of n > 1 choices (request.py) waits, with the requests queued after it, until it has n slots (free or STORE);
its prompt is prefilled once and copied (`Reuse.fork`); each choice equals its cold run (`Job.choice`).

With `use_cache=False` a job is a cold run: its slot is cleared, the whole prompt is prefilled in plain chunks
(no stops at snapshot positions: it stores nothing), nothing is read or stored. That is the correctness oracle
the tests compare against.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import math
import threading
import time

from .cache.snapshots import SnapshotCache
from .engine import Engine, EngineThread
from .errors import EngineError, OrchestratorError, QueueFull
from .memory import HeapTrimmer
from .request import Collector, Event, EventKind, Job, Phase, Result, Sink, Slot, Task
from .reuse import PrefillRate, Reuse

log = logging.getLogger("orchestrator.scheduler")


class Scheduler:
    """Bounded queue + worker thread over `n_slots` engine sequences and one snapshot cache.

    Args:
        engine: an Engine with n_seq_max >= n_slots, calibrated (min_segment).
        cache: the snapshot cache.
        checkpoint_interval: tokens between interval checkpoints inside long stretches (0 = off).
        snapshot_min_gap: tokens; interval checkpoints closer than that to the next boundary are left out.
        n_slots: concurrent requests (sequences 0..n_slots-1).
        queue_size: most requests waiting for a slot; more are refused with QueueFull.
        timeout_s: default per-request limit in seconds from submission (0 = none).
        prefill_chunk: most prompt tokens in one step while others wait or compute (an arrival waits for it).
        prefill_chunk_alone: the same while no request decodes or waits (0: n_batch): larger ubatches prefill faster.
        batch_decode: one llama_decode for all generating slots; only where that is bit-identical to decoding
            alone (calibration.check_batch_invariance), or cached and concurrent outputs may differ from cold.
        prefill_tps: measured prompt tokens/s (calibration.prefill_rate; None: from the first chunk on), refined
            by every chunk: a shared tier's fetch-or-recompute choice reads it.
        driver: the thread to run the worker loop on, shut down on close: the one that made the engine's earlier
            llama_decode calls, since calls from a second thread are slower (engine.EngineThread); None: a new one.

    submit() never blocks on compute; events reach `sink` from the worker thread, so the sink must be
    thread-safe (the server wraps asyncio's call_soon_threadsafe). A job that fails gets an ERROR event, its
    sequence is cleared, and the worker goes on.
    """

    def __init__(self, engine: Engine, cache: SnapshotCache, checkpoint_interval: int = 0, n_slots: int = 1,
                 queue_size: int = 64, timeout_s: float = 0.0, prefill_chunk: int = 128, prefill_chunk_alone: int = 0,
                 batch_decode: bool = False, prefill_tps: float | None = None,
                 driver: EngineThread | None = None, snapshot_min_gap: int = 0) -> None:
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
        self.prefill_chunk = min(max(prefill_chunk, 2 * self.min_segment), engine.n_batch)
        self.prefill_chunk_alone = min(max(prefill_chunk_alone or engine.n_batch, self.prefill_chunk), engine.n_batch)
        self.batch_decode = batch_decode
        self._waiting: collections.deque[Task] = collections.deque()
        self._cond = threading.Condition()
        self._order = itertools.count()
        self._job_s = 5.0  # moving average of request durations, for Retry-After
        self._closed = False
        self._flushes: list[concurrent.futures.Future] = []  # flush calls the worker has yet to carry out
        self._trimmer = HeapTrimmer()
        self._driver = driver or EngineThread()
        self._worker_done = self._driver.submit(self._worker)

    # ------------------------------------------------------------------ public

    def submit(self, job: Job, sink: Sink, cancel: threading.Event | None = None) -> threading.Event:
        """Queue a job; returns its cancel flag (set it to stop the job at the next step).

        Raises ContextOverflow (prompt does not fit a slot), OrchestratorError (empty prompt), InvalidRequest
        (job.n outside 1..n_slots), QueueFull (`queue_size` requests already waiting; `retry_after` says in how
        many seconds to retry).
        """
        job.check(self.engine.n_ctx, len(self.slots))
        cancel = cancel or threading.Event()
        with self._cond:
            if self._closed:
                raise OrchestratorError("the server is shutting down")
            idle = sum(s.task is None for s in self.slots)
            if len(self._waiting) >= self.queue_size + idle:
                waves = (len(self._waiting) + len(self.slots)) / len(self.slots)
                raise QueueFull(len(self._waiting), max(1, min(60, math.ceil(self._job_s * waves))))
            limit = self.timeout_s if job.timeout_s is None else job.timeout_s
            self._waiting.append(Task(job, sink, cancel, next(self._order), limit))
            self._cond.notify_all()
        return cancel

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
        """Drop every snapshot of the cache's local tiers and forget what the slots hold (POST /v1/cache/flush), so
        that no request admitted afterwards reuses state computed before: every idle slot's sequence is cleared;
        every after-generation re-prefill (STORE) is dropped with its sequence, since it would store a pre-flush
        state; a request being prefilled or decoded goes on, but stores nothing more, its slot's live KV is offered
        to no other request, and the slot is cleared when it leaves. Carried out by the worker thread (the engine's
        only user) between two steps, so nothing is stored in between; returns how many entries went.

        Raises OrchestratorError when the worker did not get to it within `timeout` seconds (a step is one prefill
        chunk or one decode step: milliseconds to seconds), or when the server is shutting down; the flush may
        still happen at the worker's next step."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise OrchestratorError("the server is shutting down")
            self._flushes.append(done)
            self._cond.notify_all()
        try:
            return done.result(timeout)
        except concurrent.futures.TimeoutError:
            raise OrchestratorError(f"the cache flush did not complete within {timeout:.0f} s: the worker is busy "
                                    "with a long step; retry", code="flush_incomplete") from None

    def _flush(self) -> None:
        """The worker's side of `flush`."""
        with self._cond:
            pending, self._flushes = self._flushes, []
        if not pending:
            return
        try:
            for slot in self.slots:
                if slot.task is not None and slot.task.phase == Phase.STORE:
                    self._release(slot.task)
                if slot.task is None:
                    self._forget(slot)
                else:
                    slot.stale = True  # cleared in _release
                    slot.task.store = False
            n = self.cache.clear()
        except Exception as e:  # noqa: BLE001 - reported to the caller; the worker goes on
            log.exception("cache flush failed")
            for done in pending:
                done.set_exception(e)
            return
        for done in pending:
            done.set_result(n)

    @property
    def queue_length(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiting)

    @property
    def slots_busy(self) -> int:
        """Slots serving a request (prefill, decode, or storing its after-generation snapshot)."""
        return sum(s.task is not None for s in self.slots)

    def close(self) -> None:
        """Stop the worker; queued and running jobs get an error."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        try:
            self._worker_done.result(timeout=30)
        except concurrent.futures.TimeoutError:
            log.warning("the scheduler's worker did not stop within 30 s")
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
            # Idle: fault in one more spare checkpoint buffer (about 13 ms on the 0.8b), so that the next
            # prefill's saves skip that cost (orchestrator/buffers.py); an arrival waits for at most one.
            if idle and self._fill_spare():
                continue
            with self._cond:
                while not self._closed and not self._waiting and not self._active() and not self._flushes:
                    self._cond.notify_all()  # wake drain()
                    self._cond.wait(self._trimmer.interval_s)
                    self._trimmer.maybe_trim()
                if self._closed:
                    break
            try:
                self._flush()
                self._expire()
                self._admit()
                if not self._step():
                    with self._cond:  # only requests waiting on others' snapshots, and nothing to compute
                        self._cond.wait(0.01)
                self._trimmer.maybe_trim()
            except Exception:  # noqa: BLE001 - the worker must survive anything; tasks fail on their own paths
                log.exception("scheduler step failed")
                for task in self._active():
                    self._fail(task, EngineError("internal error in the scheduler; see the server log"))
        with self._cond:
            pending, self._waiting = list(self._waiting), collections.deque()
            flushes, self._flushes = self._flushes, []
        for done in flushes:
            done.set_exception(OrchestratorError("the server is shutting down"))
        for task in pending + self._active():
            self._fail(task, OrchestratorError("the server is shutting down"))

    def _fill_spare(self) -> bool:
        """One more spare checkpoint buffer (Engine.fill_spare); on a failure (out of memory), none from then on:
        saves go to new memory as they did without spares, and the worker goes on."""
        try:
            return self.engine.fill_spare()
        except Exception:  # noqa: BLE001 - spares are an optimisation; losing them must not stop the worker
            log.warning("could not keep spare checkpoint buffers; saves go to new memory", exc_info=True)
            self.engine.drop_spares()
            return False

    def _expire(self) -> None:
        """Drop cancelled and timed-out requests, queued or running."""
        now = time.perf_counter()
        with self._cond:
            gone = [t for t in self._waiting if t.expired(now)]
            for t in gone:
                self._waiting.remove(t)
        for t in gone:
            self._deliver(t, Event(EventKind.ERROR, error=t.stop_error(now)))
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
        """Start waiting requests, oldest first; a request that would reuse a snapshot an earlier request is
        about to store waits (`Reuse.must_wait`). A slot re-prefilling an after-generation state (STORE) is
        not busy for them: a request that extends what it computed so far takes it over and goes on from there
        (`Reuse.take_over`), and when no slot is free a STORE task is dropped at this chunk boundary to make
        room (its sequence keeps the exact prefix it reached, a live source like any other)."""
        with self._cond:
            queued = list(self._waiting)
        for task in queued:
            free, storing = self._room()
            if len(free) + len(storing) < task.job.n:
                return  # oldest first: an n-choice job is not overtaken while it waits for n slots
            if self.reuse.must_wait(task, self._active() + queued):
                continue
            with self._cond:
                self._waiting.remove(task)
            for t in [task] + task.fork():  # choice 0 first: it picks the slot that restores most
                if task.phase == Phase.DONE:
                    break  # choice 0 failed: the others are never placed
                self._guard(t, self._place, t, *self._room())

    def _room(self) -> tuple[list[Slot], list[Slot]]:
        """(free slots, slots storing an after-generation state: never busy for a waiting request)."""
        return ([s for s in self.slots if s.task is None],
                [s for s in self.slots if s.task is not None and s.task.phase == Phase.STORE])

    def _place(self, task: Task, free: list[Slot], storing: list[Slot]) -> None:
        """Bind the task to the slot `Reuse.choose` picks (a STORE task there is taken over or dropped at this
        chunk boundary) and restore its deepest reusable prefix (one step: what is reported as cached is what
        was restored)."""
        slot, depth = self.reuse.choose(task, free, storing)
        if slot.task is not None:
            if not depth:
                self.reuse.preempt(slot.task)
            self._release(slot.task)
        task.slot, slot.task = slot, task
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
        """One decode step and one prefill chunk; False when there was nothing to compute. After-generation
        re-prefills (STORE) get a chunk only when no request is decoding or prefilling: they are the caller's
        past, not anyone's wait (a request arriving meanwhile waits at most for that one chunk)."""
        active = self._active()
        decoding = [t for t in active if t.phase == Phase.DECODE and t.pending is not None]
        if decoding:
            self._decode(decoding)
        filling = [t for t in active if t.phase == Phase.PREFILL]
        if not filling and not decoding:
            filling = [t for t in active if t.phase == Phase.STORE]
        if filling:
            task = min(filling, key=self._fill_order)
            # Small chunks while others decode or wait in the queue (512-token chunks delayed short requests by
            # ~3 s on the 0.8b, 128 by < 1 s; bench/bench_slots.py); otherwise fewer passes over the weights
            # (bench_prefill.py). Other prefills do not count: they wait for this one to finish (_fill_order),
            # so smaller chunks would only make both later.
            alone = task.phase == Phase.PREFILL and not decoding and not self._waiting
            self._guard(task, self._prefill_chunk, task, self.prefill_chunk_alone if alone else self.prefill_chunk)
        return bool(decoding or filling)

    def _fill_order(self, t: Task) -> tuple[float, int]:
        """Which prefill advances first: the one that would finish first had it been served alone since it was
        submitted (submission time + tokens left ÷ the measured prefill speed), the older on a tie. Among prompts
        that arrive together that is shortest-remaining-first, which minimises the sum of their TTFTs (agents'
        tool results of 200 and 1,500 tokens: the short one is not held up by the long one's chunks); a prompt
        that has waited as long as its remainder takes goes before any later arrival, so none waits for ever.
        Before any prefill was measured (the first chunk of the server's life), arrival order."""
        rate = self.reuse.prefill.tokens_per_s
        if not rate:
            return t.clock.submitted, t.order
        return t.clock.submitted + (len(t.work) - t.pos) / rate, t.order

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
        """One decode step for the generating slots (one llama_decode if batching, else one each), then sample."""
        tasks.sort(key=lambda t: t.slot.seq)
        if self.batch_decode and len(tasks) > 1:
            try:
                self.engine.decode_step([(t.slot.seq, t.pending, t.n + len(t.out) - 1) for t in tasks])
            except EngineError as e:
                for t in tasks:
                    self._fail(t, e)
                return
            for i, t in enumerate(tasks):
                self._guard(t, self._sample, t, i)
            return
        for t in tasks:
            self._guard(t, self._decode_one, t)

    def _decode_one(self, t: Task) -> None:
        self.engine.decode(t.slot.seq, [t.pending], t.n + len(t.out) - 1)
        self._sample(t, -1)

    def _prefill_chunk(self, t: Task, chunk: int) -> None:
        """Prefill the next chunk of the task's `work`, ending at the next snapshot position; at the end of the
        prompt, go on to decoding (or, in STORE, store the branch end and release the slot)."""
        n = len(t.work)
        target = t.positions[0] if t.positions else n
        end = min(t.pos + chunk, target)
        if 0 < target - end < self.min_segment:  # never leave a remainder shorter than min_segment
            end = target if target - t.pos <= self.engine.n_batch else target - self.min_segment
        final = end == n
        # live is extended only after a chunk is decoded; a failed decode clears the sequence.
        started = time.perf_counter()
        self.engine.decode(t.slot.seq, t.work[t.pos:end], t.pos, want_logits=final and t.phase == Phase.PREFILL)
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
        for c in [c for c in forks if c.phase == Phase.FORK] + [t]:  # all from the same logits, untouched by copies
            self._guard(c, self._start, c)

    def _start(self, t: Task) -> None:
        """Sample the first token from the prompt's logits and go on to decoding."""
        if t.job.want_logits:
            t.first_logits = self.engine.logits()
        t.sampler = self.engine.sampler(t.job.sampling, t.deadline)
        t.phase = Phase.DECODE
        self._sample(t, -1)  # now: the next llama_decode overwrites these logits

    def _sample(self, t: Task, idx: int) -> None:
        tok = t.sampler.sample(idx)
        if t.clock.first_token is None:
            t.clock.first_token = time.perf_counter()
        eog = self.engine.is_eog(tok)
        if t.logprobs is not None and not eog:
            t.logprobs.append(self.engine.logprob(tok, t.job.logprobs, idx))
        delta, done = t.take(tok, eog, b"" if eog else self.engine.piece(tok), self.engine.n_ctx)
        if delta:
            t.sink(t.text_event(delta))
        if done:
            self._finish(t)

    # ------------------------------------------------------------------ completion

    def _finish(self, t: Task) -> None:
        """Deliver the result, then store the state after generation (or at the end of the prompt)."""
        result = t.conclude(time.perf_counter())
        self._job_s = 0.8 * self._job_s + 0.2 * result.total_s
        self._deliver(t, Event(EventKind.DONE, result=result))
        if self.reuse.after_generation(t):
            t.phase = Phase.STORE
        else:
            self._release(t)

    def _deliver(self, t: Task, ev: Event) -> None:
        if t.delivered:
            return
        t.delivered = True
        try:
            t.sink(ev)
        except Exception:  # noqa: BLE001 - a broken sink must not stop the worker
            log.warning("event sink failed", exc_info=True)

    def _fail(self, t: Task, err: OrchestratorError) -> None:
        """End a task with an error. Checkpoints stored so far stay valid; the sequence keeps what was prefilled
        (a valid state at `pos`, and `live` says so) unless llama.cpp failed, which clears it."""
        if t.sampler is not None:
            t.sampler.close()
        if t.slot is not None and isinstance(err, EngineError):
            self.reuse.reset(t.slot)
        self._deliver(t, Event(EventKind.ERROR, error=err))
        if t.slot is not None:
            self._release(t)
        for c in t.choices:  # choices waiting for this one's prompt state never get it
            if c.phase == Phase.FORK:
                self._fail(c, err)

    def _forget(self, slot: Slot) -> None:
        """A flush reached this free slot: clear its sequence and its prompt_cache_key affinity."""
        self.reuse.reset(slot)
        slot.key = ""

    def _release(self, t: Task) -> None:
        slot = t.slot
        if slot is not None and slot.task is t:
            slot.task = None
            slot.last_used = time.perf_counter()
            if slot.stale:  # it served across a flush: what it holds was computed before
                self._forget(slot)
        t.phase = Phase.DONE
        with self._cond:
            self._cond.notify_all()
