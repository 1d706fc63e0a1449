"""Run `orchestrator serve` with a memory probe: where the server's RSS goes, sampled from inside the process.

    python bench/memprobe.py OUT.jsonl serve --model ... (the same arguments as `python -m orchestrator`)

Every `ORCHESTRATOR_MEMPROBE_INTERVAL` seconds (default 10) it appends one JSON line to OUT.jsonl:
  * `rss_mib`, `anon_mib`, `file_mib`: /proc/self/smaps_rollup's Rss, Anonymous and the file-backed rest;
  * resident MiB per kind of mapping (/proc/self/smaps, see `_regions`): `brk_mib`, `arenas_mib`, `anon_big_mib`,
    `anon_small_mib`, `model_mib`, `libs_mib`, `files_mib`;
  * glibc's mallinfo2(): `heap_mib` (arena: bytes the heaps span), `heap_used_mib` (uordblks: allocated),
    `heap_free_mib` (fordblks: free inside them), `mmap_mib` (hblkhd: blocks mapped one by one, such as ggml's
    buffers; address space, not all resident);
  * `gc_objects` (Python objects the collector tracks) and `threads`; with tracing on, `py_mib` (tracemalloc).
Every `ORCHESTRATOR_MEMPROBE_TOP` seconds (default 300, the first after 60 s as the baseline) a line also has
`types_growth`: the 15 object types whose count grew most since the baseline; with tracing on, `top_growth`: the
15 allocation sites whose live bytes grew most. Tracing (`ORCHESTRATOR_MEMPROBE_TRACE=1`) slows the server about
threefold and its snapshots take memory of their own; the default is off.

A bench tool: it only observes. A leak of Python objects shows as `gc_objects` and `types_growth` climbing; one
in native code as a region climbing while `gc_objects` stays flat.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import json
import os
import sys
import threading
import time
import tracemalloc


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo2():
    try:
        f = ctypes.CDLL(None).mallinfo2
    except AttributeError:  # not glibc >= 2.33
        return None
    f.restype = _MallInfo2
    return f


def _smaps() -> dict[str, float]:
    out = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                k, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[k] = int(parts[0]) / 1024
    except OSError:
        pass
    return out


_ARENA = 64 << 20  # glibc's HEAP_MAX_SIZE on 64-bit: thread heaps are mapped at multiples of it


def _regions() -> dict[str, float]:
    """Resident MiB per kind of mapping, from /proc/self/smaps: `brk` (glibc's main heap), `arenas` (glibc's
    thread heaps), `anon_big` (other anonymous mappings of 16 MiB or more: ggml's buffers, large mallocs),
    `anon_small` (the rest: Python's object arenas, mid-size mallocs), `model` (.gguf), `libs`, `files`."""
    out = dict.fromkeys(("brk", "arenas", "anon_big", "anon_small", "model", "libs", "files", "other"), 0.0)
    kind = "other"
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=6)
                if "-" in head[0] and not head[0].endswith(":"):
                    start, end = (int(x, 16) for x in head[0].split("-"))
                    path = head[5].strip() if len(head) > 5 else ""
                    if path.startswith("/"):
                        kind = "model" if path.endswith(".gguf") else "libs" if ".so" in path else "files"
                    elif path == "[heap]":
                        kind = "brk"
                    elif path:
                        kind = "other"
                    elif start % _ARENA == 0 and end - start <= _ARENA:
                        kind = "arenas"
                    else:
                        kind = "anon_big" if end - start >= 16 << 20 else "anon_small"
                elif head[0] == "Rss:":
                    out[kind] += int(head[1]) / 1024
    except OSError:
        pass
    return {f"{k}_mib": round(v, 1) for k, v in out.items()}


def _sample(t0: float, mallinfo) -> dict:
    s = _smaps()
    row = {"t_s": round(time.time() - t0, 1), "rss_mib": round(s.get("Rss", 0), 1),
           "anon_mib": round(s.get("Anonymous", 0), 1), "file_mib": round(s.get("Rss", 0) - s.get("Anonymous", 0), 1),
           **_regions()}
    if mallinfo is not None:
        m = mallinfo()
        row.update(heap_mib=round(m.arena / 2**20, 1), heap_used_mib=round(m.uordblks / 2**20, 1),
                   heap_free_mib=round(m.fordblks / 2**20, 1), mmap_mib=round(m.hblkhd / 2**20, 1))
    if tracemalloc.is_tracing():
        row["py_mib"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 2)
    row["gc_objects"] = len(gc.get_objects())
    row["threads"] = threading.active_count()
    return row


def _probe(path: str, interval: float, top_every: float) -> None:
    t0 = time.time()
    mallinfo = _mallinfo2()
    base = None
    types0 = None
    next_top = time.time() + 60  # the first top report is the baseline, after start-up allocations
    while True:
        time.sleep(interval)
        row = _sample(t0, mallinfo)
        if time.time() >= next_top:
            types = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
            if types0 is None:
                types0 = types
            else:
                row["types_growth"] = dict((types - types0).most_common(15))
            if tracemalloc.is_tracing():
                snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
                if base is None:
                    base = snap
                else:
                    row["top_growth"] = [f"{s.size_diff / 1024:+.0f} KiB {s.count_diff:+d} blocks: "
                                         + " < ".join(f"{fr.filename.rsplit('/', 2)[-1]}:{fr.lineno}"
                                                      for fr in list(reversed(s.traceback))[:4])
                                         for s in snap.compare_to(base, "traceback")[:15]]
            next_top = time.time() + top_every
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    path = sys.argv[1]
    if os.environ.get("ORCHESTRATOR_MEMPROBE_TRACE", "0") == "1":
        tracemalloc.start(6)
    interval = float(os.environ.get("ORCHESTRATOR_MEMPROBE_INTERVAL", "10"))
    top_every = float(os.environ.get("ORCHESTRATOR_MEMPROBE_TOP", "300"))
    # `serve` caps malloc arenas first thing; so must the probe, before its thread gets an arena of its own (a
    # thread keeps the arena it got first, and later threads would share it).
    from orchestrator.memory import limit_malloc_arenas

    limit_malloc_arenas(1)
    threading.Thread(target=_probe, args=(path, interval, top_every), daemon=True, name="memprobe").start()
    from server.__main__ import main as cli_main

    return cli_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
