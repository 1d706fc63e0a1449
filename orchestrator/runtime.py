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

    Covers the model file (size, modification time in ns, and hashes of its first and last MiB, where GGUF
    metadata and the last tensors live, and of 64 KiB at each of 64 evenly spaced offsets: about 6 MiB read),
    the llama-cpp-python / llama.cpp version, and the context parameters that shape the state layout: n_ctx,
    sequences, flash attention, and the split layout of saved states. The modification time makes a model file
    replaced in place (same path, size and ends) a different fingerprint; touching or copying the file without
    -p therefore also empties the disk tier, which costs only misses.
    """
    h = hashlib.blake2b(digest_size=32)
    st = model_path.stat()
    size = st.st_size
    with open(model_path, "rb") as f:
        h.update(f.read(MiB))
        for i in range(64):
            f.seek(size * i // 64)
            h.update(f.read(64 * 1024))
        f.seek(max(0, size - MiB))
        h.update(f.read(MiB))
    for part in (size, st.st_mtime_ns, llama_cpp.__version__, engine.n_ctx, engine.n_seq_max, engine.flash_attn,
                 engine.split_layout):
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
                        use_extra_bufts=cfg.use_extra_bufts)
        info = engine.info
        log.info("model %s: %s, arch %s, %.0f MiB, %d params, n_ctx %d, n_batch %d, %d threads",
                 path, info.name, info.architecture, info.size_bytes / MiB, info.n_params, engine.n_ctx,
                 engine.n_batch, engine.n_threads)
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
        cache = SnapshotCache(cfg.cache_ram_bytes if cfg.cache_enabled else 0, disk)
        if cfg.cache_enabled:
            log.info("snapshot cache: %d MiB of RAM, checkpoints every %d tokens inside long messages",
                     cfg.cache_ram_mib, cfg.checkpoint_interval)
        template = load_template(engine, cfg.chat_template)
        return cls(config=cfg, engine=engine, cache=cache, prompts=PromptBuilder(engine, template),
                   scheduler=Scheduler(engine, cache, cfg.checkpoint_interval), model_id=cfg.model_alias or path.stem)

    def close(self) -> None:
        self.scheduler.close()
        self.engine.close()
        if self.cache.disk is not None:
            self.cache.disk.close()
