"""A fake engine for unit tests of the scheduler and the reuse rules: no llama.cpp, no model, milliseconds.

It has the Engine's interface (decode, decode_step, logits, logprob, sampler, is_eog, piece, tokenize, clear, pos_max,
calibrate) and its byte-level state primitives (save_state, load_state, state_size, truncate), so the real state
kinds (orchestrator/state.py), cache, reuse rules and scheduler run on it unchanged.

What it models, so that the tests can catch what the real numerics would punish:

  * A sequence's state is its history: the tokens in its KV and, on a hybrid model, in its recurrent state, each
    with a mark saying how it was computed. Logits are a deterministic function of the whole state (a seeded
    random vector), so a restore that brings the wrong checkpoint, or KV of another prefix, gives other logits.
  * Exactness: a token computed in a ubatch shorter than `exact_from` tokens (the "hardware" threshold that
    calibration.measure_min_segment finds) is marked with that ubatch's size, as on a real CPU where a short
    ubatch takes other kernels; a decode step is such a ubatch of one row. So a cached run equals its cold run
    only if every stored state came from a prefill of long enough chunks, as the rules promise.
  * Batch invariance: a decode step of several rows marks its tokens alike to decoding alone only when
    `batch_invariant` (the hardware's answer, which calibration.check_batch_invariance finds): True, False, or
    the widths at which it holds (ARM i8mm: the odd ones; calibration.exact_batch_widths). `step_widths` records
    every decode step's width.
  * The recurrent state cannot be cut back: `truncate` fails unless the recurrent history is at most that long
    (llama_memory_seq_rm on a recurrent memory), and the sequence must then end exactly there.
  * Speculative verification (`verify`): a ubatch of w tokens of one sequence marks its tokens like one-token
    steps only when w is in `exact_widths` (else with 200 + w), and gives each position the logits of the state
    after it; `truncate` may then cut the recurrent history back into the last call's last n_rs_seq + 1
    tokens (llama.cpp's n_rs_seq rollback), and nowhere else. `verify_many` does it for several sequences in one
    call, each marked as alone only while `batched_verify_exact` (the hardware's answer, which
    calibration.check_batched_verification finds), else with 300 + its width; on a hybrid memory in the pieces
    llama.cpp's split_equal cuts (`_split_marks`), each piece marked so; `verify_many_calls` records the
    widths of each call, `replay_calls` those of each call with logits for each sequence's last token only
    (`every` False: a rollback's replay).
  * Byte sizes like the real ones at 1/64 scale: a checkpoint of `checkpoint_bytes` (19.3 MiB / 64 for
    Qwen3.5-0.8B) and `kv_bytes_per_token` of KV per token (12 KiB / 64), in llama.cpp's layout: header, KV part,
    recurrent part for a full state; header and recurrent part for a partial one.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from typing import Callable, Sequence

import numpy as np

from orchestrator.chunks import chunk_sizes
from orchestrator.errors import EngineError, ModelLoadError
from orchestrator.request import SamplingParams
from orchestrator.sampling import token_logprob
from orchestrator.state import HEADER, HybridState, KVState

MAGIC = b"FAKESEQ\0"
assert len(MAGIC) == HEADER
_ENTRY = struct.Struct("<IH")  # token id, mark


def _encode(history: Sequence[tuple[int, int]], per_token: int, total: int | None = None) -> bytes:
    """n (u32), then one entry per token padded to `per_token` bytes; padded to `total` bytes if given."""
    parts = [struct.pack("<I", len(history))]
    pad = b"\0" * (per_token - _ENTRY.size)
    for tok, mark in history:
        parts.append(_ENTRY.pack(tok, mark) + pad)
    out = b"".join(parts)
    if total is not None:
        out += b"\0" * max(0, total - len(out))
    return out


def _decode(data: bytes, per_token: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """(history, bytes read) of `_encode`'s output (without its final padding). Raises EngineError."""
    if len(data) < 4:
        raise EngineError("fake state truncated")
    (n,) = struct.unpack_from("<I", data)
    end = 4 + n * per_token
    if len(data) < end:
        raise EngineError("fake state truncated")
    return tuple(_ENTRY.unpack_from(data, 4 + i * per_token) for i in range(n)), end


class _Seq:
    def __init__(self, hybrid: bool) -> None:
        self.kv: list[tuple[int, int]] = []
        self.rec: tuple[tuple[int, int], ...] | None = () if hybrid else None


class FakeSampler:
    """Greedy argmax, or a seeded draw from softmax(logits / temperature).

    With `params.grammar` (any text: nothing is constrained), a stand-in for a slow grammar process: `ready`
    says False `engine.grammar_polls` times before each token, and while `engine.grammar_gate` (an Event) is
    clear; it raises `engine.grammar_error` when one is set. Sampling before `ready` said True fails (the
    engine's Sampler would wait for the grammar there: the worker must not)."""

    def __init__(self, engine: FakeEngine, params: SamplingParams) -> None:
        self.engine, self.params = engine, params
        self.rng = np.random.default_rng(params.seed)
        self.closed = False
        self._waited = 0  # ready() calls that said False for the current token
        self._ready = not params.grammar

    def ready(self) -> bool:
        if self._ready:
            return True
        if self.engine.grammar_error is not None:
            raise self.engine.grammar_error
        gate = self.engine.grammar_gate
        if self._waited < self.engine.grammar_polls or (gate is not None and not gate.is_set()):
            self._waited += 1
            self.engine.grammar_waits += 1
            return False
        self._ready = True
        return True

    def fileno(self) -> int | None:
        return None

    def sample(self, idx: int = -1, logits: np.ndarray | None = None) -> int:
        if not self._ready:
            raise AssertionError("sampled before the grammar answered")
        if self.params.grammar:
            self._ready, self._waited = False, 0
        logits = self.engine.logits(idx) if logits is None else logits
        if self.params.temperature <= 0:
            return int(np.argmax(logits))
        p = np.exp((logits - logits.max()) / self.params.temperature)
        return int(self.rng.choice(len(p), p=p / p.sum()))

    def close(self) -> None:
        self.closed = True


class FakeEngine:
    """See the module docstring. hybrid: a recurrent + attention state (HybridState), else KV only (KVState)."""

    def __init__(self, n_seq_max: int = 2, n_ctx: int = 4096, n_batch: int = 64, hybrid: bool = True,
                 exact_from: int = 4, batch_invariant: bool | tuple[int, ...] = True, n_vocab: int = 64,
                 checkpoint_bytes: int = 316_000, kv_bytes_per_token: int = 192,
                 exact_widths: Sequence[int] = (), n_rs_seq: int = 0, markov: bool = False) -> None:
        self.n_seq_max, self.n_ctx, self.n_batch, self.n_vocab = n_seq_max, n_ctx, n_batch, n_vocab
        self.exact_from, self.hw_batch_invariant = exact_from, batch_invariant
        self.step_widths: list[int] = []
        self.checkpoint_nbytes, self.kv_bytes_per_token = checkpoint_bytes, kv_bytes_per_token
        self.hybrid = hybrid
        self.state = HybridState() if hybrid else KVState()
        self.bos_id, self.eog_id = 0, n_vocab - 1
        self._seqs = [_Seq(hybrid) for _ in range(n_seq_max)]
        self._logits: list[np.ndarray] = []
        self.min_segment, self.batch_invariant = 2, False
        self.n_rs_seq, self.rollback = n_rs_seq, False  # no Engine.checkpoint_back; n_rs_seq: verify's rollback
        self.exact_widths = tuple(exact_widths)
        self.markov = markov  # logits from the last token and the set of marks only: greedy answers repeat
        self._verified: dict[int, tuple[int, int]] = {}  # seq -> positions [lo, hi) of its last verify call
        self.verify_calls: list[int] = []  # widths of the verify calls made
        self.batched_verify_exact = True
        self.decode_rows = 1
        self.verify_many_calls: list[list[int]] = []
        self.replay_calls: list[list[int]] = []
        self.prefilled_tokens = 0  # tokens computed by decode() in ubatches of more than one token
        self.on_decode: Callable[[int, Sequence[int], int], None] | None = None  # called before each decode()
        self.fail_loads = False  # load_state refuses everything (llama.cpp rejecting a state)
        self._scratch = bytearray()  # save_state_view's buffer, reused like the engine's
        self.fill_error: BaseException | None = None  # fill_spare raises it (tests of a failing allocation)
        self.spares_dropped = False
        # slow grammars (FakeSampler): polls each token waits, an Event that holds every grammar while clear,
        # an error every grammar's ready() raises; waits counts the polls that said "not yet"
        self.grammar_polls, self.grammar_gate, self.grammar_error = 0, None, None
        self.grammar_waits = 0
        self._running = threading.Event()
        self._running.set()
        self.state.probe(self, 1)

    # ------------------------------------------------------------------ test controls

    def pause(self) -> None:
        """Hold the worker at its next decode until `resume` (to queue several requests at once)."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    # ------------------------------------------------------------------ Engine interface

    def calibrate(self, min_segment: int, batch_invariant: bool = False) -> None:
        if min_segment < 2 or self.n_batch < 2 * min_segment - 1:
            raise ModelLoadError(f"min_segment {min_segment} does not fit n_batch {self.n_batch}")
        self.min_segment, self.batch_invariant = min_segment, batch_invariant

    def can_roll_back(self, seq: int, pos: int) -> bool:
        return False

    def fill_spare(self) -> bool:
        """No spare save buffers (the engine's page-fault saving has nothing to save here); raises `fill_error`
        when a test sets one (an allocation that fails)."""
        if self.fill_error is not None:
            raise self.fill_error
        return False

    def drop_spares(self) -> None:
        self.fill_error, self.spares_dropped = None, True

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """One token per word, from a hash (never the end-of-generation id)."""
        return [1 + int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "little") % (self.n_vocab - 2)
                for w in text.split()]

    def piece(self, token: int) -> bytes:
        return f" w{token}".encode()

    def is_eog(self, token: int) -> bool:
        return token == self.eog_id

    def sampler(self, params: SamplingParams, deadline: float | None = None) -> FakeSampler:
        return FakeSampler(self, params)

    def logits(self, idx: int = -1) -> np.ndarray:
        return self._logits[idx].copy()

    def logprob(self, token: int, k: int = 0, idx: int = -1):
        return token_logprob(self.logits(idx), token, k)

    def decode(self, seq: int, tokens: Sequence[int], pos: int, want_logits: bool = True,
               hidden: list | None = None) -> None:  # no MTP head: hidden stays as given
        if self.on_decode is not None:
            self.on_decode(seq, tokens, pos)
        self._running.wait()
        s = self._seqs[seq]
        if pos != len(s.kv) or (s.rec is not None and len(s.rec) != len(s.kv)):
            self.clear(seq)
            raise EngineError(f"fake decode at position {pos} of a sequence holding {len(s.kv)} tokens")
        if pos + len(tokens) > self.n_ctx:
            self.clear(seq)
            raise EngineError("fake context full")
        for start, n in chunk_sizes(len(tokens), self.n_batch, self.min_segment):
            mark = n if n < self.exact_from else 0
            self._append(s, tokens[start:start + n], mark)
            if n > 1:
                self.prefilled_tokens += n
        self._logits = [self._vector(s)] if want_logits else []

    def verify(self, seq: int, tokens: Sequence[int], pos: int, every: bool = True) -> None:
        self._running.wait()
        s = self._seqs[seq]
        if not 2 <= len(tokens) <= self.n_batch or pos != len(s.kv) or pos + len(tokens) > self.n_ctx:
            self.clear(seq)
            raise EngineError(f"fake verify of {len(tokens)} tokens at {pos} of a sequence holding {len(s.kv)}")
        mark = 1 if len(tokens) in self.exact_widths else 200 + len(tokens)
        self._logits = []
        for tok in tokens:
            self._append(s, [tok], mark)
            self._logits.append(self._vector(s))
        self._verified[seq] = (pos, pos + len(tokens))
        self.verify_calls.append(len(tokens))

    def verify_many(self, items: Sequence[tuple[int, Sequence[int], int]], every: bool = True) -> list[int]:
        self._running.wait()
        (self.verify_many_calls if every else self.replay_calls).append([len(tokens) for _, tokens, _ in items])
        exact = self.hw_batch_invariant
        exact = len(items) in exact if isinstance(exact, tuple) else exact
        for seq, tokens, pos in items:
            if not tokens or pos != len(self._seqs[seq].kv) or pos + len(tokens) > self.n_ctx:
                raise EngineError(f"fake verify_many of {len(tokens)} tokens at {pos}")
        split = self._split_marks(items, exact) if self.hybrid else None
        logits, starts = [], []
        for k, (seq, tokens, pos) in enumerate(items):
            s = self._seqs[seq]
            if split is not None:
                mark = split[k]
            elif len(tokens) == 1:
                mark = [1 if len(items) == 1 or exact else 100 + len(items)]
            else:
                mark = [1 if len(tokens) in self.exact_widths and self.batched_verify_exact else 300 + len(tokens)]
            starts.append(len(logits))
            for j, tok in enumerate(tokens):
                self._append(s, [tok], mark[min(j, len(mark) - 1)])
                logits.append(self._vector(s))
            self._verified[seq] = (pos, pos + len(tokens))
        self._logits = logits
        return starts

    def _split_marks(self, items, exact: bool) -> list[list[int]]:
        """A hybrid memory's ubatches of one verify_many call, as llama.cpp's split_equal cuts them: each ubatch
        takes as many tokens from every sequence that has some left as the shortest of them has, so a sequence
        is computed in pieces whose lengths the others decide (20 drafts beside one pending token: 1, then 19
        alone). Per item, the mark of each of its tokens: a piece of one token as a decode step of that many
        rows, a piece of one sequence alone as `verify`, of several as `verify_many` of one sequence each."""
        left = [len(tokens) for _, tokens, _ in items]
        marks: list[list[int]] = [[] for _ in items]
        while any(left):
            active = [k for k, n in enumerate(left) if n]
            piece = min(left[k] for k in active)
            if piece == 1:
                mark = 1 if len(active) == 1 or exact else 100 + len(active)
            elif len(active) == 1:
                mark = 1 if piece in self.exact_widths else 200 + piece
            else:
                mark = 1 if piece in self.exact_widths and self.batched_verify_exact else 300 + piece
            for k in active:
                marks[k].extend([mark] * piece)
                left[k] -= piece
        return marks

    def decode_step(self, items: Sequence[tuple[int, int, int]]) -> None:
        self._running.wait()
        if not 0 < len(items) <= self.n_batch:
            raise ValueError("bad decode step")
        self.step_widths.append(len(items))
        exact = self.hw_batch_invariant
        exact = len(items) in exact if isinstance(exact, tuple) else exact
        mark = 1 if (len(items) == 1 or exact) else 100 + len(items)
        out = []
        for seq, tok, pos in items:
            s = self._seqs[seq]
            if pos != len(s.kv):
                raise EngineError("fake decode step at a wrong position")
            self._append(s, [tok], mark)
            out.append(self._vector(s))
        self._logits = out

    def _append(self, s: _Seq, tokens: Sequence[int], mark: int) -> None:
        new = [(int(t), mark) for t in tokens]
        s.kv.extend(new)
        if s.rec is not None:
            s.rec = s.rec + tuple(new)

    def _vector(self, s: _Seq) -> np.ndarray:
        key = (s.kv, s.rec)
        if self.markov:  # still tells how every token was computed (the marks), not which tokens came before
            key = (s.kv[-1][0] if s.kv else -1, sorted({m for _, m in s.kv}),
                   None if s.rec is None else sorted({m for _, m in s.rec}))
        h = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
        return np.random.default_rng(int.from_bytes(h, "little")).standard_normal(self.n_vocab).astype(np.float32)

    def clear(self, seq: int) -> None:
        self._verified.pop(seq, None)
        self._seqs[seq] = _Seq(self.hybrid)

    def pos_max(self, seq: int) -> int:
        s = self._seqs[seq]
        return (min(len(s.kv), len(s.rec)) if s.rec is not None else len(s.kv)) - 1

    def tokens(self, seq: int) -> list[int]:
        """The tokens sequence `seq` holds (for assertions)."""
        return [t for t, _ in self._seqs[seq].kv]

    # ------------------------------------------------------------------ state bytes (StateIO)

    def save_state(self, seq: int, partial: bool = False) -> bytes:
        s = self._seqs[seq]
        # a recurrent state is fixed-size once it holds a token; an empty sequence's is a few bytes, as in llama.cpp
        rec = _encode(s.rec, _ENTRY.size, self.checkpoint_nbytes if s.rec else None) if s.rec is not None else b""
        if partial:
            return MAGIC + rec
        return MAGIC + _encode(s.kv, self.kv_bytes_per_token) + rec

    def save_state_view(self, seq: int, partial: bool = False) -> memoryview:
        """As the engine's: the state in one kept buffer, overwritten by the next save_state_view or load_state
        (so a caller that keeps the view too long reads another state, as it would on the engine)."""
        data = self.save_state(seq, partial)
        if len(self._scratch) < len(data):  # grows only, as the engine's: a smaller state overwrites in place
            self._scratch = bytearray(len(data))
        self._scratch[:len(data)] = data
        self._scratch[len(data):] = b"\xff" * (len(self._scratch) - len(data))  # what a stale view would read
        return memoryview(self._scratch)[:len(data)].toreadonly()

    def state_size(self, seq: int, partial: bool = False) -> int:
        return len(self.save_state(seq, partial))

    def load_state(self, seq: int, data: bytes | memoryview | tuple, partial: bool = False, clear: bool = True) -> None:
        data = b"".join(data) if isinstance(data, tuple) else bytes(data)
        self._scratch[:] = b"\xff" * len(self._scratch)  # the engine's kept buffer is reused by every load
        if clear:
            self.clear(seq)
        try:
            if self.fail_loads or data[:HEADER] != MAGIC:
                raise EngineError("not a state of this fake model")
            body = data[HEADER:]
            s = self._seqs[seq]
            if partial:
                if s.rec is None:
                    raise EngineError("no recurrent state in this model")
                s.rec = _decode(body, _ENTRY.size)[0]
                return
            kv, used = _decode(body, self.kv_bytes_per_token)
            s.kv = list(kv)
            if s.rec is not None:
                s.rec = _decode(body[used:], _ENTRY.size)[0]
        except EngineError:
            self.clear(seq)
            raise

    @property
    def cuttable(self) -> bool:
        """As Engine.cuttable: an attention-only memory can be cut back by KV removal alone."""
        return not self.hybrid

    def rewind_point(self, seq: int, buffer: int = 0) -> bytes | None:
        """As the engine's: the recurrent checkpoint, or None on an attention-only memory."""
        return self.save_state(seq, partial=True) if self._seqs[seq].rec is not None else None

    def truncate(self, seq: int, n_tokens: int) -> None:
        s = self._seqs[seq]
        lo, hi = self._verified.pop(seq, (0, -1))
        if s.rec is not None and len(s.rec) == hi and lo < n_tokens and hi - n_tokens <= self.n_rs_seq:
            s.rec = s.rec[:n_tokens]  # the n_rs_seq snapshot after position n_tokens - 1
        if (s.rec is not None and len(s.rec) > n_tokens) or len(s.kv) < n_tokens:
            self.clear(seq)
            raise EngineError(f"could not truncate sequence {seq} to {n_tokens} tokens")
        s.kv = s.kv[:n_tokens]
        if self.pos_max(seq) != n_tokens - 1:
            self.clear(seq)
            raise EngineError(f"could not truncate sequence {seq} to {n_tokens} tokens")
