"""Where prefill ubatches end: the rule that keeps a cached state equal to a cold one (engine.py "Numerics": a
ubatch shorter than `min_segment` computes other logits and states), written once for the engine's chunking
(`chunk_sizes`) and for the scheduler's prefill that stops at the reuse rules' positions (`chunk_end`). Pure
arithmetic on token offsets.

Odd ubatches (`odd`): on CPUs whose kernels compute rows two at a time in an even ubatch and one at a time in an
odd one (ggml-cpu with ARM i8mm: Q4_K/Q6_K `nrows = 2` under __ARM_FEATURE_MATMUL_INT8, taken only where the
ubatch's rows are even; ggml-cpu.c `ggml_compute_forward_mul_mat`), a token's logits depend on the parity of its
ubatch's length. There every ubatch is made odd, so every row is computed alone as on other CPUs: min_segment is
then twice the fewest odd tokens found exact (calibration.measure_segments), and a chunk of even length, at least
min_segment, is cut in two odd ones. A chunk shorter than min_segment (a whole prompt that short) stays whole: no
state it produces is ever stored or restored (reuse.py), so cached and cold compute it alike.
"""

from __future__ import annotations


def chunk_end(pos: int, target: int, chunk: int, n_batch: int, min_segment: int) -> int:
    """Where the next prefill ubatch from token offset `pos` towards `target` (> pos) ends: at most `chunk`
    tokens on, or `target` itself when the stretch fits one n_batch ubatch and `chunk` would leave less than
    `min_segment`; a remainder shorter than min_segment is never left (it would compute other logits and
    states: "Numerics"), so a stretch longer than n_batch ends its second-last ubatch at target - min_segment.
    Needs n_batch >= 2 * min_segment - 1 and chunk <= n_batch.

    >>> chunk_end(0, 513, 512, 512, 2), chunk_end(0, 130, 128, 512, 8), chunk_end(0, 600, 595, 512, 8)
    (511, 130, 592)
    """
    end = min(pos + chunk, target)
    if 0 < target - end < min_segment:
        end = target if target - pos <= n_batch else target - min_segment
    return end


def chunk_sizes(n_tokens: int, n_batch: int, min_chunk: int = 2, odd: bool = False) -> list[tuple[int, int]]:
    """(start, size) chunks covering n_tokens, each <= n_batch, ending where `chunk_end` says (so >= min_chunk
    tokens unless n_tokens itself is shorter: then one chunk). With `odd` (module docstring; min_chunk twice an
    odd number), a chunk of even length >= min_chunk is cut into two of odd length, the second min_chunk // 2
    long. Raises ValueError when n_batch < 2 * min_chunk - 1, or `odd` with min_chunk // 2 not odd.

    >>> chunk_sizes(513, 512)
    [(0, 511), (511, 2)]
    >>> chunk_sizes(515, 512, 8)
    [(0, 507), (507, 8)]
    >>> chunk_sizes(600, 512, 18, odd=True)
    [(0, 503), (503, 9), (512, 79), (591, 9)]
    """
    if n_batch < 2 * min_chunk - 1 or min_chunk < 1:
        raise ValueError(f"n_batch ({n_batch}) must be at least 2 * min_chunk - 1 ({2 * min_chunk - 1})")
    half = min_chunk // 2
    if odd and (min_chunk % 2 or half % 2 == 0):
        raise ValueError(f"odd ubatches need min_chunk twice an odd number, got {min_chunk}")
    chunks = []
    start = 0
    while start < n_tokens:
        end = chunk_end(start, n_tokens, n_batch, n_batch, min_chunk)
        n = end - start
        if odd and n % 2 == 0 and n >= min_chunk:
            chunks += [(start, n - half), (end - half, half)]
        else:
            chunks.append((start, n))
        start = end
    return chunks
