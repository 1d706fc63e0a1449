"""Scheduler: one worker thread that owns the engine and serves queued generation jobs one at a time.

Per job, as one step under the worker (so the cached_tokens reported are the tokens actually restored):

  1. reuse: the deepest snapshot that prefixes the prompt and leaves at least MIN_SEGMENT tokens to prefill,
     restored as a copy (llama_state_seq_set_data), else a cleared sequence;
  2. prefill the rest in segments that end at each boundary, saving a snapshot at each boundary not yet stored
     (prefill to a boundary, save, continue: no second pass over the prompt), and one at the end of the prompt;
  3. decode token by token, streaming events;
  4. after the result is delivered, before the next job: snapshot the state after generation by
     restoring the end-of-prompt state and prefilling the generated tokens (plus the end-of-turn token) as one
     batch.

Why segments of at least MIN_SEGMENT (2) tokens, and why step 4 re-prefills instead of saving the decode state:
with the engine's settings (flash attention off; see "Numerics" in engine.py) any split of a prefill into
ubatches of two or more tokens gives bit-identical states and logits, but a token computed alone (a one-token
ubatch, as in decoding) does not (measured max |Δlogit| 2e-4 on tiny F16, 0.18 on the random 0.8b Q4_K_M). So
every stored state is one a cold prefill reproduces exactly, and cached runs equal cold runs bit for bit
(tests/test_correctness.py).

With `use_cache=False` the job is a cold run: the sequence is cleared, the whole prompt is prefilled with the
same rules, nothing is read or stored. That is the correctness oracle the tests compare against.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .cache import SnapshotCache
from .radix import KV, REC
from .engine import Engine, Sampler, SamplingParams
from .errors import ContextOverflow, EngineError, OrchestratorError
from .stops import TextStream

log = logging.getLogger("orchestrator.scheduler")

MIN_SEGMENT = 2  # fewest tokens per prefill ubatch; see the module docstring


@dataclass
class Job:
    """One generation request, already tokenized.

    prompt_tokens: the prompt (n_prompt tokens). boundaries: token offsets where snapshots are taken
    (0 < b < n_prompt). max_tokens: completion budget. stop: stop strings. want_logits: keep the first-step
    logits (float32, shape (n_vocab,)) in the result, for correctness checks.
    """

    prompt_tokens: list[int]
    boundaries: Sequence[int] = ()
    max_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    use_cache: bool = True
    want_logits: bool = False
    cache_salt: str = ""  # snapshots are shared only among jobs with the same salt ("" = the shared cache)


@dataclass
class Result:
    """What a job produced. Times in seconds."""

    completion_tokens: list[int]
    text: str
    finish_reason: str  # "stop" (end-of-generation token or stop string) or "length"
    prompt_tokens: int
    cached_tokens: int
    restore_source: str  # "live", "snapshot" or "none"
    restore_s: float
    prefill_s: float
    ttft_s: float
    total_s: float
    snapshots_saved: int
    snapshot_s: float = 0.0  # part of prefill_s (and ttft_s) spent saving snapshots
    first_logits: np.ndarray | None = None


@dataclass(frozen=True)
class Event:
    """Streamed to the caller: kind "text" (a delta), "done" (result set) or "error" (error set)."""

    kind: str
    text: str = ""
    result: Result | None = None
    error: OrchestratorError | None = None


Sink = Callable[[Event], None]


class Scheduler:
    """Queue + worker thread over one engine sequence (slot 0) and one snapshot cache.

    submit() never blocks on compute; events reach `sink` from the worker thread, so the sink must be
    thread-safe (the server wraps asyncio's call_soon_threadsafe). A job that fails gets an "error" event,
    the sequence is cleared, and the worker goes on with the next job.
    """

    SEQ = 0

    def __init__(self, engine: Engine, cache: SnapshotCache, checkpoint_interval: int = 0) -> None:
        self.engine = engine
        self.cache = cache
        self.checkpoint_interval = checkpoint_interval  # tokens between interval checkpoints (0 = off)
        self._live: list[int] = []  # tokens whose KV the sequence holds, computed by prefill
        self._salt = ""  # cache salt of the current job, and of the live sequence's state
        self._snapshot_s = 0.0  # seconds spent saving snapshots in the current job
        self._queue: queue.Queue[tuple[Job, Sink, threading.Event] | threading.Event | None] = queue.Queue()
        self._busy = False
        self._thread = threading.Thread(target=self._worker, name="orchestrator-worker", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public

    def submit(self, job: Job, sink: Sink, cancel: threading.Event | None = None) -> threading.Event:
        """Queue a job; returns its cancel flag (set it to stop the job at the next token)."""
        if len(job.prompt_tokens) + 1 > self.engine.n_ctx:
            raise ContextOverflow(len(job.prompt_tokens), self.engine.n_ctx)
        if not job.prompt_tokens:
            raise OrchestratorError("empty prompt")
        cancel = cancel or threading.Event()
        self._queue.put((job, sink, cancel))
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
        """Wait until every job queued before this call, and its after-generation snapshot, is done."""
        barrier = threading.Event()
        self._queue.put(barrier)
        return barrier.wait(timeout)

    @property
    def queue_length(self) -> int:
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return self._busy

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ worker

    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            job, sink, cancel = item
            self._busy = True
            try:
                result, followup = self._serve(job, sink, cancel)
                sink(Event("done", result=result))
            except OrchestratorError as e:
                self._reset()
                sink(Event("error", error=e))
            except Exception as e:  # noqa: BLE001 - the worker must survive any job
                log.exception("job failed")
                self._reset()
                sink(Event("error", error=EngineError(f"internal error: {e}")))
            else:
                if followup is not None:
                    try:
                        followup()
                    except Exception:  # noqa: BLE001 - a lost after-generation snapshot is only a later miss
                        log.warning("after-generation snapshot failed", exc_info=True)
                        self._reset()
            finally:
                self._busy = False

    def _reset(self) -> None:
        self.engine.clear(self.SEQ)
        self._live = []

    def _reuse(self, tokens: list[int], use_cache: bool) -> tuple[int, str]:
        """Bring the sequence to the deepest reusable prefix of `tokens`; returns (n_tokens, tier)."""
        if use_cache:
            for _attempt in range(3):  # a part that vanished (evicted, corrupt on disk) is dropped: plan again
                plan = self.cache.plan(tokens, len(tokens) - MIN_SEGMENT, self._live, salt=self._salt)
                if plan.n_tokens == 0:
                    break
                parts = self.cache.load(plan)
                if parts is None:
                    continue
                kv, checkpoint = parts
                try:
                    self.engine.restore(self.SEQ, plan.n_tokens, kv, checkpoint)
                except EngineError:  # the sequence is cleared: drop what failed and plan again
                    log.warning("llama.cpp refused a snapshot restore; its entries are dropped", exc_info=True)
                    self._reset()
                    self.cache.discard(plan)
                    continue
                self._live = tokens[: plan.n_tokens]
                return plan.n_tokens, plan.tier
        self._reset()
        return 0, "none"

    def _store(self, tokens: list[int], kinds: tuple[str, ...], boundary: bool) -> int:
        """Save the entries of `kinds` missing for `tokens` from the sequence's current state (one full save
        gives both KV and checkpoint); returns how many were stored."""
        missing = [k for k in kinds if not self.cache.contains(tokens, k, salt=self._salt)]
        if not missing:
            return 0
        t = time.perf_counter()
        if KV in missing:
            kv, rec = self.engine.save_parts(self.SEQ)
            data = {KV: kv, REC: rec}
        else:
            data = {REC: self.engine.save_checkpoint(self.SEQ)}
        stored = sum(self.cache.put(tokens, k, data[k], boundary, salt=self._salt) for k in missing)
        self._snapshot_s += time.perf_counter() - t
        return stored

    def _checkpoint(self, tokens: list[int], boundary: bool = True) -> int:
        return self._store(tokens, (REC,), boundary)

    def _branch_end(self, tokens: list[int]) -> int:
        """Store the KV and checkpoint of the deepest point of a request (where a radix-tree branch ends)."""
        return self._store(tokens, (KV, REC), boundary=False)

    def _prefill(self, tokens: list[int], start: int, boundaries: Sequence[int], use_cache: bool) -> int:
        """Prefill tokens[start:], ending a segment (and saving a checkpoint) at each boundary; returns how
        many entries were stored."""
        n = len(tokens)
        saved, pos = 0, start
        for b in sorted(set(boundaries)):
            if b - pos >= MIN_SEGMENT and n - b >= MIN_SEGMENT:
                # _live is extended only after a segment is decoded; a failed decode resets the sequence.
                self.engine.decode(self.SEQ, tokens[pos:b], pos, want_logits=False)
                self._live = tokens[:b]
                pos = b
                if use_cache:
                    saved += self._checkpoint(tokens[:b])
        self.engine.decode(self.SEQ, tokens[pos:], pos, want_logits=True)
        self._live = list(tokens)
        return saved

    def _positions(self, job: Job, n: int) -> list[int]:
        """Snapshot positions: the template boundaries, plus a checkpoint every `checkpoint_interval` tokens
        inside any stretch between two boundaries that is longer than that (a long tool output or document).

        Interval positions count from the boundary before them, so two prompts that share that boundary and
        diverge inside the long message share their interval checkpoints too.
        """
        bounds = sorted(set(job.boundaries))
        step = self.checkpoint_interval
        if not step:
            return bounds
        extra = []
        for lo, hi in zip([0] + bounds, bounds + [n]):
            extra.extend(range(lo + step, hi, step))
        return sorted(set(bounds) | set(extra))

    def _serve(self, job: Job, sink: Sink, cancel: threading.Event) -> tuple[Result, Callable[[], None] | None]:
        eng = self.engine
        tokens = list(job.prompt_tokens)
        n = len(tokens)
        t0 = time.perf_counter()
        self._snapshot_s = 0.0
        if job.cache_salt != self._salt:  # never reuse the live state across salts
            self._reset()
            self._salt = job.cache_salt
        start, source = self._reuse(tokens, job.use_cache)
        t_restored = time.perf_counter()
        # A one-token prompt is prefilled as a one-token ubatch: its state must not be stored (module docstring).
        store = job.use_cache and n >= MIN_SEGMENT
        saved = self._prefill(tokens, start, self._positions(job, n), store)
        if n < MIN_SEGMENT:
            self._live = []  # its KV came from a one-token ubatch: not a reusable source either
        t_prefilled = time.perf_counter()
        first_logits = eng.logits() if job.want_logits else None
        if store:
            saved += self._checkpoint(tokens, boundary=False)

        sampler = Sampler(job.sampling)
        stream = TextStream(stop=job.stop)
        out: list[int] = []
        eog: int | None = None
        finish = "length"
        ttft = None
        try:
            while len(out) < job.max_tokens and not cancel.is_set():
                tok = sampler.sample(eng.ctx)
                if ttft is None:
                    ttft = time.perf_counter() - t0
                if eng.is_eog(tok):
                    finish, eog = "stop", tok
                    break
                out.append(tok)
                delta = stream.push(eng.piece(tok))
                if delta:
                    sink(Event("text", text=delta))
                if stream.stopped:
                    finish = "stop"
                    break
                if len(out) >= job.max_tokens or n + len(out) >= eng.n_ctx:
                    break
                eng.decode(self.SEQ, [tok], n + len(out) - 1)
        finally:
            sampler.close()
        tail = stream.finish()
        if tail:
            sink(Event("text", text=tail))
        t_end = time.perf_counter()
        result = Result(
            completion_tokens=out, text=stream.text, finish_reason=finish, prompt_tokens=n, cached_tokens=start,
            restore_source=source, restore_s=t_restored - t0, prefill_s=t_prefilled - t_restored,
            ttft_s=ttft if ttft is not None else t_end - t0, total_s=t_end - t0, snapshots_saved=saved,
            snapshot_s=self._snapshot_s, first_logits=first_logits)
        followup = None
        if store:
            generated = out + ([eog] if eog is not None else [])
            if cancel.is_set() or stream.stopped or len(generated) < MIN_SEGMENT:
                followup = lambda: self._end_of_prompt(tokens)  # noqa: E731
            else:
                followup = lambda: self._after_generation(tokens, generated)  # noqa: E731
        return result, followup

    def _end_of_prompt(self, prompt: list[int]) -> None:
        """The prompt is the deepest point of this request: store its KV there (from a batch-computed state)."""
        if not self.cache.contains(prompt, KV, salt=self._salt) and self._rewind(prompt):
            self._branch_end(prompt)

    def _after_generation(self, prompt: list[int], generated: list[int]) -> None:
        """Store the state after prompt + generated tokens, computed as a batch (see module docstring).

        Runs after the caller has its result, before the next job: always, so that what a request reports as
        cached_tokens does not depend on timing.
        """
        full = prompt + generated
        if len(full) > self.engine.n_ctx:
            return self._end_of_prompt(prompt)
        if self.cache.contains(full, KV, salt=self._salt) or not self._rewind(prompt):
            return
        self.engine.decode(self.SEQ, generated, len(prompt), want_logits=False)
        self._live = full
        self._branch_end(full)

    def _rewind(self, prompt: list[int]) -> bool:
        """Drop the decoded tokens: back to the state after `prompt` (its checkpoint + the live KV)."""
        plan = self.cache.plan(prompt, len(prompt), prompt, salt=self._salt)
        parts = self.cache.load(plan) if plan.n_tokens == len(prompt) else None
        if parts is None or parts[0] is not None:
            return False
        self.engine.restore(self.SEQ, len(prompt), None, parts[1])
        self._live = list(prompt)
        return True
