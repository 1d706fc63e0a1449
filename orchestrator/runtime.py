"""Runtime: the engine, snapshot cache, prompt builder and scheduler built from one `Config`."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import llama_cpp

from .cache import SnapshotCache
from .disk import DiskTier
from .errors import OrchestratorError
from .config import MiB, Config
from .engine import Engine
from .prompt import PromptBuilder, load_template
from .scheduler import Scheduler

log = logging.getLogger("orchestrator")


def state_fingerprint(model_path: Path, engine: Engine) -> bytes:
    """32 bytes that change whenever a stored state could not be loaded into this engine as it is.

    Covers the model file (size, and hashes of its first and last MiB, where GGUF metadata and the last
    tensors live), the llama-cpp-python / llama.cpp version, and the context parameters that shape the state
    layout: n_ctx, sequences, flash attention, and the split layout of saved states.
    """
    h = hashlib.blake2b(digest_size=32)
    size = model_path.stat().st_size
    with open(model_path, "rb") as f:
        h.update(f.read(MiB))
        f.seek(max(0, size - MiB))
        h.update(f.read(MiB))
    for part in (size, llama_cpp.__version__, engine.n_ctx, engine.n_seq_max, engine.flash_attn, engine.split_layout):
        h.update(repr(part).encode())
    return h.digest()


def resolve_model(cfg: Config) -> Path:
    """The model path: --model, else the synthetic qwen3.5-0.8b preset built once into the user cache."""
    if cfg.model is not None:
        return Path(cfg.model)
    from .synth import ensure_model

    log.warning("no --model given: serving the SYNTHETIC qwen3.5-0.8b model; its weights are RANDOM, so its "
                "text is gibberish (compute cost and state sizes are real)")
    return ensure_model("qwen3.5-0.8b")


def decode_batching(engine: Engine, mode: str) -> bool:
    """Whether the slots' decode steps share one llama_decode call. "auto": only when the engine measures it
    bit-identical to decoding alone (Engine.check_batch_invariance); "on" trades that for throughput."""
    if engine.n_seq_max < 2 or mode == "off":
        return False
    invariant = engine.check_batch_invariance()
    if mode == "on":
        if not invariant:
            log.warning("--decode-batching on: batched decoding is NOT bit-identical to decoding alone on this "
                        "model; outputs may depend on concurrent requests")
        return True
    if invariant:
        log.info("decode steps of all slots are batched (measured bit-identical to decoding alone)")
    else:
        log.warning("batched decoding is not bit-identical to decoding alone on this model (weight types); slots "
                    "decode one at a time. --decode-batching on trades exactness for throughput")
    return invariant


@dataclass
class Runtime:
    config: Config
    engine: Engine
    cache: SnapshotCache
    prompts: PromptBuilder
    scheduler: Scheduler
    model_id: str

    @classmethod
    def start(cls, cfg: Config) -> "Runtime":
        """Load the model and start the worker. Raises ModelLoadError."""
        path = resolve_model(cfg)
        engine = Engine(path, n_ctx=cfg.ctx_size, n_batch=cfg.batch_size, n_threads=cfg.threads,
                        use_extra_bufts=cfg.use_extra_bufts, n_seq_max=cfg.parallel)
        info = engine.info
        log.info("model %s: %s, arch %s, %.0f MiB, %d params, n_ctx %d per slot, n_batch %d, %d threads",
                 path, info.name, info.architecture, info.size_bytes / MiB, info.n_params, engine.n_ctx,
                 engine.n_batch, engine.n_threads)
        rec, kv_token = engine.state_sizes()
        per_slot = rec + kv_token * engine.n_ctx
        log.info("%d slots; memory per slot %.1f MiB (recurrent state %.1f MiB + KV %.1f KiB/token x %d tokens), "
                 "%.0f MiB for all", cfg.parallel, per_slot / MiB, rec / MiB, kv_token / 1024, engine.n_ctx,
                 cfg.parallel * per_slot / MiB)
        batch_decode = decode_batching(engine, cfg.decode_batching)
        if "random" in info.name.lower():
            log.warning("model %r has RANDOM weights: output text is meaningless", info.name)
        disk = None
        if cfg.cache_enabled and cfg.cache_disk_dir is not None and cfg.cache_disk_mib > 0:
            try:
                disk = DiskTier(cfg.cache_disk_dir, cfg.cache_disk_mib * MiB, state_fingerprint(path, engine))
                log.info("snapshot disk tier: %s, %d MiB, %d entries found", cfg.cache_disk_dir,
                         cfg.cache_disk_mib, len(disk))
            except OrchestratorError as e:
                log.warning("snapshot disk tier unavailable, caching in RAM only: %s", e.message)
        cache = SnapshotCache(cfg.cache_ram_bytes if cfg.cache_enabled else 0, disk, truncatable=engine.truncatable)
        if cfg.cache_enabled:
            log.info("snapshot cache: %d MiB of RAM, checkpoints every %d tokens inside long messages",
                     cfg.cache_ram_mib, cfg.checkpoint_interval)
        template = load_template(engine, cfg.chat_template)
        return cls(config=cfg, engine=engine, cache=cache, prompts=PromptBuilder(engine, template),
                   scheduler=Scheduler(engine, cache, cfg.checkpoint_interval, n_slots=cfg.parallel,
                                       queue_size=cfg.queue_size, timeout_s=cfg.timeout,
                                       prefill_chunk=cfg.prefill_chunk, batch_decode=batch_decode),
                   model_id=cfg.model_alias or path.stem)

    def close(self) -> None:
        self.scheduler.close()
        self.engine.close()
        if self.cache.disk is not None:
            self.cache.disk.close()
