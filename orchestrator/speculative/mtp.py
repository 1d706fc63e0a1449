"""Qwen3.5's multi-token-prediction (MTP) head through llama.cpp: drafts from the target's hidden state (`MtpHead`).

A Qwen3.5 GGUF converted with its MTP block (``blk.{n_layer}.nextn.*``, GGUF ``nextn_predict_layers`` = 1; the
synthetic ``<preset>-mtp`` presets have one, random) drafts the token after next from the target's last hidden
state: a second llama_context of type LLAMA_CONTEXT_TYPE_MTP over the same model decodes (token x_{p+1},
target hidden state h_p) at position p + 1, and its logits draft x_{p+2}; chained drafts feed the head's own
hidden state back (llama.cpp common/speculative.cpp, draft-mtp, one head for qwen35).

The hidden-state hand-over is llama.cpp's C++ staging API (src/llama-ext.h: llama_set_embeddings_nextn,
llama_get_embeddings_nextn_ith): llama-cpp-python 0.3.36 binds the rest (llama_batch_ext_*, llama_process,
``load_mtp``, ``ctx_type``) but not these two, which libllama.so exports under their Itanium-mangled names; they
take and return plain C types, so ctypes calls them by those names (`NextnApi`). Pinned to 0.3.36: a llama.cpp
that renames them makes `NextnApi.load` raise, and MTP is then unavailable, nothing else.

Measured (bench/results/2026-12-05/mtp): with the MTP block loaded and the target's hidden states on for every
row ("unmasked", as llama-server's target context), the target's logits are bit-identical to a load without
it, so MTP drafts cannot change an answer. Not "masked" (hidden states of the output rows only): that graph
selects the output rows before the last layer's residual and FFN instead of after the final norm, so after a
prefill the last layer's FFN runs one row instead of all, and on the qwen3.5-4b preset the prompt's logits moved
by 1.4e-6. One MTP draft step costs 0.33 of a target decode step on the qwen3.5-0.8b preset on 2 cores (its
248k-row vocabulary projection), 0.17 on the 4b; a catch-up step without logits 0.03.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import llama_cpp
import numpy as np

from ..errors import OrchestratorError

_SET = "_Z26llama_set_embeddings_nextnP13llama_contextbb"  # void (llama_context *, bool enable, bool masked)
_GET_ITH = "_Z30llama_get_embeddings_nextn_ithP13llama_contexti"  # float * (llama_context *, int32_t i)


class MtpUnavailable(OrchestratorError):
    """This llama.cpp build has no MTP hand-over, or the model has no MTP block."""


@dataclass(frozen=True)
class NextnApi:
    """The two staging functions. `set(ctx, enable, masked)`: compute the hidden state the MTP head takes, for the
    output rows only when `masked` (which changes a target's graph: module docstring; an MTP context takes
    masked) or for every row (a target's graph as without it). `get_ith(ctx, i)`: that
    row for batch index i (negative: from the end), float[n_embd], valid until the next decode; NULL where row i
    had no output."""

    set: ctypes._CFuncPtr
    get_ith: ctypes._CFuncPtr

    @classmethod
    def load(cls) -> "NextnApi":
        """Raises MtpUnavailable where libllama.so does not export them."""
        lib = llama_cpp.llama_cpp._lib
        try:
            set_, get_ith = lib[_SET], lib[_GET_ITH]
        except AttributeError as e:
            raise MtpUnavailable(f"llama-cpp-python {llama_cpp.__version__}'s libllama has no "
                                 f"llama_set_embeddings_nextn / llama_get_embeddings_nextn_ith: {e}") from None
        set_.argtypes, set_.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
        get_ith.argtypes, get_ith.restype = [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)
        return cls(set_, get_ith)


def mtp_context(model, like, n_ctx: int, n_seq_max: int = 1, n_batch: int | None = None):
    """A llama_context of type MTP over `model` (loaded with ``load_mtp``), with the threads and attention layout
    of `like` (llama_context_params of the target) and its batch size unless `n_batch`. Free with llama_free.
    Raises MtpUnavailable where the model has no MTP block or llama.cpp refuses the context."""
    if int(llama_cpp.llama_model_n_layer_nextn(model)) < 1:
        raise MtpUnavailable("the model has no MTP block (GGUF nextn_predict_layers)")
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_seq_max = n_ctx * n_seq_max, n_seq_max
    cp.n_batch = cp.n_ubatch = n_batch or like.n_batch
    cp.n_threads, cp.n_threads_batch = like.n_threads, like.n_threads_batch
    cp.flash_attn_type, cp.type_k, cp.type_v = like.flash_attn_type, like.type_k, like.type_v
    cp.kv_unified, cp.no_perf = False, True
    cp.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
    ctx = llama_cpp.llama_init_from_model(model, cp)
    if not ctx:
        raise MtpUnavailable("llama.cpp could not create an MTP context for this model")
    return ctx


class MtpHead:
    """The MTP head of an engine loaded with ``load_mtp``: its own llama_context (type MTP) with one sequence per
    engine sequence, whose one attention layer keeps KV for the positions it has seen.

    An entry at position q is the pair (token x_q, the target's hidden state h_{q-1}), llama.cpp's
    draft-mtp ``process`` pairing: `catch_up` queues entries from the target's own hidden states; `draft` adds the
    queued ones and the entry at p from (x_p, h_{p-1}) in one llama_process call, whose logits draft x_{p+1}, then
    chains (draft, the head's own hidden state) one call per further draft, and keeps only the entries up to p
    (the chained ones are guesses). Queued entries cost one call per `draft` (or per n_batch - 1 entries) instead
    of one each: a plain step's entry alone costs 0.03 of a target decode step on the qwen3.5-0.8b preset
    (bench/results/2026-12-05/mtp).

    Positions of one sequence must follow each other in llama.cpp's KV: entries that do not continue the
    sequence restart it there (its earlier entries removed), so after a batched decode step, a restore or a new
    request the head attends to what it has seen since. Drafts never change an answer (they are verified); a gap
    only makes them worse. Raises MtpUnavailable where the engine has no MTP block loaded, or llama.cpp fails a
    call (the sequence is then restarted)."""

    def __init__(self, engine, n_batch: int = 128, n_ctx: int = 4096) -> None:
        """`n_batch`: the most entries one call adds, which sizes the context's compute buffers. `n_ctx`: the
        most entries a sequence keeps (the oldest are dropped: the head attends to the last n_ctx positions), so
        the head's KV is n_ctx cells per slot whatever the target's context (a slot of 262144 tokens on the 0.8b
        would otherwise take 400 MiB for the head alone)."""
        if engine.nextn is None:
            raise MtpUnavailable("the model has no MTP block (GGUF nextn_predict_layers), or it was loaded without it")
        self.api = engine.nextn
        self.n_embd, self.n_vocab = engine.n_embd, engine.n_vocab
        self.n_batch = max(n_batch, engine.n_seq_max, 2)
        self.n_ctx = max(n_ctx, 2 * self.n_batch)
        self.ctx = mtp_context(engine.model, engine.context_params, self.n_ctx, engine.n_seq_max, self.n_batch)
        self.api.set(self.ctx, True, True)  # its output rows only, as llama-server's draft context
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_ext_init(self.ctx)
        self._pos = (llama_cpp.llama_pos * 1)()
        self.next: dict[int, int] = {}  # seq -> the position after its last entry in the KV
        self._queue: dict[int, tuple[int, list[int], list[np.ndarray]]] = {}  # seq -> (first position, entries)

    def restart(self, seq: int) -> None:
        """Forget sequence `seq`'s entries (a new request in its slot)."""
        llama_cpp.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self.next.pop(seq, None)
        self._queue.pop(seq, None)

    def _at(self, seq: int, pos: int) -> None:
        """Make `pos` the position of the sequence's next entry: entries from pos on are removed; where pos does
        not continue the sequence, it restarts empty."""
        nxt = self.next.get(seq)
        if nxt is None or nxt < pos:
            llama_cpp.llama_memory_seq_rm(self.mem, seq, -1, -1)
        elif nxt > pos:
            llama_cpp.llama_memory_seq_rm(self.mem, seq, pos, -1)

    def _run(self, seq: int, pos: int, tokens: Sequence[int], hidden: Sequence[np.ndarray], logits: bool) -> int:
        """Entries at pos.. for (tokens[j], hidden[j]) in one llama_process call, after `_at(seq, pos)` and
        dropping the entries more than n_ctx positions back; logits (and the head's hidden state) for the last one
        when `logits`. Returns the last one's batch index."""
        self._at(seq, pos)
        first = pos + len(tokens) - self.n_ctx
        if llama_cpp.llama_memory_seq_pos_min(self.mem, seq) < first:
            llama_cpp.llama_memory_seq_rm(self.mem, seq, -1, first)
        b = self.batch
        llama_cpp.llama_batch_ext_clear(b)
        idx = -1
        for j, (tok, h) in enumerate(zip(tokens, hidden)):
            idx = llama_cpp.llama_batch_ext_add_token(b, seq, int(tok))
            self._pos[0] = pos + j
            llama_cpp.llama_batch_ext_set_pos(b, idx, self._pos)
            h = np.ascontiguousarray(h, dtype=np.float32)
            llama_cpp.llama_batch_ext_set_embd_token(
                b, idx, llama_cpp.llama_embd(h.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.n_embd))
            llama_cpp.llama_batch_ext_set_output_logits(b, idx, logits and j == len(tokens) - 1)
        rc = llama_cpp.llama_process(self.ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, b)
        if rc != 0:
            self.restart(seq)
            raise MtpUnavailable(f"the MTP head's llama_process returned {rc} at position {pos}")
        self.next[seq] = pos + len(tokens)
        return idx

    def catch_up(self, seq: int, pos: int, tokens: Sequence[int], hidden: Sequence[np.ndarray]) -> None:
        """Queue entries at pos.. of the confirmed tokens[j] with the target's hidden state at pos + j - 1 (added
        with the next draft, or once n_batch - 1 are queued). Entries that do not follow the queue replace it."""
        for j, (tok, h) in enumerate(zip(tokens, hidden)):
            start, toks, hs = self._queue.get(seq, (pos + j, [], []))
            if start + len(toks) != pos + j:
                start, toks, hs = pos + j, [], []
            toks.append(int(tok))
            hs.append(h)
            self._queue[seq] = (start, toks, hs)
            if len(toks) >= self.n_batch - 1:
                self.flush(seq)

    def read_prompt(self, seq: int, pos: int, tokens: Sequence[int], hidden: Sequence[np.ndarray | None],
                    end: int) -> None:
        """Queue the entries of a prompt chunk prefilled at pos.. (`hidden[j]`: the target's hidden state at
        pos + j - 1, None where Engine.decode had none) of a prompt of `end` tokens, but only those the head
        keeps once the whole prompt is read, the last n_ctx before `end`: the older ones would be added and then
        dropped unseen. Skipping them leaves the head's KV as it would be (up to the rounding of other ubatch
        sizes: drafts only, verified), since the one layer's K and V of an entry come from that entry alone
        (x_q, h_{q-1}). So a 12k-token prompt costs the head 4096 entries."""
        skip = max(0 if hidden and hidden[0] is not None else 1, end - self.n_ctx - pos)
        if skip < len(tokens):
            self.catch_up(seq, pos + skip, tokens[skip:], hidden[skip:])

    def flush(self, seq: int) -> None:
        """Add the sequence's queued entries now."""
        queued = self._queue.pop(seq, None)
        if queued is not None:
            self._run(seq, *queued, False)

    def draft(self, seq: int, pos: int, token: int, h: np.ndarray, k: int) -> list[int]:
        """k >= 1 greedy drafts for positions pos + 1.., from the confirmed `token` at `pos` and the target's
        hidden state `h` at pos - 1; the entries up to pos stay, the chained ones are removed. One llama_process
        with the vocabulary's logits per draft (0.33 of a target decode step on the 0.8b, 0.17 on the 4b)."""
        start, toks, hs = self._queue.pop(seq, (pos, [], []))
        if start + len(toks) != pos:
            start, toks, hs = pos, [], []
        idx = self._run(seq, start, toks + [token], hs + [h], True)
        out: list[int] = []
        for i in range(k):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, idx), shape=(self.n_vocab,))
            out.append(int(np.argmax(logits)))
            if i + 1 < k:
                h = np.ctypeslib.as_array(self.api.get_ith(self.ctx, idx), shape=(self.n_embd,)).copy()
                idx = self._run(seq, pos + i + 1, [out[-1]], [h], True)
        if k > 1:
            llama_cpp.llama_memory_seq_rm(self.mem, seq, pos + 1, -1)
        self.next[seq] = pos + 1
        return out

    def close(self) -> None:
        """Free the batch and the context."""
        if self.ctx:
            llama_cpp.llama_batch_ext_free(self.batch)
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
