"""The llama.cpp model and context (through llama-cpp-python's low-level ctypes API): with sampling.py (the
sampler chain over its logits) and devices.py (ggml's device registry), the only code in the server's process
that calls llama.cpp; grammars run in grammar processes (grammar_guard.py, grammar_child.py).

One `Engine` owns a model, a context and a reusable `llama_batch`. It tokenizes, prefills in chunks of at most
n_batch tokens (llama_decode aborts the process on more), decodes one token at a time, samples with llama.cpp's
sampler chain, and saves/restores a sequence's state as bytes (llama_state_seq_get_data / set_data).

Threads. An `Engine`'s methods fall in two groups:
  * the vocabulary and metadata (`tokenize`, `piece`, `special_tokens`, `is_eog`, `meta`, and the attributes
    set at construction: `info`, `n_ctx`, `n_vocab`, ...) read only what llama.cpp does not change after loading
    and share no buffer between calls, and `check_grammar` goes to the thread-safe `GrammarPool`: safe from any
    thread at any time, also while the engine thread decodes (the server tokenizes and detokenizes on its
    thread pool and its event loop);
  * everything else (`decode`, `decode_step`, `sampler`, `logits`, `logprob`, the sequence-state and spare-buffer
    methods, `calibrate`, `close`) uses the context or the engine's kept buffers: one thread only, the engine
    thread (engine_thread.EngineThread) that loads the model and then runs the scheduler's worker loop.

Numerics (why cached equals cold, bit for bit). On the CPU backend a token's result depends on how it was
batched in three ways, measured on the synthetic Qwen3.5 presets with llama-cpp-python 0.3.36:
  * flash attention switches kernels by ubatch size (ggml-cpu ops.cpp: a tiled path for >= 64 queries
    (GGML_FA_TILE_Q), a one-row path below, a split-KV reduction for a single query), so splitting a prefill
    changes the logits (max |Δ| 2e-4 on tiny, 0.18 on the random 0.8b). With flash attention off, KQ and KQV
    are plain matmuls and any split into ubatches of >= 2 tokens is bit-identical (25 random splits, 0
    differences), at the same prefill speed (315 vs 311 tokens/s at 2,000 tokens on the 0.8b preset). The tiled
    and split-KV paths take only an F16/F32 K cache: over a Q8_0 K cache every query row runs the one-row path,
    whatever the ubatch holds, so splits are exact there too, and so is speculative verification against
    one-token decoding (`Attention`, VERIFYING).
  * a short ubatch still differs from the same tokens inside a larger one: one token always (other matmul and
    Gated DeltaNet graph paths), and on quantized models anything under 8 tokens (other ggml-cpu matmul
    kernels; max |Δlogit| 0.23 on the 0.8b). The threshold depends on the weight types and the CPU, so the
    runtime measures it at start (calibration.measure_min_segment) and passes it in (`calibrate`): `decode`
    never cuts a chunk shorter than `min_segment` out of a longer run, and the reuse rules never store or
    restore a state that a shorter segment produced.
  * with ARM i8mm, K-quant dot products take two rows at a time in a ubatch of even length and one at a time
    in an odd one, so no size is exact against every other; there the runtime keeps every prefill ubatch odd
    (`odd_ubatches`, chunks.py), where sizes from a measured one on are exact (bench/results/2026-12-05/aarch64).
The engine therefore creates contexts with flash attention off over F16 unless given another `Attention`.

CPU weight repacking ("extra buffer types", `use_extra_bufts`): with llama-cpp-python 0.3.36 on AMX CPUs, a
Q4_K_M model loaded with repacking segfaults on any llama_decode of more than one token (seen for the synthetic
Qwen3.5 and for the real Gemma 3 270M). A segfault cannot be caught, so the engine loads models with
`use_extra_bufts=False` unless told otherwise; the runtime tells it otherwise where a child process found
repacking exact and faster (repacking.py).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import llama_cpp
import numpy as np

from .buffers import SpareBuffers, address, bytes_writer
from .chunks import chunk_sizes
from .config import KV_TYPES
from .devices import Offload, device_array, select_devices
from .errors import EngineError, InvalidRequest, ModelLoadError
from .grammar_guard import GrammarLimits, GrammarPool
from .request import SamplingParams, TokenLogprob
from .sampling import Sampler, token_logprob
from .cache.radix import CHECKPOINT
from .speculative.mtp import NextnApi
from . import kernels
from .state import StateKind, state_kind

log = logging.getLogger("orchestrator.engine")

PARTIAL = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
_LOG_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}  # ggml_log_level


@llama_cpp.llama_log_callback
def _llama_log(level: int, text: bytes, _user) -> None:
    """llama.cpp's log, into this module's logger. llama_log_set is process-wide, so the callback is one object for
    the life of the process: one owned by an Engine was freed with it while llama.cpp still called it (a later
    llama_free of another context logs, and jumped into freed memory)."""
    msg = text.decode("utf-8", "replace").rstrip("\n")
    if msg:
        log.log(_LOG_LEVELS.get(level, logging.DEBUG), "llama.cpp: %s", msg)


@dataclass(frozen=True)
class ModelInfo:
    """Facts read from the GGUF (llama_model_meta_val_str) and the vocab."""

    path: Path
    architecture: str
    name: str
    n_vocab: int
    n_ctx_train: int
    size_bytes: int
    n_params: int
    chat_template: str | None
    eos_text: str
    eot_text: str
    bos_text: str
    add_bos: bool


@dataclass(frozen=True)
class Attention:
    """How attention runs and where its KV cache is kept: flash attention (llama_context_params.flash_attn_type)
    and the K and V cache types (type_k, type_v: names of KV_TYPES). Raises ValueError for an unknown type, or a
    quantized V cache without flash attention (llama.cpp refuses it).

    The default, flash attention off over an F16 cache, makes any prefill split of >= min_segment tokens
    bit-identical (module docstring, "Numerics"). VERIFYING is the layout in which a verification ubatch of k < 8
    tokens of one sequence equals k one-token decode steps, bit for bit, on K-quant models: with flash attention
    on and a K cache that is neither F16 nor F32, ggml-cpu runs every query row through the same one-row kernel
    (ops.cpp ggml_compute_forward_flash_attn_ext_f16: its tiled path for >= 64 queries and its split-KV path for
    one query both require an F16/F32 K of V's type), so attention no longer depends on how many rows a ubatch
    has; the weight matmuls are bit-identical below 8 rows already. Measured (calibration.measure_verify_widths,
    contexts up to 1,000 tokens): widths 2..7 exact on tiny-q4, the qwen3.5-0.8b preset and Gemma 3 270M, on an
    AMD EPYC with AVX-512, where the default layout has none (bench/results/2026-12-03/attention-layouts). Its
    cost: cold prefill about 0.75-0.8x (the one-row kernel instead of the tiled one), decode within noise, K cache
    about half the bytes (Q8_0: 34 bytes per 32 values).

    `kernels` "reference": decode steps and verifications run ggml-cpu's reference kernels, prefill the optimized
    ones (kernels.py, Engine._compute). In VERIFYING that removes the other 8-row switch, the weight matmuls' tiled
    kernel: every width up to 17 exact on the 0.8b and tiny-q4 presets and Gemma 3 270M, where "default" stops at
    7 (bench/results/2026-12-07/reference-kernels); prefill speed unchanged."""

    flash: bool = False
    type_k: str = "f16"
    type_v: str = "f16"
    kernels: str = "default"

    def __post_init__(self) -> None:
        for t in (self.type_k, self.type_v):
            if t not in KV_TYPES:
                raise ValueError(f"unknown KV cache type {t!r} (one of {', '.join(KV_TYPES)})")
        if not self.flash and self.type_v not in ("f16", "f32"):
            raise ValueError(f"a {self.type_v} V cache needs flash attention (-fa on)")
        if self.kernels not in ("default", "reference"):
            raise ValueError(f"decode kernels {self.kernels!r}: default or reference")

    @property
    def exact_rows(self) -> bool:
        """Whether attention runs every query row through the one-row kernel, whatever the ubatch holds: flash
        attention over a K cache that is neither F16 nor F32 (the class docstring). Only there can a verification
        equal one-token decoding under the default kernels. Flash attention over F16 (`tiled_queries`) gets there
        with reference kernels for decode steps and verifications, which skip the tiled and split-KV paths."""
        return self.flash and self.type_k not in ("f16", "f32")

    @property
    def tiled_queries(self) -> int:
        """The fewest query rows for which ggml-cpu's optimized kernels take their tiled flash attention, else 0:
        flash attention over an F16/F32 K of V's type, 64 queries or more (ops.cpp
        ggml_compute_forward_flash_attn_ext_f16, `use_tiled`; GGML_FA_TILE_Q in ggml-cpu/common.h). A ubatch of
        fewer rows runs the one-row kernel, which computes other logits: on tiny-q4 a 240-token prompt prefilled
        as 63 + 177 tokens differs from it whole by 0.037, as 64 + 176 it is bit-identical. So min_segment must be
        probed past it (calibration.measure_min_segment's `tiled`). Decode steps and verifications under
        reference kernels run the one-row kernel at every width (kernels.py)."""
        return 64 if self.flash and self.type_k == self.type_v and self.type_k in ("f16", "f32") else 0

    def key(self) -> str:
        """A short name for calibration keys and fingerprints: "fa1/q8_0/f16", "fa1/q8_0/f16/ref"."""
        return f"fa{int(self.flash)}/{self.type_k}/{self.type_v}" + ("/ref" if self.kernels == "reference" else "")

    def describe(self) -> str:
        return (f"flash attention {'on' if self.flash else 'off'}, KV cache K {self.type_k} / V {self.type_v}"
                + (", reference kernels for decode steps and verifications" if self.kernels == "reference" else ""))


VERIFYING = Attention(True, "q8_0", "f16")


class Engine:
    """A llama.cpp model + context with one sequence per slot.

    Args:
        model_path: GGUF file.
        n_ctx: context size in tokens (per sequence when n_seq_max > 1).
        n_batch: most tokens per llama_decode call; also n_ubatch.
        n_threads: CPU threads for decode and prefill.
        use_extra_bufts: llama.cpp CPU weight repacking (see the module docstring; off by default).
        attention: flash attention and KV cache types (Attention; default: flash attention off over F16, see
            "Numerics" in the module docstring; VERIFYING for exact speculative verification).
        n_gpu_layers: layers offloaded to the devices (llama_model_params.n_gpu_layers; < 0: all of them, which
            is none on a CPU-only build: llama-server's default).
        devices: ggml device names to offload to (["none"]: none; None: llama.cpp's default choice);
        main_gpu: keep only that index of them (devices.select_devices).
        kv_offload: KV cache and attention on the device of their layer (llama_context_params.offload_kqv).
        n_rs_seq: recurrent-state snapshots kept per sequence for rollback (llama_context_params.n_rs_seq,
            experimental in llama.cpp; 0 = none): after a prefill call, `rollback_checkpoint` can save the
            checkpoint of any of the call's last n_rs_seq positions. Costs n_rs_seq more recurrent states per slot.
        decode_rows: 1, or 2: every one-token decode (`decode` of one token, `decode_step`) computes its token in a
            ubatch of two rows of its sequence, the second a copy at the next position that is removed again
            (llama_memory_seq_rm; on a recurrent memory n_rs_seq >= 1 rolls the state back), so that decoding takes
            the attention kernels of two or more query rows, as a verification ubatch does: speculative
            verification is then exact by construction below the weight kernels' switch
            (bench/results/2026-12-03/verification-widths). Answers differ from decode_rows 1 (once: both are
            exact with respect to the cache). Raises ModelLoadError for 2 on a recurrent model without n_rs_seq.
        load_mtp: also load the model's multi-token-prediction block where it has one (llama_model_params.load_mtp;
            speculative/mtp.py) and compute the hidden state it drafts from for every row of every call
            (`last_hidden`, `hidden`); the trunk computes the same logits either way (bench/results/2026-12-05/mtp).
            `nextn` is then the staging API (None: no MTP block, or not asked for).
    Raises ModelLoadError when the file is missing, a device is unknown, or llama.cpp cannot load it.

    `offload` is the resulting layout (devices.Offload); `model_params` and `context_params` the llama.cpp
    parameters the model and context were created with.

    grammars: the grammar processes for this model's constrained requests (grammar_guard.GrammarPool), owned
        from here on (`close` closes them); None: a pool with the default limits, made on first use.

    Until `calibrate` is called with the measured facts (calibration.py), min_segment is 2 (no one-token
    chunks) and batch_invariant False.
    """

    def __init__(self, model_path: Path, n_ctx: int = 8192, n_batch: int = 512, n_threads: int = 2,
                 use_extra_bufts: bool = False, n_seq_max: int = 1, attention: Attention = Attention(),
                 n_gpu_layers: int = -1, devices: Sequence[str] | None = None, main_gpu: int | None = None,
                 kv_offload: bool = True, n_rs_seq: int = 0, decode_rows: int = 1,
                 grammars: GrammarPool | None = None, load_mtp: bool = False) -> None:
        model_path = Path(model_path)
        if n_batch < 3:
            raise ModelLoadError("--batch-size must be at least 3 tokens")
        reference = attention.kernels == "reference"
        if not model_path.is_file():
            raise ModelLoadError(f"model file not found: {model_path}")
        llama_cpp.llama_log_set(_llama_log, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        mparams.use_extra_bufts = use_extra_bufts
        mparams.load_mtp = load_mtp
        mparams.n_gpu_layers = n_gpu_layers
        offload_to = select_devices(devices, main_gpu)
        self._devices = device_array(offload_to)  # explicit, so that `offload` names what llama.cpp uses
        mparams.devices = ctypes.addressof(self._devices)
        self.model_params = mparams
        self.model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self.model:
            raise ModelLoadError(f"llama.cpp could not load {model_path} (not a GGUF, or an unsupported "
                                 f"architecture for llama-cpp-python {llama_cpp.__version__})")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx * n_seq_max
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch  # one llama_decode call = one ubatch: chunk_sizes() controls the split
        cparams.n_seq_max = n_seq_max
        cparams.n_rs_seq = n_rs_seq
        # One KV stream per sequence: a sequence's attention never sees other sequences' cells, so its numerics
        # do not depend on what the other slots hold (llama_context: n_ctx_seq = n_ctx / n_seq_max).
        cparams.kv_unified = False
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.no_perf = True
        cparams.offload_kqv = kv_offload
        # What the state is made of decides how it is saved, restored and rewound (state.py), and for sliding-window
        # models the cache layout (swa_full).
        self.state: StateKind = state_kind(bool(llama_cpp.llama_model_is_recurrent(self.model)),
                                           bool(llama_cpp.llama_model_is_hybrid(self.model)),
                                           int(llama_cpp.llama_model_n_swa(self.model)))
        cparams.swa_full = self.state.swa_full
        cparams.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if attention.flash
                                   else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        cparams.type_k = KV_TYPES[attention.type_k]
        cparams.type_v = KV_TYPES[attention.type_v]
        self.context_params = cparams
        with kernels.rotation_off(reference):
            self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise ModelLoadError(f"llama.cpp could not create a context of {n_ctx} tokens for {model_path} "
                                 f"(out of memory? try a smaller --ctx-size)")
        try:
            self._kernels = kernels.ReferenceKernels(self.ctx) if reference else None
        except kernels.KernelsUnavailable as e:
            llama_cpp.llama_free(self.ctx)
            llama_cpp.llama_model_free(self.model)
            raise ModelLoadError(f"--decode-kernels reference: this llama-cpp-python cannot switch kernels ({e})") \
                from None
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.n_ctx = llama_cpp.llama_n_ctx_seq(self.ctx)
        self.n_batch = llama_cpp.llama_n_batch(self.ctx)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_threads = n_threads
        self.n_seq_max = n_seq_max
        self.attention = attention
        self.offload = Offload.of(offload_to, n_gpu_layers, llama_cpp.llama_model_n_layer(self.model), kv_offload)
        if not offload_to and n_gpu_layers > 0:
            log.warning("-ngl %d: no offload device (%s), every layer runs on the CPU", n_gpu_layers,
                        "--device none" if devices else "a CPU-only llama.cpp build")
        self.n_rs_seq = int(llama_cpp.llama_n_rs_seq(self.ctx))  # 0 where the architecture has no rollback
        self._last_call: dict[int, tuple[int, int]] = {}  # seq -> positions [lo, hi) of its last prefill call
        self.n_embd = int(llama_cpp.llama_model_n_embd(self.model))
        self.nextn: NextnApi | None = None
        if load_mtp and int(llama_cpp.llama_model_n_layer_nextn(self.model)) > 0:
            self.nextn = NextnApi.load()
            # every row, not "masked": the target's graph as without it, so its logits stay bit-identical
            self.nextn.set(self.ctx, True, False)
        self._hidden: dict[int, tuple[int, np.ndarray]] = {}  # seq -> (position, hidden state there): last_hidden
        if decode_rows not in (1, 2) or (decode_rows == 2 and self.n_rs_seq < 1
                                         and llama_cpp.llama_model_is_recurrent(self.model)
                                         | llama_cpp.llama_model_is_hybrid(self.model)):
            llama_cpp.llama_free(self.ctx)
            llama_cpp.llama_model_free(self.model)
            raise ModelLoadError(f"decode_rows {decode_rows}: 1, or 2 (with n_rs_seq >= 1 on a recurrent model)")
        self.decode_rows = decode_rows
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._pieces: dict[int, bytes] = {}  # piece() by token id: at most the vocabulary
        self._scratch = bytearray()  # the kept buffer of load_state (states given in parts) and save_state_view
        self._rewind: list[bytearray] = []  # the kept buffers of rewind_point
        self._view: memoryview | None = None  # the view save_state_view returned last (load_state reads it in place)
        self._new_bytes = bytes_writer()  # save_state's bytes objects, filled in place by llama.cpp
        self.spares = SpareBuffers(self._new_bytes)  # checkpoint-sized, faulted in while idle (keep_spares)
        self.bos_id = int(llama_cpp.llama_vocab_bos(self.vocab))
        self.info = self._read_info(model_path)
        self.use_extra_bufts = use_extra_bufts
        self.min_segment = 2  # until calibrated: chunk_sizes never makes one-token chunks
        self.odd_ubatches = False  # until calibrated: ubatches of any length (chunks.py)
        self.batch_invariant = False
        self.rollback = False  # until calibrated: no checkpoint is taken back inside a prefill call
        self.state.probe(self, max(self.bos_id, 0))
        self._grammars = grammars

    def calibrate(self, min_segment: int, batch_invariant: bool = False, rollback: bool = False,
                  odd: bool = False) -> None:
        """Set the measured facts of this model on this CPU (calibration.py): the fewest tokens a prefill ubatch
        may have to be bit-identical to the same tokens in a larger one, whether prefill ubatches are kept at odd
        lengths for it (`odd`, chunks.py), whether a decode step batched over sequences equals decoding each
        alone, and whether `checkpoint_back` is bit-identical to a stopped prefill (`rollback`, kept only with
        n_rs_seq snapshots)."""
        if min_segment < 2 or self.n_batch < 2 * min_segment - 1:
            raise ModelLoadError(f"min_segment {min_segment} does not fit n_batch {self.n_batch} (--batch-size must "
                                 f"be at least {2 * min_segment - 1} on this model and CPU)")
        try:
            chunk_sizes(0, self.n_batch, min_segment, odd)  # an odd rule needs min_segment twice an odd number
        except ValueError as e:
            raise ModelLoadError(str(e)) from e
        self.min_segment = min_segment
        self.odd_ubatches = odd
        self.batch_invariant = batch_invariant
        self.rollback = rollback and self.n_rs_seq > 0

    # ---------------------------------------------------------------- metadata and vocab

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string (llama_model_meta_val_str), or None."""
        buf = ctypes.create_string_buffer(1 << 20)
        n = llama_cpp.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def _read_info(self, path: Path) -> ModelInfo:
        def text(tok: int) -> str:
            return self.piece(tok).decode("utf-8", "replace") if tok >= 0 else ""

        eos = llama_cpp.llama_vocab_eos(self.vocab)
        eot = llama_cpp.llama_vocab_eot(self.vocab)
        bos = llama_cpp.llama_vocab_bos(self.vocab)
        return ModelInfo(
            path=path,
            architecture=self.meta("general.architecture") or "unknown",
            name=self.meta("general.name") or path.stem,
            n_vocab=self.n_vocab,
            n_ctx_train=llama_cpp.llama_model_n_ctx_train(self.model),
            size_bytes=llama_cpp.llama_model_size(self.model),
            n_params=llama_cpp.llama_model_n_params(self.model),
            chat_template=self.meta("tokenizer.chat_template"),
            eos_text=text(eos),
            eot_text=text(eot if eot >= 0 else eos),
            bos_text=text(bos),
            add_bos=bool(llama_cpp.llama_vocab_get_add_bos(self.vocab)),
        )

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of `text` (llama_tokenize). parse_special: special-token texts become their ids."""
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequest(f"the text is not valid Unicode ({e.reason} at character {e.start}); "
                                 f"send UTF-8 without lone surrogates") from e
        cap = len(data) + 16
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise EngineError(f"llama_tokenize failed ({n}) on {len(data)} bytes")
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """Bytes of one token (llama_token_to_piece, special tokens rendered as their text), kept once read (a
        prompt asks for every token's: 507 ctypes calls took about 4 ms).

        Safe from any thread ("Threads" in the module docstring): a buffer per call, and a dict's get and set are
        atomic.
        """
        got = self._pieces.get(token)
        if got is not None:
            return got
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        self._pieces[token] = got = buf.raw[:n]
        return got

    def special_tokens(self) -> list[tuple[int, str, bool]]:
        """(id, text, is_control) of every token that llama_tokenize may split out of text as one token: attribute
        CONTROL or UNKNOWN (is_control True; matched only with parse_special) or USER_DEFINED (False; matched
        even without it). From llama_vocab_get_attr over the whole vocabulary (about 0.1 s for 248k tokens)."""
        control = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
        user = llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
        out = []
        for tok in range(self.n_vocab):
            attr = llama_cpp.llama_vocab_get_attr(self.vocab, tok)
            if attr & (control | user):
                out.append((tok, self.piece(tok).decode("utf-8", "replace"), bool(attr & control)))
        return out

    def is_eog(self, token: int) -> bool:
        """End of generation (EOS, EOT and the like: llama_vocab_is_eog)."""
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    # ---------------------------------------------------------------- compute

    def decode(self, seq: int, tokens: Sequence[int], pos: int, want_logits: bool = True,
               hidden: list | None = None) -> None:
        """Decode `tokens` at positions pos.. for sequence `seq`, in chunks of at most n_batch tokens and, unless
        `tokens` is shorter, at least `min_segment` (see "Numerics"), of odd length where calibrated so
        (`odd_ubatches`, chunks.py).

        Logits are kept for the last token only (when want_logits). `hidden` (a list, with `nextn`): filled with
        the hidden state before each token, that at pos + j - 1 for token j (None for token 0 where
        `last_hidden` was not at pos - 1), what an MTP head's entry for token j takes. Raises EngineError when
        llama_decode fails (e.g. no KV slot); the sequence's state is then unspecified and the caller must clear
        it.
        """
        if hidden is not None and self.nextn is not None:
            last = self._hidden.get(seq)
            hidden.append(last[1] if last is not None and last[0] == pos - 1 else None)
        else:
            hidden = None
        if len(tokens) == 1 and self.decode_rows == 2:
            self.decode_step([(seq, tokens[0], pos)])
            return
        b = self._batch
        for start, n in chunk_sizes(len(tokens), self.n_batch, self.min_segment, self.odd_ubatches):
            chunk = tokens[start:start + n]
            for i, tok in enumerate(chunk):
                b.token[i] = tok
                b.pos[i] = pos + start + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = 0
            if want_logits and start + n == len(tokens):
                b.logits[n - 1] = 1
            b.n_tokens = n
            self._last_call.pop(seq, None)
            rc = self._compute(b, step=len(tokens) == 1)  # one token: a decode step, not a prefill
            if rc != 0:
                raise EngineError(f"llama_decode failed with code {rc} at position {pos + start} "
                                  f"({n} tokens; context {self.n_ctx})")
            self._last_call[seq] = (pos + start, pos + start + n)
            if hidden is not None:
                hidden.extend(self.hidden(j) for j in range(n if start + n < len(tokens) else n - 1))
        if tokens:
            self._keep_hidden(seq, pos + len(tokens) - 1, n - 1)

    def decode_step(self, items: Sequence[tuple[int, int, int]]) -> None:
        """One decode step for several sequences in one llama_decode call: `items` are (seq, token, pos), at most
        one per sequence, at most n_batch / decode_rows. Logits are kept for every item; item i's are at batch
        index i (`logits(i)`, `Sampler.sample(i)`). With decode_rows 2 each item is two rows of its sequence, the
        copy at pos + 1 removed after the call (see the constructor).

        Pass items in increasing seq order: with a per-sequence KV cache llama.cpp packs consecutive sequence ids
        into one ubatch (llama_batch_allocr::split_equal, sequential mode). Whether the result equals decoding
        each sequence alone depends on the model's weight types: see calibration.check_batch_invariance. Raises
        EngineError when llama_decode fails (the sequences' states are then unspecified).
        """
        rows = self.decode_rows
        if not 0 < len(items) * rows <= self.n_batch:
            raise ValueError(f"a decode step takes 1..{self.n_batch // rows} items, got {len(items)}")
        b = self._batch
        n = len(items)
        for i, (seq, tok, pos) in enumerate(items):
            for r in range(rows):  # decode_rows 2: the copies after all the items, so item i's logits stay at i
                j = i + r * n
                b.token[j] = tok
                b.pos[j] = pos + r
                b.n_seq_id[j] = 1
                b.seq_id[j][0] = seq
                b.logits[j] = r == 0
        b.n_tokens = n * rows
        for seq, _, _ in items:  # not a prefill call: checkpoint_back does not apply (delta-net-base.cpp)
            self._last_call.pop(seq, None)
        rc = self._compute(b, step=True)
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc} on a decode step of {len(items)} sequences")
        for i, (seq, _, pos) in enumerate(items):
            self._keep_hidden(seq, pos, i)
        for seq, _, pos in items if rows == 2 else ():  # drop the copies (their recurrent step rolled back)
            if not llama_cpp.llama_memory_seq_rm(self.mem, seq, pos + 1, -1):
                raise EngineError(f"llama.cpp refused to drop the decode row copy of sequence {seq} at {pos + 1}")

    def _compute(self, batch, step: bool) -> int:
        """llama_decode of `batch`: a decode step or verification (`step`), or a prefill chunk; with
        `attention.kernels` "reference" the former run ggml-cpu's reference kernels (kernels.py). Returns
        llama_decode's code."""
        if self._kernels is not None:
            self._kernels.use(step)
        return llama_cpp.llama_decode(self.ctx, batch)

    def verify(self, seq: int, tokens: Sequence[int], pos: int, every: bool = True) -> None:
        """Decode `tokens` (2..n_batch) of sequence `seq` at positions pos.. in ONE ubatch with logits for every
        token (token i's at batch index i: `logits(i)`, `Sampler.sample(i)`; `every` False: the last token's
        only, as a rollback's replay needs): a speculative verification. Whether the logits and the state equal
        those of one-token steps depends on the width, the model and the CPU
        (calibration.measure_verify_widths). Afterwards `truncate(seq, pos + j + 1)` keeps the first j + 1 tokens:
        on a recurrent memory only while len(tokens) - j - 1 <= n_rs_seq (llama.cpp keeps the recurrent state
        after each of the call's last n_rs_seq + 1 tokens: llama_memory_recurrent::seq_rm). Raises EngineError
        when llama_decode fails (the sequence's state is then unspecified). To keep fewer than all of them
        without n_rs_seq: `rewind_point` before, speculative.verify.rewind after."""
        if not 2 <= len(tokens) <= self.n_batch:
            raise ValueError(f"a verification takes 2..{self.n_batch} tokens, got {len(tokens)}")
        self.verify_many([(seq, tokens, pos)], every)

    def verify_many(self, items: Sequence[tuple[int, Sequence[int], int]], every: bool = True) -> list[int]:
        """`verify` of several sequences in one llama_decode call: `items` are (seq, tokens, pos), one per
        sequence, in increasing seq order, 1.. tokens each (one token: that sequence's decode step), n_batch
        in all; logits for every token (`every` False: for each item's last token only; the other rows then skip
        the output projection, a vocabulary-sized matmul per row, and in some architectures the last layer's FFN:
        llama.cpp selects the output rows after every layer's state is written, src/models/qwen35.cpp). Returns
        each item's first batch index (its token i's logits at that + i).
        llama.cpp cuts the call into ubatches of equal tokens per sequence (llama_batch_allocr::split_equal):
        whether each sequence then gets what it gets alone is measured (calibration.check_batched_verification;
        bit-identical under reference kernels, bench/results/2026-12-07/batched-verification). Raises EngineError
        when llama_decode fails (the sequences' states are then unspecified)."""
        if not items or any(not tokens for _, tokens, _ in items) or sum(len(t) for _, t, _ in items) > self.n_batch:
            raise ValueError(f"a verification takes 1.. tokens per sequence, {self.n_batch} in all")
        b = self._batch
        starts, j = [], 0
        for seq, tokens, pos in items:
            starts.append(j)
            for i, tok in enumerate(tokens):
                b.token[j] = tok
                b.pos[j] = pos + i
                b.n_seq_id[j] = 1
                b.seq_id[j][0] = seq
                b.logits[j] = 1 if every or i == len(tokens) - 1 else 0
                j += 1
            self._last_call.pop(seq, None)  # not a prefill call: checkpoint_back does not apply
        b.n_tokens = j
        rc = self._compute(b, step=True)
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc} verifying {j} tokens of "
                              f"{len(items)} sequence(s) at {items[0][2]}")
        for (seq, tokens, pos), start in zip(items, starts):
            self._keep_hidden(seq, pos + len(tokens) - 1, start + len(tokens) - 1)
        return starts

    @property
    def cuttable(self) -> bool:
        """Whether a sequence can be cut back to any of its positions by KV removal alone (`truncate`): an
        attention-only memory. A recurrent part needs a checkpoint reloaded first (`rewind_point`)."""
        return CHECKPOINT not in self.state.entry_kinds

    def rewind_point(self, seq: int, buffer: int = 0) -> memoryview | None:
        """Before a verification of `seq`: what speculative.verify.rewind needs to bring it back here. On a memory
        with a recurrent part, its checkpoint (the recurrent state: 19 MiB on the 0.8b), written into kept buffer
        number `buffer` (valid until the next rewind_point into it: a verification of several sequences at once
        takes one each, so as many buffers as sequences verified together are kept); None on an attention-only
        memory, where KV removal suffices. Raises EngineError when llama.cpp writes nothing."""
        if self.cuttable:
            return None
        size = llama_cpp.llama_state_seq_get_size_ext(self.ctx, seq, PARTIAL)
        while len(self._rewind) <= buffer:
            self._rewind.append(bytearray())
        if len(self._rewind[buffer]) < size:
            self._rewind[buffer] = bytearray(size)
        kept = self._rewind[buffer]
        buf = (ctypes.c_uint8 * size).from_buffer(kept)
        n = llama_cpp.llama_state_seq_get_data_ext(self.ctx, buf, size, seq, PARTIAL)
        del buf
        if n == 0:
            raise EngineError(f"llama_state_seq_get_data_ext wrote nothing for sequence {seq}")
        return memoryview(kept)[:n]

    def sampler(self, params: SamplingParams, deadline: float | None = None) -> Sampler:
        """A sampler chain over this context's logits (close it when done). With `params.grammar`, the grammar is
        built in a grammar process (`grammars`), its waits bounded by the per-token budget and `deadline`
        (time.perf_counter); nothing waits for the build here: GrammarFailed, when llama.cpp cannot parse it or
        runs past them, comes from the sampler's first `ready` or `sample`."""
        grammar = None
        if params.grammar:
            grammar = self.grammars.open(params.grammar, params.grammar_triggers, deadline, wait=False)
        return Sampler(params, self.ctx, self.vocab, grammar)

    @property
    def grammars(self) -> GrammarPool:
        """The grammar processes of this model (grammar_guard.py): the pool given at construction, else one with
        the default limits made here on first use (the children start when a grammar is first opened)."""
        if self._grammars is None:
            self._grammars = GrammarPool(self.info.path, GrammarLimits(), keep=self.n_seq_max + 1)
        return self._grammars

    def check_grammar(self, grammar: str, triggers: Sequence[str], param: str, deadline: float | None = None
                      ) -> None:
        """Refuse a grammar llama.cpp does not parse, or (unless lazy) that allows no first token, within the
        budget and by `deadline` (GrammarPool.check, in a grammar process): raises GrammarFailed naming `param`.
        Safe from any thread, also while the engine thread decodes."""
        self.grammars.check(grammar, tuple(triggers), param, deadline)

    def logprob(self, token: int, k: int = 0, idx: int = -1) -> TokenLogprob:
        """`token_logprob` over the raw logits at batch index `idx` of the last llama_decode (those the sampler
        saw: sampling does not change them)."""
        return token_logprob(self.logits(idx), token, k)

    def logits(self, idx: int = -1) -> np.ndarray:
        """Copy of the logits at batch index `idx` of the last llama_decode (-1: its last token with logits on):
        float32, shape (n_vocab,)."""
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, idx)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def hidden(self, idx: int) -> np.ndarray:
        """Copy of the hidden state the MTP head drafts from (the trunk's output before the final norm), at batch
        index `idx` >= 0 of the last llama_decode: float32, shape (n_embd,). Only with `nextn`; every row of a
        call has one."""
        ptr = self.nextn.get_ith(self.ctx, idx)
        if not ptr:
            raise EngineError(f"no hidden state at batch index {idx} of the last llama_decode")
        return np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).copy()

    def last_hidden(self, seq: int) -> tuple[int, np.ndarray] | None:
        """(position, hidden state) of the last token a llama_decode computed for `seq`, while the sequence has not
        been loaded, cleared or truncated since; None otherwise or without `nextn`. Kept at every call (n_embd
        floats: 4 KiB on the 0.8b), because a scheduler step decodes other sequences in between."""
        return self._hidden.get(seq)

    def _keep_hidden(self, seq: int, pos: int, idx: int) -> None:
        if self.nextn is not None:
            self._hidden[seq] = (pos, self.hidden(idx))

    # ---------------------------------------------------------------- sequence state

    def clear(self, seq: int) -> None:
        """Remove every token of sequence `seq` from the memory (KV and recurrent)."""
        self._last_call.pop(seq, None)
        self._hidden.pop(seq, None)
        llama_cpp.llama_memory_seq_rm(self.mem, seq, -1, -1)

    @property
    def rollback_reach(self) -> int:
        """How far back from the end of a prefill that `decode` was given `checkpoint_back` can always reach:
        n_rs_seq, but with odd ubatches less than min_segment // 2, the shortest last call `decode` makes of a
        chunk of at least min_segment tokens (chunks.py: an even chunk's second half; the call's first position
        is the previous call's end, not inside it)."""
        return min(self.n_rs_seq, self.min_segment // 2 - 1) if self.odd_ubatches else self.n_rs_seq

    def can_roll_back(self, seq: int, pos: int) -> bool:
        """Whether `checkpoint_back(seq, pos)` can give the checkpoint of `seq` at `pos` now: the sequence's last
        llama_decode call was a prefill of positions [lo, hi), nothing changed the sequence since, and
        lo < pos < hi, hi - pos <= n_rs_seq. Beyond that llama.cpp rolls back silently to a stale snapshot: a
        call writes the states after its own last min(n_tokens, n_rs_seq + 1) tokens only, a decode step its
        newest only (ggml_gated_delta_net in delta-net-base.cpp; measured: bench/results/2026-12-01/stops)."""
        span = self._last_call.get(seq)
        return span is not None and span[0] < pos < span[1] and span[1] - pos <= self.n_rs_seq

    def checkpoint_back(self, seq: int, pos: int) -> bytes:
        """The checkpoint of `seq` at `pos` inside its last prefill call (as `save_state(seq, partial=True)` would
        have written it had the prefill stopped there), without a llama_decode call of its own; the sequence is
        left at the call's end, as it was. One per call: `can_roll_back` is False afterwards.

        How: the context keeps the recurrent state after each of a call's last n_rs_seq tokens
        (llama_context_params.n_rs_seq); llama_memory_seq_rm(seq, pos, -1) of at most n_rs_seq trailing
        positions selects the one at pos (llama_memory_recurrent::seq_rm sets a rollback index that state_write
        honours) but drops the KV after pos. So the whole state is saved first, into the kept buffer (KV +
        recurrent: about 12 KiB per token + 19 MiB on the 0.8b), and loaded back after the save (bytes llama.cpp
        wrote: exact). Bit-identical to a stopped prefill where calibration says so (calibration.check_rollback).
        Raises ValueError where `can_roll_back` is False, EngineError (sequence cleared) when llama.cpp refuses."""
        if not self.can_roll_back(seq, pos):
            raise ValueError(f"position {pos} is not within the last prefill call of sequence {seq} and its last "
                             f"{self.n_rs_seq} tokens")
        full = self.save_state_view(seq)
        if self._new_bytes is None:  # save_state goes through the kept buffer there: keep a copy of the state
            full = bytes(full)
        ok = llama_cpp.llama_memory_seq_rm(self.mem, seq, pos, -1)
        try:
            if ok:
                out = self.save_state(seq, partial=True)
        finally:
            self.load_state(seq, full)  # back to the end; the rollback index is reset (state_read)
        if not ok:
            raise EngineError(f"llama.cpp refused to roll sequence {seq} back to position {pos}")
        return out

    def save_state(self, seq: int, partial: bool = False) -> bytes:
        """The state of sequence `seq` as bytes (llama_state_seq_get_data_ext): KV + recurrent, or with `partial`
        the recurrent part only (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: a checkpoint, fixed size).

        llama.cpp writes straight into the bytes object that is returned (and that the RAM tier keeps as it is):
        one pass over the state. A bytearray copied into bytes by the RAM tier was two: 32 ms instead of 17 ms
        for a 19 MiB checkpoint of the 0.8b on a 2-core EPYC, at every stop of a prefill; most of the 17 is page
        faults of new memory, so a checkpoint goes into a spare written while idle when there is one (`spares`,
        `keep_spares`): 2 ms (bench/results/2026-12-01/issue12/). Size: for Qwen3.5-0.8B about 19 MiB of recurrent
        state plus about 12 KiB of KV per token held. Raises EngineError when llama.cpp writes nothing.
        """
        if self._new_bytes is None:  # not CPython: through the kept buffer, then one copy into bytes
            return bytes(self.save_state_view(seq, partial))
        flags = PARTIAL if partial else 0
        size = llama_cpp.llama_state_seq_get_size_ext(self.ctx, seq, flags)
        out = self.spares.take(size) or self._new_bytes(None, size)
        n = llama_cpp.llama_state_seq_get_data_ext(self.ctx, address(out), size, seq, flags)
        if n == 0:
            raise EngineError(f"llama_state_seq_get_data_ext wrote nothing for sequence {seq}")
        return out if n == size else out[:n]

    def keep_spares(self, count: int) -> int:
        """Keep up to `count` spare checkpoint buffers (buffers.SpareBuffers), written through by `fill_spare`
        while the server is idle; 0 drops them. Returns the bytes they will hold (0 on a model without a
        recurrent state, whose saves have no fixed size). Measures the size on sequence 0 and clears it: call it
        before serving."""
        self.spares.clear()
        self.clear(0)
        try:
            self.decode(0, [max(self.bos_id, 0)] * 2, 0, want_logits=False)
            size = self.state_size(0, partial=True) if self.state.checkpoint_bytes(self, 0) > 0 else 0
        finally:
            self.clear(0)
        self.spares = SpareBuffers(self._new_bytes, size, count)
        return self.spares.size * self.spares.target

    def drop_spares(self) -> None:
        """Keep no spare checkpoint buffers from now on (their memory goes back to the allocator)."""
        self.spares.clear()
        self.spares.target = 0

    def fill_spare(self) -> bool:
        """Write one more spare checkpoint buffer through (page faults now, not during a prefill: about 13 ms
        for 19 MiB); False when there are enough."""
        return self.spares.fill_one()

    def save_state_view(self, seq: int, partial: bool = False) -> memoryview:
        """The state of `seq` written into a buffer this engine keeps, as a read-only view that is valid until the
        next save_state_view or load_state on this engine: for callers that cut a state into parts or copy it
        into another sequence, which then pay for new memory once, for what they keep. Raises EngineError when
        llama.cpp writes nothing."""
        flags = PARTIAL if partial else 0
        size = llama_cpp.llama_state_seq_get_size_ext(self.ctx, seq, flags)
        if len(self._scratch) < size:
            self._scratch = bytearray(size)
        buf = (ctypes.c_uint8 * size).from_buffer(self._scratch)
        n = llama_cpp.llama_state_seq_get_data_ext(self.ctx, buf, size, seq, flags)
        del buf  # releases the export, so that the buffer can grow next time
        if n == 0:
            raise EngineError(f"llama_state_seq_get_data_ext wrote nothing for sequence {seq}")
        self._view = memoryview(self._scratch)[:n].toreadonly()
        return self._view

    def state_size(self, seq: int, partial: bool = False) -> int:
        """Bytes `save_state(seq, partial)` would write now (llama_state_seq_get_size_ext)."""
        return int(llama_cpp.llama_state_seq_get_size_ext(self.ctx, seq, PARTIAL if partial else 0))

    def load_state(self, seq: int, data: bytes | bytearray | memoryview | tuple, partial: bool = False, clear: bool = True) -> None:
        """Load a saved state into `seq` (llama_state_seq_set_data_ext), clearing the sequence first if `clear`.
        `data`: bytes, or a view `save_state_view` returned (both read where they are), or any other bytes-like
        object or a tuple of them (parts, loaded as their concatenation), which is copied into a buffer this
        engine keeps, growing to the largest state loaded so far (at most one slot's full state): llama.cpp reads
        one contiguous buffer, and one kept buffer spares the page faults of new memory (a 43 MiB state read
        back from the disk tier restored at 1.3 GiB/s joined into new memory, 2.6 GiB/s through the kept buffer;
        bench/results/2026-12-01/restore/). Raises EngineError (sequence cleared) when llama.cpp refuses it. How the parts
        of a state are combined is the state kind's business (`self.state.restore`)."""
        if clear:
            self.clear(seq)
        self._last_call.pop(seq, None)
        self._hidden.pop(seq, None)
        if isinstance(data, bytes):
            size, src = len(data), address(data)
        elif data is self._view and data.obj is self._scratch:  # the last view, whole: it starts the buffer
            size, src = data.nbytes, (ctypes.c_uint8 * data.nbytes).from_buffer(self._scratch)
        elif isinstance(data, memoryview) and any(data.obj is kept for kept in self._rewind):  # a rewind_point:
            size, src = data.nbytes, (ctypes.c_uint8 * data.nbytes).from_buffer(data.obj)  # it starts that buffer
        else:
            parts = data if isinstance(data, tuple) else (data,)
            # a part that lies in the kept buffer itself is copied out first: the join below overwrites it
            parts = tuple(bytes(p) if isinstance(p, memoryview) and p.obj is self._scratch else p for p in parts)
            size = sum(len(part) for part in parts)
            if len(self._scratch) < size:
                self._scratch = bytearray(size)
            view, at = memoryview(self._scratch), 0
            for part in parts:
                view[at:at + len(part)] = part
                at += len(part)
            view.release()
            src = (ctypes.c_uint8 * size).from_buffer(self._scratch)
        n = llama_cpp.llama_state_seq_set_data_ext(self.ctx, src, size, seq, PARTIAL if partial else 0)
        del src  # releases the scratch buffer's export, so that it can grow next time
        if n == 0:
            self.clear(seq)
            raise EngineError(f"llama.cpp rejected a {size}-byte state for sequence {seq}")

    def truncate(self, seq: int, n_tokens: int) -> None:
        """Keep the first `n_tokens` tokens of `seq` (llama_memory_seq_rm(seq, n_tokens, -1)). A recurrent state
        cannot be cut back, so on a hybrid memory this fails unless a checkpoint at n_tokens was loaded. Raises
        EngineError (sequence cleared) when the sequence does not end at n_tokens afterwards."""
        self._last_call.pop(seq, None)
        if self._hidden.get(seq, (n_tokens - 1,))[0] != n_tokens - 1:
            self._hidden.pop(seq, None)
        if not llama_cpp.llama_memory_seq_rm(self.mem, seq, n_tokens, -1) or self.pos_max(seq) != n_tokens - 1:
            self.clear(seq)
            raise EngineError(f"could not truncate sequence {seq} to {n_tokens} tokens after a restore")

    def pos_max(self, seq: int) -> int:
        """Last position held by `seq` (llama_memory_seq_pos_max), -1 when empty."""
        return int(llama_cpp.llama_memory_seq_pos_max(self.mem, seq))

    def close(self) -> None:
        """Free the batch, context and model."""
        if getattr(self, "_grammars", None) is not None:
            self._grammars.close()
        if getattr(self, "ctx", None):
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self.ctx)
            llama_cpp.llama_model_free(self.model)
            self.ctx = None
