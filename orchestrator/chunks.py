"""Where prefill ubatches end: the rule that keeps a cached state equal to a cold one (engine.py "Numerics": a
ubatch shorter than `min_segment` computes other logits and states), written once for the engine's chunking
(`chunk_sizes`) and for the scheduler's prefill that stops at the reuse rules' positions (`chunk_end`). Pure
arithmetic on token offsets.
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


def chunk_sizes(n_tokens: int, n_batch: int, min_chunk: int = 2) -> list[tuple[int, int]]:
    """(start, size) chunks covering n_tokens, each <= n_batch, ending where `chunk_end` says (so >= min_chunk
    tokens unless n_tokens itself is shorter: then one chunk). Raises ValueError when n_batch < 2 * min_chunk - 1.

    >>> chunk_sizes(513, 512)
    [(0, 511), (511, 2)]
    >>> chunk_sizes(515, 512, 8)
    [(0, 507), (507, 8)]
    """
    if n_batch < 2 * min_chunk - 1 or min_chunk < 1:
        raise ValueError(f"n_batch ({n_batch}) must be at least 2 * min_chunk - 1 ({2 * min_chunk - 1})")
    chunks = []
    start = 0
    while start < n_tokens:
        end = chunk_end(start, n_tokens, n_batch, n_batch, min_chunk)
        chunks.append((start, end - start))
        start = end
    return chunks
