"""The grammar process's main: `python -m orchestrator.grammar_child MODEL MEMORY_MIB`, started by
grammar_guard.GrammarProcess. It holds the model's vocabulary only (`vocab_only`) and answers the framed commands
grammar_guard.py describes (I build, A accept, M mask, F free) with llama.cpp's grammar sampler
(`sampling.grammar_sampler`); it dies with the thread that started it (PR_SET_PDEATHSIG). One thread; nothing
here runs in the server's process.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import struct
import sys

import llama_cpp
import numpy as np

from .grammar_guard import FRAME_LEN
from .sampling import TOKEN_DATA, candidates, grammar_sampler


def main(model_path: str, memory_mib: int) -> None:  # pragma: no cover - runs in the grammar process
    """Load `model_path`'s vocabulary, cap the address space at what that mapped plus `memory_mib` MiB, send the
    hello (H + uint32 n_vocab, little-endian), then answer commands from stdin until it closes."""
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
        out.write(FRAME_LEN.pack(len(payload)) + payload)

    def read() -> bytes | None:
        head = inp.read(4)
        if len(head) < 4:
            return None
        (n,) = FRAME_LEN.unpack(head)
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
    main(sys.argv[1], int(sys.argv[2]))
