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

Design. A `GrammarProcess` is `python -m orchestrator.grammar_guard MODEL` holding the model's vocabulary only
(`vocab_only`; its RSS, start time and per-token mask cost against the in-process apply:
bench/results/2026-12-01/grammar_guard/tiny.json, `python -m bench grammar-guard`), its address space capped at what it
mapped to load plus `memory_mib` (RLIMIT_AS: a runaway allocation ends it, not the server). The parent speaks a
framed protocol over its stdin/stdout (4-byte little-endian length, then one command byte):
    I + JSON {"gbnf", "triggers"}: build the grammar sampler (`engine.grammar_sampler`), reply O or E + message
    A + int32 token: accept the token into the grammar (`llama_sampler_accept`), reply O
    M: the tokens the grammar allows now, reply M + a bitmask over the vocabulary (np.packbits, 31 KiB for
       248,320 tokens), computed by the grammar sampler's own `apply` over every token id
Every command is answered, in order. The parent waits for an answer at most `token_s` (the per-token budget,
--grammar-budget) and never past the request's deadline (--timeout); past either, or when the child dies
(a C++ abort), the child is killed and the request fails with `GrammarFailed` (HTTP 400, a message naming the
budget); the worker thread goes on with the other slots after at most that wait.

Equivalence with llama.cpp's chain. The grammar sampler's apply only sets the logit of each rejected token to
-inf (`llama_grammar_apply_impl`), whatever the logits are, so the mask computed over all-zero logits in the
child, applied to the real logits here, gives the candidates `llama_sampler_sample` would give the rest of the
chain (greedy, or top-k → top-p → min-p → temp → dist): the same tokens, bit for bit.

Pipelining: right after a token is sampled, its accept and the next mask are sent, so the child filters while
the worker decodes the token. A pool (`GrammarPool`) keeps started children for the next requests; a child that
timed out or died is replaced (started in the background, it loads while the next request prefills).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from .errors import InvalidRequest

_LEN = struct.Struct("<I")
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
        self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.grammar_guard", model_path,
                                      str(memory_mib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env)
        self.ready = False
        self.n_vocab = 0
        self.unread = 0  # answers a previous user left unread (Grammar.close)
        self._buf = b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, payload: bytes) -> None:
        """Write one frame; raises GrammarFailed when the child is gone."""
        try:
            self.proc.stdin.write(_LEN.pack(len(payload)) + payload)
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

    def recv(self, deadline: float | None, what: str, cpu_limit: float | None = None) -> bytes:
        """Read one frame, by `deadline` (time.perf_counter) and before the child's CPU time passes `cpu_limit`;
        raises GrammarFailed (naming `what`) past either, or when the child exits."""
        fd = self.proc.stdout.fileno()
        while True:
            if len(self._buf) >= 4:
                (n,) = _LEN.unpack_from(self._buf)
                if len(self._buf) >= 4 + n:
                    frame, self._buf = self._buf[4:4 + n], self._buf[4 + n:]
                    return frame
            wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.perf_counter())
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                if (deadline is not None and time.perf_counter() >= deadline) or \
                        (cpu_limit is not None and self.cpu_s() >= cpu_limit):
                    raise GrammarFailed(f"llama.cpp's grammar took longer than {what}: the grammar is too "
                                        f"ambiguous or too large for this server; simplify the schema (fewer "
                                        f"optional or repeated parts, smaller enums)")
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise GrammarFailed(f"llama.cpp's grammar code aborted (the grammar process exited with "
                                    f"{self.proc.wait()}): the grammar admits no token at some point, or needs more "
                                    f"memory than this server gives it; check the schema's patterns and bounds")
            self._buf += chunk

    def wait_ready(self) -> None:
        """Wait for the child's hello (the vocabulary loaded); raises GrammarFailed when it does not come."""
        if not self.ready:
            hello = self.recv(time.perf_counter() + _LOAD_S, f"{_LOAD_S:.0f} s to load the vocabulary")
            self.n_vocab = int.from_bytes(hello[1:5], "little")
            self.ready = True

    def drain(self, cpu_budget: float) -> None:
        """Read the answers a previous user left, each within `cpu_budget` CPU seconds; raises GrammarFailed."""
        while self.unread:
            self.recv(None, f"{cpu_budget:g} s of CPU", self.cpu_s() + cpu_budget)
            self.unread -= 1

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

    def _spawn(self) -> GrammarProcess:
        return GrammarProcess(self.model_path, self.limits.memory_mib)

    def take(self) -> GrammarProcess:
        """A ready child (started now when none is idle); one more is started for the next taker."""
        with self._lock:
            proc = self._idle.pop(0) if self._idle else None
            if not self._idle and not self._closed:
                self._idle.append(self._spawn())  # loads while this one works
        if proc is not None:
            try:
                proc.wait_ready()
                proc.drain(self.limits.token_s)
                return proc
            except GrammarFailed:
                proc.kill()
        proc = self._spawn()
        proc.wait_ready()
        return proc

    def give(self, proc: GrammarProcess, healthy: bool) -> None:
        """Return a child after use: kept when `healthy` (its grammar freed) and there is room, else ended."""
        with self._lock:
            if healthy and proc.alive() and not self._closed and len(self._idle) < self.keep:
                self._idle.append(proc)
                return
        proc.kill()

    def open(self, gbnf: str, triggers: tuple[str, ...] = (), deadline: float | None = None,
             param: str | None = None) -> "Grammar":
        """A grammar for one request, built in a child within the per-token budget (and `deadline`,
        time.perf_counter). Raises GrammarFailed (naming `param`) when llama.cpp refuses, aborts or runs out of
        time on it."""
        return Grammar(self, gbnf, triggers, deadline, param)

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


class Grammar:
    """One request's grammar in a child process: `mask()` the allowed tokens now, `accept(token)` advances it.
    Every wait is bounded by the per-token budget and the request's deadline; past them, or when llama.cpp
    aborts, GrammarFailed (the child is ended). close() returns the child to the pool."""

    def __init__(self, pool: GrammarPool, gbnf: str, triggers: tuple[str, ...], deadline: float | None,
                 param: str | None) -> None:
        self._pool, self._deadline, self._param = pool, deadline, param
        self._proc: GrammarProcess | None = pool.take()
        self._sent: list[tuple[bytes, float]] = []  # commands not answered yet: (kind, child's CPU s at sending)
        self._mask: np.ndarray | None = None
        self._send(b"I" + json.dumps({"gbnf": gbnf, "triggers": list(triggers)}).encode())
        reply = self._answers()
        if reply[:1] == b"E":
            self._fail_soft()
            where = f"'{param}'" if param else "the request's structured output"
            raise GrammarFailed(f"llama.cpp could not parse the grammar built from {where}: "
                                f"{reply[1:].decode('utf-8', 'replace')[:300]}", param=param)

    def _send(self, payload: bytes) -> None:
        try:
            self._proc.send(payload)
        except GrammarFailed:
            self._fail_hard()
            raise
        self._sent.append((payload[:1], self._proc.cpu_s()))

    def _answers(self) -> bytes:
        """Read the answers to every command sent, each before the child has spent the per-token budget of CPU
        time on it (counted from its sending) and by the request's deadline; the last one. Raises GrammarFailed
        (the child ended) past either."""
        budget = self._pool.limits.token_s
        last = b""
        while self._sent:
            kind, cpu_at = self._sent[0]
            what = f"the budget of {budget:g} s of CPU per token (--grammar-budget)"
            if self._deadline is not None and self._deadline < time.perf_counter() + budget:
                what += " or the request's time left (--timeout)"
            try:
                last = self._proc.recv(self._deadline, what, cpu_at + budget)
            except GrammarFailed as e:
                self._fail_hard()
                e.param = self._param
                raise
            self._sent.pop(0)
            if self._sent:  # the next command's budget starts when this one is done
                self._sent[0] = (self._sent[0][0], max(self._sent[0][1], self._proc.cpu_s()))
        return last

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

    def mask(self) -> np.ndarray:
        """bool array (n_vocab,): the tokens the grammar allows now."""
        proc = self._require()
        if self._mask is not None and not self._sent:
            return self._mask
        self.prefetch()
        reply = self._answers()
        bits = np.frombuffer(reply, dtype=np.uint8, offset=1)
        self._mask = np.unpackbits(bits, count=proc.n_vocab).astype(bool)
        return self._mask

    def accept(self, token: int) -> None:
        """Advance the grammar over `token` (sampled or forced)."""
        self._require()
        self._mask = None
        self._send(b"A" + struct.pack("<i", token))

    def close(self) -> None:
        """Free the grammar and return the child to the pool; answers not read yet (the mask prefetched after a
        request's last token) are read by its next user (`GrammarProcess.drain`): nobody waits for them now."""
        if self._proc is None:
            return
        try:
            self._send(b"F")
        except GrammarFailed:
            return  # ended (_fail_hard); the pool starts another
        proc, self._proc = self._proc, None
        proc.unread = len(self._sent)
        self._sent = []
        self._pool.give(proc, healthy=True)


# ---------------------------------------------------------------------- the child

def _child(model_path: str, memory_mib: int) -> None:  # pragma: no cover - runs in the grammar process
    import llama_cpp

    from .engine import TOKEN_DATA, candidates, grammar_sampler

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: a child stuck in C dies with the server
    if os.getppid() == 1:
        sys.exit(4)  # the parent died before prctl
    out = os.fdopen(sys.stdout.fileno(), "wb", buffering=0)
    inp = os.fdopen(sys.stdin.fileno(), "rb", buffering=0)
    logs: list[str] = []

    @llama_cpp.llama_log_callback
    def on_log(level, text, _user):  # llama.cpp's parse errors: sent back with E
        if level >= 3 and len(logs) < 50:
            logs.append(text.decode("utf-8", "replace"))

    llama_cpp.llama_log_set(on_log, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), params)
    if not model:
        sys.exit(3)
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = vm + memory_mib * (1 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    data = np.zeros(n_vocab, dtype=TOKEN_DATA)
    ids = np.arange(n_vocab, dtype=np.int32)

    def write(payload: bytes) -> None:
        out.write(_LEN.pack(len(payload)) + payload)

    def read() -> bytes | None:
        head = inp.read(4)
        if len(head) < 4:
            return None
        (n,) = _LEN.unpack(head)
        body = b""
        while len(body) < n:
            chunk = inp.read(n - len(body))
            if not chunk:
                return None
            body += chunk
        return body

    write(b"H" + n_vocab.to_bytes(4, "little"))
    sampler = None
    while (msg := read()) is not None:
        cmd = msg[:1]
        if cmd == b"I":
            if sampler:
                llama_cpp.llama_sampler_free(sampler)
            spec = json.loads(msg[1:])
            logs.clear()
            sampler = grammar_sampler(vocab, spec["gbnf"], tuple(spec["triggers"]))
            write(b"O" if sampler else b"E" + "".join(logs).strip().encode())
        elif cmd == b"A":
            llama_cpp.llama_sampler_accept(sampler, struct.unpack("<i", msg[1:5])[0])
            write(b"O")
        elif cmd == b"M":
            data["id"] = ids
            data["logit"] = 0.0
            llama_cpp.llama_sampler_apply(sampler, ctypes.byref(candidates(data)))
            allowed = np.zeros(n_vocab, dtype=bool)
            allowed[data["id"][np.isfinite(data["logit"])]] = True
            write(b"M" + np.packbits(allowed).tobytes())
        elif cmd == b"F":
            if sampler:
                llama_cpp.llama_sampler_free(sampler)
                sampler = None
            write(b"O")


if __name__ == "__main__":  # pragma: no cover
    _child(sys.argv[1], int(sys.argv[2]))
