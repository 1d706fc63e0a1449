"""Runtime: the engine, snapshot cache, prompt builder and scheduler built from one `Config`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from .cache import SnapshotCache
from .config import MiB, Config
from .engine import Engine
from .prompt import PromptBuilder, load_template
from .scheduler import Scheduler

log = logging.getLogger("orchestrator")


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
        cache = SnapshotCache(cfg.cache_ram_bytes if cfg.cache_enabled else 0)
        log.info("snapshot cache: %d MiB of RAM%s", cfg.cache_ram_mib, "" if cfg.cache_enabled else " (disabled)")
        template = load_template(engine, cfg.chat_template)
        return cls(config=cfg, engine=engine, cache=cache, prompts=PromptBuilder(engine, template),
                   scheduler=Scheduler(engine, cache, cfg.checkpoint_interval), model_id=cfg.model_alias or path.stem)

    def close(self) -> None:
        self.scheduler.close()
        self.engine.close()
