"""Runtime: the engine, snapshot cache, prompt builder and scheduler built from one `Config`."""

from __future__ import annotations

import hashlib
import json
import logging
import platform
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
from .tiers import RamTier, Tier

log = logging.getLogger("orchestrator")


def model_file_digest(model_path: Path) -> bytes:
    """32 bytes identifying the model file as it is now: its size, modification time in ns, and hashes of its first
    and last MiB (where GGUF metadata and the last tensors live) and of 64 KiB at each of 64 evenly spaced
    offsets: about 6 MiB read. The modification time makes a model file replaced in place (same path, size and
    ends) a different file; touching or copying it without -p counts as a change too."""
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
    h.update(repr((size, st.st_mtime_ns)).encode())
    return h.digest()


def state_fingerprint(model_path: Path, engine: Engine, file_digest: bytes | None = None) -> bytes:
    """32 bytes that change whenever a stored state could not be loaded into this engine as it is.

    Covers the model file (`model_file_digest`, computed here unless given), the llama-cpp-python / llama.cpp
    version, and the context parameters that shape the state layout: n_ctx, sequences, flash attention, and the
    layout of saved entries (`StateKind.layout`). A changed model file (even touched, or copied without -p) therefore empties
    the disk tier, which costs only misses.
    """
    h = hashlib.blake2b(digest_size=32)
    h.update(file_digest if file_digest is not None else model_file_digest(model_path))
    for part in (llama_cpp.__version__, engine.n_ctx, engine.n_seq_max, engine.flash_attn, engine.state.layout):
        h.update(repr(part).encode())
    return h.digest()


class Calibration:
    """The measured `Engine.min_segment` of a model on this machine, kept in a small JSON file so that a restart
    does not measure again. Keyed by the model file (`model_file_digest`), the llama-cpp-python version,
    the CPU's instruction-set flags (/proc/cpuinfo, where ggml-cpu's kernel choice comes from), n_batch and
    weight repacking. No file (None) or an unreadable one: measure every time."""

    def __init__(self, file: Path | None, file_digest: bytes, n_batch: int, extra_bufts: bool) -> None:
        self.file = file
        h = hashlib.blake2b(digest_size=16)
        h.update(file_digest)
        cpu = ""
        try:
            cpu = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                        if ln.startswith(("flags", "Features"))), "")
        except OSError:
            self.file = None  # no way to tell this CPU from another: do not trust a stored value
        for part in (llama_cpp.__version__, platform.machine(), cpu, n_batch, extra_bufts):
            h.update(repr(part).encode())
        self.key = h.hexdigest()

    def _read(self) -> dict:
        try:
            return json.loads(self.file.read_text()) if self.file and self.file.is_file() else {}
        except (OSError, ValueError):
            return {}

    def get(self) -> int | None:
        value = self._read().get(self.key)
        return value if isinstance(value, int) and value >= 2 else None

    def put(self, min_segment: int) -> None:
        if self.file is None:
            return
        data = self._read()
        data[self.key] = min_segment
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.file.with_suffix(".tmp")
            tmp.write_text(json.dumps(data))
            tmp.replace(self.file)
        except OSError as e:
            log.warning("could not save the calibration to %s: %s", self.file, e)


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
        file_digest = model_file_digest(path)  # read once: the calibration key and the disk tier's fingerprint
        calibration = Calibration(cfg.calibration_file, file_digest, cfg.batch_size, cfg.use_extra_bufts)
        engine = Engine(path, n_ctx=cfg.ctx_size, n_batch=cfg.batch_size, n_threads=cfg.threads,
                        use_extra_bufts=cfg.use_extra_bufts, n_seq_max=cfg.parallel, min_segment=calibration.get())
        calibration.put(engine.min_segment)
        log.info("prefill ubatches of %d tokens or more are bit-identical to larger ones on this model and CPU "
                 "(min_segment)", engine.min_segment)
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
        tiers: list[Tier] = [RamTier(cfg.cache_ram_bytes if cfg.cache_enabled else 0)]
        if cfg.cache_enabled and cfg.cache_disk_dir is not None and cfg.cache_disk_mib > 0:
            try:
                disk = DiskTier(cfg.cache_disk_dir, cfg.cache_disk_mib * MiB, state_fingerprint(path, engine, file_digest))
                log.info("snapshot disk tier: %s, %d MiB, %d entries found", cfg.cache_disk_dir,
                         cfg.cache_disk_mib, len(disk))
                tiers.append(disk)
            except OrchestratorError as e:
                log.warning("snapshot disk tier unavailable, caching in RAM only: %s", e.message)
        cache = SnapshotCache(tiers, state=engine.state)
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
        self.cache.close()
