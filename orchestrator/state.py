"""What a model's sequence state is made of, and every rule of reuse that follows from it: one object per model.

llama.cpp answers what the memory of a model is (`llama_model_is_recurrent`, `llama_model_is_hybrid`,
`llama_model_n_swa`); `state_kind()` turns the answers into one of these classes, once, when the engine loads the
model. Nothing else in the server branches on the kind of model: the cache reads which entry kinds it is stored
as (and plans from what those kinds can do: cache/rules.py), the engine asks it how to configure the context,
and the reuse rules ask it where to stop a prefill, how to save, restore and rewind a sequence.

    kind        models                                  entry kinds          a restore of position p needs
    KVState     attention only; sliding window served   KV                   a KV entry (or the live KV) that
                with a full-size window cache                                covers p: truncated to p
    HybridState recurrent layers, with attention (Qwen3.5) KV, CHECKPOINT    a checkpoint at exactly p, and KV
                or without (an empty KV part)                                covering p: load KV, load the
                                                                             checkpoint, truncate the KV to p

A new model family with another state layout (say, a sliding-window model served with a window-sized cache,
or a layout llama.cpp cannot split) is one more subclass here and one more line in `state_kind()`.

The engine side goes through `StateIO`, a handful of byte-level primitives of the engine (llama.cpp's
llama_state_seq_* and llama_memory_seq_rm), so this module never imports llama.cpp and runs on a fake engine
in the unit tests. It knows one fact of llama.cpp's byte layout, measured on the running build (`probe`): a full
sequence state is an 8-byte header, the attention part, then the recurrent part, and a PARTIAL_ONLY state is the
same header and the same recurrent part (llama_memory_hybrid::state_write).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Collection, Protocol, Sequence

from .cache.radix import CHECKPOINT, KV, EntryKind
from .errors import EngineError

HEADER = 8  # bytes of llama.cpp's per-sequence state header, shared by full and PARTIAL_ONLY states

log = logging.getLogger("orchestrator.state")


class StateIO(Protocol):
    """The engine's byte-level state primitives (`Engine`, and the unit tests' fake engine)."""

    def save_state(self, seq: int, partial: bool = False) -> bytes:
        """The state of `seq` (partial: the recurrent part only, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)."""

    def save_state_view(self, seq: int, partial: bool = False) -> memoryview:
        """The same, in a buffer the engine keeps: a read-only view valid until its next save_state_view or
        load_state (for states that are cut into parts, or copied into another sequence)."""

    def load_state(self, seq: int, data: bytes, partial: bool = False, clear: bool = True) -> None:
        """Load a saved state into `seq` (clear it first if `clear`); `data` may be a tuple of bytes-like parts,
        loaded as their concatenation. Raises EngineError (sequence cleared)."""

    def state_size(self, seq: int, partial: bool = False) -> int:
        """Bytes `save_state` would write now."""

    def truncate(self, seq: int, n_tokens: int) -> None:
        """Keep the first `n_tokens` of `seq` (llama_memory_seq_rm(seq, n, -1)); raises EngineError (sequence
        cleared) when the memory cannot be cut there."""

    def decode(self, seq: int, tokens: Sequence[int], pos: int, want_logits: bool = True,
               hidden: list | None = None) -> None:
        """Prefill or decode `tokens` at `pos`; `hidden`, where given, receives each token's hidden state (the
        MTP head's input: Engine.decode)."""

    def clear(self, seq: int) -> None: ...


class StateKind(ABC):
    """The rules of one state layout. Stateless apart from what `probe` measures; shared by engine, cache and
    reuse rules."""

    name: str
    entry_kinds: frozenset[EntryKind]  # the kinds of entries this state is stored as
    swa_full: bool = False  # llama.cpp context setting this state needs (a full-size sliding-window cache)

    def probe(self, io: StateIO, token: int) -> None:  # noqa: B027 - most kinds have nothing to measure
        """Measure what depends on the llama.cpp build (at engine start; uses and clears sequence 0)."""

    @property
    def layout(self) -> str:
        """A name for the byte layout of stored entries; part of the disk tier's fingerprint."""
        return self.name

    def describe(self) -> dict:
        """For /v1/cache/stats: the kind, and whether stored entries are the parts of one full save."""
        return {"state_kind": self.name, "split_layout": False}

    # ------------------------------------------------------------------ prefill and rewind (the reuse rules)

    @abstractmethod
    def snapshot_positions(self, candidates: Sequence[int]) -> list[int]:
        """Of the ascending candidate positions (template boundaries, intervals), those where a prefill stops to
        store an entry."""

    # ------------------------------------------------------------------ save and restore (the engine)

    @abstractmethod
    def save(self, io: StateIO, seq: int, kinds: Collection[EntryKind]) -> dict[EntryKind, bytes]:
        """Entries of `kinds` for the current state of `seq` (at least those asked; one full save may give
        more)."""

    @abstractmethod
    def restore(self, io: StateIO, seq: int, n_tokens: int, kv: bytes | None, checkpoint: bytes | None) -> None:
        """Bring `seq` to the state after its first `n_tokens` tokens. kv: a stored KV entry covering n_tokens, or
        None to keep the sequence's own KV (it must hold those tokens). checkpoint: the entry at n_tokens where
        the kind has them. Raises EngineError (sequence cleared)."""

    def checkpoint_bytes(self, io: StateIO, seq: int) -> int:
        """Size of the recurrent part of `seq`'s state (0 where there is none)."""
        return 0


class KVState(StateKind):
    """Attention only (sliding window too, with its full-size window cache): the KV is the whole state, and any
    prefix of a sequence is restored by truncating its KV (llama_memory_seq_rm), so no checkpoints are stored,
    only KV where a branch ends, and a request reuses every token it shares."""

    name = "kv"
    entry_kinds = frozenset({KV})

    def __init__(self, swa_full: bool = False) -> None:
        # Sliding-window models (Gemma 2/3) get a full-size window cache. With the default window-sized cache,
        # cells of tokens that left the window are reused, so a restored sequence's cells are laid out otherwise
        # than a cold run's and the attention sums round differently: seeded sampling diverged after a few tokens
        # on Gemma 3 270M. With a full cache nothing is evicted and the layout is the cold run's.
        self.swa_full = swa_full

    def snapshot_positions(self, candidates):
        return []  # a KV entry restores any prefix: nothing to store mid-prompt

    def save(self, io, seq, kinds):
        return {KV: io.save_state(seq)}

    def restore(self, io, seq, n_tokens, kv, checkpoint):
        if kv is not None:
            io.load_state(seq, kv, partial=False, clear=True)
        io.truncate(seq, n_tokens)


class HybridState(StateKind):
    """Recurrent layers (Gated DeltaNet, Mamba), alone or with attention layers (Qwen3.5): the recurrent state
    cannot be rewound, so a restore needs a checkpoint taken at exactly that position, plus attention KV covering
    it, which is prefix-closed and so stored only where a branch ends. A pure recurrent model is the case of an
    empty KV part.

    Entries, where a full state is header + KV part + recurrent part (llama_memory_hybrid::state_write) and a
    checkpoint (PARTIAL_ONLY) is header + recurrent part, with the split layout (probed at start):

        full state   [header | KV part | recurrent part]
        KV entry     [header | KV part | empty recurrent part]    a full state of its own: the recurrent part of
                                                                  an empty sequence, a few hundred bytes
        checkpoint   [header | recurrent part]

    So both entries load where they lie, one after the other (llama_state_seq_set_data_ext of the KV entry
    clears the recurrent state, the checkpoint's then fills it), with no copy to put them together. Without the
    split layout the KV entry is the whole state and the checkpoint is loaded over it.
    """

    name = "hybrid"
    entry_kinds = frozenset({KV, CHECKPOINT})

    def __init__(self, split_layout: bool | None = None, empty_recurrent: bytes = b"") -> None:
        self.split_layout = split_layout  # KV entries are [header | KV part | empty recurrent part] (probed)
        self.empty_recurrent = empty_recurrent  # the recurrent part of an empty sequence's state

    def probe(self, io: StateIO, token: int) -> None:
        """Whether this build's states have the split layout: a full state is header + KV part + the
        checkpoint's body, and the KV part followed by an empty sequence's recurrent part loads as a state whose
        checkpoint then restores the original exactly (checked byte for byte). Uses and clears sequence 0."""
        try:
            io.clear(0)
            empty = io.save_state(0, partial=True)
            io.decode(0, [token] * 2, 0, want_logits=False)
            full, part = io.save_state(0), io.save_state(0, partial=True)
            split = (len(part) > HEADER and full[:HEADER] == part[:HEADER] and full.endswith(part[HEADER:])
                     and len(empty) >= HEADER and empty[:HEADER] == part[:HEADER])
            if split:
                kv_entry = full[:len(full) - len(part) + HEADER] + empty[HEADER:]
                try:
                    io.load_state(0, kv_entry, partial=False, clear=True)
                    io.load_state(0, part, partial=True, clear=False)
                    split = io.save_state(0) == full
                except EngineError:  # llama.cpp refused the put-together state
                    split = False
            self.split_layout, self.empty_recurrent = split, (empty[HEADER:] if split else b"")
        finally:
            io.clear(0)
        if not self.split_layout:
            log.warning("this llama.cpp build's states do not split into a KV part and a checkpoint: every KV entry "
                        "is a whole state (a checkpoint's size more per entry)")

    @property
    def layout(self) -> str:
        return f"hybrid split={self.split_layout} kv=full-state"

    def describe(self) -> dict:
        return {"state_kind": self.name, "split_layout": bool(self.split_layout)}

    def snapshot_positions(self, candidates):
        return list(candidates)

    def save(self, io, seq, kinds):
        if KV not in kinds:
            return {CHECKPOINT: io.save_state(seq, partial=True)}
        # The whole state goes into the engine's kept buffer, and each entry is copied out of it once: new memory
        # is written once per kept byte (a full save into new memory and then the parts out of it was twice).
        # Only the kinds asked are built: a KV entry alone (the live KV of another slot, or a checkpoint that is
        # stored already) copies no checkpoint.
        full = io.save_state_view(seq)
        if not self.split_layout:  # the KV entry is then the whole state
            out = {KV: bytes(full)}
            if CHECKPOINT in kinds:
                out[CHECKPOINT] = io.save_state(seq, partial=True)
            return out
        cut = len(full) - (io.state_size(seq, partial=True) - HEADER)  # where the recurrent part starts
        out = {KV: b"".join((full[:cut], self.empty_recurrent))}
        if CHECKPOINT in kinds:
            out[CHECKPOINT] = b"".join((full[:HEADER], full[cut:]))
        return out

    def restore(self, io, seq, n_tokens, kv, checkpoint):
        # Order matters on a hybrid memory: the KV, then the checkpoint, then the truncation, which fails before
        # the checkpoint is loaded (the recurrent state cannot be cut back). Each entry is a loadable state and
        # is read where it lies (bytes), not first copied together into one buffer: faster, as measured in
        # bench/results/2026-12-01/restore/README.md (`python bench/bench_restore.py`; the copy, commit b30508e).
        if kv is not None:
            io.load_state(seq, kv, partial=False, clear=True)
        io.load_state(seq, checkpoint, partial=True, clear=False)
        io.truncate(seq, n_tokens)

    def checkpoint_bytes(self, io, seq):
        return io.state_size(seq, partial=True) - HEADER


def state_kind(recurrent: bool, hybrid: bool, n_swa: int) -> StateKind:
    """The state kind of a model, from llama.cpp's answers: llama_model_is_recurrent, llama_model_is_hybrid,
    llama_model_n_swa (window size; 0 without sliding-window layers)."""
    if recurrent or hybrid:
        return HybridState()
    return KVState(swa_full=n_swa > 0)
