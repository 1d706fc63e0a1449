"""The context size (and, unless --parallel is given, the slot count) chosen from the model and the machine.

What a started server keeps resident, besides the snapshot cache's RAM budget (`cache_bytes`, --cache-ram):

* the weights (`model_bytes`, mmap'd, all of them touched by every decode);
* per slot, its recurrent state times 1 + the rollback snapshots (+ 1 where speculation verifies: the checkpoint
  Engine.rewind_point keeps), and the KV of every token of its context, which llama.cpp allocates and clears when
  the context is made (one KV stream per slot: engine.py);
* llama.cpp's compute buffer, once for all slots (measured on the 0.8b, `bench/results/2026-12-03/sizes/`: the
  same at 1 and 4 slots): the larger of the logits of one ubatch (n_ubatch x n_vocab float32, 485 MiB on Qwen3.5's
  vocabulary) and, with flash attention off as this server runs it, the attention scores and mask of one ubatch
  against the whole context, n_ubatch x (n_head + 1) float32 per context token (18 KiB on the 0.8b, 34 KiB on the
  4B): 1,172 MiB at 64k tokens on the 0.8b. `compute_floor_bytes` and `compute_bytes_per_token` carry them, and the
  fit charges both (their sum over-counts by at most the floor);
* the process itself (`OVERHEAD`: Python, the HTTP server, tokenizer tables, the grammar process).

The default context is the model's training context (GGUF `<arch>.context_length`, what llama-server uses), reduced
to what `SHARE` of the memory left beside the weights, the cache budget and `OVERHEAD` holds for the slots and the
compute buffer, in steps of `STEP` tokens, never below `MIN_CTX` (a model or machine too small for that gets MIN_CTX
and a warning); and, with the cache on, to what the RAM tier holds: one slot's whole KV plus `LIVE_CHECKPOINTS`
checkpoints, so that a session that fills its slot keeps its deepest snapshots in RAM (an entry larger than the
budget skips the RAM tier, and one nearly as large evicts everything else). When the slot count is the default
(`slots_auto`), it drops from `slots` towards 1 until each slot holds `AGENT_CTX` tokens (or the training context,
or the RAM tier's bound): an agent's one long session (Claude Code's first request alone is 11.8k tokens, and its
sessions grow past 64k) is worth more on a small machine than four short ones. The arithmetic is returned whole,
for the start log (`ContextFit.describe`).
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
GiB = 1 << 30
SHARE = 0.8  # of the memory left beside the weights, the cache budget and OVERHEAD: the rest is the OS's margin
OVERHEAD = 1 * GiB  # the process besides llama.cpp's buffers and the cache
STEP = 256
MIN_CTX = 4096
AGENT_CTX = 65536  # the context per slot worth giving up slots for (slots_auto)
LIVE_CHECKPOINTS = 8  # checkpoints of the live session the RAM tier holds beside its whole KV


@dataclass(frozen=True)
class ContextFit:
    """The inputs (bytes and tokens) and the choice: `ctx_size` tokens per slot for `slots` slots.

    fits: False when even MIN_CTX tokens per slot exceed the share (the server would page its weights or swap);
    `problem` then says why, and the server logs it as a warning. `planned_bytes` is what the plan keeps resident
    (weights, slots, compute buffer, cache budget, OVERHEAD), at most `available_bytes` when it fits."""

    n_ctx_train: int
    kv_bytes_per_token: int
    recurrent_bytes: int  # per slot, rollback snapshots included
    slots: int
    available_bytes: int
    model_bytes: int
    cache_bytes: int
    ctx_size: int
    fits: bool
    compute_bytes_per_token: int = 0
    compute_floor_bytes: int = 0
    slots_asked: int = 0
    limit: str = ""

    @property
    def share_bytes(self) -> int:
        return max(0, int((self.available_bytes - self.model_bytes - self.cache_bytes - OVERHEAD) * SHARE))

    @property
    def compute_bytes(self) -> int:
        return self.compute_floor_bytes + self.ctx_size * self.compute_bytes_per_token

    @property
    def slot_bytes(self) -> int:
        return self.recurrent_bytes + self.ctx_size * self.kv_bytes_per_token

    @property
    def planned_bytes(self) -> int:
        return self.model_bytes + self.cache_bytes + OVERHEAD + self.compute_bytes + self.slots * self.slot_bytes

    @property
    def problem(self) -> str:
        if self.fits:
            return ""
        if self.model_bytes + self.cache_bytes + OVERHEAD >= self.available_bytes:
            return (f"the weights ({self.model_bytes / GiB:.1f} GiB) and the cache budget ({self.cache_bytes / GiB:.1f}"
                    f" GiB) with {OVERHEAD / GiB:.0f} GiB for the process exceed the {self.available_bytes / GiB:.1f} "
                    f"GiB available: the machine will page the weights or swap; use a smaller model or quantization, "
                    f"or a smaller --cache-ram")
        return (f"{MIN_CTX} tokens per slot do not fit the {self.share_bytes / MiB:.0f} MiB left for the slots: the "
                f"machine may swap; set a smaller --ctx-size, --parallel or --cache-ram")

    def describe(self) -> str:
        reduced = (f" ({self.slots_asked} slots would get fewer than {AGENT_CTX} tokens each; --parallel sets them)"
                   if self.slots < self.slots_asked else "")
        text = (f"context {self.ctx_size} tokens per slot, {self.slots} slot{'s' * (self.slots != 1)}{reduced}, set "
                f"by {self.limit}: training "
                f"context {self.n_ctx_train}; {SHARE:.0%} of ({self.available_bytes / MiB:.0f} MiB available - "
                f"{self.model_bytes / MiB:.0f} MiB of weights - {self.cache_bytes / MiB:.0f} MiB of snapshot cache - "
                f"{OVERHEAD / MiB:.0f} MiB for the process) = {self.share_bytes / MiB:.0f} MiB for the compute buffer "
                f"({self.compute_floor_bytes / MiB:.0f} MiB + {self.compute_bytes_per_token / 1024:.1f} KiB per "
                f"context token) and {self.slots} slots of {self.recurrent_bytes / MiB:.1f} MiB recurrent state + "
                f"{self.kv_bytes_per_token / 1024:.1f} KiB of KV per token; planned resident "
                f"{self.planned_bytes / MiB:.0f} MiB (--ctx-size sets the context)")
        return text + (f"; WARNING: {self.problem}" if self.problem else "")


def fit_context(n_ctx_train: int, kv_bytes_per_token: int, recurrent_bytes: int, slots: int, available_bytes: int,
                model_bytes: int, cache_bytes: int, compute_bytes_per_token: int = 0, compute_floor_bytes: int = 0,
                slots_auto: bool = False, checkpoint_bytes: int | None = None) -> ContextFit:
    """The context per slot, and the slot count when `slots_auto` (at most `slots`); see the module docstring.

    ctx = min(n_ctx_train, what the share holds for `slots` slots and the compute buffer, what the RAM tier
    holds when `cache_bytes` > 0), rounded down to STEP, at least min(MIN_CTX, n_ctx_train). `recurrent_bytes`
    is a slot's (its state and rollback snapshots); `checkpoint_bytes` one checkpoint's (default recurrent_bytes).

    >>> fit_context(262144, 12288, 20 * MiB, 4, 24 << 30, 600 * MiB, 6 << 30).ctx_size
    262144
    >>> fit_context(32768, 12288, 0, 1, 64 << 30, 0, 0).ctx_size
    32768
    >>> f = fit_context(262144, 32768, 50 * MiB, 4, 12 << 30, 2570 * MiB, 3 << 30, 34816, 485 * MiB, True)
    >>> (f.slots, f.ctx_size)
    (1, 61440)
    """
    floor = min(MIN_CTX, n_ctx_train)
    share = max(0.0, (available_bytes - model_bytes - cache_bytes - OVERHEAD) * SHARE - compute_floor_bytes)
    checkpoint = recurrent_bytes if checkpoint_bytes is None else checkpoint_bytes
    by_cache = ((cache_bytes - LIVE_CHECKPOINTS * checkpoint) // max(1, kv_bytes_per_token)
                if cache_bytes > 0 else n_ctx_train)

    def by_memory(n: int) -> int:
        per = share - n * recurrent_bytes
        return int(per // max(1, n * kv_bytes_per_token + compute_bytes_per_token)) if per > 0 else 0

    want = min(n_ctx_train, max(by_cache, floor), AGENT_CTX)
    n = max(1, slots)
    while slots_auto and n > 1 and by_memory(n) < want:
        n -= 1
    caps = {"the model's training context": n_ctx_train, "memory": by_memory(n),
            "the snapshot cache's RAM budget (a slot's KV and its checkpoints)": max(by_cache, floor)}
    limit = min(caps, key=lambda k: caps[k])
    ctx = max(floor, caps[limit] // STEP * STEP if caps[limit] < n_ctx_train else n_ctx_train)
    return ContextFit(n_ctx_train, kv_bytes_per_token, recurrent_bytes, n, available_bytes, model_bytes,
                      cache_bytes, ctx, fits=by_memory(n) >= floor, compute_bytes_per_token=compute_bytes_per_token,
                      compute_floor_bytes=compute_floor_bytes, slots_asked=max(1, slots), limit=limit)


def compute_sizes(n_ubatch: int, n_vocab: int, n_head: int) -> tuple[int, int]:
    """llama.cpp's compute buffer as (floor bytes, bytes per context token) with flash attention off: the logits
    of one ubatch (n_ubatch x n_vocab float32) and its attention scores and mask (n_ubatch x (n_head + 1) float32
    per context token); see the module docstring. n_head 0 (no attention layers): nothing per token."""
    return n_ubatch * n_vocab * 4, (n_ubatch * (n_head + 1) * 4 if n_head else 0)
