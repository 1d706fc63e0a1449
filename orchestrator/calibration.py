"""Calibration: what the runtime measures on the served model and this CPU at start, and passes to the engine.

    min_segment      the fewest tokens a prefill ubatch may have for its result to be bit-identical to the same
                     tokens inside a larger ubatch (the rule of reuse.py rests on it)
    odd              whether prefill ubatches are kept at odd lengths to get there (chunks.py: CPUs whose kernels
                     pair rows in even ubatches, ARM i8mm); min_segment is then twice the odd size found
    batch_invariant  whether one decode step batched over sequences equals decoding each alone
    batch_widths     the batch widths at which it does (ARM i8mm: odd ones only, two rows at a time otherwise)
    rollback         whether a checkpoint taken back inside a prefill call (Engine.checkpoint_back, llama.cpp's
                     n_rs_seq snapshots) is bit-identical to one of a prefill that stopped there (reuse.py then
                     takes a prompt's last stop, where within n_rs_seq of its end, without a llama_decode call of
                     its own)
    state_sizes      recurrent bytes per sequence and KV bytes per token (logged: memory per slot)
    prefill_rate     prompt tokens per second of one prefill (the remote tier's fetch-or-recompute decision
                     starts from it; reuse.PrefillRate refines it from every prefill since)

Each probe uses and clears the sequences it needs; they run before the scheduler starts. min_segment is kept in a
small JSON file (`CalibrationFile`) so that a restart does not measure again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import llama_cpp
import numpy as np

from . import kernels
from .devices import Offload
from .cache.radix import CHECKPOINT
from .speculative.verify import rewind
from .engine import Attention, Engine
from .errors import EngineError

log = logging.getLogger("orchestrator.calibration")


UNEXACT_MIN_SEGMENT = 24  # the largest size measure_min_segment tests: what a device backend that fails it serves at


def measure_min_segment(engine: Engine, sizes: Sequence[int] = tuple(range(2, 25)), tiled: int = 0) -> int:
    """The fewest tokens a prefill ubatch may have for its result to be bit-identical to the same tokens inside one
    larger ubatch: the smallest tested size above every size that differed, confirmed at untested sizes above it.

    Prefills a 56-token prompt whole, then split into a short segment at its start or its end for each size, and
    compares the last logits. Measured with llama-cpp-python 0.3.36 on x86 (AVX-512): 2 for the F16 tiny preset;
    8 for Q4_K_M models (tiny-q4, the 0.8b: max |Δlogit| 0.23 with 2..7 tokens; Gemma 3 270M: 1.2), where
    ggml-cpu takes other matmul kernels for fewer than 8 rows. The thresholds differ by CPU (llamafile sgemm:
    n < 2, 4 or 8 depending on the ISA), hence a measurement at start.

    The rule assumes that every size from the found one on is exact. Kernels that compute rows in groups break it
    at sizes that are not a multiple of the group, however large: llama.cpp's repacked weights (repacking.py)
    take 4 rows at a time and the rest one by one (ggml-cpu/repack.cpp, forward_mul_mat), so on AVX2 the 0.8b was
    exact at 8, 12, 16, 20, 24 tokens only (bench/results/2026-12-03/repacking); ARM's i8mm dot products take
    two rows at a time in even ubatches only (bench/results/2026-12-03/aarch64). A difference need not show at
    every such size (repacked tiny-q4 on ARM dotprod: 11 differs, 13 does not), so every size from 2 to 24 is
    tested (an earlier list, 2..10, 12, 16, 24, read 12 and 16 there), and the found size m is confirmed at
    m + 1, m + 2, m + 3 and 2m + 1 where not tested and the reference holds them.

    `tiled` (Attention.tiled_queries): kernels that switch at that many rows, past the 56-token reference, as
    ggml-cpu's tiled flash attention does at 64 queries. The size found is then probed again against a reference
    long enough to reach them (2 * (2 * tiled + 1) + 8 tokens, n_batch permitting) at itself, tiled / 2,
    tiled - 1, tiled and 2 * tiled, and confirmed above the new size as before. Measured on tiny-q4 with flash
    attention over F16, AMD EPYC: 8 without it (wrong: a 63-token ubatch differs by 0.037), 64 with it.

    Uses and clears sequence 0; raises EngineError if even the largest size differs, or a confirming size does or
    does not fit the reference (m = 24).
    """
    found = _smallest_exact(engine, sizes, min(2 * max(sizes) + 8, engine.n_batch))
    if tiled and found < tiled:
        if engine.n_batch < 2 * tiled + 8:
            raise EngineError(f"flash attention over an F16/F32 cache changes kernels at {tiled} tokens per ubatch, "
                              f"which --batch-size {engine.n_batch} is too small to measure (at least "
                              f"{2 * tiled + 8}); use a larger --batch-size, or -fa off")
        longer = (found, tiled // 2, tiled - 1, tiled, 2 * tiled)
        found = _smallest_exact(engine, longer, min(2 * (2 * tiled + 1) + 8, engine.n_batch))
    return found


def _smallest_exact(engine: Engine, sizes: Sequence[int], n: int) -> int:
    """measure_min_segment's search over `sizes` against an n-token reference prefilled as one ubatch."""
    sizes = [m for m in sizes if 2 * m + 8 <= n] or [2]
    tokens = [1000 + (37 * i) % 5000 for i in range(n)]

    def differs(m: int, ref: np.ndarray) -> bool:
        return split_delta(engine, tokens, ref, m) > 0

    try:
        engine.clear(0)
        engine.decode(0, tokens, 0)
        ref = engine.logits()
        worst = max((m for m in sizes if differs(m, ref)), default=0)
        above = [m for m in sizes if m > worst]
        if not above:
            raise EngineError(f"prefill splits into segments of up to {max(sizes)} tokens change the logits on "
                              f"this model and CPU; prefix reuse cannot be exact here (run with --no-cache)")
        found = min(above)
        for m in (found + 1, found + 2, found + 3, 2 * found + 1):
            if m in sizes or (2 * m + 8 > n and m == 2 * found + 1):
                continue  # tested above; or 2m + 1, which a short reference cannot hold, is left out
            if 2 * m + 8 > n:
                raise EngineError(f"prefill splits change the logits at {worst} tokens on this model and CPU, and "
                                  f"{found} cannot be confirmed; prefix reuse cannot be exact here (run with "
                                  f"--no-cache)")
            if differs(m, ref):
                raise EngineError(f"prefill splits change the logits at {m} tokens though {found} were exact on this "
                                  f"model and CPU: kernels that compute rows in groups (llama.cpp's repacked weights: "
                                  f"--use-extra-bufts off; ARM i8mm dot products, two rows at a time); prefix reuse "
                                  f"cannot be exact with them")
        return found
    finally:
        engine.clear(0)


ODD_SIZES = tuple(range(3, 24, 2))  # the odd ubatch lengths measure_odd_segment tests


def measure_odd_segment(engine: Engine, sizes: Sequence[int] = ODD_SIZES) -> int:
    """The fewest tokens, an odd number, a prefill ubatch of odd length may have for its result to be
    bit-identical to the same tokens inside one larger odd ubatch: the smallest tested size above every size that
    differed. For CPUs where measure_min_segment finds no size because kernels take rows two at a time in even
    ubatches and one at a time in odd ones (ARM i8mm; chunks.py), so that only same-parity splits can agree.

    Prefills a 71-token prompt whole (odd: every row alone), then as m + (71 - 2m) + m tokens for each odd size m
    (three odd ubatches: m at the start and at the end, and the middle sizes 25..65 on the way), and compares the
    last logits. Uses and clears sequence 0; raises EngineError if even the largest size differs or the reference
    does not fit n_batch.
    """
    n = 3 * max(sizes) + 2
    if n % 2 == 0 or n > engine.n_batch:
        raise EngineError(f"the odd-ubatch probe needs an odd reference of {n} tokens in one ubatch (n_batch "
                          f"{engine.n_batch}); prefix reuse cannot be checked exact here (run with --no-cache)")
    tokens = [1000 + (37 * i) % 5000 for i in range(n)]
    try:
        engine.clear(0)
        engine.decode(0, tokens, 0)
        ref = engine.logits()
        worst = 0
        for m in sizes:
            engine.clear(0)
            engine.decode(0, tokens[:m], 0, want_logits=False)
            engine.decode(0, tokens[m:n - m], m, want_logits=False)
            engine.decode(0, tokens[n - m:], n - m)
            if _delta(engine.logits(), ref) > 0:
                worst = m
        above = [m for m in sizes if m > worst]
        if not above:
            raise EngineError(f"prefill splits into odd segments of up to {max(sizes)} tokens change the logits on "
                              f"this model and CPU; prefix reuse cannot be exact here (run with --no-cache)")
        return min(above)
    finally:
        engine.clear(0)


@dataclass(frozen=True)
class Segments:
    """How prefills are cut so that a cached state equals a cold one (chunks.py): every ubatch at least
    `min_segment` tokens, and with `odd` of odd length (min_segment is then twice the odd size found exact)."""
    min_segment: int
    odd: bool = False


def segment_key(attention: Attention) -> bytes:
    """The attention layout's part of min_segment's CalibrationFile key, with the probe that measured it: a layout
    with tiled flash attention names it (`measure_min_segment`'s `tiled`), so that a value stored before that
    probe existed (8 on tiny-q4, where 64 is exact) is measured again rather than read back."""
    return attention.key().encode() + (b"/tiled%d" % attention.tiled_queries if attention.tiled_queries else b"")


def measure_segments(engine: Engine) -> Segments:
    """measure_min_segment; where it finds no exact size, measure_odd_segment (kept at odd lengths, logged why).
    Raises measure_min_segment's EngineError where neither finds one."""
    try:
        return Segments(measure_min_segment(engine, tiled=engine.attention.tiled_queries))
    except EngineError as e:
        first = e
    if engine.attention.tiled_queries:  # odd ubatches are probed below 24 tokens only, short of the tiled path
        raise EngineError(f"{first.message}; odd-length ubatches are not probed with flash attention over an F16/F32 "
                          f"cache: run with -fa off") from None
    try:
        m = measure_odd_segment(engine)
    except EngineError:
        raise first from None
    log.info("%s; in odd-length ubatches %d tokens or more are exact (kernels that take rows two at a time in even "
             "ubatches, as ggml-cpu does with ARM i8mm): prefills are cut into odd ubatches, min_segment %d",
             first.message, m, 2 * m)
    return Segments(2 * m, odd=True)


def split_delta(engine: Engine, tokens: Sequence[int], ref: np.ndarray, m: int) -> float:
    """The largest |Δlogit| (`_delta`) of the last token of `tokens` prefilled as m + (n - m) and as (n - m) + m
    tokens against `ref`, its logits prefilled whole (0.0: bit-identical both ways). Uses sequence 0."""
    n, worst = len(tokens), 0.0
    for cut in (m, n - m):
        engine.clear(0)
        engine.decode(0, tokens[:cut], 0, want_logits=False)
        engine.decode(0, tokens[cut:], cut)
        worst = max(worst, _delta(engine.logits(), ref))
    return worst


def _delta(a: np.ndarray, b: np.ndarray) -> float:
    """0.0 where bit-identical, else the largest |a - b| (inf where that is not a positive number: NaN, inf)."""
    if np.array_equal(a, b):
        return 0.0
    d = float(np.max(np.abs(a - b)))
    return d if d > 0 else float("inf")


def check_batch_invariance(engine: Engine) -> bool:
    """Whether a decode step batched over sequences gives, for each sequence, bit-identical logits to the same
    token decoded alone, at every batch width from 2 to n_seq_max. Clears the sequences it uses.

    Measured with llama-cpp-python 0.3.36 on x86 (AVX-512): true up to 7 rows for the K-quant synthetic models
    (per-row dot products whatever the width), false from 8 rows (the kernels that make prefill fast: max
    |Δlogit| 0.14 on the 0.8b), and false at any width for the F16 tiny preset (another matmul path for more than
    one row, llamafile's tinyBLAS: 8e-4) with the default decode kernels; true for both with the reference decode
    kernels and tinyBLAS gated (kernels.py: the defaults in the default layout). So it is measured on the served
    model, for the configured number of slots.
    """
    return engine.n_seq_max >= 2 and not any(batch_deltas(engine, first_only=True).values())


def exact_batch_widths(engine: Engine) -> tuple[int, ...]:
    """The batch widths, 2..n_seq_max, at which a decode step batched over sequences gives each sequence
    bit-identical logits to decoding it alone (`batch_deltas`): all of them where check_batch_invariance holds;
    on x86 K-quant models 2..7 (8 rows switch kernels; every width with reference decode kernels, kernels.py);
    with ARM i8mm the odd ones (an even width pairs rows, chunks.py). Clears the sequences it uses."""
    return tuple(w for w, d in batch_deltas(engine).items() if d == 0.0)


def batch_deltas(engine: Engine, first_only: bool = False) -> dict[int, float]:
    """The comparison behind check_batch_invariance: batch width (2..n_seq_max) -> the largest |Δlogit| of any
    sequence's decode step in that batch against the same step alone (0.0: bit-identical); after the first width
    that differs, no more when `first_only`. Clears the sequences it uses."""
    k = engine.n_seq_max
    prompts = [[1000 + 7 * s + i for i in range(4)] for s in range(k)]
    nxt = [2000 + s for s in range(k)]
    deltas: dict[int, float] = {}
    try:
        alone = []
        for s in range(k):
            engine.clear(s)
            engine.decode(s, prompts[s], 0, want_logits=False)
            engine.decode(s, [nxt[s]], len(prompts[s]))
            alone.append(engine.logits())
            engine.clear(s)
        for width in range(2, k + 1):
            for s in range(width):
                engine.decode(s, prompts[s], 0, want_logits=False)
            engine.decode_step([(s, nxt[s], len(prompts[s])) for s in range(width)])
            deltas[width] = max(_delta(engine.logits(i), alone[i]) for i in range(width))
            for s in range(width):
                engine.clear(s)
            if first_only and deltas[width]:
                break
        return deltas
    finally:
        for s in range(k):
            engine.clear(s)


def check_rollback(engine: Engine, seq: int | None = None) -> bool:
    """Whether `Engine.checkpoint_back` gives, on this model and CPU, the bytes of a checkpoint saved by a prefill
    that stopped there, at every distance from 1 to min(rollback_reach, min_segment + 1) back from the end of a
    call that starts from a restored state as a cached prefill does, and whether the sequence then goes on
    exactly: the logits of a decode step after it, and the logits of the tail prefilled from the taken-back checkpoint,
    equal those of the plain prefill. False without n_rs_seq snapshots. Uses and clears sequence `seq` (default:
    the last, so that the other cells are in use as when serving) and sequence 0.

    Measured with llama-cpp-python 0.3.36 (bench/results/2026-12-01/stops): bit-identical on the tiny and 0.8b
    presets on an AVX-512 EPYC; llama.cpp marks n_rs_seq experimental, hence the check at start."""
    m, k = engine.min_segment, engine.n_rs_seq
    if k < 1 or CHECKPOINT not in engine.state.entry_kinds:
        return False
    seq = engine.n_seq_max - 1 if seq is None else seq
    head = [1000 + (37 * i) % 5000 for i in range(2 * m + 8)]
    tail = [3000 + (53 * i) % 5000 for i in range(max(k, m) + m + 4)]
    tokens = head + tail
    n, h = len(tokens), len(head)
    try:
        if seq != 0:  # another sequence holds a state, as other slots do
            engine.clear(0)
            engine.decode(0, tail, 0, want_logits=False)
        engine.clear(seq)
        engine.decode(seq, head, 0, want_logits=False)
        start = engine.save_state(seq)
        for back in range(1, min(engine.rollback_reach, m + 1) + 1):
            p = n - back
            engine.load_state(seq, start)
            engine.decode(seq, tokens[h:p], h, want_logits=False)
            stopped = engine.save_state(seq, partial=True)
            engine.load_state(seq, start)
            engine.decode(seq, tokens[h:], h)
            plain = engine.logits()
            taken = engine.checkpoint_back(seq, p)
            if taken != stopped:
                return False
            engine.decode(seq, [tokens[0]], n)
            after = engine.logits()
            engine.load_state(seq, start)
            engine.decode(seq, tokens[h:], h)
            engine.decode(seq, [tokens[0]], n)
            if not np.array_equal(after, engine.logits()):
                return False
            if back >= m:  # a cached request restores the checkpoint and prefills the rest
                engine.load_state(seq, start)
                engine.decode(seq, tokens[h:], h)
                kv = engine.save_state(seq)
                engine.load_state(seq, kv)
                engine.load_state(seq, taken, partial=True, clear=False)
                engine.truncate(seq, p)
                engine.decode(seq, tokens[p:], p)
                if not np.array_equal(engine.logits(), plain):
                    return False
        return True
    except EngineError:
        return False
    finally:
        engine.clear(seq)
        engine.clear(0)


# Verification widths measured: every one up to 16, then multiples of 4. Wider ones pay only on long runs of accepted
# drafts, where a few sizes suffice, and each one measured lengthens the first start (widths up to 32: 64 s against
# 50 s up to 16 on the qwen3.5-0.8b preset, bench/results/2026-12-07/width-calibration-cost); with them Gemma 3 270M
# decoded its agent-shaped answers 1.07-1.15x faster than up to 16 (bench/results/2026-12-07/wide-verification).
DENSE_WIDTHS = 16


def verify_candidates(max_width: int) -> tuple[int, ...]:
    """The verification widths `measure_verify_widths` tries up to `max_width`, ascending (DENSE_WIDTHS)."""
    return tuple(w for w in range(2, max_width + 1) if w <= DENSE_WIDTHS or w % 4 == 0)


def measure_verify_widths(engine: Engine, max_width: int = 7, contexts: Sequence[int] = (40, 90, 170, 300),
                          follow: int = 2) -> tuple[int, ...]:
    """The verification widths w (`verify_candidates` up to max_width) at which one ubatch of w tokens of one sequence
    (`Engine.verify`) gives bit-identical logits to w one-token decode steps, at every position, AND the state
    after keeping all w of them, and in the first and the last of `contexts` also after keeping 1, w // 2 and
    w - 1 (speculative.verify.rewind: KV removal, and on a recurrent memory the checkpoint from before the
    verification reloaded and the kept tokens decoded again: the farthest and the nearest rollback), goes on
    exactly: the logits of the next `follow` one-token steps equal those of the one-token path (`Engine.decode`
    of one token: decode_rows apply). Tested after prefills of each length in `contexts` (pseudo-random tokens);
    a width counts only if every context passes, and the result runs over the candidates from 2 (the first that
    fails ends it), or where width 2 fails, over the odd ones from 3: with ARM i8mm, ggml-cpu's K-quant dot
    products take two rows at a time where a ubatch's length is even (ggml-cpu.c, `num_rows_per_vec_dot`),
    reference kernels or not, so only odd widths can equal one-row steps; a rollback then replays a count that
    is not a width in pieces that are (an even count as an odd one + 1)
    (speculative.verify.replay's `widths`), as checked here. Empty: speculation cannot be exact here. Uses and
    clears sequence 0.

    Why it must be measured, and why passing is evidence, not proof: on ggml-cpu the attention matmuls over the
    F16 KV cache (KQ, KQV) run ggml_vec_dot_f16 (several accumulators) for one query row and llamafile's
    tinyBLAS (one accumulator per element; llamafile_sgemm refuses n < 2) for two or more, so the sums round
    differently; on K-quant models the Q8_K rounding of the activations absorbs most of it, position by
    position, data-dependently (bench/results/2026-12-03/verification-widths/README.md): on an AMD EPYC with
    AVX-512, tiny-q4 passed widths 2..7 after 40 tokens, 2..3 after 300 and none after 128 or 170 (1-ulp
    differences), so two contexts read (2, 3), which another prompt refuted; four are tried. Widths of 8 and more
    also change the weight-matmul kernels (as `measure_min_segment` sees). With decode_rows 2 the one-token
    step takes the verification's attention kernels: widths 2..7 exact on K-quant models; F16 still none (the
    output projection then runs for one row in a step and for w rows in a verification).

    Cost: the rollbacks are most of it (each one a second verification, a replay and `follow` steps): on the
    qwen3.5-0.8b preset at widths 2..16 on a 2-core AMD EPYC, 81.3 s with them in all four contexts, 50.3 s in
    the first and last only (bench/results/2026-12-07/width-calibration-cost). A rollback's replay is itself a
    verification-shaped ubatch, whose logits every context checks at its width."""
    candidates = verify_candidates(min(max_width, engine.n_batch))
    if not candidates:
        return ()
    top = candidates[-1]
    exact = {w: True for w in candidates}
    passed: set[int] = set()  # measured exact in every context so far

    def alive(w: int) -> bool:  # can still end up in the result: every smaller width, or every smaller odd one
        smaller = [v for v in candidates if v < w]
        return exact[w] and (all(exact[v] for v in smaller) or (w % 2 == 1 and all(exact[v] for v in smaller
                                                                                   if v % 2 == 1)))

    try:
        for c, n in enumerate(contexts):
            if not any(alive(w) for w in exact):
                break  # nothing left to find
            rollbacks = c in (0, len(contexts) - 1)
            n = min(n, engine.n_ctx - top - follow - 1)
            prompt = [1000 + (41 * i + 7 * n) % 5000 for i in range(n)]
            nxt = [1500 + (59 * i + n) % 5000 for i in range(top + follow)]
            engine.clear(0)
            engine.decode(0, prompt, 0)
            start = engine.save_state(0)
            ref = []
            for i, tok in enumerate(nxt):  # the one-token path
                engine.decode(0, [tok], n + i)
                ref.append(engine.logits())
            for w in candidates:
                if not alive(w):
                    continue
                engine.load_state(0, start)
                engine.verify(0, nxt[:w], n)
                if not all(np.array_equal(engine.logits(i), ref[i]) for i in range(w)):
                    exact[w] = False
                    continue
                replays = {v for v in passed if v < w and exact[v]}  # rollbacks replay in exact lengths
                keeps = {1, w // 2, w - 1, w} if rollbacks else {w}
                for keep in sorted(keeps, reverse=True):  # all kept: this verification goes on
                    if keep < w:
                        engine.load_state(0, start)
                        point = engine.rewind_point(0)
                        engine.verify(0, nxt[:w], n)
                        rewind(engine, 0, point, n, nxt[:keep], replays)
                    for i in range(keep, keep + follow):
                        engine.decode(0, [nxt[i]], n + i)
                        if not np.array_equal(engine.logits(), ref[i]):
                            exact[w] = False
                            break
                    if not exact[w]:
                        break
                if exact[w]:
                    passed.add(w)
    except EngineError:
        return ()
    finally:
        engine.clear(0)
    run = [w for w in candidates if exact[2] or w % 2 == 1]  # every width from 2, or (ARM i8mm) odd ones
    widths = []
    for w in run:
        if not exact[w] or w not in passed:
            break
        widths.append(w)
    return tuple(widths)


def check_batched_verification(engine: Engine, width: int, contexts: Sequence[int] = (40, 170, 300)) -> bool:
    """Whether verifications of several sequences in one llama_decode call (`Engine.verify_many`; a sequence with
    one token is a decode step there) give each sequence bit-identical logits to its own call alone, and leave
    the states one-token steps continue from exactly: every sequence 0..k-1 (k = n_seq_max, the slots that can
    decode together; after prefills of `contexts`) verifies, at once, widths like (width, 1, 1, width, ..),
    (1, width, 2, 1, ..), (width, width, ..) and (2, 1, width, 2, ..) (each pattern repeated over the k
    sequences), against each alone, then each decodes one more token; and the same calls with logits for each
    sequence's last token only (a rollback's replay: speculative.verify.replay) continue exactly too. The
    scheduler verifies the drafts of slots that decode together only where this holds
    (speculative.verify.Speculation.step_group); where it does not, they decode their one token each, batched,
    as before.

    Why it can hold: llama.cpp cuts such a call into ubatches of equal tokens per sequence (split_equal), and
    under reference decode kernels (kernels.py) every row runs the one-row kernels, so a row's result depends
    on neither the ubatch nor its neighbours. Measured on tiny-q4 with reference kernels (flash attention over a
    Q8_0 or an F16 K cache): bit-identical in every case; with the default kernels, 3.6e-7 to 0.033
    (bench/results/2026-12-07/batched-verification). Uses and clears sequences 0..k-1; False where llama.cpp
    fails or fewer than two sequences or width < 2."""
    k = engine.n_seq_max
    if k < 2 or width < 2:
        return False
    if k * width > engine.n_batch:
        log.info("verifications of %d slots of %d tokens do not fit --batch-size %d: not checked", k, width,
                 engine.n_batch)
        return False
    patterns = [(width, 1, 1), (1, width, 2), (width, width, width), (2, 1, width)]
    cases = [tuple(p[s % len(p)] for s in range(k)) for p in patterns]
    starts, nxt, ends = [], [], []
    try:
        for s in range(k):
            n = min(contexts[s % len(contexts)], engine.n_ctx - width - 2)
            engine.clear(s)
            engine.decode(s, [1000 + (43 * i + 11 * s) % 5000 for i in range(n)], 0, want_logits=False)
            starts.append(engine.save_state(s))
            nxt.append([1500 + (61 * i + 7 * s) % 5000 for i in range(width + 1)])
            ends.append(n)

        def run(seqs: Sequence[int], case: Sequence[int], every: bool = True) -> list[list[np.ndarray]]:
            """The logits of each sequence's rows (none where not `every`: a rollback's replay), then of its next
            one-token step."""
            for s in seqs:
                engine.load_state(s, starts[s])
            first = engine.verify_many([(s, nxt[s][:case[s]], ends[s]) for s in seqs], every)
            rows = [[engine.logits(at + i) for i in range(case[s])] if every else [] for s, at in zip(seqs, first)]
            for s, got in zip(seqs, rows):
                engine.decode(s, nxt[s][case[s]:case[s] + 1], ends[s] + case[s])
                got.append(engine.logits())
            return rows

        for case in cases:
            alone = [run([s], case)[0] for s in range(k)]
            together = run(range(k), case)
            replayed = run(range(k), case, every=False)  # speculative.verify.replay: the next step alone compared
            if not all(np.array_equal(a, b) for s in range(k) for a, b in zip(alone[s], together[s])) or \
                    not all(np.array_equal(alone[s][-1], replayed[s][-1]) for s in range(k)):
                return False
        return True
    except EngineError:
        return False
    finally:
        for s in range(k):
            engine.clear(s)


def measure_verify_costs(engine: Engine, widths: Sequence[int], context: int = 512, reps: int = 3
                         ) -> dict[int, float]:
    """What a verification of each width in `widths` costs in one-token decode steps (`Engine.verify` against
    `Engine.decode` of one token), and under key 0 a rollback after a rejected one (speculative.verify.rewind
    keeping one token), on this engine: medians of `reps` timings after one warm-up each (a new ubatch shape
    builds llama.cpp's compute graph), every one from the same `context`-token state (pseudo-random tokens).
    The start values of speculative.policy.VerifyCosts, which the requests' own timings then replace. {} where
    llama.cpp fails. Uses and clears sequence 0.

    Why at start: how much a row costs is the CPU's (compute- or memory-bound) and the model's: on a 2-core AMD
    EPYC the second row 0.83-0.87 of a step and each further one 0.35-1.1, for both the qwen3.5-0.8b and -4b
    presets, where the policy's assumed prior was 0.25 a row (bench/results/2026-12-06/sizes-verification), so a
    first request verified at widths that do not pay until its own timings came in."""
    if not widths:
        return {}
    top = max(widths)
    n = max(2, min(context, engine.n_ctx - top - 2))
    prompt = [1000 + (41 * i + 3) % 5000 for i in range(n)]
    nxt = [1500 + (59 * i) % 5000 for i in range(top)]

    def seconds(call) -> float:
        t = time.perf_counter()
        call()
        return time.perf_counter() - t

    def median(run) -> float:  # of what run() returns, from the start state each time; the first is the warm-up
        times = []
        for _ in range(reps + 1):
            engine.load_state(0, start)
            times.append(run())
        return float(np.median(times[1:]))

    def rejected() -> float:  # a rejected verification, then only its rollback timed
        point = engine.rewind_point(0)
        engine.verify(0, nxt, n)
        return seconds(lambda: rewind(engine, 0, point, n, nxt[:1]))

    try:
        engine.clear(0)
        engine.decode(0, prompt, 0, want_logits=False)
        start = engine.save_state(0)
        step = median(lambda: seconds(lambda: engine.decode(0, nxt[:1], n)))
        costs = {w: median(lambda: seconds(lambda: engine.verify(0, nxt[:w], n))) / step for w in widths}
        costs[0] = median(rejected) / step
        return {w: round(c, 3) for w, c in costs.items()}
    except EngineError:
        return {}
    finally:
        engine.clear(0)


def state_sizes(engine: Engine) -> tuple[int, int]:
    """(recurrent state bytes per sequence, KV bytes per token) as llama.cpp serialises them (at 2 and 4 tokens).
    Memory per slot is about recurrent + n_ctx * kv_per_token. Uses and clears sequence 0."""
    tok = max(engine.bos_id, 0)
    try:
        engine.decode(0, [tok] * 2, 0, want_logits=False)
        two = engine.state_size(0)
        recurrent = engine.state.checkpoint_bytes(engine, 0)
        engine.decode(0, [tok] * 2, 2, want_logits=False)
        four = engine.state_size(0)
        return recurrent, (four - two) // 2
    finally:
        engine.clear(0)


def prefill_rate(engine: Engine, n_tokens: int = 256) -> float:
    """Prompt tokens per second of one prefill of `n_tokens` (at most n_batch) on this model and CPU, after a short
    warm-up. Uses and clears sequence 0."""
    n = max(2, min(n_tokens, engine.n_batch))
    tok = max(engine.bos_id, 0)
    try:
        engine.decode(0, [tok] * 8, 0, want_logits=False)  # warm-up: first-call allocations
        engine.clear(0)
        start = time.perf_counter()
        engine.decode(0, [tok] * n, 0, want_logits=False)
        return n / max(time.perf_counter() - start, 1e-9)
    finally:
        engine.clear(0)


def cpu_flags() -> str | None:
    """The instruction-set flags line of /proc/cpuinfo ("flags" on x86, "Features" on ARM), where ggml-cpu's kernel
    choice comes from; "" where it has none; None where it cannot be read."""
    try:
        return next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith(("flags", "Features"))), "")
    except OSError:
        return None


def kernel_environment(environ: Mapping[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    """The environment variables that llama.cpp and ggml read (names starting GGML_, LLAMA_ or SPACEMIT_), sorted:
    some change which kernels run and so the numerics. GGML_CPU_TILED_MM=0 turns off ggml-cpu's tiled K-quant
    matmul, which otherwise takes every matmul of 8 or more rows (the "8-row switch" in docs/correctness.md), and
    GGML_CPU_TILED_MM_FORCE=1 takes it at every width: either makes min_segment 2 and every verification width
    exact where it was 8 (ggml/src/ggml-cpu/tiled/tiled.cpp; bench/results/2026-12-05/tiled-matmul).
    GGML_CPU_DISABLE_FUSION and LLAMA_ATTN_ROT_DISABLE change the graph. Debug switches among them only cost a
    measurement."""
    env = os.environ if environ is None else environ
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(("GGML_", "LLAMA_", "SPACEMIT_"))))


class CalibrationFile:
    """The measured min_segment of a model on this machine, kept in a small JSON file so that a restart does not
    measure again. Keyed by the model file (`model_file_digest`), the llama-cpp-python version, the CPU's
    instruction-set flags (/proc/cpuinfo, where ggml-cpu's kernel choice comes from), the llama.cpp/ggml
    environment variables (`kernel_environment`: a value measured with the tiled matmul off is never reused
    with it on), how reference paths compute matmuls of 2+ rows (`kernels.reference_matmuls`: without llamafile,
    or with its tinyBLAS gated, widths differ from ungated tinyBLAS's; the last keeps the keys it had), n_batch, weight
    repacking (None: a measurement of both, repacking.py) and the offload layout (`Offload.key`: backend, devices, layers and KV placement; a CPU
    measurement is never reused for a GPU). No file (None), an unreadable one, or no layout: measure every
    time."""

    def __init__(self, file: Path | None, file_digest: bytes, n_batch: int, extra_bufts: bool | None,
                 offload: Offload | None = None) -> None:
        self.file = file if offload is not None else None  # no layout, no way to tell it from another's
        offload_key = offload.key() if offload is not None else None
        h = hashlib.blake2b(digest_size=16)
        h.update(file_digest)
        cpu = cpu_flags()
        if cpu is None:
            self.file = None  # no way to tell this CPU from another: do not trust a stored value
        matmuls = kernels.reference_matmuls()
        for part in (llama_cpp.__version__, platform.machine(), cpu, n_batch, extra_bufts, offload_key,
                     kernel_environment(), *(() if matmuls == "tinyBLAS" else (matmuls,))):
            h.update(repr(part).encode())
        self.key = h.hexdigest()

    def _read(self) -> dict:
        try:
            return json.loads(self.file.read_text()) if self.file and self.file.is_file() else {}
        except (OSError, ValueError):
            return {}

    def get(self) -> int | None:
        value = self._read().get(self.key)
        return value if isinstance(value, int) and value >= 2 else None

    def get_value(self, suffix: str) -> object:
        """What `put(value, suffix)` stored under this key, or None."""
        return self._read().get(self.key + suffix)

    def get_widths(self) -> tuple[int, ...] | None:
        """The stored exact verification widths (`measure_verify_widths`; () when none), or None: not measured."""
        value = self._read().get(self.key + ":verify_widths")
        if isinstance(value, list) and all(isinstance(w, int) and w >= 2 for w in value):
            return tuple(value)
        return None

    def put_widths(self, widths: tuple[int, ...]) -> None:
        self.put(list(widths), ":verify_widths")

    def get_costs(self) -> dict[int, float] | None:
        """The stored verification costs (`measure_verify_costs`), or None: not measured."""
        value = self._read().get(self.key + ":verify_costs")
        if isinstance(value, dict):
            try:
                return {int(w): float(c) for w, c in value.items()}
            except (TypeError, ValueError):
                return None
        return None

    def put_costs(self, costs: Mapping[int, float]) -> None:
        self.put({str(w): c for w, c in costs.items()}, ":verify_costs")

    def put(self, min_segment, suffix: str = "") -> None:
        if self.file is None:
            return
        data = self._read()
        data[self.key + suffix] = min_segment
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.file.with_suffix(".tmp")
            tmp.write_text(json.dumps(data))
            tmp.replace(self.file)
        except OSError as e:
            log.warning("could not save the calibration to %s: %s", self.file, e)


@dataclass(frozen=True)
class Calibration:
    min_segment: int
    batch_invariant: bool
    rollback: bool = False
    odd: bool = False  # prefill ubatches kept at odd lengths (Segments)
    batch_widths: tuple[int, ...] = ()  # exact_batch_widths (measured where decode batching is not off)


def calibrate(engine: Engine, file: CalibrationFile, decode_batching: str = "auto") -> Calibration:
    """Measure (or read back) the facts above, pass them to the engine (`Engine.calibrate`) and return them.
    Batch invariance is measured only where it matters: more than one sequence, and decode batching not off."""
    min_segment, odd = file.get(), file.get_value(":odd") is True
    if min_segment is None:
        log.info("measuring the smallest exact prefill ubatch (first start of this model on this CPU; a few "
                 "seconds, kept in %s)", file.file or "memory only: --calibration-file keeps it")
        started = time.perf_counter()
        try:
            min_segment, odd = dataclasses.astuple(measure_segments(engine))
        except EngineError as e:
            if not engine.offload.devices:
                raise
            # A device backend whose kernels differ at every split (lavapipe: bench/results/2026-12-01/vulkan/):
            # serve anyway, as llama-server would, at the largest size tested, and say that cached != cold.
            min_segment, odd = UNEXACT_MIN_SEGMENT, False
            log.warning("%s on %s; serving anyway with min_segment %d: with the cache on, outputs may differ "
                        "from cache off (deviation measured in bench/results/2026-12-01/vulkan/README.md)",
                        e.message, engine.offload.backend, min_segment)
        if odd:
            file.put(True, ":odd")
        file.put(min_segment)
        log.info("measured min_segment %d%s in %.1f s", min_segment, " (odd ubatches)" if odd else "",
                 time.perf_counter() - started)
    engine.calibrate(min_segment, odd=odd)
    started = time.perf_counter()
    widths = exact_batch_widths(engine) if engine.n_seq_max >= 2 and decode_batching != "off" else ()
    invariant = engine.n_seq_max >= 2 and widths == tuple(range(2, engine.n_seq_max + 1))
    seconds = time.perf_counter() - started
    if seconds > 2.0:  # a start-up step longer than 2 s says what it did (issue 12, item 7)
        log.info("checked batched decoding against decoding alone in %.1f s", seconds)
    rollback = False
    if engine.n_rs_seq:
        started = time.perf_counter()
        if engine.n_rs_seq < min_segment:
            log.info("--rs-snapshots %d is less than min_segment %d: every snapshot is a prefill stop",
                     engine.n_rs_seq, min_segment)
        elif check_rollback(engine):
            rollback = True
            log.info("checkpoints within %d tokens of a prefill call's end are taken back without a stop "
                     "(checked bit-identical in %.1f s)", engine.n_rs_seq, time.perf_counter() - started)
        else:
            log.warning("a checkpoint taken back inside a prefill call (llama.cpp n_rs_seq) is NOT bit-identical "
                        "to a stopped prefill on this model and CPU: turned off, every snapshot is a stop")
    engine.calibrate(min_segment, invariant, rollback, odd=odd)
    return Calibration(min_segment, invariant, rollback, odd, widths)


def describe_widths(widths: Sequence[int]) -> str:
    """Verification widths as the log names them: runs of consecutive ones as "a..b" ("2..16, 20, 24"), and where
    none are even "(odd widths: ...)"."""
    runs: list[list[int]] = []
    for w in widths:
        if runs and w == runs[-1][-1] + 1:
            runs[-1].append(w)
        else:
            runs.append([w])
    text = ", ".join(f"{r[0]}..{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)
    if len(widths) > 1 and all(w % 2 for w in widths):
        text += " (odd widths: an even number of rows takes other kernels)"
    return text


def speculation_widths(measured: tuple[int, ...], mode: str, draft_max: int, drafts: str = "ngram"
                       ) -> tuple[int, ...]:
    """The verification widths the scheduler uses (empty: speculative decoding off), from the widths measured
    exact (`measure_verify_widths`) and --speculative: "off" none; "auto", "mtp" and "draft" the measured ones up
    to draft_max + 1 (`drafts`, Config.drafts, names their source in the log);
    "ngram" those, or where none were measured exact 2..draft_max + 1 with a warning (outputs may then differ
    from speculation off). Logs the decision and why."""
    if mode == "off":
        return ()
    exact = tuple(w for w in measured if w <= draft_max + 1)
    if exact:
        log.info("speculative decoding on: %s drafts verified %s tokens at a time (measured bit-identical "
                 "to one-token decoding on this model and CPU)",
                 {"mtp": "MTP", "draft": "draft-model"}.get(drafts, "n-gram"),
                 describe_widths(exact))
        return exact
    if mode == "ngram":
        log.warning("--speculative ngram: no verification width is bit-identical to one-token decoding on this "
                    "model and CPU; verifying up to %d tokens anyway, so outputs may differ from --speculative off",
                    draft_max + 1)
        return tuple(range(2, draft_max + 2))
    log.warning("speculative decoding off: no verification width is bit-identical to one-token decoding on this "
                "model and CPU in its attention layout (ggml-cpu takes other kernels for one row than for two or "
                "more: llamafile's tinyBLAS for F32/F16 matrices, unless gated out of the reference decode kernels "
                "by orchestrator/native/tinyblas_gate.c, which needs a C compiler (cc) at the first start; "
                "bench/results/2026-12-07/tinyblas-gate/README.md). --speculative ngram trades exactness for "
                "speed")
    return ()


def decode_batching(calibration: Calibration, n_seq_max: int, mode: str) -> tuple[int, ...]:
    """The batch widths at which the slots' decode steps share one llama_decode call (empty: each slot decodes
    alone). "auto": the widths measured bit-identical to decoding alone (`exact_batch_widths`); "on": every width,
    trading that for throughput; "off": none."""
    if n_seq_max < 2 or mode == "off":
        return ()
    every = tuple(range(2, n_seq_max + 1))
    if mode == "on":
        if not calibration.batch_invariant:
            log.warning("--decode-batching on: batched decoding is NOT bit-identical to decoding alone on this "
                        "model; outputs may depend on concurrent requests")
        return every
    widths = calibration.batch_widths
    if widths == every:
        log.info("decode steps of all slots are batched (measured bit-identical to decoding alone)")
    elif widths:
        log.info("decode steps are batched %s slots at a time (the widths measured bit-identical to decoding "
                 "alone on this model and CPU; others differ); the rest decode alone", ", ".join(map(str, widths)))
    else:
        log.warning("batched decoding is not bit-identical to decoding alone on this model (weight types); slots "
                    "decode one at a time. --decode-batching on trades exactness for throughput")
    return widths
