"""The scheduler's speculative step for one generating request: draft, verify in one ubatch, accept by sampling.

    positions   p          p+1        ...  p+w-1
    ubatch      pending    draft[0]   ...  draft[w-2]         (Engine.verify: logits at every index)
    sample i    from logits i with the request's own sampler; accepted while it equals draft[i]

Token i is sampled from the logits after ubatch[0..i], which are those of one-token decoding where the width w
is exact (calibration.measure_verify_widths). Sampling stops at the first token that differs from the draft
(that token is the step's last output, as a plain decode step's would be), at the end of generation, or after
the last index; so the sampler runs exactly once per output token, in order, with its own RNG, and every
other effect of a token (logprobs, stop strings, streaming, the end) happens through the scheduler's own
`_sample`. Afterwards the sequence keeps ubatch[0..i] (`rewind`: KV removal, and on a recurrent memory
the checkpoint taken before the verification reloaded and ubatch[0..i] decoded again), the state i + 1 one-token
steps give, unless generation ended (then the after-generation rules take over the sequence, as after any decode
step).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

from ..errors import EngineError
from .draft import DraftModel
from .mtp import MtpHead, MtpUnavailable
from .ngram import NgramDrafter
from .policy import DraftLength, VerifyCosts

log = logging.getLogger(__name__)


def rewind(engine, seq: int, point, pos: int, kept: Sequence[int], widths: Collection[int] | None = None) -> None:
    """After `engine.verify(seq, tokens, pos)`, keep only `kept`, its first len(kept) >= 1 tokens; `point` is
    what `engine.rewind_point(seq)` gave before the verification. Attention-only memory (`point` None): the KV
    after them is removed. Otherwise the recurrent state cannot be cut back without llama.cpp's n_rs_seq
    snapshots, which cost every decode step a state copy (+6.5% on the 0.8b:
    bench/results/2026-12-03/attention-layouts) and a recurrent state per snapshot and slot: so the checkpoint
    `point` is loaded, the KV from `pos` removed (`cut`), and `kept` decoded again at `pos` (`replay`, in ubatches
    of `widths`' lengths). Raises EngineError (sequence cleared)."""
    item = cut(engine, seq, point, pos, kept)
    if item is not None:
        replay(engine, [item], widths)


def cut(engine, seq: int, point, pos: int, kept: Sequence[int]) -> tuple[int, Sequence[int], int] | None:
    """The first part of `rewind`: on an attention-only memory the whole of it (None); otherwise the checkpoint
    loaded and the KV from `pos` removed, and the (seq, kept, pos) that `replay` must decode again. Raises
    EngineError (sequence cleared)."""
    if point is None:
        engine.truncate(seq, pos + len(kept))
        return None
    engine.load_state(seq, point, partial=True, clear=False)
    engine.truncate(seq, pos)
    return seq, kept, pos


def replay(engine, items: Sequence[tuple[int, Sequence[int], int]], widths: Collection[int] | None = None) -> None:
    """The second part of `rewind`, for one or several sequences (`cut`'s items, in increasing seq order) in ONE
    llama_decode call: one token of one sequence is a decode step, otherwise a verification (Engine.verify_many)
    with logits for each sequence's last token only, since the tokens that follow were sampled already; the
    skipped rows change nothing the memory keeps. Exact where the widths are (calibration.
    measure_verify_widths checks this path, one sequence) and where several sequences verify together
    (calibration.check_batched_verification checks replays too). `widths`: the exact verification widths, where
    not every length is one (ARM i8mm: odd widths only, an even number of rows taking the paired SMMLA kernel;
    past 16, multiples of 4 only: calibration.verify_candidates): one sequence's tokens whose count is not among
    them are decoded in pieces that are, the widest that fits first, then the rest (an even count on ARM: an odd
    one + 1; 19 tokens: 16 + 3), so every call has an exact length. Raises EngineError (the sequences' states
    are then unspecified)."""
    if len(items) == 1 and widths is not None and 1 < len(items[0][1]) and len(items[0][1]) not in widths:
        seq, kept, pos = items[0]
        w = max((v for v in widths if v < len(kept)), default=1)  # 1: a decode step
        replay(engine, [(seq, kept[:w], pos)], widths)
        replay(engine, [(seq, kept[w:], pos + w)], widths)
    elif len(items) == 1 and len(items[0][1]) == 1:
        seq, kept, pos = items[0]
        engine.decode(seq, kept, pos)
    elif len(items) == 1:
        engine.verify(*items[0], every=False)
    elif items:
        engine.verify_many(items, every=False)


def _reraise(error: Exception) -> None:
    raise error


@dataclass
class SpecStats:
    """Counts of one request (or of a server): tokens drafted into verifications, and accepted among them."""

    drafted: int = 0
    accepted: int = 0
    verifications: int = 0


@dataclass
class RequestSpec:
    """Per-request speculation state: the drafter over prompt + answer (n-gram drafts; None with MTP or draft-model
    drafts) and the draft length policy."""

    drafter: NgramDrafter | None
    length: DraftLength
    stats: SpecStats = field(default_factory=SpecStats)
    shadow: tuple[int, int] | None = None  # (index in the answer, token) a draft not verified predicted there
    shadow_gap: int = 1  # MTP, draft model: plain steps between two drafts made only to be checked (`_draft_costly`)
    since_shadow: int = 0


class Speculation:
    """Verification steps for the scheduler. `widths`: the exact verification widths (2..); empty = never.
    `drafts`: "ngram" (prompt lookup, `NgramDrafter`), "mtp" (the model's MTP head, `mtp.MtpHead`: the engine
    loaded with ``load_mtp``; raises MtpUnavailable otherwise) or "draft" (`draft_model`, a smaller model with the
    same vocabulary: draft.DraftModel, owned from here on).

    `step(task, sample)` runs one step for a task that decodes alone in its llama_decode call and returns True,
    or returns False without touching the sequence (no usable draft, a grammar, no width pays: then the draft is
    kept to be checked against the token the plain step gives, DraftLength.shadow): the caller then runs its
    plain decode step. `sample(task, idx)` is the scheduler's `_sample`. Totals for /metrics: `stats`.
    `costs`: seconds of verifications (timed here) and of plain decode steps (timed by the scheduler), which the
    requests' width policies weigh; given, it starts from the ratios measured at start (VerifyCosts `start`).
    `together`: slots that decode in one llama_decode call verify their drafts in it too (`step_group`), where
    calibration.check_batched_verification measured that exact (one-row decode steps only).

    MTP and draft-model drafts cost a model step each (0.33 of a plain step for the MTP head of the qwen3.5-0.8b
    preset), so unlike n-gram lookups they are made only for a verification the policy chose. While no width
    pays, only every `shadow_gap`-th plain step drafts one token to be checked against the token decoded there
    (the gap doubles after a wrong one, up to `max_gap`, stays after a right one, and is `min_gap` after a
    verification); the other plain steps queue the MTP head's entry, added with the next draft
    (`MtpHead.catch_up`), or leave the draft model's reading to its next draft. Measured on the qwen3.5-0.8b
    preset (bench/results/2026-12-06/mtp-drafts): a gap reset to 1 after every right draft drafted at nearly
    every step where three drafts in four were right but verifying did not pay (0.81x speculation off); a gap
    doubled after every draft, right or not, left a request whose drafts were all right but whose first
    estimate did not pay at 1.02x, where verifying gave 1.26x."""

    def __init__(self, engine, widths: Sequence[int], min_n: int = 2, max_n: int = 4, drafts: str = "ngram",
                 min_gap: int = 4, max_gap: int = 32, draft_model: DraftModel | None = None,
                 costs: VerifyCosts | None = None, together: bool = False) -> None:
        self.engine = engine
        self.together = together and engine.decode_rows == 1
        self.widths = tuple(sorted(widths))
        # the widest verification such that every shorter one is exact too (x86: 16, then multiples of 4 past it)
        self.dense = next(w for w in range(1, len(self.widths) + 2) if w + 1 not in self.widths)
        self.min_n, self.max_n = min_n, max_n
        self.stats = SpecStats()
        self.costs = costs if costs is not None else VerifyCosts()
        self.min_gap, self.max_gap = min_gap, max_gap
        self.mtp = MtpHead(engine) if drafts == "mtp" and self.widths else None
        if drafts == "draft" and draft_model is None and self.widths:
            raise ValueError("drafts='draft' needs a draft_model (unless there are no widths: speculation off)")
        self.draft_model = draft_model if drafts == "draft" else None

    def state(self, task) -> RequestSpec | None:
        """The task's speculation state, made at its first step; None where it never speculates: no widths, or
        a grammar (its mask is computed in a grammar process token by token: `Sampler.ready`)."""
        if task.spec is None and self.widths and not task.job.sampling.grammar:
            ngram = self.mtp is None and self.draft_model is None
            drafter = NgramDrafter(task.tokens, self.min_n, self.max_n) if ngram else None
            task.spec = RequestSpec(drafter, DraftLength(self.widths, self.costs))
        return task.spec

    def step(self, task, sample: Callable[[object, int], None]) -> bool:
        plan = self._plan(task)
        if plan is None:
            return False
        spec, tokens = plan
        width, seq, pos = len(tokens), task.slot.seq, task.pending_pos
        started = time.perf_counter()
        point = self.engine.rewind_point(seq)
        self.engine.verify(seq, tokens, pos)
        spent = time.perf_counter() - started
        hidden = self._hidden(0, width)
        i = self._accept(task, spec, tokens, 0, sample)
        self.costs.observe(width, spent)  # against a plain step
        self._follow(task, pos, tokens, i, hidden)
        if task.pending is None:
            return True
        self._keep(seq, point, pos, tokens, i)
        return True

    def _hidden(self, first: int, width: int) -> list | None:
        """With MTP drafts, the target's hidden states at batch indices first.. of a verification of `width`
        tokens, but its last (the entries of its drafts, should they be accepted); read before anything decodes
        again. None otherwise."""
        return [self.engine.hidden(first + j) for j in range(width - 1)] if self.mtp is not None else None

    def _follow(self, task, pos: int, tokens: list[int], i: int, hidden: list | None) -> None:
        """The drafting model follows a verification of `tokens` at pos whose first i drafts were accepted: the
        draft model's sequence keeps them; the MTP head queues their entries from the target's hidden states
        (`_hidden`), unless generation ended."""
        seq = task.slot.seq
        if self.draft_model is not None:
            self.draft_model.accepted(seq, i)
        if hidden is not None and task.pending is not None:
            self._head(seq, self.mtp.catch_up, seq, pos + 1, tokens[1:i + 1], hidden[:i])

    def step_group(self, tasks, sample: Callable[[object, int], None],
                   guard: Callable[..., None]) -> bool:
        """One step for `tasks` (in increasing seq order), which decode together: each one's drafts, where it has
        any its policy verifies, and each other one's pending token, in ONE llama_decode call
        (Engine.verify_many; drafts past n_batch in all are dropped, widest first); then each samples its rows
        as in `step`, the drafting model follows (`_follow`), and those that rejected a draft are rewound, their
        replays in one more call (`_keep_group`). MTP and draft-model drafts are made one task at a time, as
        alone. Returns False without touching a sequence where verifying together was not measured exact
        (`together`), or n-gram drafts left nothing to verify: the caller then decodes their one token each,
        batched (`batched` and Engine.decode_step). With drafts from a model it always takes the step, since
        planning it queued the head's entries. `guard(task, fn, *args)` runs a task's part so that its failure
        fails that task only. Raises EngineError where the first call fails (every task's state is then
        unspecified). Costs are not timed here: the width policy weighs what a verification costs alone, which
        the rows a verification adds to a batched step roughly cost too (rows run the one-row kernels). On a
        recurrent memory each task verifies at most `dense` tokens here: llama.cpp computes such a call in
        ubatches as long as the shortest sequence left (split_equal), so a sequence's pieces are lengths the
        others decide (20 drafts beside a pending token: 1, then 19 alone), and within `dense` each is an exact
        width."""
        if not self.together:
            return False
        cap = None if self.engine.cuttable else self.dense  # llama.cpp's split_equal (docstring)
        plans = [self._plan(t, cap) for t in tasks]
        modelled = self.mtp is not None or self.draft_model is not None
        if not any(plans) and not modelled:
            return False  # (a model's plans queued the head's entries: the step is this one's, drafts or not)
        while sum(len(plan[1]) if plan else 1 for plan in plans) > self.engine.n_batch:
            widest = max(range(len(plans)), key=lambda k: len(plans[k][1]) if plans[k] else 0)
            plans[widest] = None  # made, not verified: as a draft the policy did not choose
        items = [(t.slot.seq, plan[1] if plan else [t.pending], t.pending_pos) for t, plan in zip(tasks, plans)]
        points = [self.engine.rewind_point(seq, b) if plan else None
                  for b, ((seq, _, _), plan) in enumerate(zip(items, plans))]
        firsts = self.engine.verify_many(items)
        hidden = [self._hidden(at, len(tokens)) if plan else None
                  for at, (_, tokens, _), plan in zip(firsts, items, plans)]
        accepted: dict[int, int] = {}

        def accept(k: int) -> None:
            accepted[k] = self._accept(tasks[k], plans[k][0], items[k][1], firsts[k], sample)
            self._follow(tasks[k], items[k][2], items[k][1], accepted[k], hidden[k])

        for k, t in enumerate(tasks):  # every task samples before any rewind: a rewind decodes, overwriting logits
            if plans[k]:
                guard(t, accept, k)
            else:
                guard(t, sample, t, firsts[k])
        self._keep_group(tasks, items, points, accepted, guard)
        return True

    def _keep_group(self, tasks, items, points, accepted: dict[int, int], guard: Callable[..., None]) -> None:
        """`_keep` for the tasks of one `step_group` (`accepted`: task index -> drafts accepted) that rejected a
        draft: each is cut back (`cut`; its failure fails that task), then every replay runs in ONE llama_decode
        call (`replay`; its failure fails the tasks in it), not one call per task. Not timed (as `step_group`)."""
        replays, owners = [], []
        for k, i in accepted.items():
            task, (seq, tokens, pos) = tasks[k], items[k]
            if task.pending is None or i + 1 == len(tokens):
                continue

            def one(task=task, seq=seq, point=points[k], pos=pos, kept=tokens[:i + 1]) -> None:
                item = cut(self.engine, seq, point, pos, kept)
                if item is not None:
                    replays.append(item)
                    owners.append(task)

            guard(task, one)
        try:
            replay(self.engine, replays, self.widths)
        except EngineError as e:
            for task in owners:
                guard(task, _reraise, e)

    def _plan(self, task, cap: int | None = None) -> tuple[RequestSpec, list[int]] | None:
        """(the task's state, [pending] + the drafts to verify now, at most `cap` tokens where given), or None: a
        plain step (no usable draft, a grammar, a held token, no width pays)."""
        spec = self.state(task)
        if spec is None or task.pending is None or task.held is not None:
            return None
        pos = task.pending_pos  # where `pending` goes
        room = min(self.engine.n_ctx - pos, task.job.max_tokens - len(task.out) + 1)
        if spec.shadow is not None and len(task.out) > spec.shadow[0]:  # the token decoded where a draft was not
            hit = task.out[spec.shadow[0]] == spec.shadow[1]  # verified: the estimate keeps up
            spec.length.shadow(hit)
            if not hit:
                spec.shadow_gap = min(2 * spec.shadow_gap, self.max_gap)
            spec.shadow = None
        most = min(self.widths[-1], room, cap or room) - 1
        if self.mtp is not None:
            tokens = self._draft_mtp(task, spec, pos, most)
        elif self.draft_model is not None:
            tokens = self._draft_model(task, spec, most)
        else:
            tokens = self._draft_ngram(task, spec, most)
        return None if tokens is None else (spec, tokens)

    def _accept(self, task, spec: RequestSpec, tokens: list[int], at: int, sample: Callable[[object, int], None]
                ) -> int:
        """Sample the task's verified rows (batch indices at..) in order, stopping at the first token that differs
        from the draft, at the end of generation or after the last row; count them. Returns how many drafts were
        accepted (their computed state is kept)."""
        width, i = len(tokens), 0
        while True:
            sample(task, at + i)
            if task.pending is None or i == width - 1 or task.pending != tokens[i + 1]:
                break
            i += 1
        spec.length.observe(width - 1, i)
        for s in (spec.stats, self.stats):
            s.drafted += width - 1
            s.accepted += i
            s.verifications += 1
        return i

    def _keep(self, seq: int, point, pos: int, tokens: list[int], i: int) -> None:
        """After a verification of `tokens` at pos whose first i drafts were accepted: keep tokens[0..i]
        (`rewind`, timed for the policy) where some were rejected."""
        if i + 1 < len(tokens):
            started = time.perf_counter()
            rewind(self.engine, seq, point, pos, tokens[:i + 1], self.widths)
            self.costs.observe_rewind(time.perf_counter() - started)

    def admitted(self, task) -> None:
        """`task` was given its slot: the MTP head forgets what that slot's sequence held."""
        if self.mtp is not None:
            self.mtp.restart(task.slot.seq)

    def hidden_for(self, task) -> list | None:
        """A list for Engine.decode to fill with the hidden states of a prefill chunk of `task` (`prefilled`), or
        None: without MTP drafts, or where the task never speculates."""
        return [] if self.mtp is not None and self.widths and not task.job.sampling.grammar else None

    def prefilled(self, task, pos: int, tokens, hidden: list | None) -> None:
        """`tokens` of `task` were prefilled at pos.., `hidden` filled by Engine.decode: the MTP head queues their
        entries, so that it attends to the prompt from where the prefill started (a restored prefix has no
        hidden states: the head's entries begin one token after it), as llama.cpp's draft-mtp catches up over
        every prefilled batch; only the last n_ctx of the prompt (MtpHead.read_prompt)."""
        if hidden is not None:
            self._head(task.slot.seq, self.mtp.read_prompt, task.slot.seq, pos, tokens, hidden, task.n)
        elif self.draft_model is not None and self.state(task) is not None:
            self._read_prompt(task, pos + len(tokens))

    def _read_prompt(self, task, end: int) -> None:
        """The draft model's sequence of `task` reads its prompt up to `end` (kept at the prompt's end:
        DraftModel.read's horizon)."""
        seq = task.slot.seq
        self._drafting(seq, self.draft_model.read, seq, task.tokens, end, horizon=len(task.tokens))

    def forked(self, first, other) -> None:
        """`other`, a choice of `first`'s job, was given a copy of its sequence (Reuse.fork): the draft model's
        sequence is copied too, so that it does not read the prompt's window again; choice 0's reads it first
        where the prefill did not (a prompt restored whole is not prefilled)."""
        if self.draft_model is not None and self.state(first) is not None:
            self._read_prompt(first, len(first.tokens))
            self._drafting(other.slot.seq, self.draft_model.copy, first.slot.seq, other.slot.seq)

    def batched(self, tasks) -> None:
        """`tasks` are about to decode in one llama_decode call of several slots, where nothing is verified: with
        MTP drafts the head queues each one's entry, so that its sequence still follows on when the task decodes
        alone again (else the head would restart there and attend to nothing before)."""
        if self.mtp is None:
            return
        for task in tasks:
            spec = self.state(task)
            if spec is None or task.pending is None:
                continue
            seq, pos = task.slot.seq, task.pending_pos
            last = self.engine.last_hidden(seq)
            if last is not None and last[0] == pos - 1:
                self._head(seq, self.mtp.catch_up, seq, pos, [task.pending], [last[1]])

    def _draft_ngram(self, task, spec: RequestSpec, most: int) -> list[int] | None:
        """[pending] + the n-gram drafts to verify, or None (a plain step; the first draft kept as the shadow)."""
        drafter = spec.drafter
        drafter.extend(task.out[len(drafter.tokens) - len(task.tokens):])  # the last one is `pending`
        draft = drafter.draft(most)
        width = spec.length.width(len(draft))
        if width < 2:
            spec.shadow = (len(task.out), draft[0]) if draft else None
            return None
        return [task.pending] + draft[:width - 1]

    def _draft_mtp(self, task, spec: RequestSpec, pos: int, most: int) -> list[int] | None:
        """[pending] + the MTP head's drafts to verify, or None (a plain step: the head adds its entry for
        `pending`). Nothing where the target's hidden state before `pending` is not known (the prompt restored
        whole, the first step of a fork)."""
        seq = task.slot.seq
        last = self.engine.last_hidden(seq)
        if last is None or last[0] != pos - 1:
            return None
        return self._draft_costly(
            task, spec, most, lambda k: self._head(seq, self.mtp.draft, seq, pos, task.pending, last[1], k),
            lambda: self._head(seq, self.mtp.catch_up, seq, pos, [task.pending], [last[1]]))

    def _draft_model(self, task, spec: RequestSpec, most: int) -> list[int] | None:
        """[pending] + the draft model's drafts to verify, or None (a plain step: the draft model reads the
        tokens since with its next draft)."""
        seq = task.slot.seq
        context = task.tokens + task.out  # the last one is `pending`
        return self._draft_costly(task, spec, most,
                                  lambda k: self._drafting(seq, self.draft_model.draft, seq, context, k),
                                  lambda: None)

    def _draft_costly(self, task, spec: RequestSpec, most: int, draw: Callable[[int], list[int] | None],
                      skip: Callable[[], None]) -> list[int] | None:
        """Drafts that cost a model step each (MTP head, draft model): [pending] + draw(width - 1) where the
        policy chose a width, else None (a plain step: `skip()`, and every `shadow_gap`-th time draw(1) as the
        shadow, checked against the token the step gives)."""
        width = spec.length.width(most)
        if width < 2:
            spec.since_shadow += 1
            if spec.since_shadow >= spec.shadow_gap:
                spec.since_shadow = 0
                draft = draw(1)
                spec.shadow = (len(task.out), draft[0]) if draft else None
            else:
                skip()
            return None
        spec.shadow_gap = self.min_gap
        started = time.perf_counter()
        draft = draw(width - 1)
        if not draft:
            return None
        self.costs.observe_draft(len(draft), time.perf_counter() - started)
        return [task.pending] + draft

    def _head(self, seq: int, fn, *args):
        """fn(*args) of the MTP head, or None where llama.cpp failed it (logged; the head's sequence restarts):
        a failed draft costs the request its drafts for a while, never its answer."""
        try:
            return fn(*args)
        except MtpUnavailable as e:
            log.warning("MTP head: %s; its sequence %d restarts", e.message, seq)
            self.mtp.restart(seq)
            return None

    def _drafting(self, seq: int, fn, *args, **kw):
        """fn(*args, **kw) of the draft model, or None where its llama.cpp call failed (logged; its sequence
        restarts): as `_head`, a failed draft costs drafts, never an answer."""
        try:
            return fn(*args, **kw)
        except EngineError as e:
            log.warning("draft model: %s; its sequence %d restarts", e.message, seq)
            return None

    def close(self) -> None:
        """Free the MTP head's context or the draft model, if any."""
        if self.mtp is not None:
            self.mtp.close()
        if self.draft_model is not None:
            self.draft_model.close()
