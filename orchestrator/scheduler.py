"""Scheduler: N slots (sequences of one llama.cpp context) served by one worker thread that owns the engine.

A request waits in a bounded queue until a slot is free. Admission is one step of the worker, so the lookup,
the restore and the cached_tokens the request reports are the tokens actually restored:

  1. pick the slot: the one whose live state restores the longest prefix of the prompt (its own KV plus a
     stored checkpoint), else the least valuable idle slot (empty first, then least recently used);
  2. reuse: the deepest snapshot that prefixes the prompt and leaves at least min_segment tokens to prefill,
     else a cleared sequence.

Then the worker loops over steps; each step is

  * one decode step for every slot that is generating: their next tokens go into one llama_decode call when
    the model is batch-invariant (Engine.check_batch_invariance), else one call per slot;
  * one prefill chunk for one prefilling slot, in turn: at most `prefill_chunk` tokens, never crossing a
    snapshot position. A long prefill thus advances between
    other conversations' tokens instead of stalling them for its whole duration.

A prefill segment ends at each template boundary (and interval checkpoint), where a recurrent checkpoint is
saved, and at the repeat point, min_segment tokens before the end of the prompt: the last position any request
can restore, so an identical repeat prefills only min_segment tokens. After the result is delivered, the slot
stores the state after generation by restoring the repeat point and prefilling the rest of the prompt and the
generated tokens (plus the end-of-turn token) as one batch, in chunks like any prefill; the slot stays busy
until then.

Why segments of at least `min_segment` tokens, and why the after-generation state is re-prefilled instead of
saved from decoding: with the engine's settings (flash attention off; see "Numerics" in engine.py) any split of
a prefill into ubatches of at least Engine.min_segment tokens (measured at start: 2 for F16 weights, 8 for
Q4_K_M on x86) gives bit-identical states and logits, but shorter ubatches, and a token computed alone (as in
decoding), do not. So every stored state is one a cold prefill reproduces exactly,
and cached runs equal cold runs bit for bit (tests/test_correctness.py, tests/test_slots.py).

Sequential semantics: a request that shares a prefix with an earlier request still in flight (or still
queued) waits while that request is about to store a snapshot deeper than anything stored now, instead of
prefilling the shared prefix a second time. So concurrent requests report the cached_tokens a sequential run
reports, and a fleet of agents sharing a tools block prefills it once. Requests that share nothing pass.

Cancellation and limits: a cancelled request (client gone) leaves its slot at the next step; a request past
its deadline (`timeout_s`) fails with RequestTimeout; a full queue refuses new requests with QueueFull (the
server's 429). Checkpoints stored before a cancellation stay valid (each is complete at its position); the
end-of-prompt state of a request cancelled during prefill is never stored.

With `use_cache=False` a job is a cold run: its slot is cleared, the whole prompt is prefilled with the same
rules, nothing is read or stored. That is the correctness oracle the tests compare against.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .cache import SnapshotCache
from .engine import Engine, Sampler, SamplingParams
from .memory import HeapTrimmer
from .errors import ContextOverflow, EngineError, OrchestratorError, QueueFull, RequestCancelled, RequestTimeout
from .radix import CHECKPOINT, KV, common_len
from .stops import TextStream

log = logging.getLogger("orchestrator.scheduler")

PREFILL, DECODE, FOLLOWUP = "prefill", "decode", "followup"


@dataclass
class Job:
    """One generation request, already tokenized.

    prompt_tokens: the prompt (n_prompt tokens). boundaries: token offsets where snapshots are taken
    (0 < b < n_prompt). max_tokens: completion budget. stop: stop strings. want_logits: keep the first-step
    logits (float32, shape (n_vocab,)) in the result, for correctness checks. prompt_cache_key: OpenAI's
    routing hint; requests with the same key prefer the slot that last served it. timeout_s: seconds from
    submission to completion (None: the scheduler's default; 0: none).
    """

    prompt_tokens: list[int]
    boundaries: Sequence[int] = ()
    max_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    use_cache: bool = True
    want_logits: bool = False
    prompt_cache_key: str = ""
    timeout_s: float | None = None
    cache_salt: str = ""  # snapshots are shared only among jobs with the same salt ("" = the shared cache)


@dataclass
class Result:
    """What a job produced. Times in seconds; ttft_s and total_s count from submission (queue wait included)."""

    completion_tokens: list[int]
    text: str
    finish_reason: str  # "stop" (end-of-generation token or stop string) or "length"
    prompt_tokens: int
    cached_tokens: int
    restore_source: str  # "live", "ram", "disk" or "none"
    restore_s: float
    prefill_s: float
    ttft_s: float
    total_s: float
    snapshots_saved: int
    snapshot_s: float = 0.0  # part of prefill_s (and ttft_s) spent saving snapshots
    first_logits: np.ndarray | None = None
    queue_s: float = 0.0  # waiting for a slot
    slot: int = 0


@dataclass(frozen=True)
class Event:
    """Streamed to the caller: kind "text" (a delta), "done" (result set) or "error" (error set)."""

    kind: str
    text: str = ""
    result: Result | None = None
    error: OrchestratorError | None = None


Sink = Callable[[Event], None]


class _Task:
    """A job from submission to release: its slot, phase and progress. Touched by the worker thread only
    (after submission)."""

    def __init__(self, job: Job, sink: Sink, cancel: threading.Event, order: int, deadline: float | None) -> None:
        self.job, self.sink, self.cancel, self.order, self.deadline = job, sink, cancel, order, deadline
        self.tokens = list(job.prompt_tokens)
        self.n = len(self.tokens)
        self.t_submit = time.perf_counter()
        self.slot: Slot | None = None
        self.phase = ""
        self.work: list[int] = self.tokens  # what the current prefill-like phase brings into the sequence
        self.pos = 0  # tokens of `work` in the sequence
        self.positions: list[int] = []  # snapshot positions still ahead in `work`, ascending
        self.store = False
        self.cached, self.source, self.saved, self.snapshot_s = 0, "none", 0, 0.0
        self.t_admit = self.t_restored = self.t_prefilled = 0.0
        self.ttft: float | None = None
        self.first_logits: np.ndarray | None = None
        self.sampler: Sampler | None = None
        self.stream: TextStream | None = None
        self.out: list[int] = []
        self.eog: int | None = None
        self.finish = "length"
        self.pending: int | None = None  # the token to decode next
        self.repeat_point = 0  # n - min_segment: the end-of-request checkpoint (see Scheduler._start)
        self.delivered = False  # "done" or "error" was sent


@dataclass
class Slot:
    """One sequence of the context. live: tokens whose KV the sequence holds, computed by prefill."""

    seq: int
    live: list[int] = field(default_factory=list)
    key: str = ""  # prompt_cache_key of the last request served here
    salt: str = ""  # cache_salt of the request whose state the sequence holds
    last_used: float = 0.0
    task: _Task | None = None


class Scheduler:
    """Bounded queue + worker thread over `n_slots` engine sequences and one snapshot cache.

    Args:
        engine: an Engine with n_seq_max >= n_slots.
        cache: the snapshot cache.
        checkpoint_interval: tokens between interval checkpoints inside long stretches (0 = off).
        n_slots: concurrent requests (sequences 0..n_slots-1).
        queue_size: most requests waiting for a slot; more are refused with QueueFull.
        timeout_s: default per-request limit in seconds from submission (0 = none).
        prefill_chunk: most prompt tokens prefilled in one step (a request arriving meanwhile waits for it).
        batch_decode: put the decode steps of all generating slots into one llama_decode call. Only set it when
            that is bit-identical to decoding alone (Engine.check_batch_invariance), or cached and concurrent
            outputs may differ from cold ones.

    submit() never blocks on compute; events reach `sink` from the worker thread, so the sink must be
    thread-safe (the server wraps asyncio's call_soon_threadsafe). A job that fails gets an "error" event, its
    sequence is cleared, and the worker goes on.
    """

    def __init__(self, engine: Engine, cache: SnapshotCache, checkpoint_interval: int = 0, n_slots: int = 1,
                 queue_size: int = 64, timeout_s: float = 0.0, prefill_chunk: int = 128,
                 batch_decode: bool = False) -> None:
        if not 1 <= n_slots <= engine.n_seq_max:
            raise ValueError(f"n_slots must be 1..{engine.n_seq_max} (the engine's sequences), got {n_slots}")
        self.engine = engine
        self.min_segment = engine.min_segment  # fewest tokens per prefill ubatch; see the module docstring
        self.cache = cache
        self.checkpoint_interval = checkpoint_interval
        self.queue_size = queue_size
        self.timeout_s = timeout_s
        self.prefill_chunk = min(max(prefill_chunk, 2 * self.min_segment), engine.n_batch)
        self.batch_decode = batch_decode
        self.slots = [Slot(seq) for seq in range(n_slots)]
        self._waiting: collections.deque[_Task] = collections.deque()
        self._cond = threading.Condition()
        self._order = itertools.count()
        self._turn = 0  # round-robin cursor over prefilling slots
        self._job_s = 5.0  # moving average of request durations, for Retry-After
        self._closed = False
        self._trimmer = HeapTrimmer()
        self._thread = threading.Thread(target=self._worker, name="orchestrator-worker", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public

    def submit(self, job: Job, sink: Sink, cancel: threading.Event | None = None) -> threading.Event:
        """Queue a job; returns its cancel flag (set it to stop the job at the next step).

        Raises ContextOverflow (prompt does not fit a slot), OrchestratorError (empty prompt), QueueFull
        (`queue_size` requests already waiting; `retry_after` says in how many seconds to retry).
        """
        if len(job.prompt_tokens) + 1 > self.engine.n_ctx:
            raise ContextOverflow(len(job.prompt_tokens), self.engine.n_ctx)
        if not job.prompt_tokens:
            raise OrchestratorError("empty prompt")
        cancel = cancel or threading.Event()
        limit = self.timeout_s if job.timeout_s is None else job.timeout_s
        with self._cond:
            if self._closed:
                raise OrchestratorError("the server is shutting down")
            idle = sum(s.task is None for s in self.slots)
            if len(self._waiting) >= self.queue_size + idle:
                waves = (len(self._waiting) + len(self.slots)) / len(self.slots)
                raise QueueFull(len(self._waiting), max(1, min(60, math.ceil(self._job_s * waves))))
            task = _Task(job, sink, cancel, next(self._order), None)
            task.deadline = task.t_submit + limit if limit else None
            self._waiting.append(task)
            self._cond.notify_all()
        return cancel

    def run(self, job: Job) -> Result:
        """Submit and wait (for tests, benchmarks and the CLI). Raises the job's error."""
        done = threading.Event()
        box: list[Event] = []

        def sink(ev: Event) -> None:
            if ev.kind in ("done", "error"):
                box.append(ev)
                done.set()

        self.submit(job, sink)
        done.wait()
        if box[0].kind == "error":
            raise box[0].error
        return box[0].result

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no job is queued or in a slot (after-generation snapshots included). False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._waiting and not self._active(), timeout)

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
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ worker

    def _active(self) -> list[_Task]:
        return [s.task for s in self.slots if s.task is not None]

    def _worker(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._waiting and not self._active():
                    self._cond.notify_all()  # wake drain()
                    self._cond.wait(self._trimmer.interval_s)
                    self._trimmer.maybe_trim()
                if self._closed:
                    break
            try:
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
        for task in pending + self._active():
            self._fail(task, OrchestratorError("the server is shutting down"))

    def _expire(self) -> None:
        """Drop cancelled and timed-out requests, queued or running."""
        now = time.perf_counter()
        with self._cond:
            gone = [t for t in self._waiting if t.cancel.is_set() or (t.deadline and now > t.deadline)]
            for t in gone:
                self._waiting.remove(t)
        for t in gone:
            self._deliver(t, Event("error", error=self._stop_error(t)))
        for t in self._active():
            if t.delivered:
                continue  # storing its after-generation snapshot: not the caller's time any more
            if t.cancel.is_set() or (t.deadline and now > t.deadline):
                if t.phase == DECODE and t.cancel.is_set():
                    self._finish(t)  # deliver what was generated; the caller is gone or done
                else:
                    self._fail(t, self._stop_error(t))

    def _stop_error(self, t: _Task) -> OrchestratorError:
        if t.cancel.is_set():
            return RequestCancelled()
        return RequestTimeout(time.perf_counter() - t.t_submit)

    # ------------------------------------------------------------------ admission

    def _admit(self) -> None:
        """Start waiting requests, oldest first, on free slots; a request that would reuse a snapshot an
        earlier request is about to store waits (module docstring, "Sequential semantics")."""
        free = [s for s in self.slots if s.task is None]
        if not free:
            return
        with self._cond:
            queued = list(self._waiting)
        for task in queued:
            if not free:
                return
            if task.job.use_cache and self._blocked(task, queued):
                continue
            slot = self._pick_slot(task, free)
            with self._cond:
                self._waiting.remove(task)
            free.remove(slot)
            try:
                self._start(task, slot)
            except OrchestratorError as e:
                self._fail(task, e)
            except Exception as e:  # noqa: BLE001
                log.exception("admission failed")
                self._fail(task, EngineError(f"internal error: {e}"))

    def _plans(self, tokens: list[int], salt: str) -> list:
        """The restore plan of `tokens` under `salt` with each slot's live KV (stored entries are the same for
        all; a slot holding another salt's state offers none)."""
        lim = len(tokens) - self.min_segment
        return [self.cache.plan(tokens, lim, s.live if s.salt == salt else (), salt=salt) for s in self.slots]

    def _blocked(self, task: _Task, queued: Sequence[_Task]) -> bool:
        avail = max(p.n_tokens for p in self._plans(task.tokens, task.job.cache_salt))
        upto = task.n - self.min_segment
        if upto <= avail:
            return False
        for other in self._active() + list(queued):
            if other.order >= task.order or not other.job.use_cache or other.job.cache_salt != task.job.cache_salt:
                continue
            shared = min(common_len(other.tokens, task.tokens), upto)
            if shared <= avail:
                continue
            if shared == other.n:
                return True  # it extends the other's whole prompt: wait for its after-generation state too
            if other.phase in ("", PREFILL):
                ahead = other.positions if other.phase else self._positions(other.job, other.n)
                if any(avail < p <= shared for p in ahead):
                    return True
        return False

    def _pick_slot(self, task: _Task, free: Sequence[Slot]) -> Slot:
        """The free slot whose own live KV restores the deepest prefix (no copy), else, by preference, the last
        slot of the same prompt_cache_key, an empty slot, the least recently used."""
        depth = ([p.n_tokens for p in self._plans(task.tokens, task.job.cache_salt)] if task.job.use_cache
                 else [0] * len(self.slots))
        best = max(depth)

        def score(s: Slot):
            key = bool(task.job.prompt_cache_key) and s.key == task.job.prompt_cache_key
            return (best > 0 and depth[s.seq] == best, key, not s.live, -s.last_used)

        return max(free, key=score)

    def _start(self, task: _Task, slot: Slot) -> None:
        """Bind the task to the slot and restore its deepest reusable prefix (one step: what is reported as
        cached is what was restored)."""
        task.slot, slot.task = slot, task
        slot.key = task.job.prompt_cache_key
        task.t_admit = time.perf_counter()
        start, task.source = self._reuse(slot, task.tokens, task.job.use_cache, task.job.cache_salt)
        slot.salt = task.job.cache_salt
        task.cached = task.pos = start
        task.t_restored = time.perf_counter()
        task.store = task.job.use_cache and task.n >= self.min_segment  # else the prompt is a too-short ubatch
        kept, pos = [], start
        candidates = self._positions(task.job, task.n)
        if task.store:
            # The repeat point: the last position an identical request can restore (it must prefill at least
            # min_segment tokens). Taken instead of a checkpoint at the very end, which nothing could restore.
            task.repeat_point = task.n - self.min_segment
            candidates = sorted(set(candidates) | {task.repeat_point})
        for b in self.engine.state.snapshot_positions(candidates):
            if b - pos >= self.min_segment and task.n - b >= self.min_segment:
                kept.append(b)
                pos = b
        task.positions = kept
        task.phase = PREFILL

    def _reuse(self, slot: Slot, tokens: list[int], use_cache: bool, salt: str) -> tuple[int, str]:
        """Bring the slot's sequence to the deepest reusable prefix of `tokens`; returns (n_tokens, tier).

        The KV may come from a stored entry, the slot's own sequence, or another slot's sequence (busy or not:
        its state is saved and its KV part loaded here, bytes llama.cpp itself wrote, so the copy is exact).
        """
        if use_cache:
            for _attempt in range(3):  # a part that vanished (evicted, corrupt on disk) is dropped: plan again
                plans = self._plans(tokens, salt)
                src = max(self.slots, key=lambda s: (plans[s.seq].n_tokens, s is slot))
                plan = plans[src.seq]
                if plan.n_tokens == 0:
                    break
                parts = self.cache.load(plan)
                if parts is None:
                    continue
                kv, checkpoint = parts
                try:
                    if kv is None and src is not slot:  # the KV is live in another slot: copy it as bytes
                        kv = self.engine.state.save(self.engine, src.seq, (KV,))[KV]
                    self.engine.state.restore(self.engine, slot.seq, plan.n_tokens, kv, checkpoint)
                except EngineError:  # the sequence is cleared: drop what failed and plan again
                    log.warning("llama.cpp refused a snapshot restore; its entries are dropped", exc_info=True)
                    self._reset(slot)
                    self.cache.discard(plan)
                    continue
                slot.live = tokens[: plan.n_tokens]
                return plan.n_tokens, plan.tier
        self._reset(slot)
        return 0, "none"

    def _positions(self, job: Job, n: int) -> list[int]:
        """Snapshot positions: the template boundaries, plus a checkpoint every `checkpoint_interval` tokens
        inside any stretch between two boundaries that is longer than that (a long tool output or document).

        Interval positions count from the boundary before them, so two prompts that share that boundary and
        diverge inside the long message share their interval checkpoints too.
        """
        bounds = sorted(b for b in set(job.boundaries) if 0 < b < n)
        step = self.checkpoint_interval
        if not step:
            return bounds
        extra = []
        for lo, hi in zip([0] + bounds, bounds + [n]):
            extra.extend(range(lo + step, hi, step))
        return sorted(set(bounds) | set(extra))

    # ------------------------------------------------------------------ steps

    def _step(self) -> bool:
        """One decode step and one prefill chunk; False when there was nothing to compute."""
        active = self._active()
        decoding = [t for t in active if t.phase == DECODE and t.pending is not None]
        if decoding:
            self._decode(decoding)
        filling = [t for t in self._active() if t.phase in (PREFILL, FOLLOWUP)]
        if filling:
            filling.sort(key=lambda t: (t.slot.seq - self._turn) % len(self.slots))
            task = filling[0]
            self._turn = (task.slot.seq + 1) % len(self.slots)
            # Always at most prefill_chunk, also when alone: a request arriving mid-chunk waits for that chunk
            # (measured: 512-token chunks delayed short requests by ~3 s on the 0.8b, 128 by < 1 s, at the same
            # prefill speed; bench/bench_slots.py).
            self._guard(task, self._prefill_chunk, task, self.prefill_chunk)
        return bool(decoding or filling)

    def _guard(self, task: _Task, fn, *args) -> None:
        try:
            fn(*args)
        except OrchestratorError as e:
            self._fail(task, e)
        except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
            log.exception("request failed")
            self._fail(task, EngineError(f"internal error: {e}"))

    def _decode(self, tasks: list[_Task]) -> None:
        """One decode step for the generating slots, then sample each."""
        tasks.sort(key=lambda t: t.slot.seq)
        if self.batch_decode and len(tasks) > 1:
            items = [(t.slot.seq, t.pending, t.n + len(t.out) - 1) for t in tasks]
            try:
                self.engine.decode_step(items)
            except EngineError as e:
                for t in tasks:
                    self._fail(t, e)
                return
            for i, t in enumerate(tasks):
                self._guard(t, self._sample, t, i)
            return
        for t in tasks:
            self._guard(t, self._decode_one, t)

    def _decode_one(self, t: _Task) -> None:
        self.engine.decode(t.slot.seq, [t.pending], t.n + len(t.out) - 1)
        self._sample(t, -1)

    def _prefill_chunk(self, t: _Task, chunk: int) -> None:
        """Prefill the next chunk of the task's `work`, ending at the next snapshot position, where a checkpoint
        is saved; at the end of the prompt, go on to decoding (or, after a followup, store the branch end)."""
        slot, n = t.slot, len(t.work)
        target = t.positions[0] if t.positions else n
        end = min(t.pos + chunk, target)
        if 0 < target - end < self.min_segment:  # never leave a remainder shorter than min_segment
            end = target if target - t.pos <= self.engine.n_batch else target - self.min_segment
        final = end == n
        # live is extended only after a chunk is decoded; a failed decode clears the sequence.
        self.engine.decode(slot.seq, t.work[t.pos:end], t.pos, want_logits=final and t.phase == PREFILL)
        slot.live = t.work[:end] if n >= self.min_segment else []  # a too-short ubatch's KV is no reusable source
        t.pos = end
        if t.positions and end == t.positions[0]:
            t.positions.pop(0)
            if t.store:  # the repeat point too counts as a boundary: it keeps its branch's KV, as a user-message
                # end did when restores could leave 2 tokens to prefill
                t.saved += self._store(t, t.work[:end], (CHECKPOINT,), boundary=True)
        if not final:
            return
        if t.phase == FOLLOWUP:
            self._store(t, t.work, (KV, CHECKPOINT), boundary=False)
            self._release(t)
            return
        self._prefilled(t)

    def _prefilled(self, t: _Task) -> None:
        t.t_prefilled = time.perf_counter()
        if t.job.want_logits:
            t.first_logits = self.engine.logits()
        t.sampler = Sampler(t.job.sampling)
        t.stream = TextStream(stop=t.job.stop)
        t.phase = DECODE
        self._sample(t, -1)  # now: the next llama_decode overwrites these logits

    def _sample(self, t: _Task, idx: int) -> None:
        eng = self.engine
        tok = t.sampler.sample(eng.ctx, idx)
        if t.ttft is None:
            t.ttft = time.perf_counter() - t.t_submit
        t.pending = None
        if eng.is_eog(tok):
            t.finish, t.eog = "stop", tok
            return self._finish(t)
        t.out.append(tok)
        delta = t.stream.push(eng.piece(tok))
        if delta:
            t.sink(Event("text", text=delta))
        if t.stream.stopped:
            t.finish = "stop"
            return self._finish(t)
        if len(t.out) >= t.job.max_tokens or t.n + len(t.out) >= eng.n_ctx:
            return self._finish(t)
        t.pending = tok

    # ------------------------------------------------------------------ completion

    def _finish(self, t: _Task) -> None:
        """Deliver the result, then store the state after generation (or at the end of the prompt)."""
        tail = t.stream.finish()
        if tail:
            t.sink(Event("text", text=tail))
        t_end = time.perf_counter()
        total = t_end - t.t_submit
        self._job_s = 0.8 * self._job_s + 0.2 * total
        result = Result(
            completion_tokens=t.out, text=t.stream.text, finish_reason=t.finish, prompt_tokens=t.n,
            cached_tokens=t.cached, restore_source=t.source, restore_s=t.t_restored - t.t_admit,
            prefill_s=t.t_prefilled - t.t_restored, ttft_s=t.ttft if t.ttft is not None else total, total_s=total,
            snapshots_saved=t.saved, snapshot_s=t.snapshot_s, first_logits=t.first_logits,
            queue_s=t.t_admit - t.t_submit, slot=t.slot.seq)
        t.sampler.close()
        t.pending = None
        self._deliver(t, Event("done", result=result))
        if not t.store:
            return self._release(t)
        generated = t.out + ([t.eog] if t.eog is not None else [])
        full = t.tokens + generated
        try:
            if (t.cancel.is_set() or t.stream.stopped or len(full) > self.engine.n_ctx
                    or self.cache.contains(full, KV, salt=t.job.cache_salt)):
                work = t.tokens  # store the KV where the prompt ends, unless stored already
                if self.cache.contains(work, KV, salt=t.job.cache_salt):
                    return self._release(t)
            else:
                work = full  # the state after the generated tokens (and the end-of-turn token)
            start = self._rewind(t)
            if not start:
                return self._release(t)
            if 0 < len(work) - start < self.min_segment:  # too few generated tokens for an exact prefill
                work = t.tokens
        except Exception:  # noqa: BLE001 - a lost after-generation snapshot is only a later miss
            log.warning("after-generation snapshot failed", exc_info=True)
            self._reset(t.slot)
            return self._release(t)
        t.phase, t.work, t.pos, t.positions = FOLLOWUP, work, start, []

    def _rewind(self, t: _Task) -> int:
        """Drop the decoded tokens: back to a state the followup can prefill on from exactly, and return its
        position (0: none): the deepest position the state kind can rewind to (the prompt's end on a KV-only
        model, the repeat point as a rule on a hybrid one) with the live KV."""
        prompt = t.tokens
        limit = self.engine.state.rewind_limit(len(prompt), self.min_segment)
        plan = self.cache.plan(prompt, limit, prompt, salt=t.job.cache_salt)
        parts = self.cache.load(plan) if plan.n_tokens else None
        if parts is None or parts[0] is not None:
            return 0
        self.engine.state.restore(self.engine, t.slot.seq, plan.n_tokens, None, parts[1])
        t.slot.live = prompt[:plan.n_tokens]
        return plan.n_tokens

    def _store(self, t: _Task, tokens: list[int], kinds: tuple[str, ...], boundary: bool) -> int:
        """Save the entries of `kinds` missing for `tokens` from the slot's current state (one full save gives
        both KV and checkpoint); returns how many were stored."""
        kinds = tuple(k for k in kinds if k in self.engine.state.entry_kinds)
        salt = t.job.cache_salt
        missing = [k for k in kinds if not self.cache.contains(tokens, k, salt=salt)]
        if not missing:
            return 0
        start = time.perf_counter()
        seq = t.slot.seq
        data = self.engine.state.save(self.engine, seq, missing)
        stored = sum(self.cache.put(tokens, k, data[k], boundary, salt=salt) for k in missing)
        t.snapshot_s += time.perf_counter() - start
        return stored

    def _deliver(self, t: _Task, ev: Event) -> None:
        if t.delivered:
            return
        t.delivered = True
        try:
            t.sink(ev)
        except Exception:  # noqa: BLE001 - a broken sink must not stop the worker
            log.warning("event sink failed", exc_info=True)

    def _fail(self, t: _Task, err: OrchestratorError) -> None:
        """End a task with an error. Checkpoints stored so far stay valid; the sequence keeps what was prefilled
        (a valid state at `pos`, and `live` says so) unless llama.cpp failed, which clears it."""
        if t.sampler is not None:
            t.sampler.close()
        if t.slot is not None and isinstance(err, EngineError):
            self._reset(t.slot)
        self._deliver(t, Event("error", error=err))
        if t.slot is not None:
            self._release(t)

    def _release(self, t: _Task) -> None:
        slot = t.slot
        if slot is not None and slot.task is t:
            slot.task = None
            slot.last_used = time.perf_counter()
        t.phase = "done"
        with self._cond:
            self._cond.notify_all()

    def _reset(self, slot: Slot) -> None:
        self.engine.clear(slot.seq)
        slot.live = []
