"""The rules of reuse, in one place: what a request restores (match, restore), where its prefill stops to store
what (store), and the state kept after generation. vLLM keeps these behind its KVCacheManager
(get_computed_blocks, cache_blocks), SGLang behind match_prefix / cache_unfinished_req / cache_finished_req.

The scheduler calls, per request:

    reuse.must_wait(task, earlier)   # admission order: wait for a snapshot an earlier request is about to store
    reuse.choose(task, free, storing) # which sequence serves it: a free one, or one storing (taken over or
                                     #   preempted); pick_slot chooses among free ones
    reuse.admit(task, slot)          # restore the deepest reusable prefix; plan the snapshot positions
    reuse.chunk_end(task, chunk)     # where the next prefill chunk ends (a stop, or min_segment before one)
    reuse.prefilled(task, end)       # after each prefill chunk: the live KV, and a checkpoint at a position
    reuse.after_generation(task)     # after the result: rewind and choose what to re-prefill and store, or not
    reuse.take_over(task, slot, n)   # or go on from the n tokens a STORE task left in the slot, no restore
    reuse.fork(first, other)         # n > 1 choices: copy choice 0's prompt state to another choice's slot
    reuse.store_finished(task)       # at the end of that re-prefill: store its KV and checkpoint
    reuse.flush(release)             # POST /v1/cache/flush, between two steps; reuse.released(slot) after each task

Reuse is the only writer of a task's `TaskReuse` (task.reuse) and of a slot's live KV, salt and stale flag.

Why every stored state is exact (cached runs equal cold runs bit for bit): with the engine's settings (flash
attention off; "Numerics" in engine.py) any split of a prefill into ubatches of at least `min_segment` tokens
(measured at start, calibration.py) gives bit-identical states and logits, but shorter ubatches, and a token
computed alone (as in decoding), do not. Hence these rules, each written once:

    a prefill segment may be stored or restored after if it has >= min_segment tokens    (`exact`)
    last restorable position of an n-token prompt = n - min_segment                       (`max_hit`)
    ... or n itself, with the logits its prefill computed, for a byte-identical repeat    (`plans`, LOGITS)
    no prefill chunk leaves a remainder shorter than min_segment before a stop   (`chunk_end`, chunks.chunk_end)
    the last stop is taken back after the final call where the engine can          (`taken_back`)

(vLLM's max_cache_hit_length, which is n - 1 there). Every request stores, after its final prefill call, the
checkpoint at its prompt's end and the logits of its last token (the *prompt end*; no stop: the call ends
there anyway), so a byte-identical repeat restores it and samples with no llama_decode at all, from the very
logits its first run sampled from; a longer prompt restores it where at least min_segment tokens follow.
Snapshot positions closer than min_segment to the previous one are skipped; and the state after generation is
not the decode state but a re-prefill, from the prompt end, of the generated tokens as one batch.

What is stored where (hybrid models; a KV-only model stores only the KV where a branch ends, state.py):

    prompt  ──────────┬───────────────┬─────────────────────────┬────────────────┬ n
                      tools end       system end   (interval)   (repeat point)   prompt end
    stored:           checkpoint      checkpoint   checkpoint   checkpoint       checkpoint + logits (every kind)

The repeat point, n - min_segment, is a stop only after a long last stretch (REPEAT_TAIL): a next turn that
re-renders the generation prompt restores it instead of the last stop before that stretch.
    after generation: prompt + generated (+ end-of-turn) tokens ──▶ checkpoint and KV at their end
                      (or the prompt's KV when too few were generated for an exact prefill; after_generation)

Every stop is a llama_decode call of its own, with a cost that does not shrink with its tokens (the weights
are read once per call); the prompt end costs a save (a checkpoint and n_vocab floats) and no call.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from .cache.radix import CHECKPOINT, KV, LOGITS, EntryKind, common_len
from .cache.snapshots import RestorePlan, SnapshotCache
from .chunks import chunk_end
from .engine import Engine
from .errors import EngineError, OrchestratorError
from .prompt.boundaries import Boundaries
from .request import Job, Phase, Slot, Task

log = logging.getLogger("orchestrator.reuse")


def spaced_stops(boundaries: Boundaries | Sequence[int] | None, n_prompt: int, min_gap: int = 0,
                 interval: int = 0) -> list[int]:
    """Where the prefill of an n_prompt-token prompt may stop to store a checkpoint, ascending, before the state
    kind's and min_segment's filters (`Reuse.snapshot_positions`); `min_gap` and `interval` in tokens.

    boundaries: the template's (`Boundaries`: tools end, system end, breakpoints, the last message end and the
    latest message's start are kept; an earlier message end closer than `min_gap` to a kept stop is left out, taken from the last one
    backwards, where templates rewrite history and conversations fork), or token offsets, all kept. Then, with
    `interval`, a checkpoint every `interval` tokens inside any longer stretch between two stops (or the prompt's
    end), counted from the stop before it (two prompts that share that stop and diverge inside the long
    message share their interval checkpoints too), less those closer than `min_gap` to the next stop. Every stop
    is a llama_decode call of its own and a save: what a gap saves was measured for message ends in
    bench/results/2026-12-01/ab_cold.json (bench/ab_cold.py; commit b45ee00) and for interval checkpoints in
    commit 6d363ee.

        tokens  0 ── tools_end ── +I ── +2I ── (+3I, < min_gap before) ── system_end ── … ── last end ── n
        stop?        yes          yes    yes     no                         yes                 yes
    """
    if isinstance(boundaries, Boundaries):
        fixed, optional, latest_start = boundaries.split(n_prompt)
    else:
        fixed, optional, latest_start = sorted({b for b in boundaries or () if 0 < b < n_prompt}), [], None
    kept = set(fixed)
    for p in reversed(optional):
        if all(abs(p - k) >= min_gap for k in kept):
            kept.add(p)
    if latest_start is not None:  # after the thinning: it moves no other stop (Boundaries.split)
        kept.add(latest_start)
    bounds = sorted(kept)
    stops = set(bounds)
    if interval:
        for lo, hi in zip([0] + bounds, bounds + [n_prompt]):
            stops.update(range(lo + interval, hi - max(min_gap, 1) + 1, interval))
    return sorted(stops)


class FlushRequests:
    """Cache flush calls (POST /v1/cache/flush) waiting for the worker thread, the engine's only user, to carry
    them out between two steps (`Reuse.flush`). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[concurrent.futures.Future] = []

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self) -> concurrent.futures.Future:
        """A new request; its future gets the number of entries dropped, or the flush's exception."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._pending.append(done)
        return done

    @staticmethod
    def wait(done: concurrent.futures.Future, timeout: float) -> int:
        """The result of `done` within `timeout` seconds. Raises OrchestratorError (code flush_incomplete) when
        the worker did not get to it (a step is one prefill chunk or one decode step: milliseconds to seconds);
        the flush may still happen at the worker's next step."""
        try:
            return done.result(timeout)
        except concurrent.futures.TimeoutError:
            raise OrchestratorError(f"the cache flush did not complete within {timeout:.0f} s: the worker is busy "
                                    "with a long step; retry", code="flush_incomplete") from None

    def carry_out(self, flush: Callable[[], int]) -> None:
        """On the worker: run `flush` once for every request waiting, and answer them all."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        try:
            n = flush()
        except Exception as e:  # noqa: BLE001 - reported to the callers; the worker goes on
            log.exception("cache flush failed")
            for done in pending:
                done.set_exception(e)
            return
        for done in pending:
            done.set_result(n)

    def refuse(self, error: Exception) -> None:
        """Answer every waiting request with `error` (the worker is stopping)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for done in pending:
            done.set_exception(error)


class PrefillRate:
    """Measured prompt tokens per second: a moving average over prefill chunks, seeded by a measurement at start
    (calibration.prefill_rate) where there is one. Touched by the scheduler's worker thread only."""

    WEIGHT = 0.2  # of a new chunk in the average

    def __init__(self, tokens_per_s: float | None = None) -> None:
        self.tokens_per_s = tokens_per_s

    def observe(self, n_tokens: int, seconds: float) -> None:
        """One prefill of `n_tokens` that took `seconds`."""
        if n_tokens <= 0 or seconds <= 0:
            return
        rate = n_tokens / seconds
        self.tokens_per_s = rate if self.tokens_per_s is None else \
            (1 - self.WEIGHT) * self.tokens_per_s + self.WEIGHT * rate

    def seconds(self, n_tokens: int) -> float:
        """Measured seconds to prefill `n_tokens` now (0.0 before any measurement: then nothing is fetched)."""
        return n_tokens / self.tokens_per_s if self.tokens_per_s else 0.0


@dataclass
class AfterGenerationStats:
    """What happened to after-generation work since start (issue 18). Counts of finished requests that stored
    nothing after generation because the state after the answer cannot be restored by the likely next request
    (`unrestorable`), that re-prefilled to the answer's end (`answer`; `answer_repeat` of them stopping to store a
    checkpoint min_segment before it, where the next request adds fewer tokens: `Reuse.after_generation`) or to
    the prompt's end (`prompt_end`);
    STORE tasks dropped for a waiting request (`preempted`) or taken over by the request that extends them
    (`taken_over`, `taken_over_tokens`: the positions the taking request did not compute again); `tokens` and
    `seconds` of STORE prefill chunks (the compute spent, in tokens and wall seconds of the worker)."""

    unrestorable: int = 0
    answer: int = 0
    answer_repeat: int = 0
    prompt_end: int = 0
    preempted: int = 0
    taken_over: int = 0
    taken_over_tokens: int = 0
    tokens: int = 0
    seconds: float = 0.0


class Reuse:
    """Match, restore and store for the sequences `slots` of `engine`, over `cache`.

    checkpoint_interval: tokens between interval checkpoints inside long stretches between boundaries (0: off).
    min_gap: tokens (--snapshot-min-gap); message ends and interval checkpoints closer than that to another stop
        are left out (`spaced_stops`).
    prefill: the measured prefill speed, against which a fetch from a shared tier is weighed.
    """

    # Tokens after a prompt's last stop from which its repeat point, n - min_segment, is a stop too. The next turn of
    # a conversation re-renders the generation prompt (Qwen3.5: "<think>\n" becomes the answer's think block), so it
    # diverges within the last min_segment tokens, and restores the last stop before them: the repeat point saves it
    # re-prefilling that tail, a call of its own (about 90 ms more than its tokens inside a full ubatch, 12 tokens'
    # worth, bench/results/2026-12-01/one-run) that pays from a tail of a few dozen tokens; a short last message
    # (W1's 43-token user line) is re-prefilled instead (bench/results/2026-12-02/w5: a 1,500-token tool result).
    REPEAT_TAIL = 64

    def __init__(self, engine: Engine, cache: SnapshotCache, slots: Sequence[Slot], checkpoint_interval: int = 0,
                 prefill: PrefillRate | None = None, min_gap: int = 0):
        self.engine, self.cache, self.slots = engine, cache, slots
        self.prefill = prefill or PrefillRate()
        self.state = engine.state
        self.min_segment = engine.min_segment  # fewest tokens per exact prefill ubatch (calibration.py)
        self.rollback = engine.rollback  # checkpoints inside a prefill call are exact (calibration.check_rollback)
        self.checkpoint_interval = checkpoint_interval
        self.min_gap = min_gap
        self.after_stats = AfterGenerationStats()
        self.flushes = FlushRequests()

    # ------------------------------------------------------------------ the rule

    def max_hit(self, n_tokens: int) -> int:
        """The last restorable position of an n-token prompt: at least min_segment tokens are always prefilled
        (the module docstring)."""
        return n_tokens - self.min_segment

    def exact(self, n_tokens: int) -> bool:
        """Whether a prefill segment of `n_tokens` computes what the same tokens inside a longer one do (at least
        min_segment: the module docstring), so the state after it may be stored or restored."""
        return n_tokens >= self.min_segment

    def stores(self, job: Job) -> bool:
        """Whether a job stores snapshots: a cache run whose prompt is not itself a too-short ubatch."""
        return job.use_cache and self.exact(len(job.prompt_tokens))

    def snapshot_positions(self, job: Job, start: int = 0) -> list[int]:
        """Where the prefill of `job` from token offset `start` stops, ascending: the `spaced_stops` of its
        boundaries, and the *repeat point* (`max_hit`) where at least REPEAT_TAIL tokens follow the last of them,
        less those the state kind does not store and those closer than min_segment to the previous stop or beyond
        `max_hit` (the prompt end is stored after the final call, `prefilled`, not a stop). [] for a job that
        stores nothing (a cold run): it prefills in plain chunks, so the correctness oracle does not share the
        split points of the runs it checks (a restore at p followed by the rest must equal a prefill that never
        stopped at p), and costs no llama_decode call per boundary."""
        if not self.stores(job):
            return []
        n = len(job.prompt_tokens)
        candidates = spaced_stops(job.boundaries, n, self.min_gap, self.checkpoint_interval)
        last = max((c for c in candidates if c <= self.max_hit(n)), default=0)
        candidates += self.repeat_point(n, last)
        kept, pos = [], start
        for b in self.state.snapshot_positions(sorted(candidates)):
            if self.exact(b - pos) and b <= self.max_hit(n):
                kept.append(b)
                pos = b
        return kept

    def repeat_point(self, n_tokens: int, last: int) -> list[int]:
        """[the repeat point of n tokens whose last stop is at `last`] (`max_hit`), where at least REPEAT_TAIL
        tokens lie between the two; else []."""
        return [self.max_hit(n_tokens)] if self.max_hit(n_tokens) - last >= self.REPEAT_TAIL else []

    def chunk_size(self, tokens: int) -> int:
        """A prefill chunk setting (--prefill-chunk) as used: at least 2 * min_segment tokens, so that the chunks
        `chunk_end` cuts are exact, and at most n_batch (llama_decode's limit)."""
        return min(max(tokens, 2 * self.min_segment), self.engine.n_batch)

    def taken_back(self, task: Task) -> bool:
        """Whether the task's next snapshot position is not a stop: it is its last one, within the engine's
        reach (`rollback_reach`: n_rs_seq) of the end of the work, and the engine can take its checkpoint back
        after the final prefill call (Engine.checkpoint_back; calibrated exact: `rollback`). A stop is a
        llama_decode call of its own, with a cost that does not shrink with its tokens (an 8-token call took
        58 ms against 1.46 s for 512 tokens on the 0.8b on a 2-core EPYC: bench/results/2026-12-01/stops); the
        take-back is a full save and load of the sequence's state. Only the last position: one take-back per
        call (the snapshots are those of the sequence's cell, which a second load might move)."""
        r = task.reuse
        return (self.rollback and task.phase == Phase.PREFILL and len(r.positions) == 1
                and len(r.work) - r.positions[0] <= self.engine.rollback_reach)

    def chunk_end(self, task: Task, chunk: int) -> int:
        """Where the task's next prefill chunk of at most `chunk` tokens ends: at its next snapshot position
        (unless it is `taken_back`) or the end of its work, never leaving less than min_segment before it
        (chunks.chunk_end). A chunk towards the end that would pass a taken-back position without being the
        final one cannot: the remainder after it would be shorter than min_segment, so it ends at the end or
        exactly at that position (a plain stop)."""
        r = task.reuse
        target = r.positions[0] if r.positions and not self.taken_back(task) else len(r.work)
        return chunk_end(r.pos, target, chunk, self.engine.n_batch, self.min_segment)

    # ------------------------------------------------------------------ match

    def plans(self, tokens: list[int], salt: str) -> list[RestorePlan]:
        """The restore plan of `tokens` under `salt` with each slot's live KV (stored entries are the same for
        all; a slot holding another salt's state, or state from before a cache flush (`stale`), offers none): the
        whole prompt where its logits are stored (a byte-identical repeat: nothing to prefill), else at most
        `max_hit` deep."""
        limit = self.max_hit(len(tokens))
        return [self.cache.plan(tokens, limit, s.live if s.salt == salt and not s.stale else (), salt=salt,
                                whole=True)
                for s in self.slots]

    def pick_slot(self, task: Task, free: Sequence[Slot]) -> Slot:
        """The free slot whose own live KV restores the deepest prefix (no copy), else, by preference, the last
        slot of the same prompt_cache_key, an empty slot, the least recently used."""
        depth = ([p.n_tokens for p in self.plans(task.tokens, task.job.cache_salt)] if task.job.use_cache
                 else [0] * len(self.slots))
        best = max(depth)

        def score(s: Slot):
            key = bool(task.job.prompt_cache_key) and s.key == task.job.prompt_cache_key
            return (best > 0 and depth[s.seq] == best, key, not s.live, -s.last_used)

        return max(free, key=score)

    def choose(self, task: Task, free: Sequence[Slot], storing: Sequence[Slot]) -> tuple[Slot, int]:
        """The slot for `task` and the depth it takes over there (0: restore as usual, `admit`). `storing`:
        slots re-prefilling an after-generation state (STORE), which are never busy for a new request. The STORE
        slot whose computed tokens the task extends, when that is at least as deep as any restore (issue 18: a
        tool result continues the work instead of waiting for it or computing it again); else the best free
        slot; else a STORE slot, to be preempted (`preempt`).

        Choice i > 0 of an n-choice job gets its state copied from choice 0 (`fork`), so any slot serves it: the one
        whose live state is worth least (empty, else the least recently used), a free one before a STORE one."""
        if task.index:
            return min(free or storing, key=lambda s: (bool(s.live), s.last_used)), 0
        depth, slot = max(((self.take_over_depth(task, s.task), s) for s in storing), key=lambda d: d[0],
                          default=(0, None))
        if depth and depth >= max(p.n_tokens for p in self.plans(task.tokens, task.job.cache_salt)):
            return slot, depth
        if free:
            return self.pick_slot(task, free), 0
        return self.pick_slot(task, storing), 0

    def preempt(self, task: Task) -> None:
        """Stop `task`'s after-generation re-prefill at the chunk boundary it reached, keeping what it computed:
        the KV of work[:pos] (exact: prefill chunks of at least min_segment from a checkpoint) is stored unless
        it is already, so the prompt's checkpoints stay restorable after a new request replaces the slot's
        sequence. A save of the KV (bytes: Engine.state_size), not a prefill."""
        self.after_stats.preempted += 1
        if task.slot.live and self.exact(task.reuse.pos):
            task.reuse.saved += self._store(task, task.reuse.work[: task.reuse.pos], (KV,), boundary=False)

    def must_wait(self, task: Task, earlier: Iterable[Task]) -> bool:
        """Sequential semantics: whether `task` should wait for a snapshot deeper than anything stored now that
        an earlier request (in a slot or queued) of the same salt is about to store, instead of prefilling the
        shared prefix a second time. So concurrent requests report the cached_tokens a sequential run
        reports, and a fleet of agents sharing a tools block prefills it once."""
        if not task.job.use_cache:
            return False
        avail = max(p.n_tokens for p in self.plans(task.tokens, task.job.cache_salt))
        upto = self.max_hit(task.n)
        if upto <= avail:
            return False
        for other in earlier:
            if (other.order >= task.order or not other.job.use_cache or other.job.cache_salt != task.job.cache_salt
                    or other.index  # choices i > 0 store nothing (choice 0 does)
                    or (other.phase != Phase.QUEUED and not other.reuse.store)):  # nor does one admitted before a flush
                continue
            shared = min(common_len(other.tokens, task.tokens), upto)
            if shared <= avail:
                continue
            if shared == other.n and other.phase != Phase.STORE:
                return True  # it extends the other's whole prompt: wait for its after-generation state too
                # (a STORE task is not waited for: it is taken over or preempted, Scheduler._admit)
            if other.phase in (Phase.QUEUED, Phase.PREFILL):
                ahead = other.reuse.positions if other.phase == Phase.PREFILL else self.snapshot_positions(other.job)
                if any(avail < p <= shared for p in ahead):
                    return True
        return False

    # ------------------------------------------------------------------ restore

    def admit(self, task: Task, slot: Slot) -> None:
        """Bring the slot's sequence to the deepest reusable prefix of the task's prompt (what is reported as
        cached is what was restored) and plan the task's snapshot positions from there. A whole prompt restored
        with its logits (task.reuse.logits) leaves nothing to prefill."""
        start, task.reuse.source, task.reuse.logits = self._restore(slot, task.tokens, task.job.use_cache,
                                                                    task.job.cache_salt)
        slot.salt = task.job.cache_salt
        task.reuse.cached = task.reuse.pos = start
        task.reuse.store = self.stores(task.job)
        task.reuse.positions = self.snapshot_positions(task.job, start)

    def _restore(self, slot: Slot, tokens: list[int], use_cache: bool,
                 salt: str) -> tuple[int, str, np.ndarray | None]:
        """Restore and return (n_tokens, tier, the logits after tokens[:n_tokens] where the plan restores the
        whole prompt with them, else None). The KV may come from a stored entry, the slot's own sequence, or
        another slot's sequence (busy or not: its state is saved and its KV part loaded here, bytes llama.cpp
        itself wrote, so the copy is exact)."""
        if use_cache:
            for _attempt in range(3):  # a part that vanished (evicted, corrupt on disk) is dropped: plan again
                plans = self.plans(tokens, salt)
                if self.cache.has_shared:
                    plans = self._with_shared(tokens, salt, plans)
                src = max(self.slots, key=lambda s: (plans[s.seq].n_tokens, s is slot))
                plan = plans[src.seq]
                if plan.n_tokens == 0:
                    break
                parts = self.cache.load(plan)
                if parts is None:
                    continue
                kv, checkpoint, logits = parts
                try:
                    if kv is None and src is not slot:  # the KV is live in another slot: copy it as bytes
                        kv = self.state.save(self.engine, src.seq, (KV,))[KV]
                    self.state.restore(self.engine, slot.seq, plan.n_tokens, kv, checkpoint)
                except EngineError:  # the sequence is cleared: drop what failed and plan again
                    log.warning("llama.cpp refused a snapshot restore; its entries are dropped", exc_info=True)
                    self.reset(slot)
                    self.cache.discard(plan)
                    continue
                slot.live = tokens[: plan.n_tokens]
                return plan.n_tokens, plan.tier, None if logits is None else np.frombuffer(logits, np.float32)
        self.reset(slot)
        return 0, "none", None

    def fork(self, first: Task, other: Task) -> None:
        """Copy the state of choice 0's sequence (`first`, its prompt just prefilled, nothing decoded yet) to the
        slot of another choice of the same job (FORK), as the bytes llama.cpp wrote
        (llama_state_seq_get_data / set_data of the whole sequence: KV and recurrent parts), so the copy is exact
        and that choice goes on as its cold run would. It stores nothing: only choice 0 keeps snapshots and its
        after-generation state. The logits of the prefill's last token are untouched (a sequence state holds
        none), so every choice samples its first token from them (or from the restored ones, reuse.logits).
        Raises EngineError (that sequence cleared)."""
        slot = other.slot
        try:
            self.engine.load_state(slot.seq, self.engine.save_state_view(first.slot.seq))
        except EngineError:
            slot.live = []
            raise
        slot.live, slot.salt = list(first.slot.live), first.slot.salt
        r, f = other.reuse, first.reuse
        r.cached, r.source, r.pos, r.logits = f.cached, f.source, f.pos, f.logits
        other.forked(first)

    def _with_shared(self, tokens: list[int], salt: str, plans: list[RestorePlan]) -> list[RestorePlan]:
        """The plans again, with what the shared tier holds for prefixes deeper than the local plans
        (`SnapshotCache.discover`), when reading the parts it adds takes less time than prefilling the tokens
        it saves: transfer time from the tier's measured round trip and bandwidth, prefill time from the
        measured prefill speed. Otherwise the local plans (and the found entries are forgotten).

        Only the deepest plan is weighed: going shallower saves fewer tokens but reads about as many bytes
        (a checkpoint is fixed-size; the KV entry that covers a position is the same deeper entry)."""
        local = max(p.n_tokens for p in plans)
        if not self.cache.discover(tokens, self.max_hit(len(tokens)), local, salt=salt):
            return plans
        wider = self.plans(tokens, salt)
        best = max(wider, key=lambda p: p.n_tokens)
        fetch_s = self.cache.transfer_s(best)
        recompute_s = self.prefill.seconds(best.n_tokens - local)
        if best.n_tokens > local and fetch_s < recompute_s:
            return wider
        log.debug("not fetching %d tokens from the shared tier: %.3f s to read, %.3f s to recompute",
                  best.n_tokens - local, fetch_s, recompute_s)
        self.cache.release_adopted()
        return plans

    def reset(self, slot: Slot) -> None:
        """Clear the slot's sequence: it offers nothing to reuse (and holds nothing of before a flush)."""
        self.engine.clear(slot.seq)
        slot.live, slot.stale = [], False

    def forget(self, slot: Slot) -> None:
        """A free slot after a flush: clear its sequence and its prompt_cache_key affinity."""
        self.reset(slot)
        slot.key = ""

    def flush(self, release: Callable[[Task], None]) -> int:
        """Drop every entry of the cache's local tiers and what the slots hold, so that no request admitted
        afterwards reuses state computed before: each STORE task is dropped with its sequence (`release` is the
        scheduler's; it would store a pre-flush state) and each free slot cleared; a task being prefilled or
        decoded goes on but stores nothing more, and its slot is `stale` (its live KV is offered to no one)
        until `released` clears it. Call it between two steps (nothing is stored in between). Returns how many
        entries went."""
        for slot in self.slots:
            if slot.task is not None and slot.task.phase == Phase.STORE:
                release(slot.task)
            if slot.task is None:
                self.forget(slot)
            else:
                slot.stale = True
                slot.task.reuse.store = False
        return self.cache.clear()

    def released(self, slot: Slot) -> None:
        """The slot's task left: a slot that served across a flush is cleared (what it holds came before)."""
        if slot.stale:
            self.forget(slot)

    # ------------------------------------------------------------------ store

    def prefilled(self, task: Task, end: int, seconds: float = 0.0) -> None:
        """The slot's sequence now holds work[:end] of `task.reuse`, computed by prefill in the last `seconds`: its
        KV is a reusable source (unless the whole work is a too-short ubatch), and at a snapshot position a
        checkpoint is stored; at the end of a prompt, its checkpoint and logits are due (`store_prompt_end`). A
        STORE task's chunks count in `after_stats`."""
        self.prefill.observe(end - task.reuse.pos, seconds)  # ignores a chunk that was not timed (0 s)
        if task.phase == Phase.STORE:
            self.after_stats.tokens += end - task.reuse.pos
            self.after_stats.seconds += seconds
        task.slot.live = task.reuse.work[:end] if self.exact(len(task.reuse.work)) else []
        r = task.reuse
        start, r.pos = r.pos, end
        r.end_due = task.phase == Phase.PREFILL and end == len(r.work) and r.store
        if not r.positions or end < r.positions[0]:
            return
        p = r.positions.pop(0)
        if not r.store:
            return
        if p == end:
            r.saved += self._store(task, r.work[:end], (CHECKPOINT,), boundary=True)  # a stop
        elif start < p and self.engine.can_roll_back(task.slot.seq, p):  # taken back: no stop
            r.saved += self._store(task, r.work[:p], (CHECKPOINT,), boundary=True,
                                   save=lambda: {CHECKPOINT: self.engine.checkpoint_back(task.slot.seq, p)})
        else:  # not reached by this engine's rollback (chunk_end never lets that happen): a missed checkpoint
            log.warning("the checkpoint at %d could not be taken back after a prefill call of %d..%d", p, start, end)

    def store_prompt_end(self, task: Task) -> None:
        """Where the prompt's end is due (its final prefill call is done, `prefilled`): its checkpoint (a restore
        point for any longer prompt, and where the re-prefill after generation starts) and the logits of its
        last token (a byte-identical repeat samples from them, `plans`), both as boundaries (they keep their
        branch's KV; the KV itself is stored after generation). A save and no llama_decode call. Call it once the
        first token is sampled, before the next llama_decode (that changes both the state and the logits): the
        scheduler does, so the save is not in the time to first token; `after_generation` does too, for a reply
        that ended at its first token. A sequence that llama.cpp cleared meanwhile (a failed task) stores
        nothing."""
        r = task.reuse
        if not r.end_due:
            return
        r.end_due = False
        if task.slot.live:
            r.saved += self._store(task, r.work, (CHECKPOINT, LOGITS), boundary=True)

    def after_generation(self, task: Task) -> bool:
        """After the result is delivered: choose the state to store, rewind the sequence to re-prefill it
        exactly, and set task.reuse.work and task.reuse.pos for that (True); or nothing to do (False).

        The state after the generated tokens (and the end-of-turn token): what the conversation's next request
        extends. When the likely next request would not restore it (the job's `restorable_after` says no: on
        Qwen3.5 a text answer's reasoning or empty think block is not rendered by the next user turn), no
        re-prefill at all: the prompt's KV up to the rewind point is saved (False). Instead the state where the
        prompt ends, when the generated text is not what the next request will send (cancelled, or cut by a stop
        string), when it would not fit the context, when it is stored already, or when too few tokens were
        generated for an exact prefill from the rewind point. Nothing when that is stored already, or when the
        sequence cannot be rewound.

        The answer's end is restored by a next request that adds at least min_segment tokens after it (`max_hit`).
        Where the probe says the next request may add fewer (a tool result of a few tokens: 14 on Qwen3.5, under a
        min_segment of 64 with `-fa on`, or 34 on ARM with repacked weights), the re-prefill also stops at the
        answer's repeat point, min_segment before its end, and stores a checkpoint there (`repeat_point`, after a
        long enough answer): that request restores it and prefills min_segment tokens more, not the whole answer.
        """
        self.store_prompt_end(task)
        if not task.reuse.store:
            return False
        salt = task.job.cache_salt
        generated = task.generated()
        full = task.tokens + generated
        try:
            unusable = task.cut or len(full) > self.engine.n_ctx or self.cache.contains(full, KV, salt=salt)
            added = None if unusable else self._next_turn(task.job, generated)  # a render: only where it counts
            if not unusable and added is None:
                # Nothing the next request extends: keep only the prompt's KV (so its checkpoints stay
                # restorable once the slot serves another conversation), saved at the rewind point, no prefill.
                self.after_stats.unrestorable += 1
                start = self._rewind(task)
                if start:
                    task.reuse.saved += self._store(task, task.tokens[:start], (KV,), boundary=False)
                return False
            work = task.tokens if unusable else full
            if work is task.tokens and self.cache.contains(work, KV, salt=salt, covered=True):
                return False
            start = self._rewind(task)
            if not start:
                return False
            if 0 < len(work) - start and not self.exact(len(work) - start):  # too few for an exact prefill
                work = task.tokens
            if start == len(work):  # back at the prompt's end, which has its checkpoint: its KV only
                if not self.cache.contains(work, KV, salt=salt, covered=True):
                    task.reuse.saved += self._store(task, work, (KV,), boundary=False)
                return False
            positions = []
            if work is full and added is not None and added < self.min_segment:  # the end is not restorable then
                positions = [p for p in self.state.snapshot_positions(self.repeat_point(len(work), start))
                             if self.exact(p - start)]
        except Exception:  # noqa: BLE001 - a lost after-generation snapshot is only a later miss
            log.warning("after-generation snapshot failed", exc_info=True)
            self.reset(task.slot)
            return False
        if work is task.tokens:
            self.after_stats.prompt_end += 1
        else:
            self.after_stats.answer += 1
            self.after_stats.answer_repeat += bool(positions)
        task.reuse.work, task.reuse.pos, task.reuse.positions = work, start, positions
        return True

    def _next_turn(self, job: Job, generated: list[int]) -> int | None:
        """The job's `restorable_after` answer: None where the likely next request does not restore the state
        after `generated`, else the fewest tokens it adds after them. Without a probe, or where it fails,
        min_segment: the answer's end is assumed restorable, as before probes (a cost and never a wrong answer)."""
        if job.restorable_after is None:
            return self.min_segment
        try:
            return job.restorable_after(generated)
        except Exception:  # noqa: BLE001 - a failing probe must not lose the slot's state
            log.warning("restorable_after failed; the after-generation state is stored", exc_info=True)
            return self.min_segment

    def take_over_depth(self, task: Task, other: Task) -> int:
        """How deep `task` could start in `other`'s slot, where `other` is re-prefilling its after-generation
        state (STORE) and holds work[:pos] of its `reuse`, computed by exact prefill chunks: that pos when the
        task (same salt, using the cache) starts with those tokens and still has at least min_segment tokens to
        prefill after them; else 0."""
        p = other.reuse.pos
        if (not task.job.use_cache or other.phase != Phase.STORE or other.job.cache_salt != task.job.cache_salt
                or p <= 0 or p > self.max_hit(task.n) or common_len(task.tokens, other.reuse.work) < p):
            return 0
        return p

    def take_over(self, task: Task, slot: Slot, depth: int) -> None:
        """Admit `task` on `slot` from the state its sequence holds (take_over_depth tokens of the STORE task
        that was there), without a restore: reported as `depth` cached tokens from the live sequence."""
        slot.salt = task.job.cache_salt
        slot.live = task.tokens[:depth]
        task.reuse.cached = task.reuse.pos = depth
        task.reuse.source = "live"
        task.reuse.store = self.stores(task.job)
        task.reuse.positions = self.snapshot_positions(task.job, depth)
        self.after_stats.taken_over += 1
        self.after_stats.taken_over_tokens += depth

    def _rewind(self, task: Task) -> int:
        """Drop the decoded tokens (decoded one at a time, which a prefill does not reproduce): back to a state
        the re-prefill can go on from exactly, and return its position (0: none): the deepest position of the
        prompt the live KV and the stored checkpoints restore (its end as a rule: `store_prompt_end`; a KV-only
        model's prompt KV, computed by prefill, truncates to it exactly)."""
        prompt = task.tokens
        plan = self.cache.plan(prompt, len(prompt), prompt, salt=task.job.cache_salt)
        parts = self.cache.load(plan) if plan.n_tokens else None
        if parts is None or parts.kv is not None:
            return 0
        self.state.restore(self.engine, task.slot.seq, plan.n_tokens, None, parts[1])
        task.slot.live = prompt[:plan.n_tokens]
        return plan.n_tokens

    def store_finished(self, task: Task) -> None:
        """The re-prefill after generation reached its end: store its KV and checkpoint (the branch end)."""
        self._store(task, task.reuse.work, (KV, CHECKPOINT), boundary=False)

    def _store(self, task: Task, tokens: list[int], kinds: tuple[EntryKind, ...], boundary: bool,
               save: Callable[[], dict] | None = None) -> int:
        """Save the entries of `kinds` (those the state kind has, and LOGITS: the engine's logits of the last
        llama_decode) missing for `tokens` from the slot's current state (one full save gives both KV and
        checkpoint), or as `save` gives them; returns how many were stored."""
        salt = task.job.cache_salt
        missing = [k for k in kinds if (k in self.state.entry_kinds or k is LOGITS)
                   and not self.cache.contains(tokens, k, salt=salt)]
        if not missing:
            return 0
        start = time.perf_counter()
        if save:
            data = save()
        else:
            state_kinds = [k for k in missing if k is not LOGITS]
            data = self.state.save(self.engine, task.slot.seq, state_kinds) if state_kinds else {}
            if LOGITS in missing:
                data[LOGITS] = self.engine.logits().tobytes()
        stored = sum(self.cache.put(tokens, k, data[k], boundary, salt=salt) for k in missing)
        task.reuse.snapshot_s += time.perf_counter() - start
        return stored
