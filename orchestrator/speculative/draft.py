"""Drafts from a smaller model with the target's vocabulary (`--model-draft`, e.g. a Qwen3.5 0.8B drafting for a 9B).

The draft model is a second Engine (its own llama.cpp model and context, one sequence per target sequence) that
reads each request's conversation and drafts greedily, one decode step per drafted token, as llama.cpp's
common/speculative.cpp does for a draft model. Its drafts are only proposals: the target verifies them in the
exact widths (speculative/verify.py), so neither the draft model's numerics nor its attention layout can change
an answer; a bad draft model costs speed, never correctness.

What a draft sequence holds: the tokens context[offset:offset + len(held)] of its request's context (prompt +
answer so far), at positions 0.., where `offset` keeps the draft's reading to the last `window` tokens of a
prompt (a draft needs the recent text; a 30k-token agent prompt read whole would cost the draft model a prefill
of its own). Keeping it in step:

    before a draft    it reads what the context added since (one llama_decode, no state copy)
    drafting k        1 + (k - 1) one-token decodes; the state before them is kept first (`Engine.rewind_point`)
    after verifying   accepted i of k: the drafted tokens it read beyond the i accepted ones are dropped
                      (attention-only memory: KV removal; recurrent: the kept state reloaded, and the accepted
                      ones are read with the next draft)
    a new request     the longest common prefix is kept where the memory can be cut back (attention-only); on a
                      recurrent draft model the state kept at the end of the slot's previous prompt is reloaded
                      where that prompt is a prefix of the new one (an agent's next turn: what follows it, the
                      answer as re-rendered and the tool result, is read); else the sequence restarts from the
                      prompt's last `window` tokens

Costs (measured by the width policy at run time, `VerifyCosts.observe_draft`): one draft-model decode per
drafted token, plus the reading, plus on a recurrent draft model one state copy per draft (19 MiB on the
qwen3.5-0.8b preset), and one more per prompt read to its end.
"""

from __future__ import annotations

import logging
from typing import Sequence

from ..errors import EngineError, ModelLoadError

log = logging.getLogger(__name__)


def check_vocab(target, draft, max_difference: int = 128, samples: int = 512) -> None:
    """Raise ModelLoadError unless `draft` (an Engine) can draft for `target`: vocabularies of nearly the same
    size (at most `max_difference` ids apart: GGUFs of one family pad their embedding rows differently, the
    limit llama.cpp's speculative code allows) whose pieces agree on `samples` ids spread over the shared range
    and on the end-of-generation tokens."""
    nt, nd = target.n_vocab, draft.n_vocab
    if abs(nt - nd) > max_difference:
        raise ModelLoadError(f"--model-draft: its vocabulary has {nd} tokens, the model's {nt}; a draft model "
                             f"must share the model's tokenizer (e.g. a smaller model of the same family)")
    shared = min(nt, nd)
    ids = sorted(set(range(0, shared, max(1, shared // samples))) | {shared - 1})
    for tok in ids:
        if target.piece(tok) != draft.piece(tok) or target.is_eog(tok) != draft.is_eog(tok):
            raise ModelLoadError(f"--model-draft: token {tok} is {draft.piece(tok)!r} in the draft model and "
                                 f"{target.piece(tok)!r} in the model; a draft model must share the model's "
                                 f"tokenizer")


class DraftModel:
    """Greedy drafts from `engine` (the draft model's Engine, n_seq_max >= the target's slots, n_ctx >= window
    + 2 * margin) for the target's sequences. `window`: the most prompt tokens a sequence reads when it
    (re)starts; `margin`: more than the most tokens drafted at once; `n_vocab`: the target's vocabulary (a
    draft of an id beyond it ends the draft there).

    Raises EngineError where the draft engine fails a call (the sequence is then restarted)."""

    def __init__(self, engine, window: int, n_vocab: int, margin: int = 64) -> None:
        if engine.n_ctx < window + 2 * margin:
            raise ValueError(f"the draft context ({engine.n_ctx}) must be at least the window ({window}) "
                             f"+ {2 * margin}")
        self.engine = engine
        self.window = window
        self.n_vocab = n_vocab
        self.margin = margin
        self.held: dict[int, tuple[int, list[int]]] = {}  # seq -> (offset, the context tokens it holds from there)
        self._drafted: dict[int, tuple[int, object]] = {}  # seq -> (tokens held before the draft, rewind point)
        # seq -> (offset, tokens, recurrent checkpoint) at the end of its last prompt read (recurrent memory only)
        self._prompt: dict[int, tuple[int, list[int], bytes]] = {}

    def restart(self, seq: int) -> None:
        """Forget what sequence `seq` holds."""
        self.engine.clear(seq)
        self.held.pop(seq, None)
        self._drafted.pop(seq, None)
        self._prompt.pop(seq, None)

    def copy(self, src: int, dst: int) -> None:
        """Make `dst` hold what `src` holds, as the bytes llama.cpp wrote (the choices of an n > 1 request fork
        from choice 0 after its prompt: the window is then read once, not once per choice). Raises EngineError
        (`dst` restarted)."""
        if src not in self.held:
            self.restart(dst)
            return
        try:
            self.engine.load_state(dst, self.engine.save_state_view(src))
        except EngineError:
            self.restart(dst)
            raise
        offset, held = self.held[src]
        self.held[dst] = (offset, list(held))
        self._drafted.pop(dst, None)
        kept = self._prompt.get(src)
        if kept is not None:
            self._prompt[dst] = (kept[0], list(kept[1]), kept[2])  # the state bytes are immutable: shared
        else:
            self._prompt.pop(dst, None)

    def read(self, seq: int, context: Sequence[int], end: int, logits: bool = False,
             horizon: int | None = None) -> None:
        """Make `seq` hold context[:end] from its offset on, with logits for its last token when `logits`. Keeps
        what it holds where that is a prefix of the context; cuts back to the common prefix on an attention-only
        memory, or to the end of its last prompt (`_resume`); else starts again at the last `window` tokens before
        `horizon` (a prompt read chunk by chunk as it is prefilled passes its whole length, so that its early
        chunks are skipped, and its end is kept for the next request: `_resume`; default `end`)."""
        offset, held = self.held.get(seq, (0, []))
        same = _common(held, context, offset, len(context))
        if same < len(held):
            if self.engine.cuttable and same > 0:
                self.engine.truncate(seq, same)
                held = held[:same]
            else:
                offset, held = self._resume(seq, context, offset, same) or self._fresh(seq, horizon or end)
        if end - offset + self.margin > self.engine.n_ctx:  # full: start again at the recent text
            offset, held = self._fresh(seq, end)
        new = context[offset + len(held):end]
        if logits and not new:  # the logits of its last token are gone: read it again
            if self.engine.cuttable and len(held) > 1:
                self.engine.truncate(seq, len(held) - 1)
                held = held[:-1]
            else:
                offset, held = self._fresh(seq, end)
            new = context[offset + len(held):end]
        if new:
            self._decode(seq, new, len(held), logits)
            held.extend(new)
        self.held[seq] = (offset, held)
        if new and horizon == end and not self.engine.cuttable:  # a prompt read to its end: kept for the next one
            self._prompt[seq] = (offset, list(held), self.engine.save_state(seq, partial=True))

    def _resume(self, seq: int, context: Sequence[int], offset: int, same: int) -> tuple[int, list[int]] | None:
        """Cut `seq` back to the end of its last prompt read, where the sequence still holds that prompt
        (`same`: how many tokens it holds agree with the context) and the context extends it: its recurrent
        checkpoint reloaded, the KV after it removed. None where it does not apply."""
        kept = self._prompt.get(seq)
        if kept is None or kept[0] != offset or same < len(kept[1]):
            return None
        try:
            self.engine.load_state(seq, kept[2], partial=True, clear=False)
            self.engine.truncate(seq, len(kept[1]))
        except EngineError:
            self.restart(seq)
            return None
        return offset, list(kept[1])

    def draft(self, seq: int, context: Sequence[int], k: int) -> list[int]:
        """Up to k greedy drafts of the tokens after `context` (the request's tokens, its pending one last)."""
        self.read(seq, context, len(context), logits=True)
        offset, held = self.held[seq]
        self._drafted[seq] = (len(held), self.engine.rewind_point(seq) if k > 1 else None)
        out: list[int] = []
        while True:
            tok = int(self.engine.logits().argmax())
            if tok >= self.n_vocab:
                break
            out.append(tok)
            if len(out) == k:
                break
            self._decode(seq, [tok], len(held), True)
            held.append(tok)  # in place: self.held[seq] is this list
        return out

    def accepted(self, seq: int, n: int) -> None:
        """The target accepted the first n tokens of the last draft of `seq`: what it read beyond them goes (on
        a recurrent memory the accepted ones too: they are read again with the next draft)."""
        before, point = self._drafted.pop(seq, (None, None))
        offset, held = self.held.get(seq, (0, []))
        if before is None or len(held) <= before + n:
            return
        keep = before + n if self.engine.cuttable else before
        try:
            if not self.engine.cuttable:
                self.engine.load_state(seq, point, partial=True, clear=False)
            self.engine.truncate(seq, keep)
        except EngineError:
            self.restart(seq)
            return
        self.held[seq] = (offset, held[:keep])

    def _decode(self, seq: int, tokens: Sequence[int], pos: int, logits: bool) -> None:
        try:
            self.engine.decode(seq, tokens, pos, want_logits=logits)
        except EngineError:
            self.restart(seq)
            raise

    def _fresh(self, seq: int, horizon: int) -> tuple[int, list[int]]:
        """Clear `seq`; it reads from the last `window` tokens before `horizon` on."""
        self.engine.clear(seq)
        self._drafted.pop(seq, None)
        self._prompt.pop(seq, None)
        return max(0, horizon - self.window), []

    def close(self) -> None:
        """Free the draft model."""
        self.engine.close()


def _common(held: Sequence[int], context: Sequence[int], offset: int, end: int) -> int:
    """How many of `held` equal context[offset:end] from the start."""
    n = min(len(held), max(0, end - offset))
    if list(held[:n]) == list(context[offset:offset + n]):
        return n
    i = 0
    while i < n and held[i] == context[offset + i]:
        i += 1
    return i
