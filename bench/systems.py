"""The systems under test: how each server is started, asked, and measured (RSS, CPU idle).

A `System` names one server configuration. `launch()` starts it as a child process on its own port, waits until
it answers, and returns a `Running` handle with the process for psutil. Every HTTP call has a timeout.

Systems (same model file, threads, context size, n_batch/n_ubatch 512, flash attention off, repacking off):
  orchestrator      this project's server, cache on (W3: a small --cache-ram and a temp --cache-disk-dir)
  llama-server      llama.cpp's server (bench/install_llama_server.sh), prefix machinery at its documented
                    defaults: cache_prompt on, --ctx-checkpoints 32, --checkpoint-min-step 8192, --cache-ram 8192
                    MiB, automatic slots (4, sharing one unified KV of the context size, so each may use all of
                    it; an explicit -np 4 would split it into 2,048 tokens a slot)
  llama-server-tuned  the same binary at the most favourable settings found: --cache-ram unlimited,
                    --ctx-checkpoints 128, --checkpoint-min-step 64 (a checkpoint at every user message start);
                    on W3 also --slot-prompt-similarity 0. With the default similarity (0.1) every request goes to
                    the slot that shares the tools block, and the prompt cache is consulted only when that slot
                    would lose over half its tokens, so agents overwrite each other's state; with 0 each request
                    takes the least recently used slot and loads its best match from the prompt cache. That
                    helps the fleet (W3) but loses W1's B, D and "X again" (the slot just used is not yet in the
                    prompt cache when the next request picks a slot), so W1/W2 keep the default.
  orchestrator-before  orchestrator as of another checkout (`python -m bench --before DIR`: a git worktree of
                    the commit before a change), run from that directory with this venv
  llama-cpp-python  `python -m llama_cpp.server` (through bench/llama_cpp_server_norepack.py), cache true,
                    cache_type ram (2 GiB)
On W4 (the agent tool loop, 3 agents at once) llama-server runs with -np 3 (-c is then 3 x the per-slot
context, so each slot gets what an orchestrator slot gets) and the tuned variant adds its cache flags to that;
orchestrator keeps its default 4 slots; llama-cpp-python serves one request at a time and is not run there.
Cold references run on "cold" variants: orchestrator with `cache_prompt: false`, llama-server with
`cache_prompt: false` and --cache-ram 0 (a fresh process, so a fresh slot), llama-cpp-python with cache false.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
LLAMA_SERVER = ROOT / "bench" / ".llama-server" / "build" / "bin" / "llama-server"
# `launch`'s default, and the benches' `--omp passive`: OpenMP's passive wait. On a 2-core machine shared with other
# jobs llama-server's OpenMP threads otherwise spin between graph nodes (it also polls for work, --poll 50):
# measured on a cold 507-token prompt, 5.2-5.6 CPU-s and 8-10 s TTFT spinning vs 2.2 CPU-s and 3-4 s passive,
# interleaved. On a quiet machine passive halves one-token decode for every server, so `python -m bench` uses
# OpenMP's default (`--omp default`). Set OMP_WAIT_POLICY yourself to override either.
OMP_WAIT_POLICY = "PASSIVE"


def llama_server_binary() -> Path:
    """The llama-server every bench runs: the file $LLAMA_SERVER names where it is set (another build of the same
    llama.cpp, e.g. one linked against shared libraries: bench/results/2026-12-02/engine-gap-xeon/), else
    bench/install_llama_server.sh's build (LLAMA_SERVER), which may not exist yet. Raises FileNotFoundError when
    $LLAMA_SERVER names no file: building the default would not make that one exist."""
    named = os.environ.get("LLAMA_SERVER")
    if not named:
        return LLAMA_SERVER
    if not Path(named).is_file():
        raise FileNotFoundError(f"$LLAMA_SERVER={named} is not a file: build it, or unset LLAMA_SERVER to run "
                                f"bench/install_llama_server.sh's build")
    return Path(named)


@dataclass(frozen=True)
class System:
    """One server configuration. api: 'chat' (POST /v1/chat/completions with the chat body) or 'prompt'
    (POST /v1/completions with the prompt rendered by orchestrator's template: identical tokens)."""

    name: str
    kind: str              # orchestrator | llama-server | llama-cpp-python
    api: str
    cold: bool = False     # a cold-reference variant (no reuse)
    extra: tuple[str, ...] = ()
    workload_extra: tuple[tuple[str, tuple[str, ...]], ...] = ()   # more flags on one workload
    root: str = ""         # orchestrator: the checkout to run (PYTHONPATH; default: this one)

    def flags(self, workload: str) -> tuple[str, ...]:
        """Extra command-line flags of this system on `workload`."""
        return self.extra + sum((f for w, f in self.workload_extra if w == workload), ())

    @property
    def cold_group(self) -> str:
        """Systems whose cold runs are numerically the same process share cold references."""
        return "llama-server" if self.kind == "llama-server" else self.name


SYSTEMS = {
    "orchestrator": System("orchestrator", "orchestrator", "chat"),
    "llama-server": System("llama-server", "llama-server", "chat", workload_extra=(("W4", ("-np", "3")),)),
    "llama-server-tuned": System("llama-server-tuned", "llama-server", "chat",
                                 extra=("--cache-ram", "-1", "--ctx-checkpoints", "128",
                                        "--checkpoint-min-step", "64"),
                                 workload_extra=(("W3", ("-sps", "0")), ("W4", ("-np", "3")))),
    "llama-cpp-python": System("llama-cpp-python", "llama-cpp-python", "prompt"),
}


def cold_variant(s: System) -> System:
    """The cold-reference configuration of a system (see the module docstring)."""
    return System(s.cold_group, s.kind, s.api, cold=True, root=s.root)


@dataclass
class Running:
    """A started server. url: base URL; proc: its process; log: its stdout+stderr file."""

    system: System
    url: str
    popen: subprocess.Popen
    log: Path
    tmp: Path | None = None
    proc: psutil.Process = field(init=False)

    def __post_init__(self) -> None:
        self.proc = psutil.Process(self.popen.pid)

    def _tree_sum(self, measure) -> float:
        """Σ measure(process) over the server process and its children now (a process gone counts 0)."""
        try:
            procs = [self.proc] + self.proc.children(recursive=True)
        except psutil.Error:
            return 0
        total = 0
        for p in procs:
            try:
                total += measure(p)
            except psutil.Error:
                pass
        return total

    def rss(self) -> int:
        """Resident bytes of the server process and its children now (0 once gone)."""
        return self._tree_sum(lambda p: p.memory_info().rss)

    def cpu_s(self) -> float:
        """CPU seconds (user+system) used so far by the server process tree."""
        return float(self._tree_sum(lambda p: sum(p.cpu_times()[:2])))

    def wait_idle(self, quiet_s: float = 0.25, max_s: float = 60.0) -> float:
        """Block until the server has used under 2% CPU for `quiet_s` seconds; returns seconds waited.

        Servers may keep computing after a response (orchestrator stores the post-generation state then);
        waiting keeps that work from overlapping the next system's request. Gives up after `max_s` seconds.
        """
        t0 = time.perf_counter()
        last = self.cpu_s()
        while time.perf_counter() - t0 < max_s:
            time.sleep(quiet_s)
            now = self.cpu_s()
            if now - last < 0.02 * quiet_s:
                return time.perf_counter() - t0
            last = now
        return time.perf_counter() - t0

    def stop(self, grace_s: float = 15.0) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after `grace_s` seconds) and remove its temp dir."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(15)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def omp_policy(choice: str) -> str | None:
    """The OMP_WAIT_POLICY `launch` gives for a bench's `--omp` choice: "passive" (threads sleep between graph
    nodes: the setting for a machine shared with other jobs) or "default" (None: OpenMP's own spin-then-sleep,
    what a user running a server gets; one-token decode steps take half the time of passive's on 2 cores)."""
    if choice not in ("passive", "default"):
        raise ValueError(f"--omp {choice!r}: passive or default")
    return OMP_WAIT_POLICY if choice == "passive" else None


def before_system(root: Path) -> System:
    """orchestrator run from another checkout (its PYTHONPATH), e.g. the commit before a change."""
    return System("orchestrator-before", "orchestrator", "chat", root=str(root))


def np_flag(flags: tuple[str, ...] | list[str]) -> int:
    """The slot count an explicit -np/--parallel flag sets (0: none given)."""
    flags = list(flags)
    for i, f in enumerate(flags[:-1]):
        if f in ("-np", "--parallel"):
            return int(flags[i + 1])
    return 0


def command(s: System, model: Path, port: int, threads: int, ctx: int, cache_ram_mib: int | None,
            tmp: Path, workload: str = "") -> list[str]:
    """The command line that starts system `s` on `port` for `workload` (cache_ram_mib: orchestrator's
    --cache-ram; ctx: context per slot)."""
    if s.kind == "orchestrator":
        cmd = [sys.executable, "-m", "orchestrator", "serve", "-m", str(model), "--port", str(port),
               "-c", str(ctx), "-t", str(threads), "-b", "512", "--use-extra-bufts", "off",
               "--cache-disk-dir", str(tmp / "snapshots"), "--log-level", "info"]
        if s.cold:
            cmd += ["--cache-ram", "0"]
        elif cache_ram_mib is not None:
            cmd += ["--cache-ram", str(cache_ram_mib)]
        return cmd + list(s.flags(workload))
    if s.kind == "llama-server":
        n_slots = 1 if s.cold else np_flag(s.flags(workload))  # an explicit -np splits -c among the slots
        cmd = [str(llama_server_binary()), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
               "-c", str(ctx * max(n_slots, 1)),
               "-t", str(threads), "-tb", str(threads), "-b", "512", "-ub", "512", "--no-repack", "-fa", "off",
               "--jinja", "--no-webui", "--seed", "1234"]
        if s.cold:
            cmd += ["--cache-ram", "0", "-np", "1"]
        return cmd + list(s.flags(workload))
    if s.kind == "llama-cpp-python":
        cmd = [sys.executable, str(ROOT / "bench" / "llama_cpp_server_norepack.py"), "--model", str(model),
               "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(ctx), "--n_threads", str(threads),
               "--n_threads_batch", str(threads), "--n_batch", "512", "--n_ubatch", "512", "--flash_attn", "false",
               "--seed", "1234", "--verbose", "true", "--logits_all", "false"]
        cmd += ["--cache", "false"] if s.cold else ["--cache", "true", "--cache_type", "ram"]
        return cmd + list(s.flags(workload))
    raise ValueError(s.kind)


def launch(s: System, model: Path, port: int, threads: int, ctx: int, log_dir: Path,
           cache_ram_mib: int | None = None, workload: str = "", ready_timeout_s: float = 300.0,
           omp_wait_policy: str | None = OMP_WAIT_POLICY, unset: tuple[str, ...] = ()) -> Running:
    """Start `s` and wait until it serves (GET /v1/models answers 200); raises RuntimeError on failure.
    omp_wait_policy: the OMP_WAIT_POLICY given unless the environment sets one; None leaves OpenMP's default (spin,
    then sleep). unset: environment variables of this process the server does not inherit."""
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} is already in use: another server would answer for {s.name}")
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-{s.name}-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{s.name}{'-cold' if s.cold else ''}-{port}.log"
    env = dict(os.environ, PYTHONPATH=s.root or str(ROOT), ORCHESTRATOR_CACHE_DIR=os.environ.get(
        "ORCHESTRATOR_CACHE_DIR", str(Path.home() / ".cache" / "orchestrator")))
    if omp_wait_policy:
        env.setdefault("OMP_WAIT_POLICY", omp_wait_policy)
    for name in unset:
        env.pop(name, None)
    with open(log, "ab") as fh:
        popen = subprocess.Popen(command(s, model, port, threads, ctx, cache_ram_mib, tmp, workload), stdout=fh,
                                 stderr=subprocess.STDOUT, cwd=s.root or ROOT, env=env)  # -m puts the cwd first
    r = Running(s, f"http://127.0.0.1:{port}", popen, log, tmp)
    deadline = time.monotonic() + ready_timeout_s
    with httpx.Client(timeout=5.0) as c:
        while time.monotonic() < deadline:
            if popen.poll() is not None:
                r.stop()
                raise RuntimeError(f"{s.name} exited with {popen.returncode} at start; see {log}")
            try:
                if c.get(r.url + "/v1/models").status_code == 200:
                    return r
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    r.stop()
    raise RuntimeError(f"{s.name} did not answer within {ready_timeout_s:.0f} s; see {log}")


class RssSampler:
    """Samples the RSS of running servers every `period_s` seconds in a thread; keeps peaks (bytes).

    `window_start(name)` resets the per-request window of one server and makes it the one sampled (only the
    server that is serving a request changes its memory; sampling idle ones would only cost CPU);
    `window_peak(name)` reads the window's peak.
    """

    def __init__(self, period_s: float = 0.1) -> None:
        self.period_s = period_s
        self.servers: dict[str, Running] = {}
        self.peak: dict[str, int] = {}
        self.window: dict[str, int] = {}
        self.active: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def add(self, key: str, r: Running) -> None:
        with self._lock:
            self.servers[key] = r
            self.peak.setdefault(key, 0)
            self.window[key] = 0

    def remove(self, key: str) -> None:
        with self._lock:
            self.servers.pop(key, None)

    def window_start(self, key: str) -> None:
        with self._lock:
            self.window[key] = self.servers[key].rss() if key in self.servers else 0
            self.active = key

    def window_peak(self, key: str) -> int:
        with self._lock:
            if key in self.servers:
                self.window[key] = max(self.window[key], self.servers[key].rss())
            return self.window.get(key, 0)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with self._lock:
                items = [(k, r) for k, r in self.servers.items() if k == self.active]
            for key, r in items:
                v = r.rss()
                with self._lock:
                    self.peak[key] = max(self.peak.get(key, 0), v)
                    if key in self.window:
                        self.window[key] = max(self.window[key], v)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


def add_variant_args(ap, peer: bool = True) -> None:
    """--variant NAME=FLAGS (orchestrator with more flags) and, with `peer`, --peer-variant (llama-server with
    more flags) on an argparse parser; `with_variants` turns them into systems."""
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="one more system: orchestrator with more flags, named orchestrator-NAME (repeatable)")
    if peer:
        ap.add_argument("--peer-variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="one more system: llama-server with more flags, named llama-server-NAME, e.g. "
                             "'ngram-mod=--spec-type ngram-mod' (repeatable)")


def with_variants(ap, args, systems: list[System]) -> list[System]:
    """`systems` and the variants `add_variant_args` parsed into `args`; a malformed spec is the parser's error."""
    try:
        return (systems + variants(args.variant, SYSTEMS["orchestrator"])
                + variants(getattr(args, "peer_variant", []), SYSTEMS["llama-server"]))
    except ValueError as e:
        ap.error(f"--variant/--peer-variant {e}")


def variants(specs: list[str], base: System) -> list[System]:
    """`base` started with more flags, from `NAME=FLAGS` specs (named <base>-NAME; base's own flags first, its
    workload flags kept: llama-server's -np 3 on W4). Raises ValueError for a spec without a name or flags."""
    out = []
    for spec in specs:
        name, _, flags = spec.partition("=")
        if not name or not flags.strip():
            raise ValueError(f"{spec!r}: expected NAME=FLAGS")
        out.append(replace(base, name=f"{base.name}-{name}", extra=base.extra + tuple(flags.split())))
    return out

