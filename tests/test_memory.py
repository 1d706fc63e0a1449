"""orchestrator.memory: the malloc arena cap really leaves threads on the one main heap (glibc, Linux)."""

import os
import subprocess
import sys

SCRIPT = r"""
import sys, threading
from orchestrator import memory
if sys.argv[1] == "cap":
    assert memory.limit_malloc_arenas(1)
else:
    assert not memory.limit_malloc_arenas(1)  # MALLOC_ARENA_MAX is set in the environment: left to it

def work():
    keep = [bytearray(200_000) for _ in range(20)]  # malloc'd, not pymalloc'd

threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
n = 0  # glibc maps each thread arena's heap at a multiple of 64 MiB, anonymous and writable
for line in open("/proc/self/maps"):
    f = line.split()
    start, end = (int(x, 16) for x in f[0].split("-"))
    n += len(f) == 5 and f[1].startswith("rw") and start % (64 << 20) == 0 and end - start <= 64 << 20
print(n)
"""


def _arenas(mode: str, env_arenas: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    if env_arenas is not None:
        env["MALLOC_ARENA_MAX"] = env_arenas
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_arena_cap_keeps_threads_on_the_main_heap_and_the_environment_wins():
    assert _arenas("cap", None) == 0
    assert _arenas("env", "8") >= 1  # without the cap each thread gets its own arena
