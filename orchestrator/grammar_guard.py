"""Constrained sampling out of process: llama.cpp's grammar runs in a child process, under a time and memory
budget, so that no grammar can crash, wedge or exhaust the server.

Why a process. llama.cpp's grammar code (vendor/llama.cpp/src/llama-grammar.cpp in llama-cpp-python 0.3.36)
fails in ways nothing in this process could survive or stop:
  * it throws C++ exceptions that ctypes cannot catch (`llama_grammar_accept_str`/`_impl`: "Unexpected empty
    grammar stack after accepting piece", reached when the grammar accepts no token: `[b-a]`), which abort the
    process, and it aborts outright (GGML_ABORT on an end-of-generation token the grammar cannot end at,
    GGML_ASSERT on empty stacks);
  * the parser's `handle_repetitions` computes `max_times - min_times` unsigned: `x{10,5}` adds rules without end;
  * the stacks of an ambiguous grammar (`(a?){1000}`) grow without bound: `llama_grammar_advance_stack`
    deduplicates with a linear search and `llama_grammar_reject_candidates` walks every stack for every token,
    so one token's filtering can take longer than any request; a thread inside C cannot be interrupted.
The static checks in output/grammar.py refuse what is known to do that before anything is parsed (400 naming
the field); this module contains what they miss.

Design. A `GrammarProcess` is `python -m orchestrator.grammar_child MODEL` holding the model's vocabulary only
(`vocab_only`; its RSS, start time and per-token mask cost against the in-process apply:
bench/results/2026-12-01/grammar_guard/tiny.json), its address space capped at what it
mapped to load plus `memory_mib` (RLIMIT_AS: a runaway allocation ends it, not the server). The parent speaks a
framed protocol over its stdin/stdout (4-byte little-endian length, then one command byte):
    I + JSON {"gbnf", "triggers"}: build the grammar sampler (`sampling.grammar_sampler`), reply O or E + message
    A + int32 token: accept the token into the grammar (`llama_sampler_accept`), reply O
    M: the tokens the grammar allows now, reply M + a bitmask over the vocabulary (np.packbits, 31 KiB for
       248,320 tokens), computed by the grammar sampler's own `apply` over every token id
Every command is answered, in order. An answer may take at most `token_s` of the child's CPU time (the
per-token budget, --grammar-budget) from the moment its command is the child's current one, and never come
past the request's deadline (--timeout); past either, or when the child dies (a C++ abort), the child is killed
and the request fails with `GrammarFailed` (HTTP 400, a message naming the budget).

Nobody waits for a child unless they ask to. The scheduler's worker never does: it sends the build, the accepts
and the mask requests, and reads the answers as they arrive (`Grammar.poll`/`ready`, select with no timeout,
which also enforce the budget and the deadline); a request whose grammar has not answered yet sits out the
decode steps with its logits kept (scheduler.py) while the other slots go on, and the worker waits on the
children's pipes (`Grammar.fileno`) only when nothing else can run. So a slow grammar costs its own request's
time, not the others'. `wait`/`mask` block, for callers outside the worker (the check before queueing, tests).

Equivalence with llama.cpp's chain. The grammar sampler's apply only sets the logit of each rejected token to
-inf (`llama_grammar_apply_impl`), whatever the logits are, so the mask computed over all-zero logits in the
child, applied to the real logits here, gives the candidates `llama_sampler_sample` would give the rest of the
chain (greedy, or top-k → top-p → min-p → temp → dist): the same tokens, bit for bit.

Pipelining: right after a token is sampled, its accept and the next mask are sent, so the child filters while
the worker decodes the token. A pool (`GrammarPool`) keeps started children for the next requests; a child that
timed out or died is replaced (started in the background, it loads while the next request prefills). A child
is handed out at once (`GrammarPool.lend`), still loading or with answers its previous user left unread; the
grammar reads those first, each within the budget, and moves to a new child once should they fail.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from .errors import InvalidRequest

FRAME_LEN = struct.Struct("<I")  # a frame's head: the length of its payload (command byte included)
_LOAD_S = 120.0  # seconds a new child may take to load the vocabulary (not the request's budget)
_POLL_S = 0.1  # seconds between two looks at the child's CPU time while waiting for it
_TICKS = os.sysconf("SC_CLK_TCK")


class GrammarFailed(InvalidRequest):
    """The request's grammar could not be applied within this server's limits (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param=param, code="grammar_failed")


@dataclass(frozen=True)
class GrammarLimits:
    """Budgets of one grammar: token_s, seconds llama.cpp may take to build it or to filter the vocabulary for
    one token (--grammar-budget); memory_mib, MiB of address space the child may allocate beyond what it
    needs to hold the vocabulary."""

    token_s: float = 5.0
    memory_mib: int = 1024


class GrammarProcess:
    """One child process running llama.cpp's grammar sampler over `model_path`'s vocabulary."""

    def __init__(self, model_path: str, memory_mib: int) -> None:
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.grammar_child", model_path,
                                      str(memory_mib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env)
        self.ready = False  # the hello (vocabulary loaded) was read
        self.n_vocab = 0
        self.unread = 0  # answers a previous user left unread (Grammar.close), read by the next one
        self.eof = False  # the child closed its end of the pipe (it exited)
        self._buf = b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fileno(self) -> int:
        """The pipe the child's answers arrive on (readable when one has: select)."""
        return self.proc.stdout.fileno()

    def send(self, payload: bytes) -> None:
        """Write one frame; raises GrammarFailed when the child is gone."""
        try:
            self.proc.stdin.write(FRAME_LEN.pack(len(payload)) + payload)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as e:
            raise GrammarFailed("llama.cpp's grammar code stopped (the grammar process exited)") from e

    def cpu_s(self) -> float:
        """CPU seconds the child has used so far (user + system, /proc/PID/stat); 0 when it is gone."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _TICKS
        except (OSError, IndexError, ValueError):
            return 0.0

    def frames(self) -> list[bytes]:
        """The whole frames that have arrived since the last call, in order, without waiting; `eof` is set once
        the child has closed its end (it exited)."""
        fd = self.fileno()
        while not self.eof and select.select([fd], [], [], 0)[0]:
            chunk = os.read(fd, 1 << 20)
            self.eof = not chunk
            self._buf += chunk
        out = []
        while len(self._buf) >= 4:
            (n,) = FRAME_LEN.unpack_from(self._buf)
            if len(self._buf) < 4 + n:
                break
            out.append(self._buf[4:4 + n])
            self._buf = self._buf[4 + n:]
        return out

    def settle(self, token_s: float) -> None:
        """Wait for the hello (within _LOAD_S s) and the answers a previous user left (each within `token_s` s
        of the child's CPU time). Raises GrammarFailed past either, or when the child exits."""
        until, cpu_at = time.perf_counter() + _LOAD_S, self.cpu_s()
        while not self.ready or self.unread:
            for frame in self.frames():
                if self.ready:
                    self.unread -= 1
                else:
                    self.n_vocab, self.ready = int.from_bytes(frame[1:5], "little"), True
                cpu_at = self.cpu_s()
            if self.eof:
                raise GrammarFailed(f"the grammar process exited with {self.exit_code()}")
            if not self.ready and time.perf_counter() >= until:
                raise GrammarFailed(f"the grammar process did not load the vocabulary within {_LOAD_S:.0f} s")
            if self.ready and self.unread and self.cpu_s() >= cpu_at + token_s:
                raise GrammarFailed(f"a previous grammar took longer than {token_s:g} s of CPU")
            if not self.ready or self.unread:
                select.select([self.fileno()], [], [], _POLL_S)

    def exit_code(self) -> int | str:
        """The exit status of a child that closed its pipe (it is ended first if it has not exited within 1 s)."""
        try:
            return self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.kill()
            return "unknown"

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class GrammarPool:
    """Started grammar processes for `model_path`, handed out one per constrained request. Thread-safe."""

    def __init__(self, model_path: str, limits: GrammarLimits = GrammarLimits(), keep: int = 2) -> None:
        self.model_path = str(model_path)
        self.limits = limits
        self.keep = keep
        self._idle: list[GrammarProcess] = []
        self._lock = threading.Lock()
        self._closed = False
        self._spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-spawner")

    def spawn(self) -> GrammarProcess:
        """A new child (it loads the vocabulary in the background: its hello comes when done), started from the
        pool's own thread: a child dies with the thread that started it (PR_SET_PDEATHSIG in `grammar_child.main`
        is the thread's, not the process's), and the threads that check grammars come and go (the server's thread pool
        ends idle ones: the children they had started for the next requests were killed with them)."""
        try:
            started = self._spawner.submit(GrammarProcess, self.model_path, self.limits.memory_mib)
        except RuntimeError:  # closed: from this thread
            return GrammarProcess(self.model_path, self.limits.memory_mib)
        return started.result()

    def take(self) -> GrammarProcess:
        """A child that has loaded and has nothing of a previous user's left to read, waiting for it (for callers
        other than `Grammar`, e.g. benchmarks); one that fails to is replaced by a new one. Raises GrammarFailed."""
        proc = self.lend()
        try:
            proc.settle(self.limits.token_s)
            return proc
        except GrammarFailed:
            proc.kill()
        proc = self.spawn()
        proc.settle(self.limits.token_s)
        return proc

    def lend(self) -> GrammarProcess:
        """A child for one grammar, without waiting: an idle one (it may still be loading, or have answers of
        its previous user to read: `Grammar` reads them as they come), else one started now; one more is
        started for the next taker."""
        proc = None
        with self._lock:
            while self._idle and proc is None:
                proc = self._idle.pop(0)
                if not proc.alive():
                    proc.kill()
                    proc = None
            if not self._idle and not self._closed:
                self._idle.append(self.spawn())  # loads while this one works
        return proc if proc is not None else self.spawn()

    def give(self, proc: GrammarProcess, healthy: bool) -> None:
        """Return a child after use: kept when `healthy` (its grammar freed) and there is room, else ended."""
        with self._lock:
            if healthy and proc.alive() and not self._closed and len(self._idle) < self.keep:
                self._idle.append(proc)
                return
        proc.kill()

    def open(self, gbnf: str, triggers: tuple[str, ...] = (), deadline: float | None = None,
             param: str | None = None, wait: bool = True) -> "Grammar":
        """A grammar for one request, built in a child within the per-token budget (and `deadline`,
        time.perf_counter). Raises GrammarFailed (naming `param`) when llama.cpp refuses, aborts or runs out of
        time on it: here with `wait`, else from the first `Grammar.poll`, `ready`, `wait` or `mask` (the build
        goes on in the child meanwhile: the scheduler's worker does not wait for it)."""
        g = Grammar(self, gbnf, triggers, deadline, param)
        if wait:
            g.wait()
        return g

    def check(self, gbnf: str, triggers: tuple[str, ...], param: str, deadline: float | None = None) -> None:
        """Refuse a grammar before the request is queued: llama.cpp must parse it and, unless it is lazy, allow at
        least one first token, within the budget (and by `deadline`). Raises GrammarFailed naming `param`."""
        g = self.open(gbnf, triggers, deadline, param=param)
        try:
            if not triggers and not g.mask().any():
                raise GrammarFailed(f"the grammar built from '{param}' accepts no token: check its patterns and "
                                    f"bounds", param=param)
        finally:
            g.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for proc in idle:
            proc.kill()
        self._spawner.shutdown(wait=False)


class Grammar:
    """One request's grammar in a child process: `mask()` the allowed tokens now, `accept(token)` advances it.

    Nothing here waits unless asked: commands are written to the child and its answers read as they arrive
    (`poll`, `ready`: never blocking; `wait`, `mask`: blocking). Every answer is bounded by the per-token
    budget (the child's CPU time from the moment the command is its current one) and the request's deadline;
    past them, or when llama.cpp aborts, GrammarFailed (the child is ended), raised by whichever of those calls
    notices it. Answers a previous user of the child left (and its hello, while it loads) come first, each
    within the same budget; should those fail, the commands are sent again to a new child, once. close()
    returns the child to the pool."""

    def __init__(self, pool: GrammarPool, gbnf: str, triggers: tuple[str, ...], deadline: float | None,
                 param: str | None) -> None:
        self._pool, self._deadline, self._param = pool, deadline, param
        self._proc: GrammarProcess | None = None
        # answers not read yet, in order: [command byte, the child's CPU s when its budget starts, wall-clock
        # limit or None]; "H" the child's hello, "L" an answer its previous user left
        self._sent: list[list] = []
        self._mine: list[bytes] | None = []  # commands sent before any of their answers came (sent again to a
        #                                       new child when the one before fails on what it owed others)
        self._restarted = False
        self._mask: np.ndarray | None = None
        self._attach(pool.lend())
        build = b"I" + json.dumps({"gbnf": gbnf, "triggers": list(triggers)}).encode()
        try:
            self._send(build)
        except GrammarFailed:  # an idle child that died since it was lent: a new one, once
            self._restarted, self._sent, self._mine = True, [], []
            self._attach(pool.spawn())
            self._send(build)

    def _attach(self, proc: GrammarProcess) -> None:
        self._proc = proc
        if not proc.ready:
            self._sent.append([b"H", None, time.perf_counter() + _LOAD_S])
        self._sent += [[b"L", proc.cpu_s(), None] for _ in range(proc.unread)]
        proc.unread = 0

    def _send(self, payload: bytes) -> None:
        proc = self._require()
        try:
            proc.send(payload)
        except GrammarFailed as e:
            self._fail_hard()
            e.param = self._param
            raise
        self._sent.append([payload[:1], proc.cpu_s(), None])
        if self._mine is not None:
            self._mine.append(payload)

    def fileno(self) -> int | None:
        """The pipe this grammar's answers arrive on (for select), None once the grammar is stopped."""
        return None if self._proc is None else self._proc.fileno()

    def poll(self) -> bool:
        """Read the answers that have arrived, without waiting: True when every command sent is answered. Raises
        GrammarFailed (naming the request's field; the child ended) when llama.cpp refused the grammar, aborted,
        or the current command has run past the budget or the request's deadline."""
        proc = self._require()
        for frame in proc.frames():
            if not self._sent:
                break
            kind = self._sent.pop(0)[0]
            if self._sent:  # the next command's budget starts when this one is done
                self._sent[0][1] = None if self._sent[0][1] is None else max(self._sent[0][1], proc.cpu_s())
            self._answer(proc, kind, frame)
        if not self._sent:
            return True
        problem = self._overdue(proc)
        if problem is None:
            return False
        owed_to_others = self._sent[0][0] in (b"H", b"L")
        mine = self._mine
        self._fail_hard()
        if owed_to_others and mine is not None and not self._restarted and not self._past_deadline():
            self._restarted = True  # a new child, which owes nobody anything: the commands again
            self._sent, self._mine = [], None
            self._attach(self._pool.spawn())
            for payload in mine:
                self._send(payload)
            return self.poll()
        raise GrammarFailed(problem, param=self._param)

    def _answer(self, proc: GrammarProcess, kind: bytes, frame: bytes) -> None:
        if kind in (b"H", b"L"):  # owed to nobody or to a previous user
            if kind == b"H":
                proc.n_vocab, proc.ready = int.from_bytes(frame[1:5], "little"), True
            return
        self._mine = None  # this child answers this grammar's commands: it is the one
        if kind == b"I" and frame[:1] == b"E":
            self._fail_soft()
            where = f"'{self._param}'" if self._param else "the request's structured output"
            raise GrammarFailed(f"llama.cpp could not parse the grammar built from {where}: "
                                f"{frame[1:].decode('utf-8', 'replace')[:300]}", param=self._param)
        if kind == b"M" and not any(k == b"A" for k, *_ in self._sent):  # else a later token makes it stale
            bits = np.frombuffer(frame, dtype=np.uint8, offset=1)
            self._mask = np.unpackbits(bits, count=proc.n_vocab).astype(bool)

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.perf_counter() >= self._deadline

    def _overdue(self, proc: GrammarProcess) -> str | None:
        """Why the current command failed (the child exited, or it ran out of time), or None."""
        _, cpu_at, until = self._sent[0]
        if proc.eof:
            return (f"llama.cpp's grammar code aborted (the grammar process exited with {proc.exit_code()}): the "
                    f"grammar admits no token at some point, or needs more memory than this server gives it; check "
                    f"the schema's patterns and bounds")
        if until is not None and time.perf_counter() >= until:
            return f"the grammar process did not load the vocabulary within {_LOAD_S:.0f} s"
        budget = self._pool.limits.token_s
        what = f"the budget of {budget:g} s of CPU per token (--grammar-budget)"
        if self._past_deadline():
            what += " or the request's time left (--timeout)"
        elif cpu_at is None or proc.cpu_s() < cpu_at + budget:
            return None
        return (f"llama.cpp's grammar took longer than {what}: the grammar is too ambiguous or too large for this "
                f"server; simplify the schema (fewer optional or repeated parts, smaller enums)")

    def wait(self) -> None:
        """Block until every command sent is answered (the bounds of `poll`). Raises GrammarFailed."""
        while not self.poll():
            select.select([self._proc.fileno()], [], [], _POLL_S)

    def _fail_soft(self) -> None:
        self._pool.give(self._proc, healthy=False)
        self._proc = None

    def _fail_hard(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._pool.give(self._proc, healthy=False)
            self._proc = None

    def _require(self) -> GrammarProcess:
        if self._proc is None:
            raise GrammarFailed("the grammar was stopped earlier in this request", param=self._param)
        return self._proc

    def prefetch(self) -> None:
        """Ask for the next mask now (the child computes it while the caller decodes)."""
        self._require()
        if not self._sent or self._sent[-1][0] != b"M":
            self._send(b"M")

    def ready(self) -> bool:
        """Whether `mask()` answers now without waiting: asks for the mask if nobody has, then reads what has
        arrived (`poll`, never blocking). Raises GrammarFailed as `poll` does."""
        if self._mask is None:
            self.prefetch()
        return self.poll() and self._mask is not None

    def mask(self) -> np.ndarray:
        """bool array (n_vocab,): the tokens the grammar allows now (waiting for the child if it is not `ready`)."""
        self._require()
        if self._mask is not None and not self._sent:
            return self._mask
        self.prefetch()
        self.wait()
        return self._mask

    def accept(self, token: int) -> None:
        """Advance the grammar over `token` (sampled or forced)."""
        self._require()
        self._mask = None
        self._send(b"A" + struct.pack("<i", token))

    def close(self) -> None:
        """Free the grammar and return the child to the pool; answers not read yet (the mask prefetched after a
        request's last token, a build or a mask of a request that ended while waiting for it) are read by its
        next user: nobody waits for them now."""
        if self._proc is None:
            return
        try:
            self._send(b"F")
        except GrammarFailed:
            return  # ended (_fail_hard); the pool starts another
        proc, self._proc = self._proc, None
        proc.unread = sum(kind != b"H" for kind, *_ in self._sent)
        self._sent = []
        self._pool.give(proc, healthy=True)
