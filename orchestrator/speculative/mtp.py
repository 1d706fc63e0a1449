"""Qwen3.5's multi-token-prediction (MTP) head through llama.cpp: the pieces a draft needs, not yet a drafter.

A Qwen3.5 GGUF converted with its MTP block (``blk.{n_layer}.nextn.*``, GGUF ``nextn_predict_layers`` = 1; the
synthetic ``<preset>-mtp`` presets have one, random) drafts the token after next from the target's last hidden
state: a second llama_context of type LLAMA_CONTEXT_TYPE_MTP over the same model decodes (token x_{p+1},
target hidden state h_p) at position p + 1, and its logits draft x_{p+2}; chained drafts feed the head's own
hidden state back (llama.cpp common/speculative.cpp, draft-mtp, one head for qwen35).

The hidden-state hand-over is llama.cpp's C++ staging API (src/llama-ext.h: llama_set_embeddings_nextn,
llama_get_embeddings_nextn_ith): llama-cpp-python 0.3.36 binds the rest (llama_batch_ext_*, llama_process,
``load_mtp``, ``ctx_type``) but not these two, which libllama.so exports under their Itanium-mangled names; they
take and return plain C types, so ctypes calls them by those names (`NextnApi`). Pinned to 0.3.36: a llama.cpp
that renames them makes `NextnApi.load` raise, and MTP is then unavailable, nothing else.

Measured (bench/results/2026-12-05/mtp): with the MTP block loaded and the target's hidden states on for every
row ("unmasked", as llama-server's target context), the target's logits are bit-identical to a load without
it, so MTP drafts cannot change an answer. Not "masked" (hidden states of the output rows only): that graph
selects the output rows before the last layer's residual and FFN instead of after the final norm, so after a
prefill the last layer's FFN runs one row instead of all, and on the qwen3.5-4b preset the prompt's logits moved
by 1.4e-6. One MTP draft step costs 0.33 of a target decode step on the qwen3.5-0.8b preset on 2 cores (its
248k-row vocabulary projection), 0.17 on the 4b; a catch-up step without logits 0.03.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import llama_cpp

from ..errors import OrchestratorError

_SET = "_Z26llama_set_embeddings_nextnP13llama_contextbb"  # void (llama_context *, bool enable, bool masked)
_GET_ITH = "_Z30llama_get_embeddings_nextn_ithP13llama_contexti"  # float * (llama_context *, int32_t i)


class MtpUnavailable(OrchestratorError):
    """This llama.cpp build has no MTP hand-over, or the model has no MTP block."""


@dataclass(frozen=True)
class NextnApi:
    """The two staging functions. `set(ctx, enable, masked)`: compute the hidden state the MTP head takes, for the
    output rows only when `masked` (which changes a target's graph: module docstring; an MTP context takes
    masked) or for every row (a target's graph as without it). `get_ith(ctx, i)`: that
    row for batch index i (negative: from the end), float[n_embd], valid until the next decode; NULL where row i
    had no output."""

    set: ctypes._CFuncPtr
    get_ith: ctypes._CFuncPtr

    @classmethod
    def load(cls) -> "NextnApi":
        """Raises MtpUnavailable where libllama.so does not export them."""
        lib = llama_cpp.llama_cpp._lib
        try:
            set_, get_ith = lib[_SET], lib[_GET_ITH]
        except AttributeError as e:
            raise MtpUnavailable(f"llama-cpp-python {llama_cpp.__version__}'s libllama has no "
                                 f"llama_set_embeddings_nextn / llama_get_embeddings_nextn_ith: {e}") from None
        set_.argtypes, set_.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
        get_ith.argtypes, get_ith.restype = [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)
        return cls(set_, get_ith)


def mtp_context(model, like, n_ctx: int, n_seq_max: int = 1):
    """A llama_context of type MTP over `model` (loaded with ``load_mtp``), with the threads, batch size and
    attention layout of `like` (llama_context_params of the target). Free with llama_free. Raises MtpUnavailable
    where the model has no MTP block or llama.cpp refuses the context."""
    if int(llama_cpp.llama_model_n_layer_nextn(model)) < 1:
        raise MtpUnavailable("the model has no MTP block (GGUF nextn_predict_layers)")
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_seq_max = n_ctx * n_seq_max, n_seq_max
    cp.n_batch = cp.n_ubatch = like.n_batch
    cp.n_threads, cp.n_threads_batch = like.n_threads, like.n_threads_batch
    cp.flash_attn_type, cp.type_k, cp.type_v = like.flash_attn_type, like.type_k, like.type_v
    cp.kv_unified, cp.no_perf = False, True
    cp.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
    ctx = llama_cpp.llama_init_from_model(model, cp)
    if not ctx:
        raise MtpUnavailable("llama.cpp could not create an MTP context for this model")
    return ctx
