"""A request inside the scheduler: the job as submitted (`Job`), what it produced (`Result`), the events it
streams (`Event`), its progress from submission to release (`Task`, in a `Phase`), and the sequence that serves
it (`Slot`), with the sampling settings (`SamplingParams`) and log-probabilities (`TokenLogprob`) the API reads
and writes. Plain data, no llama.cpp: the scheduler moves a task through its phases; the reuse rules (reuse.py)
are the only writer of `Task.reuse` (what was restored, the prefill's progress, what was stored) and of a slot's
`live`, `salt` and `stale`.

A job of n > 1 choices is n tasks: choice 0 is queued, restored and prefilled like any job; at its admission
choices 1..n-1 (`Task.fork`) take a slot each and wait (FORK) until choice 0's prompt is prefilled, when its
sequence state is copied to their slots (`Reuse.fork`). Then each samples with its own seed (`Job.choice`),
decodes and delivers its own events (tagged with its `index`); only choice 0 stores (snapshots, and the state
after generation).

    QUEUED ──admit: restore──▶ PREFILL ──prompt done──▶ DECODE ──result delivered──▶ STORE ──▶ DONE
       │                          │                        │                            (after-generation
       └── cancelled / timed out ─┴────────────────────────┴──▶ DONE                     state, if any;
                                                                                      taken over or
                                                                                      preempted at a chunk)

    choices 1..n-1 of an n-choice job:  (admitted with choice 0) FORK ──choice 0's prompt state copied──▶ DECODE
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .errors import ContextOverflow, InvalidRequest, OrchestratorError, RequestCancelled, RequestTimeout
from .output.stops import TextStream

if TYPE_CHECKING:
    from .prompt.boundaries import Boundaries

log = logging.getLogger("orchestrator.request")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request. temperature <= 0 means greedy (llama_sampler_init_greedy).

    grammar: GBNF text (root rule `root`) that every sampled token must fit, "" for none (llama.cpp's grammar
    sampler, first in the chain). grammar_triggers: texts that start the grammar (a lazy grammar: tokens before
    a trigger are not constrained, and the grammar must match from the trigger's text on); empty: the grammar
    constrains from the first token.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    grammar: str = ""
    grammar_triggers: tuple[str, ...] = ()


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of a sampled token and of the most likely tokens at that step: natural logs of the
    softmax of the raw logits (before the grammar, temperature or truncation samplers changed them).

    token: the sampled id; logprob: its log-probability (<= 0); top: (id, logprob) of the k most likely tokens,
    most likely first (k = the request's top_logprobs; ties in id order)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()



class Phase(str, Enum):
    """Where a task is (vLLM's RequestStatus, llama.cpp server's slot_state)."""

    QUEUED = "queued"  # waiting for a slot
    PREFILL = "prefill"  # the prompt's uncached tokens are computed, in chunks
    DECODE = "decode"  # one token a step (none while its grammar has not answered: `Task.held`)
    FORK = "fork"  # choice i > 0 of an n-choice job, in its slot: waits for choice 0's prompt state (Reuse.fork)
    STORE = "store"  # result delivered; the after-generation state is re-prefilled and stored (SGLang's
    #                  cache_finished_req), one chunk at a time while no other request prefills or decodes; a
    #                  new request takes it over (it extends the work) or preempts it (no free slot).
    DONE = "done"  # released


class EventKind(str, Enum):
    TEXT = "text"  # a text delta
    DONE = "done"  # the result
    ERROR = "error"  # the job failed


@dataclass
class Job:
    """One generation request, already tokenized.

    prompt_tokens: the prompt (n_prompt tokens). boundaries: where snapshots may be taken, as found in the
    template (`prompt.boundaries.Boundaries`, the server's) or as token offsets 0 < b < n_prompt that are all
    kept (tests, benchmarks); None or (): none. Reuse.snapshot_positions turns them into prefill stops.
    max_tokens: completion budget. stop: stop strings. want_logits: keep the first-step logits (float32, shape
    (n_vocab,)) in the result, for correctness checks. logprobs: None, or k to record a TokenLogprob (with the
    k most likely tokens) per completion token. prompt_cache_key: OpenAI's
    routing hint; requests with the same key prefer the slot that last served it. timeout_s: seconds from
    submission to completion (None: the scheduler's default; 0: none). restorable_after: given the generated
    token ids (with the end-of-generation token that ended them, if one did), None where the request most
    likely to follow does not start with the prompt and exactly those ids, else the fewest tokens it adds after
    them (`PromptBuilder.restorable_after`); None instead of a probe: assume it does, adding enough. When it
    says no, the state after generation is not computed (issue 18). n: choices, 1..the scheduler's
    slots: the prompt is prefilled once and choice i is sampled as `choice(i)` (seed + i).
    """

    prompt_tokens: list[int]
    boundaries: Boundaries | Sequence[int] | None = ()
    max_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    use_cache: bool = True
    want_logits: bool = False
    prompt_cache_key: str = ""
    timeout_s: float | None = None
    cache_salt: str = ""  # snapshots are shared only among jobs with the same salt ("" = the shared cache)
    logprobs: int | None = None  # None: none; k >= 0: each completion token's logprob and the k most likely
    restorable_after: Callable[[Sequence[int]], int | None] | None = None
    prepare_s: dict[str, float] = field(default_factory=dict)  # seconds spent before submission, by phase
    #                                                            (render, tokenize, boundaries: Prompt's)
    n: int = 1
    tenant: str = ""  # who the queue is fair between (the server's: cache_salt, else prompt_cache_key)

    def check(self, n_ctx: int, n_slots: int) -> None:
        """Whether a scheduler of `n_slots` slots of `n_ctx` tokens can run this job. Raises InvalidRequest (n
        outside 1..n_slots), ContextOverflow (the prompt does not fit a slot), OrchestratorError (empty prompt)."""
        if isinstance(self.n, bool) or not 1 <= self.n <= n_slots:
            raise InvalidRequest(f"'n' is {self.n}: a request gets 1 to {n_slots} choices here, each generated in a "
                                 f"slot of its own (--parallel {n_slots})", param="n")
        if len(self.prompt_tokens) + 1 > n_ctx:
            raise ContextOverflow(len(self.prompt_tokens), n_ctx)
        if not self.prompt_tokens:
            raise OrchestratorError("empty prompt")

    def choice(self, i: int) -> Job:
        """Choice i of this job as a job of its own (n = 1), the one whose cold run that choice equals: the same
        prompt and settings, sampled with seed `sampling.seed + i` (llama.cpp keeps its low 32 bits)."""
        return replace(self, n=1, sampling=replace(self.sampling, seed=self.sampling.seed + i))


@dataclass
class Result:
    """What a job produced. Times in seconds; ttft_s and total_s count from submission (queue wait included)."""

    completion_tokens: list[int]
    text: str
    finish_reason: str  # "stop" (end-of-generation token or stop string) or "length"
    prompt_tokens: int
    cached_tokens: int
    restore_source: str  # "live", "ram", "disk", "remote" or "none"
    restore_s: float
    prefill_s: float
    ttft_s: float
    total_s: float
    snapshots_saved: int
    snapshot_s: float = 0.0  # part of prefill_s (and ttft_s) spent saving snapshots
    first_logits: np.ndarray | None = None
    slot: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per completion token when the job asked for them
    phases: dict[str, float] = field(default_factory=dict)  # the breakdown of total_s (and of the prompt's
    #   preparation before it), seconds by phase: `Task.result` lists them in order
    index: int = 0  # the choice (0..n-1); choices i > 0 report choice 0's restore and prefill as theirs
    stop_sequence: str | None = None  # the stop string that ended `text` (finish_reason "stop"), if one did
    token_ends: list[int] = field(default_factory=list)  # per completion token, the characters of `text` through
    #   it (TextStream.ends): how many tokens a span of the text took, without tokenizing it again
    drafted_tokens: int = 0  # speculative decoding: drafts verified, and those accepted (speculative/verify.py)
    accepted_tokens: int = 0

    @property
    def cut(self) -> bool:
        """Generation stopped at its budget (or the context's end), not where the model ended: a tool call it
        was writing is partial (output/parsing.py drops it)."""
        return self.finish_reason == "length"


@dataclass(frozen=True)
class Event:
    """Streamed to the caller: TEXT (a delta), DONE (`result` set) or ERROR (`error` set). A TEXT event of a job
    that asked for logprobs carries those of the tokens sampled since the previous TEXT event (a token whose text
    is held back, e.g. as a possible stop string, reports with the next delta; the rest are in the result).
    index: the choice it belongs to (0 unless the job has n > 1 choices). cached_tokens: on a TEXT event from the
    scheduler, the prompt tokens restored at admission (the result's `cached_tokens`, known before it: the
    Messages API's message_start reports it); None where not known."""

    kind: EventKind
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    result: Result | None = None
    error: OrchestratorError | None = None
    index: int = 0
    cached_tokens: int | None = None


Sink = Callable[[Event], None]


@dataclass
class Clock:
    """perf_counter() readings of a task's milestones."""

    submitted: float = field(default_factory=time.perf_counter)
    admitted: float = 0.0
    restored: float = 0.0
    prefilled: float = 0.0
    first_token: float | None = None


@dataclass
class TaskReuse:
    """What the reuse rules decided for a task and how far its prefill got; `Reuse` is the only writer, the
    scheduler and `Task.result` read it.

    Prefill-like phases (PREFILL, and STORE's re-prefill) bring `work` (token ids) into the slot's sequence:
    `pos` of its tokens are in, and `positions` are the snapshot positions still ahead, ascending (token
    offsets into `work`). store: whether the task stores snapshots (False for a cold run, and once a cache
    flush came). cached, source: prompt tokens restored at admission and where from ("live", "ram", "disk",
    "remote", "none"). logits: float32 (n_vocab,), the logits after the whole prompt where admission restored
    it entire with them (nothing to prefill; the first token is sampled from these). saved, snapshot_s: entries
    stored so far and seconds spent saving them.
    """

    work: list[int]
    pos: int = 0
    logits: np.ndarray | None = None
    end_due: bool = False  # the prompt's end is prefilled and not stored yet (Reuse.store_prompt_end)
    positions: list[int] = field(default_factory=list)
    store: bool = False
    cached: int = 0
    source: str = "none"
    saved: int = 0
    snapshot_s: float = 0.0


class Task:
    """A job from submission to release. Touched by the scheduler's worker thread only (after submission)."""

    def __init__(self, job: Job, sink: Sink, cancel: threading.Event, order: int, deadline_s: float) -> None:
        self.job, self.sink, self.cancel, self.order = job, sink, cancel, order
        self.tokens = list(job.prompt_tokens)
        self.n = len(self.tokens)
        self.clock = Clock()
        self.deadline = self.clock.submitted + deadline_s if deadline_s else None
        self.slot: Slot | None = None
        self.phase = Phase.QUEUED
        self.reuse = TaskReuse(self.tokens)  # written by reuse.Reuse only
        # generation
        self.first_logits: np.ndarray | None = None
        self.sampler = None  # a sampling.Sampler from the scheduler's start of decoding until `finish` closes it
        self.stream = TextStream(stop=job.stop)
        self.out: list[int] = []
        self.eog: int | None = None  # the end-of-generation token that ended it, if one did
        self.finish = "length"
        self.pending: int | None = None  # the token to decode next
        # the logits of the step whose token is due, copied while the grammar has not answered (float32,
        # (n_vocab,); Sampler.ready): the task sits out the decode steps until it samples them (scheduler._resume)
        self.held: np.ndarray | None = None
        self.spec = None  # speculative decoding state (speculative.verify.RequestSpec), made at its first step
        self.logprobs: list[TokenLogprob] | None = [] if job.logprobs is not None else None
        self._reported = 0  # logprobs already sent with TEXT events
        self.delivered = False  # DONE or ERROR was sent
        self.cut = False  # the generated tokens are not the whole answer (cancelled or a stop string), read at
        #                   the result: the caller may set `cancel` once it has the result
        self.index = 0  # the choice this task generates (n > 1 choices: Job.n)
        self.choices: list[Task] = []  # choice 0 of an n-choice job: the other choices, once admitted

    @property
    def pending_pos(self) -> int:
        """The position `pending` is decoded at: the prompt's tokens and every generated token but `pending`
        (the last of `out`) are in the slot's sequence."""
        return self.n + len(self.out) - 1

    def fork(self) -> list[Task]:
        """Choice 0's n - 1 other choices (set as `choices`): each the task of `job.choice(i)` with the same prompt,
        cancel flag, order, submission time and deadline, its events tagged with index i."""
        def tagged(i: int) -> Sink:
            return lambda ev: self.sink(replace(ev, index=i))

        self.choices = []
        for i in range(1, self.job.n):
            t = Task(self.job.choice(i), tagged(i), self.cancel, self.order, 0)
            t.index, t.clock.submitted, t.deadline = i, self.clock.submitted, self.deadline
            self.choices.append(t)
        return self.choices

    def forked(self, first: Task) -> None:
        """This choice now holds the prompt state of choice 0 (`first`): report its restore and prefill times."""
        self.clock.admitted, self.clock.restored, self.clock.prefilled = (first.clock.admitted, first.clock.restored,
                                                                          first.clock.prefilled)

    def stop_error(self, now: float) -> OrchestratorError:
        """Why an expired task stops: cancelled by the caller, or past its deadline."""
        if self.cancel.is_set():
            return RequestCancelled()
        return RequestTimeout(now - self.clock.submitted)

    def expired(self, now: float) -> bool:
        """Cancelled by the caller or past its deadline."""
        return self.cancel.is_set() or (self.deadline is not None and now > self.deadline)

    def take(self, token: int, eog: bool, piece: bytes, n_ctx: int) -> tuple[str, bool]:
        """Take a sampled token (`eog`: an end-of-generation token; `piece`: its bytes): returns the text that
        may be streamed now and whether generation is over (end of generation, a stop string, max_tokens, or a
        full context). Otherwise the token is `pending`, to be decoded next."""
        self.pending = None
        if eog:
            self.finish, self.eog = "stop", token
            return "", True
        self.out.append(token)
        delta = self.stream.push(piece)
        if self.stream.stopped:
            self.finish = "stop"
            return delta, True
        if len(self.out) >= self.job.max_tokens or self.n + len(self.out) >= n_ctx:
            return delta, True
        self.pending = token
        return delta, False

    def deliver(self, ev: Event) -> None:
        """Send the task's end (DONE or ERROR) to its sink, once; a sink that raises is logged, not raised."""
        if self.delivered:
            return
        self.delivered = True
        try:
            self.sink(ev)
        except Exception:  # noqa: BLE001 - a broken sink must not stop the worker
            log.warning("event sink failed", exc_info=True)

    def text_event(self, delta: str) -> Event:
        """A TEXT event for `delta`, with the logprobs not reported yet and the prompt tokens restored."""
        if not self.logprobs:
            return Event(EventKind.TEXT, text=delta, cached_tokens=self.reuse.cached)
        new, self._reported = tuple(self.logprobs[self._reported:]), len(self.logprobs)
        return Event(EventKind.TEXT, text=delta, logprobs=new, cached_tokens=self.reuse.cached)

    def conclude(self, now: float) -> Result:
        """End generation at `now`: flush the text held back (a TEXT event), free the sampler, and return the
        result. Whether the answer was cut (`cut`) is read first: the caller may cancel once it has the result."""
        self.cut = self.cancel.is_set() or self.stream.stopped
        tail = self.stream.finish()
        if tail:
            self.sink(self.text_event(tail))
        self.sampler.close()
        self.pending = self.held = None
        return self.result(now)

    def generated(self) -> list[int]:
        """The completion tokens, with the end-of-generation token that ended them (it is in the sequence)."""
        return self.out + ([self.eog] if self.eog is not None else [])

    def result(self, now: float) -> Result:
        """The result at `now` (after the last token). `phases`: the job's preparation phases, then queue (wait
        for a slot), restore, prefill (snapshot saves excluded), snapshot (saving snapshots during prefill),
        sample (prefill's end to the first token: logits, sampler set-up, first sample), decode (the rest)."""
        c, r = self.clock, self.reuse
        total = now - c.submitted
        first = c.first_token if c.first_token is not None else now
        phases = {**self.job.prepare_s, "queue": c.admitted - c.submitted, "restore": c.restored - c.admitted,
                  "prefill": c.prefilled - c.restored - r.snapshot_s, "snapshot": r.snapshot_s,
                  "sample": first - c.prefilled, "decode": now - first}
        return Result(
            completion_tokens=self.out, text=self.stream.text, finish_reason=self.finish, prompt_tokens=self.n,
            cached_tokens=r.cached, restore_source=r.source, restore_s=c.restored - c.admitted,
            prefill_s=c.prefilled - c.restored,
            ttft_s=c.first_token - c.submitted if c.first_token is not None else total, total_s=total,
            snapshots_saved=r.saved, snapshot_s=r.snapshot_s, first_logits=self.first_logits,
            slot=self.slot.seq, logprobs=self.logprobs, phases=phases, index=self.index,
            stop_sequence=self.stream.matched, token_ends=self.stream.ends,
            drafted_tokens=self.spec.stats.drafted if self.spec else 0,
            accepted_tokens=self.spec.stats.accepted if self.spec else 0)


class RetryAfter:
    """Retry-After (seconds, 1 to 60) for a request refused with QueueFull: the moving average of request
    durations (`observe`, seconds from submission to result) times the waves of slots the queue ahead fills."""

    WEIGHT = 0.2  # of a new duration in the average

    def __init__(self, job_s: float = 5.0) -> None:
        self.job_s = job_s

    def observe(self, total_s: float) -> None:
        self.job_s = (1 - self.WEIGHT) * self.job_s + self.WEIGHT * total_s

    def seconds(self, waiting: int, n_slots: int) -> int:
        return max(1, min(60, math.ceil(self.job_s * ((waiting + n_slots) / n_slots))))


class Collector:
    """A sink that keeps the end of each of a job's `n` choices (DONE or ERROR; TEXT events are dropped) for a
    caller that waits for the results (`Scheduler.run`). Thread-safe."""

    def __init__(self, n: int = 1) -> None:
        self.n = n
        self.ends: dict[int, Event] = {}
        self._lock = threading.Lock()
        self._done = threading.Event()

    def __call__(self, ev: Event) -> None:
        if ev.kind == EventKind.TEXT:
            return
        with self._lock:
            self.ends.setdefault(ev.index, ev)
            if ev.kind == EventKind.ERROR or len(self.ends) == self.n:
                self._done.set()

    def wait(self, cancel: threading.Event | None = None) -> list[Result]:
        """Block until every choice delivered its result, or one failed: the results by index. Raises the first
        error delivered. Sets `cancel` (the job's flag) on the way out: the choices still running stop."""
        try:
            self._done.wait()
        finally:
            if cancel is not None:
                cancel.set()
        with self._lock:
            ends = dict(self.ends)
        for ev in ends.values():
            if ev.kind == EventKind.ERROR:
                raise ev.error
        return [ends[i].result for i in range(self.n)]


@dataclass
class Slot:
    """One sequence of the context. live: tokens whose KV the sequence holds, computed by prefill (a reusable
    source); salt: the cache_salt of the request whose state it holds; stale: a cache flush came while it served
    its task, so its live KV is offered to no other request and it is cleared when the task leaves."""

    seq: int
    live: list[int] = field(default_factory=list)
    key: str = ""  # prompt_cache_key of the last request served here
    salt: str = ""
    last_used: float = 0.0
    task: Task | None = None
    stale: bool = False
