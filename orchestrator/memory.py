"""Keeping RSS at what is live: glibc's malloc_trim and a single malloc arena; and the memory work done while
the server is idle (`IdleWork`: spare checkpoint buffers, heap trimming).

Snapshots are large, short-lived byte strings (tens of MiB on real models). glibc raises its mmap threshold after
such blocks are freed, so later ones come from the heaps, whose free space fragments as entries of different sizes
are evicted; malloc_trim(0) gives the free pages inside the heaps back (madvise) as well as their tops. Each thread
that allocates (the scheduler's worker, the HTTP event loop, the threads that render and tokenize prompts) gets
its own arena, up to 8 per core, and each fragments on its own: the soak saw the thread arenas' resident bytes
creep up (121 to 137 MiB in 30 minutes, RSS slope 0.34 MiB/min) while Python objects and cache bytes stayed flat;
with one arena RSS stayed flat (slopes 0.02 ± 0.07 and 0.17 ± 0.07 MiB/min in two 30-minute runs).
Measurements: docs/performance.md, "Soak". Elsewhere than glibc both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time
from typing import Protocol

_M_ARENA_MAX = -8  # mallopt parameter, glibc's malloc.h

log = logging.getLogger(__name__)


def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def limit_malloc_arenas(n: int = 1) -> bool:
    """Cap glibc's malloc arenas at `n` (mallopt M_ARENA_MAX), unless the MALLOC_ARENA_MAX environment variable
    already chose. Call it before any thread allocates: a thread keeps the arena it got first.

    Returns whether the cap was set (False elsewhere than glibc, or when the environment decides). Arena
    contention costs little here: Python threads allocate under the GIL, and llama.cpp's compute threads do not
    allocate per token. The soak's request rate was within 2% either way.
    """
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None or getattr(libc, "malloc_trim", None) is None:  # malloc_trim: a glibc extension
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_ARENA_MAX, n) == 1
    if ok:
        log.debug("malloc arenas capped at %d", n)
    return ok


class HeapTrimmer:
    """Calls malloc_trim(0) at most every `interval_s` seconds, from the caller's thread (the scheduler's worker,
    between steps, so it never runs during a llama.cpp call of its own)."""

    def __init__(self, interval_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self._last = time.monotonic()
        self._trim = getattr(_libc(), "malloc_trim", None)  # None: not glibc
        if self._trim is not None:
            self._trim.argtypes = [ctypes.c_size_t]
            self._trim.restype = ctypes.c_int

    def maybe_trim(self) -> None:
        """Trim if the interval has passed since the last trim."""
        now = time.monotonic()
        if self._trim is not None and now - self._last >= self.interval_s:
            self._last = now
            self._trim(0)


class Spares(Protocol):
    """The engine's spare checkpoint buffers (Engine.fill_spare / drop_spares; buffers.SpareBuffers)."""

    def fill_spare(self) -> bool: ...

    def drop_spares(self) -> None: ...


class IdleWork:
    """Memory work for the scheduler's worker to do between steps, never during a llama.cpp call of its own:
    `fill` writes one more spare checkpoint buffer through while no request waits (one buffer of a checkpoint's
    size at a time, so an arrival waits for at most one: buffers.py), and `trim` gives freed heap pages back
    (`HeapTrimmer`). Touched by the worker thread only.
    """

    def __init__(self, engine: Spares, trimmer: HeapTrimmer | None = None) -> None:
        self.engine = engine
        self.trimmer = trimmer or HeapTrimmer()

    @property
    def interval_s(self) -> float:
        """Seconds an idle worker sleeps before it trims again."""
        return self.trimmer.interval_s

    def fill(self) -> bool:
        """One more spare buffer; False when there are enough. On a failure (out of memory) none from then on:
        saves go to new memory as they did without spares, and the worker goes on."""
        try:
            return self.engine.fill_spare()
        except Exception:  # noqa: BLE001 - spares are an optimisation; losing them must not stop the worker
            log.warning("could not keep spare checkpoint buffers; saves go to new memory", exc_info=True)
            self.engine.drop_spares()
            return False

    def trim(self) -> None:
        """malloc_trim(0), if `interval_s` has passed since the last one."""
        self.trimmer.maybe_trim()
