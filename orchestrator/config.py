"""All configuration in one dataclass, filled by the CLI (flags use llama-server's spelling)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import psutil

MiB = 1024 * 1024
# llama.cpp's KV cache types by their llama-server names (-ctk / -ctv): ggml_type values (ggml.h)
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30}


#: Environment variable naming the cache root: models, the compiled kernel gate (orchestrator/kernels.py)
CACHE_ENV_VAR = "ORCHESTRATOR_CACHE_DIR"


def cache_root() -> Path:
    """Where built files are kept between runs: ``$ORCHESTRATOR_CACHE_DIR`` if set, else
    ``user_cache_dir("orchestrator")`` (platformdirs)."""
    root = os.environ.get(CACHE_ENV_VAR)
    if root:
        return Path(root).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("orchestrator"))


def default_cache_ram_mib(available: int | None = None) -> int:
    """Default RAM budget for snapshots, in MiB: a quarter of `available` bytes (default: the memory available now,
    psutil), at most 8 GiB.

    A quarter leaves room for the model weights, the context's own KV/recurrent buffers and the OS; the context is
    then fitted beside it (orchestrator/sizing.py), and bounded by what it holds of one slot.
    """
    if available is None:
        available = psutil.virtual_memory().available
    return int(min(available // 4, 8 * 1024 * MiB) // MiB)


@dataclass
class Config:
    """Server, engine and cache settings.

    Units: sizes in tokens unless the name says MiB; times in seconds.
    """

    model: Path | None = None  # GGUF path; None = the synthetic qwen3.5-0.8b preset (random weights)
    host: str = "127.0.0.1"
    port: int = 8080
    # n_ctx per slot, tokens (the llama.cpp context holds parallel * ctx_size); None: the model's training context,
    # reduced to what the slots' memory fits (orchestrator/sizing.py)
    ctx_size: int | None = None
    batch_size: int = 512  # n_batch: the most tokens one llama_decode call takes (prefill is chunked to it)
    threads: int = field(default_factory=lambda: max(1, psutil.cpu_count(logical=False) or 1))
    cache_ram_mib: int = field(default_factory=default_cache_ram_mib)  # snapshot LRU budget, MiB
    checkpoint_interval: int = 512  # tokens between recurrent checkpoints inside long messages (0 = off)
    snapshot_min_gap: int = 256  # tokens: message ends closer than that to another snapshot position are not stops
    # Recurrent-state snapshots per slot kept by llama.cpp for rollback (n_rs_seq): a prompt's last stop, where within
    # n_rs_seq of its end, is taken back after the final prefill call instead of being a call of its own, when
    # n_rs_seq >= min_segment and checked exact at start (calibration.check_rollback). Each costs one recurrent state per slot
    # (19 MiB on the 0.8b); 0 = off, the default: with 8 a 507-token prefill call of the 0.8b took 1.15x (0.94-1.32)
    # the time of one without, on a loaded 2-core EPYC (bench/results/2026-12-01/stops), more than the stop saved.
    rs_snapshots: int = 0
    spare_checkpoints: int = 8  # checkpoint buffers faulted in while idle, out of cache_ram_mib (at most 1/8 of it)
    # RAM tier eviction (orchestrator/cache/policy.py POLICIES): "recency-value" (recency with a bonus for tokens
    # saved per byte and sharing), "lru", or "value" (mid-stretch checkpoints first; bench/results/2026-12-03/trace)
    cache_policy: str = "recency-value"
    cache_disk_dir: Path | None = None  # disk tier directory; None = no disk tier
    cache_disk_mib: int = 4096  # disk tier budget, MiB
    # The remote tier shared with other replicas: redis://[user:password@]host:port/db, rediss:// for TLS, or
    # unix:///path.sock; None = none. It holds user data (orchestrator/cache/remote.py, docs/scale-out.md).
    cache_remote: str | None = None
    cache_remote_queue_mib: int = 256  # remote tier write-behind queue, MiB (entries beyond it are dropped, counted)
    cache_remote_timeout: float = 2.0  # seconds one Redis socket operation may take before the tier counts as down
    replica_name: str | None = None  # named in every response's x-orchestrator-replica; None: "<hostname>:<port>"
    cache_enabled: bool = True  # False: every request is prefilled cold (the correctness oracle)
    model_alias: str | None = None  # id reported by /v1/models; default: the model file's stem
    chat_template: Path | None = None  # override the template stored in the GGUF
    # completion budget when a request gives none; None: until the context is full (at most max_tokens_limit)
    max_tokens_default: int | None = None
    # llama.cpp CPU weight repacking ("extra buffer types"): "on", "off", or "auto": measured per model and CPU at
    # start in a child process, kept where exact and faster (orchestrator/repacking.py); Runtime.start resolves it
    use_extra_bufts: str = "auto"
    # Offload (orchestrator/devices.py). Layers on the GPU/iGPU devices; -1: all of them, which is none on a
    # CPU-only build (llama-server's default, without its --fit memory fitting).
    n_gpu_layers: int = -1
    devices: tuple[str, ...] | None = None  # ggml device names to offload to; ("none",): none; None: llama.cpp's choice
    main_gpu: int | None = None  # only this index of those devices (llama-server's -sm none -mg N); None: all
    kv_offload: bool = True  # KV cache and attention on the device of their layer (False: --no-kv-offload)
    parallel: int = 4  # slots: requests served at once (sequences of one llama.cpp context)
    # True (serve without -np): with ctx_size None, start may use fewer slots than `parallel` so that each holds an
    # agent's session (orchestrator/sizing.py AGENT_CTX); False: exactly `parallel`
    parallel_auto: bool = False
    queue_size: int = 64  # requests waiting for a slot before new ones get HTTP 429
    timeout: float = 600.0  # seconds a request may take from arrival to its last token (0 = no limit)
    prefill_chunk: int = 128  # most prompt tokens per prefill step (between two decode steps of other slots)
    prefill_chunk_alone: int = 0  # most prompt tokens per step when no other request waits or decodes (0: n_batch)
    decode_batching: str = "auto"  # "auto": batch slots' decode steps when bit-identical to alone; "on"; "off"
    # Speculative decoding (orchestrator/speculative/): "auto" = n-gram drafts verified only in widths that
    # calibration measured bit-identical to one-token decoding on this model, CPU and attention layout (K-quant
    # models in engine.VERIFYING: 2..7, 2..16 with reference decode kernels; none found: off, logged), each
    # request's width weighed by its acceptance and the measured cost of a verification (speculative/policy.py);
    # "ngram" = also where none were measured exact, at widths up to draft_max + 1 (outputs may then differ
    # from "off", as --decode-batching on); "mtp" = the model's MTP head drafts (a GGUF with nextn layers: loaded
    # with them, speculative/mtp.py), verified in the exact widths only, as "auto"; "draft" = drafts from
    # `model_draft` (speculative/draft.py), exact widths only ("auto" with a model_draft does the same); "off".
    speculative: str = "auto"
    model_draft: Path | None = None  # a smaller GGUF with the model's vocabulary that drafts (--model-draft)
    draft_window: int = 4096  # most prompt tokens the draft model reads of a request (its context: twice that)
    # most drafted tokens per verification (the ubatch is draft_max + 1 wide); calibration measures the exact widths
    # up to draft_max + 1 (2..7 with ggml-cpu's default kernels, 2..16 and then 20, 24, 28, 32 with reference ones:
    # decode_kernels, calibration.verify_candidates). 31 over 15: Gemma 3 270M decoded its agent-shaped answers
    # 1.07-1.15x faster (bench/results/2026-12-07/wide-verification), and the first start measures 64 s against 50 s
    # on the qwen3.5-0.8b preset
    draft_max: int = 31
    # Flash attention ("on", "off", "auto") and the K / V cache types ("f16", "q8_0", ... engine.KV_TYPES, or
    # "auto"), llama-server's -fa / -ctk / -ctv. All three "auto": flash attention off over F16, whose prefill
    # splits are exact (Runtime._attention). Any of them set: that layout, the rest at those defaults; -ctk q8_0
    # alone is engine.VERIFYING, where verification is exact at one row per decode step but prefill is 3x slower
    # at 12k tokens of context (bench/results/2026-12-04/layouts/).
    flash_attn: str = "auto"
    cache_type_k: str = "auto"
    cache_type_v: str = "auto"
    # Rows per one-token decode step (Engine decode_rows): 1, or 2 (the token and a copy that is rolled back), which
    # takes the same attention kernels as a verification ubatch, so that verification widths 2..7 (K-quant) are
    # exact by construction and --speculative auto turns on (bench/results/2026-12-03/verification-widths).
    # Answers differ from 1 (both equal their cold runs); each step computes a second row.
    decode_rows: int = 1
    # ggml-cpu kernels of decode steps and verifications (engine.Attention.kernels, orchestrator/kernels.py):
    # "reference" = ggml-cpu's reference kernels, the one-row kernels at every width, so verifications wider than
    # 7 tokens and batched decode steps of 8+ slots are exact, while prefill keeps the tiled ones; "auto" = that
    # in a layout where verification can be exact (flash attention over a quantized K cache: -ctk q8_0) where this
    # llama-cpp-python build can switch kernels; "default" = llama.cpp's choice everywhere. Answers differ between
    # the two (both equal their cold runs).
    decode_kernels: str = "auto"
    calibration_file: Path | None = None  # where measured kernel facts are kept across restarts; None: re-measure
    api_key: str | None = None  # Bearer key required on every endpoint but /health; None = no authentication
    # The operator's key (administration: flush, /metrics, /v1/cache/stats, /health's full view); None: api_key
    admin_key: str | None = None
    max_body_mib: int = 16  # largest request body accepted, MiB (413 above)
    max_messages: int = 4096  # most messages in one chat request (400 above)
    # most completion tokens one request generates: a request asking for more is served up to it (and to what its
    # context holds) and ends with the route's length reason, as llama-server does, never refused
    max_tokens_limit: int = 32768
    # A prompt's text is checked before it is rendered and tokenized (400 above): bytes of all its strings
    # (messages, tools, system) together, and parts (content blocks, cache breakpoints, tool calls).
    max_prompt_kib: int = 2048
    max_prompt_parts: int = 20000
    # Structured output (orchestrator/output/grammar.py, orchestrator/grammar_guard.py): seconds llama.cpp may take
    # to build a grammar or filter the vocabulary for one token, and the schema converter to build it (400 above);
    # schema values in one request; MiB the grammar process may allocate.
    grammar_budget: float = 5.0
    grammar_max_schema: int = 20000
    grammar_memory_mib: int = 1024
    # Tokenize control-token text in caller strings as control tokens (llama-server's behaviour; unsafe, see
    # orchestrator/prompt/control.py). Off: only the chat template's own markup becomes control tokens.
    parse_special_in_content: bool = False

    @property
    def replica(self) -> str:
        """This server's name among replicas (x-orchestrator-replica): --replica-name, else hostname:port."""
        return self.replica_name or f"{socket.gethostname()}:{self.port}"

    @property
    def drafts(self) -> str:
        """Where speculative drafts come from: "mtp" (--speculative mtp), "draft" (--speculative draft, or auto
        with --model-draft) or "ngram"."""
        if self.speculative in ("mtp", "draft"):
            return self.speculative
        return "draft" if self.speculative == "auto" and self.model_draft is not None else "ngram"

    @property
    def extra_bufts(self) -> bool:
        """use_extra_bufts as llama.cpp takes it. Raises ValueError while it is "auto" (Runtime.start resolves that
        before any model loads)."""
        if self.use_extra_bufts not in ("on", "off"):
            raise ValueError(f"use_extra_bufts {self.use_extra_bufts!r} is not resolved to on or off")
        return self.use_extra_bufts == "on"

    @property
    def cache_ram_bytes(self) -> int:
        return self.cache_ram_mib * MiB

    @property
    def max_body_bytes(self) -> int:
        return self.max_body_mib * MiB

    @property
    def max_prompt_bytes(self) -> int:
        return self.max_prompt_kib * 1024

    @property
    def operator_key(self) -> str | None:
        """The key of the administration routes: --admin-key, else --api-key (None: no key at all)."""
        return self.admin_key or self.api_key

    @property
    def max_choices(self) -> int:
        """Most choices (`n`) one request may ask for: each takes a slot, and one slot is always left to other
        requests (one request cannot hold every slot while others wait)."""
        return max(1, self.parallel - 1)

    @property
    def max_rendered_chars(self) -> int:
        """Most characters one render of the chat template may produce: twice the prompt budget (the template's
        markup and the tools' JSON add to the caller's text; a template that repeats it is stopped there)."""
        return 2 * self.max_prompt_bytes
