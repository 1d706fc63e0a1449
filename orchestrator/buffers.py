"""Memory for snapshot saves: bytes objects that llama.cpp writes a state into, and spares of them written
through once while the server is idle.

A prefill stops at every snapshot position to save a checkpoint (the recurrent state, a fixed size: 19.3 MiB on
the 0.8b) before it goes on, so a save's time is on the request's TTFT. llama.cpp copies the state in 2 ms; the
rest of a 17 ms save is the kernel handing out new pages (a fault and a zeroed page every 4 KiB of a buffer no
one wrote before; bench/results/2026-12-01/issue12/, a 2-core EPYC). Every checkpoint is new memory that the cache
keeps, so it cannot be reused; but the pages can be faulted in before they are needed: `SpareBuffers` keeps up
to `target` checkpoint-sized bytes objects that were written once while nothing waited (`fill_one`, about 13 ms
each), and a save takes one (`take`) instead of new memory. A spare is referenced by the pool alone until it is
taken, and taken once, so no one else ever sees it change.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Callable


def bytes_writer() -> Callable[[None, int], bytes] | None:
    """A function (None, size) -> a new bytes object of `size` bytes whose contents are not initialised, for
    llama.cpp to write into before anyone else sees it (PyBytes_FromStringAndSize(NULL, size): the C API's way
    to fill a bytes object in place); None where that API is not reachable through ctypes (not CPython)."""
    if sys.implementation.name != "cpython":
        return None
    return ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t)(
        ("PyBytes_FromStringAndSize", ctypes.pythonapi))


def address(data: bytes):
    """A uint8 pointer to the contents of a bytes object (no copy: ctypes.c_char_p points into it)."""
    return ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))


class SpareBuffers:
    """Up to `target` bytes objects of `size` bytes, each written through once (its pages faulted in), for the
    saves of that size. Not thread-safe: the engine's thread is its only user.

    size: bytes of one buffer (a checkpoint of this model: Engine.state_size(seq, partial=True)); target: how many
    to keep (0: none). `nbytes` is what they hold now, at most size * target; `taken` counts the saves that got
    a spare since start. Only the engine's thread changes it; `describe` may be read from any thread.
    """

    def __init__(self, new: Callable[[None, int], bytes] | None, size: int = 0, target: int = 0) -> None:
        self._new = new
        self._free: list[bytes] = []
        self.size = size
        self.target = target if new is not None and size > 0 else 0
        self.taken = 0

    @property
    def nbytes(self) -> int:
        return self.size * len(self._free)

    def __len__(self) -> int:
        return len(self._free)

    def take(self, size: int) -> bytes | None:
        """A spare of exactly `size` bytes, now the caller's alone, or None (none left, or another size)."""
        if size != self.size or not self._free:
            return None
        self.taken += 1
        return self._free.pop()

    def fill_one(self) -> bool:
        """Write one more spare through (about 13 ms for 19 MiB: page faults); False when `target` are kept."""
        if len(self._free) >= self.target:
            return False
        buf = self._new(None, self.size)
        ctypes.memset(address(buf), 0, self.size)
        self._free.append(buf)
        return True

    def describe(self) -> dict:
        """For /v1/cache/stats: spares kept now and wanted, their bytes, and saves that got one since start."""
        kept = len(self._free)  # read once: the worker may add one meanwhile
        return {"kept": kept, "target": self.target, "bytes": kept * self.size, "taken": self.taken}

    def clear(self) -> None:
        """Drop every spare (their memory goes back to the allocator)."""
        self._free.clear()
