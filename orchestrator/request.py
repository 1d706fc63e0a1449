"""A request inside the scheduler: the job as submitted (`Job`), what it produced (`Result`), the events it
streams (`Event`), its progress from submission to release (`Task`, in a `Phase`), and the sequence that serves
it (`Slot`). Plain data: the scheduler moves a task through its phases, the reuse rules (reuse.py) fill in what
was restored and stored.

    QUEUED ──admit: restore──▶ PREFILL ──prompt done──▶ DECODE ──result delivered──▶ STORE ──▶ DONE
       │                          │                        │                            (after-generation
       └── cancelled / timed out ─┴────────────────────────┴──▶ DONE                     state, if any;
                                                                                      taken over or
                                                                                      preempted at a chunk)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Sequence

import numpy as np

from .engine import Sampler, SamplingParams, TokenLogprob
from .errors import OrchestratorError
from .output.stops import TextStream


class Phase(str, Enum):
    """Where a task is (vLLM's RequestStatus, llama.cpp server's slot_state)."""

    QUEUED = "queued"  # waiting for a slot
    PREFILL = "prefill"  # the prompt's uncached tokens are computed, in chunks
    DECODE = "decode"  # one token a step
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

    prompt_tokens: the prompt (n_prompt tokens). boundaries: token offsets where snapshots are taken
    (0 < b < n_prompt). max_tokens: completion budget. stop: stop strings. want_logits: keep the first-step
    logits (float32, shape (n_vocab,)) in the result, for correctness checks. logprobs: None, or k to record a
    TokenLogprob (with the k most likely tokens) per completion token. prompt_cache_key: OpenAI's
    routing hint; requests with the same key prefer the slot that last served it. timeout_s: seconds from
    submission to completion (None: the scheduler's default; 0: none). restorable_after: given the generated
    token ids (with the end-of-generation token that ended them, if one did), whether the request most likely
    to follow starts with the prompt and exactly those ids (`PromptBuilder.restorable_after`); None: assume it
    does. When it says no, the state after generation is not computed (issue 18).
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
    logprobs: int | None = None  # None: none; k >= 0: each completion token's logprob and the k most likely
    restorable_after: Callable[[Sequence[int]], bool] | None = None
    prepare_s: dict[str, float] = field(default_factory=dict)  # seconds spent before submission, by phase
    #                                                            (render, tokenize, boundaries: Prompt's)


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


@dataclass(frozen=True)
class Event:
    """Streamed to the caller: TEXT (a delta), DONE (`result` set) or ERROR (`error` set). A TEXT event of a job
    that asked for logprobs carries those of the tokens sampled since the previous TEXT event (a token whose text
    is held back, e.g. as a possible stop string, reports with the next delta; the rest are in the result)."""

    kind: EventKind
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    result: Result | None = None
    error: OrchestratorError | None = None


Sink = Callable[[Event], None]


@dataclass
class Clock:
    """perf_counter() readings of a task's milestones."""

    submitted: float = field(default_factory=time.perf_counter)
    admitted: float = 0.0
    restored: float = 0.0
    prefilled: float = 0.0
    first_token: float | None = None


class Task:
    """A job from submission to release. Touched by the scheduler's worker thread only (after submission).

    Prefill-like phases (PREFILL, and STORE's re-prefill) bring `work` into the slot's sequence: `pos` of its
    tokens are in, and `positions` are the snapshot positions still ahead, ascending.
    """

    def __init__(self, job: Job, sink: Sink, cancel: threading.Event, order: int, deadline_s: float) -> None:
        self.job, self.sink, self.cancel, self.order = job, sink, cancel, order
        self.tokens = list(job.prompt_tokens)
        self.n = len(self.tokens)
        self.clock = Clock()
        self.deadline = self.clock.submitted + deadline_s if deadline_s else None
        self.slot: Slot | None = None
        self.phase = Phase.QUEUED
        # prefill progress
        self.work: list[int] = self.tokens
        self.pos = 0
        self.positions: list[int] = []
        # reuse: set at admission (reuse.Reuse.admit) and as snapshots are stored
        self.store = False  # whether this task stores snapshots
        self.cached, self.source, self.saved, self.snapshot_s = 0, "none", 0, 0.0
        # generation
        self.first_logits: np.ndarray | None = None
        self.sampler: Sampler | None = None
        self.stream = TextStream(stop=job.stop)
        self.out: list[int] = []
        self.eog: int | None = None  # the end-of-generation token that ended it, if one did
        self.finish = "length"
        self.pending: int | None = None  # the token to decode next
        self.logprobs: list[TokenLogprob] | None = [] if job.logprobs is not None else None
        self._reported = 0  # logprobs already sent with TEXT events
        self.delivered = False  # DONE or ERROR was sent
        self.cut = False  # the generated tokens are not the whole answer (cancelled or a stop string), read at
        #                   the result: the caller may set `cancel` once it has the result

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

    def text_event(self, delta: str) -> Event:
        """A TEXT event for `delta`, with the logprobs not reported yet."""
        if not self.logprobs:
            return Event(EventKind.TEXT, text=delta)
        new, self._reported = tuple(self.logprobs[self._reported:]), len(self.logprobs)
        return Event(EventKind.TEXT, text=delta, logprobs=new)

    def generated(self) -> list[int]:
        """The completion tokens, with the end-of-generation token that ended them (it is in the sequence)."""
        return self.out + ([self.eog] if self.eog is not None else [])

    def result(self, now: float) -> Result:
        """The result at `now` (after the last token). `phases`: the job's preparation phases, then queue (wait
        for a slot), restore, prefill (snapshot saves excluded), snapshot (saving snapshots during prefill),
        sample (prefill's end to the first token: logits, sampler set-up, first sample), decode (the rest)."""
        c = self.clock
        total = now - c.submitted
        first = c.first_token if c.first_token is not None else now
        phases = {**self.job.prepare_s, "queue": c.admitted - c.submitted, "restore": c.restored - c.admitted,
                  "prefill": c.prefilled - c.restored - self.snapshot_s, "snapshot": self.snapshot_s,
                  "sample": first - c.prefilled, "decode": now - first}
        return Result(
            completion_tokens=self.out, text=self.stream.text, finish_reason=self.finish, prompt_tokens=self.n,
            cached_tokens=self.cached, restore_source=self.source, restore_s=c.restored - c.admitted,
            prefill_s=c.prefilled - c.restored,
            ttft_s=c.first_token - c.submitted if c.first_token is not None else total, total_s=total,
            snapshots_saved=self.saved, snapshot_s=self.snapshot_s, first_logits=self.first_logits,
            slot=self.slot.seq, logprobs=self.logprobs, phases=phases)


@dataclass
class Slot:
    """One sequence of the context. live: tokens whose KV the sequence holds, computed by prefill (a reusable
    source); salt: the cache_salt of the request whose state it holds."""

    seq: int
    live: list[int] = field(default_factory=list)
    key: str = ""  # prompt_cache_key of the last request served here
    salt: str = ""
    last_used: float = 0.0
    task: Task | None = None
