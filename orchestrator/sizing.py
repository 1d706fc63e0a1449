"""The context size chosen from the model and the machine when `--ctx-size` is not given.

A slot's memory is its recurrent state (times 1 + the rollback snapshots) plus the KV of every token of its
context, which llama.cpp allocates and clears when the context is made (one KV stream per slot: engine.py). The
default is the model's training context (GGUF `<arch>.context_length`, what llama-server uses), reduced to what
`SHARE` of the memory left beside the model's weights and the snapshot cache's RAM budget holds for all slots,
in steps of `STEP` tokens and never below `MIN_CTX` (a model or machine too small for that gets MIN_CTX and a
warning). The arithmetic is returned whole, for the start log (`ContextFit.describe`).
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
SHARE = 0.5  # of the memory left beside the weights and the cache budget: the rest is the process's and the OS's
STEP = 256
MIN_CTX = 4096


@dataclass(frozen=True)
class ContextFit:
    """The inputs (bytes and tokens) and the chosen context size per slot (`ctx_size`, tokens)."""

    n_ctx_train: int
    kv_bytes_per_token: int
    recurrent_bytes: int  # per slot, rollback snapshots included
    slots: int
    available_bytes: int
    model_bytes: int
    cache_bytes: int
    ctx_size: int
    fits: bool  # False: even MIN_CTX tokens per slot exceed the share

    def describe(self) -> str:
        share = max(0, int((self.available_bytes - self.model_bytes - self.cache_bytes) * SHARE))
        limit = "the model's training context" if self.ctx_size == self.n_ctx_train else "memory"
        return (f"context {self.ctx_size} tokens per slot, set by {limit}: training context {self.n_ctx_train}; "
                f"{SHARE:.0%} of ({self.available_bytes / MiB:.0f} MiB available - {self.model_bytes / MiB:.0f} MiB "
                f"of weights - {self.cache_bytes / MiB:.0f} MiB of snapshot cache) = {share / MiB:.0f} MiB for "
                f"{self.slots} slots of {self.recurrent_bytes / MiB:.1f} MiB recurrent state + "
                f"{self.kv_bytes_per_token / 1024:.1f} KiB of KV per token (--ctx-size sets it)")


def fit_context(n_ctx_train: int, kv_bytes_per_token: int, recurrent_bytes: int, slots: int, available_bytes: int,
                model_bytes: int, cache_bytes: int) -> ContextFit:
    """The context per slot: min(n_ctx_train, what SHARE of the memory left holds for `slots` slots), rounded
    down to STEP, at least min(MIN_CTX, n_ctx_train).

    >>> fit_context(262144, 12288, 20 * MiB, 4, 24 << 30, 600 * MiB, 6 << 30).ctx_size
    188416
    >>> fit_context(32768, 12288, 0, 1, 64 << 30, 0, 0).ctx_size
    32768
    """
    share = (available_bytes - model_bytes - cache_bytes) * SHARE
    per_slot = share / max(1, slots) - recurrent_bytes
    by_memory = int(per_slot // max(1, kv_bytes_per_token)) // STEP * STEP if per_slot > 0 else 0
    floor = min(MIN_CTX, n_ctx_train)
    ctx = max(floor, min(n_ctx_train, by_memory))
    return ContextFit(n_ctx_train, kv_bytes_per_token, recurrent_bytes, slots, available_bytes, model_bytes,
                      cache_bytes, ctx, fits=by_memory >= floor)
