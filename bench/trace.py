"""Replay a Mooncake-format trace through the real scheduler, reuse rules and cache tiers over a simulated engine.

`python -m bench trace --trace conversation_trace.jsonl [--shapes 0.8b,4b,27b] [--ram-gib 1,2,4,8,16] ...`

The trace (kvcache-ai/Mooncake `FAST25-release/traces/*.jsonl`): one request a line, `timestamp` (ms),
`input_length`, `output_length` (tokens) and `hash_ids`, the ids of the prompt's 512-token blocks, chained (an id
names its block *and* everything before it), so a shared id prefix is a shared token prefix.

What runs for real, and what stands in (each request submitted in trace order and drained before the next one:
the scheduler's sequential semantics, `docs/reuse.md`, which is what concurrent requests report too):

    real        Scheduler (admission, slot choice, chunking, stops, after generation), Reuse (match, restore,
                store, supersede), SnapshotCache (radix tree, rules, eviction policy), RamTier
    stand-in    the engine (`SimEngine`: no llama.cpp; states are byte strings of the shape's sizes, checked on
                restore), the disk tier (`SimDiskTier`: DiskTier's budget rule, LRU out, in memory), the prompt
                (`TracePrompts`: token ids and boundary offsets straight from the block ids; no template, no
                tokenizer), the clock (`TimeModel`: seconds from token and byte counts, nothing sleeps)

Scales (exact for eviction, approximate for token positions; `Scale`): one simulated token stands for
`tokens` real ones (16: a 512-token block is 32), and every byte count, budgets included, is divided by `bytes`
(4096: a 16 GiB RAM budget is 4 MiB of real memory), so the whole hour runs in minutes. Token-valued settings
(n_batch, prefill chunk, snapshot min gap, checkpoint interval, the repeat tail) are divided by `tokens`;
`min_segment` becomes 2 simulated tokens (32 real; the measured CPU value is smaller, so each request
re-prefills up to 32 tokens more than on the server). Reported figures are scaled back.

Messages (`TracePrompts`, the mapping of blocks to chat messages): a block is part of one message, and a message
ends at a block's end where the trace makes it a turn end: where two requests' block paths fork (a shared
system prompt or history ends there) or where another request's prompt ends (the next turn extends it) —
"turn" mode; "block" mode makes every block a message. Those ends are the request's template boundaries, passed
as token offsets (all kept), so the infinite-cache ceiling of the trace (blocks seen before, in trace order) is
reachable: `ceiling()`.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

BLOCK = 512  # tokens per hash id (Mooncake FAST25 traces)
GiB = 1 << 30


# ---------------------------------------------------------------------------------------------------- the trace

@dataclass(frozen=True)
class TraceRequest:
    """One line of a Mooncake trace: arrival (ms from the trace's start), prompt and answer tokens, block ids."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path | str, limit: int | None = None) -> list[TraceRequest]:
    """The requests of a Mooncake jsonl trace, in file order (which is timestamp order), at most `limit`.
    Raises ValueError for a line whose blocks cannot hold its input (512 × (blocks - 1) < input <= 512 × blocks)."""
    out = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            d = json.loads(line)
            r = TraceRequest(int(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                             tuple(int(h) for h in d["hash_ids"]))
            if not BLOCK * (len(r.hash_ids) - 1) < r.input_length <= BLOCK * len(r.hash_ids):
                raise ValueError(f"line {len(out) + 1}: {r.input_length} tokens in {len(r.hash_ids)} blocks")
            out.append(r)
    return out


def ceiling(requests: Sequence[TraceRequest]) -> tuple[int, int]:
    """(prefix-hit tokens, input tokens) of an infinite cache in trace order: each request hits its leading blocks
    seen in any earlier request (ids are chained, so a seen id means its whole prefix was seen), the last one
    counted at its own length. Mooncake's FAST'25 paper gives 37.4% (conversation) and 65.1% (synthetic)."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[k] in seen:
            k += 1
        hit += min(k * BLOCK, r.input_length)
        total += r.input_length
        seen.update(r.hash_ids)
    return hit, total


# ---------------------------------------------------------------------------------------------------- sizes

@dataclass(frozen=True)
class Shape:
    """A Qwen3.5 size's state bytes and compute speed.

    checkpoint_bytes: one recurrent checkpoint, per Gated DeltaNet layer f32 conv state (kernel - 1) × (2 × k_heads
    × d_k + v_heads × d_v) plus f32 delta-rule state v_heads × d_k × d_v (llama.cpp's recurrent memory; 19.27 MiB
    on the 0.8B, as the server logs). kv_bytes_per_token: f16 K and V of the full-attention layers, 2 × layers /
    interval × kv_heads × head_dim × 2 (12 KiB on the 0.8B, as logged). prefill_tps: prompt tokens per second in a
    full 512-token call on the 2-core EPYC this project measures on (0.8B: the cold rate 126–130 tokens/s of
    docs/performance.md; the larger shapes by their non-embedding parameters, prefill being weight-bound on a CPU).
    """

    name: str
    checkpoint_bytes: int
    kv_bytes_per_token: int
    prefill_tps: float


def qwen35_shape(name: str, n_layer: int, interval: int, kv_heads: int, head_dim: int, k_heads: int,
                 v_heads: int, d_state: int, hidden: int, ffn: int, n_heads: int, conv: int = 4) -> Shape:
    """A `Shape` from a Qwen3.5 config.json's fields (the formulas in `Shape`'s docstring); prefill speed scaled
    from the 0.8B's 130 tokens/s by non-embedding parameters (attention: q with its gate, k, v, o; Gated DeltaNet:
    qkv, gate, beta, alpha, out; every layer: the SwiGLU MLP)."""
    linear = n_layer - n_layer // interval
    conv_dim = 2 * k_heads * d_state + v_heads * d_state
    checkpoint = linear * 4 * ((conv - 1) * conv_dim + v_heads * d_state * d_state)
    kv = 2 * (n_layer // interval) * kv_heads * head_dim * 2

    def params(n_layer, hidden, ffn, n_heads, kv_heads, k_heads, v_heads):
        attn = hidden * head_dim * (2 * n_heads + 2 * kv_heads) + head_dim * n_heads * hidden
        lin = hidden * (2 * k_heads * d_state + 2 * v_heads * d_state + 2 * v_heads) + v_heads * d_state * hidden
        return (n_layer // interval) * attn + (n_layer - n_layer // interval) * lin + n_layer * 3 * hidden * ffn

    base = params(24, 1024, 3584, 8, 2, 16, 16)  # the 0.8B (orchestrator/models/synth.py's qwen3.5-0.8b)
    return Shape(name, checkpoint, kv, 130.0 * base / params(n_layer, hidden, ffn, n_heads, kv_heads, k_heads, v_heads))


# Published config.json shapes (Qwen/Qwen3.5-*): layers, full_attention_interval 4, kv heads, head_dim 256, linear
# key heads 16, linear value heads, linear head dims 128, hidden, intermediate, attention heads.
SHAPES = {
    "0.8b": qwen35_shape("0.8b", 24, 4, 2, 256, 16, 16, 128, 1024, 3584, 8),
    "4b": qwen35_shape("4b", 32, 4, 4, 256, 16, 32, 128, 2560, 9216, 16),
    "9b": qwen35_shape("9b", 32, 4, 4, 256, 16, 32, 128, 4096, 12288, 16),
    "27b": qwen35_shape("27b", 64, 4, 4, 256, 16, 48, 128, 5120, 17408, 24),
}
LOGITS_BYTES = 248_320 * 4  # a prompt end's logits: n_vocab float32


@dataclass(frozen=True)
class Scale:
    """Simulated units: one simulated token is `tokens` real ones; every byte count is divided by `bytes`."""

    tokens: int = 16
    bytes: int = 4096

    def sim_tokens(self, real: int) -> int:
        return max(1, -(-real // self.tokens))

    def sim_bytes(self, real: int) -> int:
        return max(1, round(real / self.bytes))


# ---------------------------------------------------------------------------------------------------- prompts

class TracePrompts:
    """Token ids and template boundaries of each request, from its block ids (see the module docstring).

    Block b's simulated tokens are a deterministic function of b (ids in [1, 2**24), a fresh run gives the same);
    a request's last block is cut at its input length. mode "turn": a block end inside the prompt is a boundary
    where the trace's block paths fork or another request ends; "block": every block end."""

    def __init__(self, requests: Sequence[TraceRequest], scale: Scale, mode: str = "turn") -> None:
        if mode not in ("turn", "block"):
            raise ValueError(f"mode is 'turn' or 'block', not {mode!r}")
        self.scale, self.mode = scale, mode
        self.per_block = BLOCK // scale.tokens
        children: dict[int, set[int]] = {}
        self.ends: set[int] = set()
        for r in requests:
            for a, b in zip(r.hash_ids, r.hash_ids[1:]):
                children.setdefault(a, set()).add(b)
            self.ends.add(r.hash_ids[-1])
        self.forks = {a for a, c in children.items() if len(c) > 1}

    def block_tokens(self, block: int) -> list[int]:
        step = (block * 2654435761) & 0xFFFFFF
        return [1 + (step + i * 40503) % 0xFFFFFE for i in range(self.per_block)]

    def tokens(self, r: TraceRequest) -> list[int]:
        """The request's prompt: `scale.sim_tokens(input_length)` simulated tokens."""
        out: list[int] = []
        for b in r.hash_ids:
            out += self.block_tokens(b)
        return out[: self.scale.sim_tokens(r.input_length)]

    def message_ends(self, r: TraceRequest) -> list[int]:
        """Indices j of the blocks that end a message inside the prompt (the last block always ends one): every
        block in "block" mode; in "turn" mode those where two requests' block paths fork or a request ends."""
        return [j for j, h in enumerate(r.hash_ids[:-1]) if self.mode == "block" or h in self.forks or h in self.ends]

    def boundaries(self, r: TraceRequest, n: int) -> list[int]:
        """Offsets 0 < b < n (simulated tokens) of the message ends inside the prompt."""
        return [b for b in ((j + 1) * self.per_block for j in self.message_ends(r)) if b < n]


# ---------------------------------------------------------------------------------------------------- engine

_MAGIC = b"SIMSTATE"  # the state header: state.HEADER bytes, as llama.cpp's
_REC = struct.Struct("<QQ")  # recurrent part: position, hash of the tokens before it
_HASH_MUL, _HASH_MOD = 1_000_003, (1 << 61) - 1


def _extend_hash(h: int, tokens: Sequence[int]) -> int:
    for t in tokens:
        h = (h * _HASH_MUL + t) % _HASH_MOD
    return h


class _Sampler:
    def ready(self) -> bool:
        return True

    def fileno(self) -> None:
        return None

    def sample(self, idx: int = -1, logits=None) -> int:
        return 1

    def close(self) -> None:
        pass


@dataclass
class EngineCounts:
    """What the engine computed: prefill calls and simulated tokens, states saved and loaded (simulated bytes)."""

    calls: int = 0
    tokens: int = 0
    saved_bytes: int = 0
    loaded_bytes: int = 0


class SimEngine:
    """The engine interface the scheduler and the reuse rules use, without a model: each sequence is its KV length
    and its recurrent position with a hash of the tokens before it. States are byte strings of the shape's sizes
    (scaled): [header | KV part: length + kv_bytes × length | recurrent part: position, hash, padding to the
    checkpoint's size], split like llama.cpp's (state.HybridState, split layout). A restore of the wrong
    checkpoint is caught: `prompt_hash` against the sequence's hash at the end of each prefill
    (`check_prompt`). Decode steps are not modelled (the replay asks for one token)."""

    def __init__(self, n_slots: int, n_ctx: int, n_batch: int, checkpoint_bytes: int, kv_bytes_per_token: int,
                 logits_floats: int) -> None:
        from orchestrator.state import HybridState

        self.n_seq_max, self.n_ctx, self.n_batch = n_slots, n_ctx, n_batch
        self.min_segment, self.batch_invariant, self.rollback, self.n_rs_seq = 2, True, False, 0
        self.state = HybridState(split_layout=True, empty_recurrent=b"")
        self.checkpoint_bytes, self.kv_bytes = checkpoint_bytes, kv_bytes_per_token
        self._logits = np.zeros(logits_floats, np.float32)
        self._seqs = [[0, 0, 0] for _ in range(n_slots)]  # kv length, recurrent position, recurrent hash
        self.counts = EngineCounts()

    # state bytes (state.StateIO)
    def _rec(self, s) -> bytes:
        if not s[1]:
            return b""
        return _REC.pack(s[1], s[2]) + bytes(max(0, self.checkpoint_bytes - _REC.size))

    def save_state(self, seq: int, partial: bool = False) -> bytes:
        s = self._seqs[seq]
        data = _MAGIC + self._rec(s) if partial else \
            _MAGIC + struct.pack("<Q", s[0]) + bytes(s[0] * self.kv_bytes) + self._rec(s)
        self.counts.saved_bytes += len(data)
        return data

    def save_state_view(self, seq: int, partial: bool = False) -> memoryview:
        return memoryview(self.save_state(seq, partial))

    def state_size(self, seq: int, partial: bool = False) -> int:
        s = self._seqs[seq]
        rec = (max(self.checkpoint_bytes, _REC.size) if s[1] else 0) + len(_MAGIC)
        return rec if partial else rec + 8 + s[0] * self.kv_bytes

    def load_state(self, seq: int, data, partial: bool = False, clear: bool = True) -> None:
        from orchestrator.errors import EngineError

        data = b"".join(data) if isinstance(data, tuple) else bytes(data)
        self.counts.loaded_bytes += len(data)
        if clear:
            self.clear(seq)
        s = self._seqs[seq]
        if data[:8] != _MAGIC:
            self.clear(seq)
            raise EngineError("not a simulated state")
        body = data[8:]
        if not partial:
            (s[0],) = struct.unpack_from("<Q", body)
            body = body[8 + s[0] * self.kv_bytes:]
        s[1], s[2] = _REC.unpack_from(body) if body else (0, 0)

    def truncate(self, seq: int, n_tokens: int) -> None:
        from orchestrator.errors import EngineError

        s = self._seqs[seq]
        if s[1] != n_tokens or s[0] < n_tokens:
            self.clear(seq)
            raise EngineError(f"cannot truncate sequence {seq} to {n_tokens}")
        s[0] = n_tokens

    def decode(self, seq: int, tokens: Sequence[int], pos: int, want_logits: bool = True,
               hidden: list | None = None) -> None:  # no MTP head: hidden stays as given
        from orchestrator.errors import EngineError

        s = self._seqs[seq]
        if pos != s[0] or pos != s[1] or pos + len(tokens) > self.n_ctx:
            self.clear(seq)
            raise EngineError(f"decode at {pos} of a sequence holding {s[0]} (recurrent {s[1]})")
        s[0] = s[1] = pos + len(tokens)
        s[2] = _extend_hash(s[2], tokens)
        if len(tokens) > 1:
            self.counts.calls += 1
            self.counts.tokens += len(tokens)

    def clear(self, seq: int) -> None:
        self._seqs[seq] = [0, 0, 0]

    def pos_max(self, seq: int) -> int:
        return min(self._seqs[seq][0], self._seqs[seq][1]) - 1

    def seq_hash(self, seq: int) -> tuple[int, int]:
        """(recurrent position, hash of the tokens before it) of a sequence."""
        return self._seqs[seq][1], self._seqs[seq][2]

    # the rest of the Engine interface the scheduler calls
    def logits(self, idx: int = -1) -> np.ndarray:
        return self._logits.copy()

    def sampler(self, params, deadline=None) -> _Sampler:
        return _Sampler()

    def is_eog(self, token: int) -> bool:
        return False

    def piece(self, token: int) -> bytes:
        return b" x"

    def can_roll_back(self, seq: int, pos: int) -> bool:
        return False

    def fill_spare(self) -> bool:
        return False

    def drop_spares(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------- tiers

class SimDiskTier:
    """The disk tier's rules without files (orchestrator/cache/disk.py's DiskTier): at most `budget_bytes`, the
    budget checked before each write, least recently used out first (reported through `on_evict`), a hit marks
    used; a file costs its payload plus blob.py's 59-byte header and 4 bytes per *real* token id (`token_bytes`
    per simulated token, scaled). Payloads are kept in memory (scaled, small). Counts bytes written and read."""

    name, shared = "disk", False

    def __init__(self, budget_bytes: int, token_bytes: float = 0.0) -> None:
        self._budget, self.token_bytes = budget_bytes, token_bytes
        self._lru: OrderedDict[str, tuple] = OrderedDict()  # key -> (kind, tokens, payload, nbytes)
        self._bytes = 0
        self.on_evict: Callable[[str], None] | None = None
        self.written = self.read = self.inserts = self.evictions = 0

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._lru)

    def contains(self, key: str) -> bool:
        return key in self._lru

    def get(self, key: str):
        from orchestrator.cache.tiers import Stored

        got = self._lru.get(key)
        if got is None:
            return None
        self._lru.move_to_end(key)
        self.read += len(got[2])
        return Stored(got[0], got[1], got[2])

    def put(self, key: str, tokens: Sequence[int], kind, payload: bytes) -> bool:
        nbytes = len(payload) + round(len(tokens) * self.token_bytes)
        if nbytes > self._budget:
            return False
        self.delete(key)
        evicted = []
        while self._bytes + nbytes > self._budget:
            victim, (_, _, _, n) = self._lru.popitem(last=False)
            self._bytes -= n
            evicted.append(victim)
        self._lru[key] = (kind, tuple(tokens), bytes(payload), nbytes)
        self._bytes += nbytes
        self.written += len(payload)
        self.inserts += 1
        self.evictions += len(evicted)
        for victim in evicted:
            if self.on_evict is not None:
                self.on_evict(victim)
        return True

    def delete(self, key: str) -> bool:
        got = self._lru.pop(key, None)
        if got is not None:
            self._bytes -= got[3]
        return got is not None

    def entries(self) -> Iterator:
        return iter(())

    def stats(self):
        from orchestrator.cache.tiers import TierStats

        return TierStats(self.name, len(self._lru), self._bytes, self._budget, inserts=self.inserts,
                         evictions=self.evictions)

    def close(self) -> None:
        self._lru.clear()


def counting_ram(budget_bytes: int):
    """The real RamTier, counting payload bytes written (successful puts) and read (gets)."""
    from orchestrator.cache.tiers import RamTier

    class CountingRam(RamTier):
        written = read = 0
        _last: tuple[str, int] = ("", 0)

        def put(self, key, tokens, kind, payload):
            ok = super().put(key, tokens, kind, payload)
            self.written += len(payload) if ok else 0
            return ok

        def get(self, key):
            got = super().get(key)
            n = len(got.payload) if got is not None else 0
            self.read += n
            self._last = (key, n)
            return got

        def delete(self, key):  # the cache reads an entry it evicts (to spill it): not a restore's read
            if self._last[0] == key:
                self.read -= self._last[1]
            self._last = ("", 0)
            return super().delete(key)

    return CountingRam(budget_bytes)


# ---------------------------------------------------------------------------------------------------- time

@dataclass(frozen=True)
class TimeModel:
    """Seconds from counts, nothing sleeps (2-core EPYC, the 0.8b preset, bench/results): a prefill call costs
    `call_s` beyond its tokens (an 8-token call 58 ms: 2026-12-01/stops), tokens at the shape's prefill_tps; a
    restore reads RAM at 7.4 GiB/s and the disk tier at 1.85 GiB/s (2026-12-01/restore); a save writes at
    9.6 GiB/s (memcpy of a checkpoint's size, the same run); an answer decodes at 23 tokens/s on the 0.8B
    (2026-12-01/one-run), scaled like prefill."""

    call_s: float = 0.058
    ram_read_bps: float = 7.4 * GiB
    disk_read_bps: float = 1.85 * GiB
    save_bps: float = 9.6 * GiB
    decode_tps_08b: float = 23.0


# ---------------------------------------------------------------------------------------------------- replay

@dataclass
class ReplayConfig:
    """One replay: the shape, the RAM and disk budgets in real bytes (disk 0: no disk tier), the eviction policy
    by name (`orchestrator.cache.policy.POLICIES`), the scales, the message mapping and the server's settings in
    real tokens (orchestrator/config.py's defaults)."""

    shape: str = "0.8b"
    ram_bytes: int = 4 * GiB
    disk_bytes: int = 0
    policy: str = "lru"
    scale: Scale = field(default_factory=Scale)
    messages: str = "turn"
    n_slots: int = 4
    n_batch: int = 512
    prefill_chunk: int = 128
    snapshot_min_gap: int = 256
    checkpoint_interval: int = 512
    n_ctx: int = 262_144


def replay(requests: Sequence[TraceRequest], cfg: ReplayConfig, prompts: TracePrompts | None = None,
           time_model: TimeModel = TimeModel(), progress: Callable[[int], None] | None = None) -> dict:
    """Serve `requests` one after the other through a real Scheduler over `SimEngine` and the real cache, and
    return the figures (real tokens, real bytes, modelled seconds). Raises AssertionError if a restore gave a
    sequence other than the prompt's (the engine's hash check) or the cache's invariants break at the end."""
    from orchestrator.cache import SnapshotCache
    from orchestrator.cache.policy import POLICIES
    from orchestrator.request import Job
    from orchestrator.reuse import Reuse
    from orchestrator.scheduler import Scheduler

    sc, shape = cfg.scale, SHAPES[cfg.shape]
    prompts = prompts or TracePrompts(requests, sc, cfg.messages)
    st = lambda real: max(1, real // sc.tokens)  # noqa: E731 - a token-valued setting in simulated tokens
    engine = SimEngine(cfg.n_slots, cfg.n_ctx // sc.tokens, st(cfg.n_batch), sc.sim_bytes(shape.checkpoint_bytes),
                       sc.sim_bytes(shape.kv_bytes_per_token * sc.tokens), max(1, LOGITS_BYTES // sc.bytes // 4))
    ram = counting_ram(cfg.ram_bytes // sc.bytes)
    tiers = [ram]
    disk = None
    if cfg.disk_bytes:
        disk = SimDiskTier(cfg.disk_bytes // sc.bytes, 4 * sc.tokens / sc.bytes)
        tiers.append(disk)
    policy = POLICIES[cfg.policy]()
    if hasattr(policy, "near_end"):  # a token-valued setting
        policy = replace(policy, near_end=policy.near_end // sc.tokens)
    cache = SnapshotCache(tiers, policy=policy, state=engine.state)
    sched = Scheduler(engine, cache, checkpoint_interval=st(cfg.checkpoint_interval), n_slots=cfg.n_slots,
                      queue_size=4, timeout_s=0, prefill_chunk=st(cfg.prefill_chunk),
                      batch_widths=tuple(range(2, cfg.n_slots + 1)),
                      snapshot_min_gap=st(cfg.snapshot_min_gap))
    sched.reuse.REPEAT_TAIL = max(1, Reuse.REPEAT_TAIL // sc.tokens)
    speed = shape.prefill_tps
    out = dict(cached=0, input=0, requests=0, sources={}, prefill_s=0.0, cold_s=0.0, restore_s=0.0, save_s=0.0,
               decode_s=0.0, busy_s=0.0, wait_s=0.0)
    clock = 0.0
    t0 = time.perf_counter()
    try:
        for i, r in enumerate(requests):
            tokens = prompts.tokens(r)
            before = (engine.counts.calls, engine.counts.tokens, ram.read, disk.read if disk else 0,
                      engine.counts.saved_bytes)
            res = sched.run(Job(tokens, prompts.boundaries(r, len(tokens)), max_tokens=1,
                                restorable_after=lambda generated: None))
            sched.drain()
            pos, h = engine.seq_hash(next(s.seq for s in sched.slots if s.last_used == max(
                x.last_used for x in sched.slots)))
            if pos == len(tokens):  # the state after the prompt is what a cold prefill computes
                assert h == _extend_hash(0, tokens), f"request {i}: restored state is not the prompt's"
            cached = min(res.cached_tokens * sc.tokens, r.input_length)
            out["cached"] += cached
            out["input"] += r.input_length
            out["requests"] += 1
            out["sources"][res.restore_source] = out["sources"].get(res.restore_source, 0) + 1
            calls = engine.counts.calls - before[0]
            new_real = (engine.counts.tokens - before[1]) * sc.tokens
            prefill = calls * time_model.call_s + new_real / speed
            restore = ((ram.read - before[2]) / time_model.ram_read_bps
                       + ((disk.read if disk else 0) - before[3]) / time_model.disk_read_bps) * sc.bytes
            save = (engine.counts.saved_bytes - before[4]) * sc.bytes / time_model.save_bps
            decode = r.output_length / (time_model.decode_tps_08b * speed / SHAPES["0.8b"].prefill_tps)
            out["prefill_s"] += prefill
            out["cold_s"] += math.ceil(r.input_length / cfg.n_batch) * time_model.call_s + r.input_length / speed
            out["restore_s"] += restore
            out["save_s"] += save
            out["decode_s"] += decode
            start = max(clock, r.timestamp_ms / 1000)
            out["wait_s"] += start - r.timestamp_ms / 1000
            clock = start + prefill + restore + save + decode
            out["busy_s"] += prefill + restore + save + decode
            if progress is not None:
                progress(i)
        cache.check()
        stats = cache.stats()
    finally:
        sched.close()
    out["hit_rate"] = out["cached"] / max(out["input"], 1)
    out["trace_span_s"] = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000 if requests else 0.0
    out["ram"] = dict(budget=cfg.ram_bytes, written=ram.written * sc.bytes, read=ram.read * sc.bytes,
                      held=stats.ram_bytes * sc.bytes, entries=stats.ram_entries)
    out["disk"] = dict(budget=cfg.disk_bytes, written=disk.written * sc.bytes, read=disk.read * sc.bytes,
                       held=disk.bytes * sc.bytes, entries=len(disk)) if disk else None
    out["evictions"], out["spills"], out["dropped"] = stats.evictions, stats.spills, stats.dropped
    out["wall_s"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------------------------------- command

def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def grid(args) -> Iterator[ReplayConfig]:
    """The replays the command line asks for, shape by shape, disk tier off then on, budget ascending."""
    scale = Scale(args.token_scale, args.byte_scale)
    for shape in args.shapes.split(","):
        for disk in _floats(args.disk_gib):
            for ram in _floats(args.ram_gib):
                for policy in args.policies.split(","):
                    yield ReplayConfig(shape=shape, ram_bytes=int(ram * GiB), disk_bytes=int(disk * GiB),
                                       policy=policy, scale=scale, messages=args.messages,
                                       checkpoint_interval=args.checkpoint_interval)


def _run_one(job: tuple) -> dict:
    path, limit, cfg = job
    requests = load_trace(path, limit)
    r = replay(requests, cfg)
    hit, total = ceiling(requests)
    r.update(trace=Path(path).name, shape=cfg.shape, ram_gib=cfg.ram_bytes / GiB, disk_gib=cfg.disk_bytes / GiB,
             policy=cfg.policy, messages=cfg.messages, scale=asdict(cfg.scale), ceiling=hit / total,
             checkpoint_interval=cfg.checkpoint_interval,
             of_ceiling=r["hit_rate"] / (hit / total) if hit else 0.0)
    print(f"{r['trace']} {cfg.shape} ram {r['ram_gib']:g} GiB disk {r['disk_gib']:g} GiB {cfg.policy}: hit "
          f"{r['hit_rate']:.4f} = {r['of_ceiling']:.1%} of the ceiling {hit / total:.4f} ({r['wall_s']:.0f} s)",
          flush=True)
    return r


def table(rows: Sequence[dict]) -> str:
    """Markdown: one row per replay (hit rate, share of the ceiling, bytes per tier in GiB)."""
    out = ["| trace | shape | RAM GiB | disk GiB | policy | hit rate | of ceiling | RAM written | RAM read | "
           "disk written | disk read | evictions |", "|" + "---|" * 12]
    for r in rows:
        d = r["disk"] or {}
        out.append(f"| {r['trace']} | {r['shape']} | {r['ram_gib']:g} | {r['disk_gib']:g} | {r['policy']} | "
                   f"{r['hit_rate']:.4f} | {r['of_ceiling']:.1%} | {r['ram']['written'] / GiB:,.0f} | "
                   f"{r['ram']['read'] / GiB:,.0f} | {d.get('written', 0) / GiB:,.0f} | {d.get('read', 0) / GiB:,.0f} | "
                   f"{r['evictions']:,} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench trace", description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, action="append", required=True, help="Mooncake jsonl trace (repeatable)")
    p.add_argument("--limit", type=int, default=None, help="first N requests of each trace (default: all)")
    p.add_argument("--shapes", default="0.8b,4b,27b", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--ram-gib", default="1,2,4,8,16", help="RAM tier budgets, GiB")
    p.add_argument("--disk-gib", default="0,64", help="disk tier budgets, GiB (0: no disk tier)")
    p.add_argument("--policies", default="lru", help="eviction policies (orchestrator.cache.policy.POLICIES)")
    p.add_argument("--messages", default="turn", choices=("turn", "block"), help="block-to-message mapping")
    p.add_argument("--checkpoint-interval", type=int, default=512, help="the server's, in tokens (0: off)")
    p.add_argument("--token-scale", type=int, default=16, help="real tokens per simulated token (divides 512)")
    p.add_argument("--byte-scale", type=int, default=4096, help="real bytes per simulated byte")
    p.add_argument("--jobs", type=int, default=1, help="replays run at once (processes)")
    p.add_argument("--out", type=Path, default=None, help="write <trace>.json and print tables (default: print)")
    p.add_argument("--estimate", action="store_true",
                   help="print lru_budget_curve's estimate per shape (with and without interval checkpoints), no replay")
    args = p.parse_args(argv)
    if BLOCK % args.token_scale:
        p.error("--token-scale must divide 512")
    if args.estimate:
        for path in args.trace:
            requests = load_trace(path, args.limit)
            for shape in args.shapes.split(","):
                for interval in (args.checkpoint_interval, 0):
                    curve = lru_budget_curve(requests, SHAPES[shape], interval)
                    print(f"{path.name} {shape} interval {interval}: " +
                          ", ".join(f"{b:g} GiB {v:.1%}" for b, v in curve.items()))
        return 0
    jobs = [(str(path), args.limit, cfg) for path in args.trace for cfg in grid(args)]
    if args.jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            rows = pool.map(_run_one, jobs, chunksize=1)
    else:
        rows = [_run_one(j) for j in jobs]
    for path in args.trace:
        mine = [r for r in rows if r["trace"] == path.name]
        hit, total = ceiling(load_trace(path, args.limit))
        print(f"\n{path.name}: {len(load_trace(path, args.limit)):,} requests, {total:,} input tokens, "
              f"infinite-cache ceiling {hit / total:.4f}\n\n{table(mine)}")
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{path.stem}.json").write_text(json.dumps(
                dict(trace=path.name, limit=args.limit, ceiling=hit / total, ceiling_tokens=hit, input_tokens=total,
                     argv=sys.argv[1:] if argv is None else argv, runs=mine), indent=1))
    return 0


def lru_budget_curve(requests: Sequence[TraceRequest], shape: Shape, interval: int = 512,
                     budgets_gib: Sequence[float] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)) -> dict:
    """An estimate, not a replay: the share of the infinite-cache ceiling that one least-recently-used store of
    each budget (GiB, RAM and disk together) keeps, from reuse distances in bytes. A request hits its seen
    prefix when the bytes written since that prefix was last stored or restored fit the budget; what it writes
    is modelled on the server's stores: a checkpoint every `interval` new tokens (0: none) plus the repeat point
    and the prompt end, its logits, and the prompt's KV. Returns {budget: share of the ceiling}."""
    last: dict[int, int] = {}
    written = 0
    need: list[tuple[int, int]] = []  # (bytes since last use, tokens)
    for r in requests:
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[k] in last:
            k += 1
        hit = min(k * BLOCK, r.input_length)
        if k:
            need.append((written - last[r.hash_ids[k - 1]], hit))
        new = r.input_length - hit
        stops = (-(-new // interval) if interval else 1) + 2
        written += stops * shape.checkpoint_bytes + LOGITS_BYTES + r.input_length * shape.kv_bytes_per_token
        for h in r.hash_ids:
            last[h] = written
    ceiling_tokens = sum(t for _, t in need)
    return {b: sum(t for d, t in need if d <= b * GiB) / max(ceiling_tokens, 1) for b in budgets_gib}
