"""Returning freed heap memory to the OS (glibc's malloc_trim), so that RSS tracks what is live.

Snapshots are large, short-lived byte strings (tens of MiB). glibc raises its mmap threshold after such blocks
are freed, so later ones come from the heap and leave it fragmented: the soak (bench/soak.py) measured RSS
growing about 4 MiB a minute with the cache full and flat. malloc_trim(0) releases the free pages inside the heap
(madvise) as well as its top. Elsewhere than glibc this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time


class HeapTrimmer:
    """Calls malloc_trim(0) at most every `interval_s` seconds, from the caller's thread (the scheduler's worker,
    between steps, so it never runs during a llama.cpp call of its own)."""

    def __init__(self, interval_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self._last = time.monotonic()
        self._trim = None
        name = ctypes.util.find_library("c")
        if name:
            try:
                self._trim = ctypes.CDLL(name).malloc_trim
                self._trim.argtypes = [ctypes.c_size_t]
                self._trim.restype = ctypes.c_int
            except (OSError, AttributeError):  # not glibc
                self._trim = None

    def maybe_trim(self) -> None:
        """Trim if the interval has passed since the last trim."""
        now = time.monotonic()
        if self._trim is not None and now - self._last >= self.interval_s:
            self._last = now
            self._trim(0)
