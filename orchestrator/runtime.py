"""Runtime: the engine, snapshot cache, prompt builder and scheduler built from one `Config`, calibrated on
this machine at start (calibration.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import psutil

from . import calibration, kernels, repacking, sizing
from .cache.policy import POLICIES
from .cache.snapshots import CacheStats, SnapshotCache
from .cache.disk import DiskTier
from .cache.remote import RemoteTier, redacted
from .devices import Offload, select_devices
from .engine import Attention, Engine, ModelInfo
from .engine_thread import EngineThread
from .errors import ModelLoadError, OrchestratorError
from .config import MiB, Config
from .grammar_guard import GrammarLimits, GrammarPool
from .output import grammar
from .output.grammar import Constraint, Structure
from .prompt.builder import PromptBuilder, load_template
from .request import Job, Sink
from .reuse import AfterGenerationStats
from .scheduler import Scheduler
from .speculative.draft import DraftModel, check_vocab
from .state import HEADER
from .cache.tiers import RamTier, Tier

log = logging.getLogger("orchestrator")


def model_file_digest(model_path: Path, with_mtime: bool = True) -> bytes:
    """32 bytes identifying the model file as it is now: its size, modification time in ns, and hashes of its first
    and last MiB (where GGUF metadata and the last tensors live) and of 64 KiB at each of 64 evenly spaced
    offsets: about 6 MiB read. The modification time makes a model file replaced in place (same path, size and
    ends) a different file; touching or copying it without -p counts as a change too.

    with_mtime=False: the content only, so that copies of one file on several hosts match (the remote tier's
    fingerprint: replicas share snapshots when their model files are byte-identical)."""
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
    h.update(repr((size, st.st_mtime_ns) if with_mtime else (size,)).encode())
    return h.digest()


def state_fingerprint(model_path: Path, engine: Engine, file_digest: bytes | None = None) -> bytes:
    """32 bytes that change whenever a stored state could not be loaded into this engine as it is.

    Covers the model file (`model_file_digest`, computed here unless given), the llama-cpp-python / llama.cpp
    version, and the context parameters that shape the state layout: n_ctx, sequences, flash attention and the KV
    cache types (`Engine.attention`), the layout of saved entries (`StateKind.layout`), CPU weight repacking
    (`use_extra_bufts`: other matmul kernels, so other numerics), and the prefill chunk rule (min_segment, odd
    ubatches: a state prefilled in ubatches a newer measurement forbids is not what a cold prefill computes). A
    changed model file (even touched, or copied without -p) therefore empties the disk tier, which costs only
    misses.

    It also covers where the state was computed (`devices.Offload.key`: backend and device, layer split, KV
    placement, the CPU's kernel features): llama.cpp's state bytes do not depend on the device, so a state
    computed on one loads under another, but continuing from it there is not what a cold prefill there computes
    (bench/results/2026-12-01/vulkan/README.md), so it is not portable across layouts.
    """
    h = hashlib.blake2b(digest_size=32)
    h.update(file_digest if file_digest is not None else model_file_digest(model_path))
    for part in (llama_cpp.__version__, engine.n_ctx, engine.n_seq_max, engine.attention.key(), engine.state.layout,
                 engine.offload.key(), engine.use_extra_bufts, engine.min_segment, engine.odd_ubatches):
        h.update(repr(part).encode())
    return h.digest()


def _engine(cfg: Config, path: Path, attention: Attention, **kw) -> Engine:
    """An Engine of `path` with the configuration's threads, batch, repacking and offload, `attention`, and `kw`
    (n_ctx, n_seq_max, n_rs_seq, ...). Raises ModelLoadError."""
    kw.setdefault("n_batch", cfg.batch_size)
    return Engine(path, n_threads=cfg.threads, use_extra_bufts=cfg.extra_bufts, n_gpu_layers=cfg.n_gpu_layers,
                  devices=cfg.devices, main_gpu=cfg.main_gpu, kv_offload=cfg.kv_offload, attention=attention, **kw)


def _draft_context(cfg: Config) -> tuple[int, int]:
    """(context per slot, margin) of the draft model's Engine: twice --draft-window plus room for the drafts."""
    margin = max(64, 2 * (cfg.draft_max + 1))
    return 2 * cfg.draft_window + 2 * margin, margin


def _draft_footprint(cfg: Config) -> tuple[int, int]:
    """What --model-draft keeps resident, as (bytes once, bytes per slot): its weights, its compute buffer
    (sizing.compute_sizes at its context) and its rollback buffer; per slot the KV of its context
    (`_draft_context`), its recurrent state and the copy kept at each prompt's end (speculative.draft.DraftModel).
    From a probe of the draft model in a small context. Raises ModelLoadError (a missing or unreadable file)."""
    info, recurrent, kv_token, floor, per_token = _probe_sizes(cfg, Path(cfg.model_draft), Attention())
    n_ctx, _ = _draft_context(cfg)
    return info.size_bytes + floor + n_ctx * per_token + recurrent, 2 * recurrent + n_ctx * kv_token


def _probe_sizes(cfg: Config, path: Path, attention: Attention) -> tuple[ModelInfo, int, int, int, int]:
    """(info, recurrent state bytes per sequence, KV bytes per token, compute buffer floor bytes and bytes per
    context token: sizing.compute_sizes at --batch-size) of the model at `path`, from a probe in a small context."""
    probe = _engine(cfg, path, attention, n_ctx=256, n_batch=min(cfg.batch_size, 256))
    try:
        recurrent, kv_token = calibration.state_sizes(probe)
        info = probe.info
        n_head = int(probe.meta(f"{info.architecture}.attention.head_count") or 0)
    finally:
        probe.close()
    return (info, recurrent, kv_token) + sizing.compute_sizes(cfg.batch_size, info.n_vocab, n_head)


def _draft_model(cfg: Config, target: Engine) -> DraftModel:
    """The draft model of --model-draft for `target`: its own Engine (threads, offload and batch as the model's;
    flash attention off over F16, since its numerics never reach an answer), one sequence per slot, a context
    of `_draft_context`. Raises ModelLoadError (a missing file, another vocabulary)."""
    n_ctx, margin = _draft_context(cfg)
    engine = _engine(cfg, Path(cfg.model_draft), Attention(), n_ctx=n_ctx, n_seq_max=target.n_seq_max)
    try:
        check_vocab(target, engine)
    except ModelLoadError:
        engine.close()
        raise
    log.info("draft model %s: %s, %.0f MiB, %d params; it reads the last %d prompt tokens of a request",
             cfg.model_draft, engine.info.name, engine.info.size_bytes / MiB, engine.info.n_params,
             cfg.draft_window)
    return DraftModel(engine, cfg.draft_window, target.n_vocab, margin)


def resolve_model(cfg: Config) -> Path:
    """The model path: --model, else the synthetic qwen3.5-0.8b preset built once into the user cache."""
    if cfg.model is not None:
        return Path(cfg.model)
    from .models.synth import ensure_model

    log.warning("no --model given: serving the SYNTHETIC qwen3.5-0.8b model; its weights are RANDOM, so its "
                "text is gibberish (compute cost and state sizes are real)")
    return ensure_model("qwen3.5-0.8b")


@dataclass
class Runtime:
    """The parts of a started server. `server/` uses the query methods below, never the parts themselves."""

    config: Config
    engine: Engine
    cache: SnapshotCache
    prompts: PromptBuilder
    scheduler: Scheduler
    model_id: str

    @classmethod
    def start(cls, cfg: Config) -> "Runtime":
        """Load the model and start the worker. Raises ModelLoadError.

        The model is found (or synthesized) here; it is loaded and calibrated on the thread that then runs the
        scheduler's worker loop, so that one thread makes every llama_decode call (engine_thread.EngineThread)."""
        if cfg.drafts == "draft" and (cfg.model_draft is None or not Path(cfg.model_draft).is_file()):
            raise ModelLoadError(f"--speculative draft needs --model-draft, a GGUF with the model's vocabulary "
                                 f"(got {cfg.model_draft or 'none'})")
        path = resolve_model(cfg)
        file_digest = model_file_digest(path)  # read once: the calibration key and the disk tier's fingerprint
        cfg = cls._repacking(cfg, path, file_digest)
        driver = EngineThread()
        try:
            return driver.run(cls._start, cfg, path, file_digest, driver)
        except BaseException:
            driver.shutdown()
            raise

    @staticmethod
    def _repacking(cfg: Config, path: Path, file_digest: bytes) -> Config:
        """cfg with use_extra_bufts resolved to "on" or "off" and the choice logged. "auto" follows
        repacking.py: measured once per model, CPU and slot count in a child process, and kept in the
        calibration file."""
        if cfg.use_extra_bufts != "auto":
            return cfg
        slots = cfg.parallel if cfg.decode_batching != "off" else 1
        if select_devices(cfg.devices, cfg.main_gpu) and cfg.n_gpu_layers != 0:
            choice = repacking.Choice(False, "layers are offloaded to a device")
        elif repacking.amx(calibration.cpu_flags() or ""):
            choice = repacking.Choice(False, "this CPU has AMX, where repacked Q4_K_M crashes in llama-cpp-python "
                                             "0.3.36 (docs/operations.md)")
        else:
            file = calibration.CalibrationFile(cfg.calibration_file, file_digest + b"repacking/%d" % slots,
                                               cfg.batch_size, None, Offload.cpu())
            choice = repacking.Choice.from_json(file.get_value(":repacking"))
            if choice is None:
                log.info("measuring llama.cpp CPU weight repacking on this model and CPU in a child process (first "
                         "start; kept in %s)", file.file or "memory only: --calibration-file keeps it")
                started = time.perf_counter()
                choice = repacking.probe(path, cfg.threads, cfg.batch_size, slots)
                log.info("measured CPU weight repacking in %.1f s: %s", time.perf_counter() - started,
                         choice.describe())
                if choice.kept:
                    file.put(choice.to_json(), ":repacking")
        log.info("CPU weight repacking %s (--use-extra-bufts auto): %s", "on" if choice.use_extra_bufts else "off",
                 choice.reason)
        return dataclasses.replace(cfg, use_extra_bufts="on" if choice.use_extra_bufts else "off")

    @staticmethod
    def _fit_context(cfg: Config, path: Path, n_rs: int, attention: Attention, draft: tuple[int, int] = (0, 0),
                     rewind: bool = False) -> sizing.ContextFit:
        """The context per slot when --ctx-size is not given, and the slot count when --parallel is not either
        (orchestrator/sizing.py), from a probe of the model in a small context: its training context, KV bytes per
        token, recurrent state, vocabulary and attention heads (the compute buffer). A slot's recurrent bytes are
        its state, its `n_rs` snapshots and, with `rewind` (speculation verifies), the checkpoint
        Engine.rewind_point keeps for it (one per slot verified in one call: Speculation.step_group). `draft`: a
        draft model's (bytes once, bytes per slot) (`_draft_footprint`), counted with the weights and each slot's
        state. Logs the arithmetic."""
        info, recurrent, kv_token, floor, per_token = _probe_sizes(cfg, path, attention)
        fit = sizing.fit_context(info.n_ctx_train, kv_token, recurrent * (1 + n_rs + rewind) + draft[1], cfg.parallel,
                                 psutil.virtual_memory().available, info.size_bytes + draft[0],
                                 cfg.cache_ram_bytes if cfg.cache_enabled else 0, per_token, floor, cfg.parallel_auto,
                                 recurrent)
        (log.info if fit.fits else log.warning)("%s", fit.describe())
        return fit

    @staticmethod
    def _attention(cfg: Config) -> tuple[Attention, ...]:
        """The attention layouts to try, best first (Config.flash_attn, cache_type_k, cache_type_v): all three
        "auto", flash attention off over F16, whose prefill splits are exact; any of them set, that one layout
        (flash attention "auto" is then on when a cache type is not F16/F32, so `-ctk q8_0` alone is
        engine.VERIFYING, where speculative verification is exact at one row per decode step). VERIFYING is not
        the default: its row-wise flash attention makes prefill 1.6-3.3x slower at agent-length contexts (4k-12k
        tokens) and decoding slower too (bench/results/2026-12-04/layouts/). Its decode steps and verifications run
        ggml-cpu's reference kernels where --decode-kernels asks, or with auto where flash attention is on and this
        build can switch them (kernels.py): row-wise attention (`Attention.exact_rows`), and `-fa on` over F16,
        whose one-token steps otherwise take a split-KV path that verifications never take; there the reference
        steps made widths 2..16 exact on the 0.8b and decoded 1.18x faster than the default kernels at 12k
        tokens of context, both about half as fast as flash attention off (bench/results/2026-12-07/flash-f16).
        auto takes them in the default layout too where their matmuls run row by row (kernels.reference_matmuls:
        ggml-cpu built without llamafile's tinyBLAS, or, in llama-cpp-python's default build, tinyBLAS gated off
        for reference paths by native/tinyblas_gate.c, prefill keeping it): there every width 2..32 measured exact
        (bench/results/2026-12-07/no-llamafile, bench/results/2026-12-07/tinyblas-gate).
        Raises ModelLoadError for a layout llama.cpp refuses, or a --decode-kernels value it cannot serve."""
        try:
            if (cfg.flash_attn, cfg.cache_type_k, cfg.cache_type_v) != ("auto", "auto", "auto"):
                k, v = (("f16" if t == "auto" else t) for t in (cfg.cache_type_k, cfg.cache_type_v))
                flash = cfg.flash_attn == "on" or (cfg.flash_attn == "auto" and {k, v} - {"f16", "f32"} != set())
                layout = Attention(flash, k, v)
            else:
                layout = Attention()
            kind = cfg.decode_kernels
            if kind == "auto":  # flash attention, or flash attention off where reference matmuls skip tinyBLAS
                exact = layout.flash or kernels.reference_matmuls() != "tinyBLAS"
                kind = "reference" if exact and kernels.unavailable() is None else "default"
            return (dataclasses.replace(layout, kernels=kind),)
        except ValueError as e:
            raise ModelLoadError(str(e)) from e

    @classmethod
    def _verify_widths(cls, cfg: Config, path: Path, file_digest: bytes
                       ) -> tuple[Attention, tuple[int, ...], dict[int, float]]:
        """The attention layout to serve with and the speculative verification widths to use in it
        (calibration.speculation_widths). The layout is the first of `_attention` where some width was measured
        exact, else the last; it does not depend on --speculative, so that speculation on and off answer alike.
        Widths are measured on a probe context of one sequence (the same model, threads and kernels; the
        recurrent rollback is a reloaded checkpoint, Engine.rewind, so no n_rs_seq snapshots), and kept in the
        calibration file beside min_segment (widths up to draft_max + 1), as are what verifications of the widths
        used and a rollback cost in decode steps (calibration.measure_verify_costs: the width policy's start)."""
        layouts = cls._attention(cfg)
        if cfg.speculative == "off" and len(layouts) == 1:
            return layouts[0], (), {}
        for attention in layouts:
            started = time.perf_counter()
            probe = _engine(cfg, path, attention, n_ctx=1024, n_seq_max=1, n_rs_seq=cfg.decode_rows - 1,
                            decode_rows=cfg.decode_rows)
            try:
                file = calibration.CalibrationFile(  # "replay": rollbacks replay with the last row's logits only
                    cfg.calibration_file, file_digest + b"%d/%d/%s/replay" % (cfg.draft_max, cfg.decode_rows,
                                                                             attention.key().encode()),
                    cfg.batch_size, cfg.extra_bufts, probe.offload)
                measured = file.get_widths()
                if measured is None:
                    log.info("measuring which speculative verification widths (2..%d) are bit-identical to one-token "
                             "decoding (%s; first start of this model, layout and CPU: where every width is exact, "
                             "about 1,300 decode steps' worth at --draft-max 31, 64 s on the 0.8b on 2 cores; kept in %s)",
                             cfg.draft_max + 1, attention.describe(), file.file or "memory only")
                    measured = calibration.measure_verify_widths(probe, cfg.draft_max + 1)
                    file.put_widths(measured)
                    log.info("measured the exact speculative verification widths (%s) in %.1f s: %s",
                             attention.describe(), time.perf_counter() - started,
                             ", ".join(map(str, measured)) or "none")
                widths = calibration.speculation_widths(measured, cfg.speculative, cfg.draft_max, cfg.drafts) \
                    if measured or attention == layouts[-1] else ()
                costs = cls._verify_costs(file, probe, widths)
            finally:
                probe.close()
            if measured:
                break
        return attention, widths, costs

    @staticmethod
    def _verify_costs(file: calibration.CalibrationFile, probe: Engine, widths: tuple[int, ...]) -> dict[int, float]:
        """What verifying each of `widths` and a rollback cost in decode steps on `probe`
        (calibration.measure_verify_costs), read from the calibration file or measured once and kept there."""
        costs = file.get_costs() if widths else {}
        if widths and (costs is None or not set(widths) <= set(costs)):
            started = time.perf_counter()
            costs = calibration.measure_verify_costs(probe, widths)
            file.put_costs(costs)
            log.info("measured what verifying costs in decode steps in %.1f s: %s; a rollback %.2f",
                     time.perf_counter() - started,
                     ", ".join(f"{w} tokens {costs[w]:.2f}" for w in widths if w in costs), costs.get(0, float("nan")))
        return costs or {}

    @staticmethod
    def _verify_together(cfg: Config, file: calibration.CalibrationFile, engine: Engine, widths: tuple[int, ...],
                         batch_widths: tuple[int, ...]) -> bool:
        """Whether slots that decode in one llama_decode call verify their drafts in it (Speculation.step_group):
        one-row decode steps, batched decoding on, and calibration.check_batched_verification
        exact at the widest width over every slot of the served engine (measured once per slot count, kept in the
        calibration file)."""
        if not widths or not batch_widths or cfg.decode_rows != 1:
            return False
        key = ":verify_together:%d:%d" % (widths[-1], engine.n_seq_max)  # the check runs every slot
        together = file.get_value(key)
        if not isinstance(together, bool):
            started = time.perf_counter()
            together = calibration.check_batched_verification(engine, widths[-1])
            file.put(together, key)
            log.info("checked verifications of several slots in one call against each alone in %.1f s: %s",
                     time.perf_counter() - started, "bit-identical" if together else "not shown bit-identical")
        if not together:
            log.info("slots that decode together do not verify drafts (a slot decoding alone does): verifying "
                     "several in one call was not shown bit-identical to each alone on this model and CPU")
        return together

    @classmethod
    def _start(cls, cfg: Config, path: Path, file_digest: bytes, driver: EngineThread) -> "Runtime":
        attention, widths, verify_costs = cls._verify_widths(cfg, path, file_digest)
        log.info("%s%s", attention.describe(), " (the layout in which speculative verification is exact at one "
                 "row per decode step; prefill about 3x slower than -fa off at 12k tokens of context)"
                 if attention.exact_rows else "")
        # recurrent snapshots per slot: the cache's (--rs-snapshots), a decode row's (a verification rolls back
        # through a reloaded checkpoint instead: Engine.rewind)
        n_rs_seq = max(cfg.rs_snapshots if cfg.cache_enabled else 0, cfg.decode_rows - 1)
        if cfg.ctx_size is None:
            draft = _draft_footprint(cfg) if cfg.drafts == "draft" and widths else (0, 0)
            if draft != (0, 0):
                log.info("the draft model keeps %.0f MiB resident and %.0f MiB per slot: counted in the context's fit "
                         "with the weights and each slot's state", draft[0] / MiB, draft[1] / MiB)
            fit = cls._fit_context(cfg, path, n_rs_seq, attention, draft, rewind=bool(widths))
            cfg = dataclasses.replace(cfg, ctx_size=fit.ctx_size, parallel=fit.slots)
        grammars = GrammarPool(path, GrammarLimits(cfg.grammar_budget, cfg.grammar_memory_mib), keep=cfg.parallel + 1)
        engine = _engine(cfg, path, attention, n_ctx=cfg.ctx_size, n_seq_max=cfg.parallel, n_rs_seq=n_rs_seq,
                         decode_rows=cfg.decode_rows, grammars=grammars, load_mtp=cfg.drafts == "mtp")
        if cfg.speculative == "mtp" and engine.nextn is None:
            arch = engine.info.architecture
            engine.close()
            raise ModelLoadError(f"--speculative mtp: {path} has no MTP block (GGUF {arch}.nextn_predict_layers "
                                 f"is 0 or absent); --speculative auto drafts from n-grams")
        log.info("backend %s: %s", engine.offload.backend, engine.offload.describe())
        facts_file = calibration.CalibrationFile(cfg.calibration_file, file_digest + calibration.segment_key(attention),
                                                 cfg.batch_size, cfg.extra_bufts, engine.offload)
        facts = calibration.calibrate(engine, facts_file, cfg.decode_batching)
        log.info("prefill ubatches of %d tokens or more are bit-identical to larger ones on this model and %s "
                 "(min_segment)", facts.min_segment, engine.offload.backend)
        info = engine.info
        log.info("model %s: %s, arch %s, %.0f MiB, %d params, n_ctx %d per slot, n_batch %d, %d threads",
                 path, info.name, info.architecture, info.size_bytes / MiB, info.n_params, engine.n_ctx,
                 engine.n_batch, engine.n_threads)
        recurrent, kv_token = calibration.state_sizes(engine)
        rewind = bool(widths and recurrent)  # a slot's rollback checkpoint (Engine.rewind_point)
        per_slot = recurrent * (1 + engine.n_rs_seq + rewind) + kv_token * engine.n_ctx
        log.info("%d slots; memory per slot %.1f MiB (recurrent state %.1f MiB x (1 + %d snapshots%s) + KV %.1f "
                 "KiB/token x %d tokens), %.0f MiB for all", cfg.parallel, per_slot / MiB, recurrent / MiB,
                 engine.n_rs_seq, " + 1 rollback checkpoint" if rewind else "", kv_token / 1024, engine.n_ctx,
                 cfg.parallel * per_slot / MiB)
        batch_widths = calibration.decode_batching(facts, engine.n_seq_max, cfg.decode_batching)
        together = cls._verify_together(cfg, facts_file, engine, widths, batch_widths)
        if "random" in info.name.lower():
            log.warning("model %r has RANDOM weights: output text is meaningless", info.name)
        spare_bytes = 0
        if cfg.cache_enabled and cfg.spare_checkpoints and recurrent:
            # Spare checkpoint buffers are snapshot memory to come: reserved out of --cache-ram (an eighth at most).
            count = min(cfg.spare_checkpoints, cfg.cache_ram_bytes // 8 // (recurrent + HEADER))
            spare_bytes = engine.keep_spares(count)
            if spare_bytes:
                log.info("%d spare checkpoint buffers (%.0f MiB of the snapshot RAM), faulted in while idle",
                         count, spare_bytes / MiB)
        tiers: list[Tier] = [RamTier(cfg.cache_ram_bytes - spare_bytes if cfg.cache_enabled else 0)]
        if cfg.cache_enabled and cfg.cache_disk_dir is not None and cfg.cache_disk_mib > 0:
            try:
                disk = DiskTier(cfg.cache_disk_dir, cfg.cache_disk_mib * MiB, state_fingerprint(path, engine, file_digest))
                log.info("snapshot disk tier: %s, %d MiB, %d entries found", cfg.cache_disk_dir,
                         cfg.cache_disk_mib, len(disk))
                tiers.append(disk)
            except OrchestratorError as e:
                log.warning("snapshot disk tier unavailable, caching in RAM only: %s", e.message)
        prefill_tps = None
        if cfg.cache_enabled and cfg.cache_remote:
            remote = RemoteTier(cfg.cache_remote, state_fingerprint(path, engine, model_file_digest(path, False)),
                                cfg.cache_remote_queue_mib * MiB, cfg.cache_remote_timeout)
            prefill_tps = calibration.prefill_rate(engine)
            log.info("snapshot remote tier: %s (shared with the replicas using it; it holds user data), "
                     "write-behind queue %d MiB; prefill measured at %.0f tokens/s", redacted(cfg.cache_remote),
                     cfg.cache_remote_queue_mib, prefill_tps)
            tiers.append(remote)
        cache = SnapshotCache(tiers, policy=POLICIES[cfg.cache_policy](), state=engine.state)
        if cfg.cache_enabled:
            log.info("snapshot cache: %d MiB of RAM, checkpoints every %d tokens inside long messages",
                     cfg.cache_ram_mib, cfg.checkpoint_interval)
        template = load_template(engine, cfg.chat_template, cfg.max_rendered_chars)
        draft_model = None
        if cfg.drafts == "draft" and not widths:
            log.warning("--model-draft %s is not loaded: speculative decoding is off in this layout (above)",
                        cfg.model_draft)
        elif cfg.drafts == "draft":
            try:
                draft_model = _draft_model(cfg, engine)
            except ModelLoadError:
                cache.close()
                engine.close()
                raise
        return cls(config=cfg, engine=engine, cache=cache, prompts=PromptBuilder(engine, template,
                                                                           cfg.parse_special_in_content),
                   scheduler=Scheduler(engine, cache, cfg.checkpoint_interval, n_slots=cfg.parallel,
                                       queue_size=cfg.queue_size, timeout_s=cfg.timeout,
                                       prefill_chunk=cfg.prefill_chunk,
                                       prefill_chunk_alone=cfg.prefill_chunk_alone, batch_widths=batch_widths,
                                       prefill_tps=prefill_tps, driver=driver,
                                       snapshot_min_gap=cfg.snapshot_min_gap, verify_widths=widths,
                                       drafts=cfg.drafts, draft_model=draft_model, verify_costs=verify_costs,
                                       verify_together=together),
                   model_id=cfg.model_alias or path.stem)

    # ------------------------------------------------------------------ what server/ asks

    @property
    def n_ctx(self) -> int:
        """Tokens per slot: the prompt plus its completion must fit."""
        return self.engine.n_ctx

    def submit(self, job: Job, sink: Sink) -> threading.Event:
        """Queue a job (Scheduler.submit: raises ContextOverflow, QueueFull); returns its cancel flag."""
        return self.scheduler.submit(job, sink)

    def constraint(self, structure: Structure, tools: list[dict] | None, opens_reasoning: bool) -> Constraint | None:
        """The grammar that enforces a chat request's structured output on this model's replies (`grammar.build`
        for its template family), checked by llama.cpp; None when nothing is constrained. Raises InvalidRequest
        naming the field when it cannot be built or llama.cpp refuses it."""
        found = grammar.build(structure, tools, self.prompts.output_format, opens_reasoning, self.grammar_budget)
        if found is not None:
            param = structure.param
            deadline = time.perf_counter() + self.config.timeout if self.config.timeout else None
            self.engine.check_grammar(found.gbnf, found.triggers, param, deadline)
        return found

    @property
    def grammar_budget(self) -> grammar.Budget:
        """What building one request's grammar may cost (--grammar-max-schema, --grammar-budget)."""
        return grammar.Budget(self.config.grammar_max_schema, self.config.grammar_budget)

    def piece(self, token: int) -> bytes:
        """The bytes of one token (special tokens as their text)."""
        return self.engine.piece(token)

    def detokenize(self, tokens: list[int]) -> str:
        """The text of token ids (llama_token_to_piece per token, joined, then UTF-8 decoded with replacement)."""
        return b"".join(self.engine.piece(t) for t in tokens).decode("utf-8", "replace")

    def model_meta(self) -> dict:
        """What /v1/models says about the served model."""
        info = self.engine.info
        return {"name": info.name, "architecture": info.architecture, "n_ctx": self.engine.n_ctx,
                "n_vocab": info.n_vocab, "size_bytes": info.size_bytes, "n_params": info.n_params,
                "chat_format": self.prompts.output_format.name}

    def cache_stats(self) -> CacheStats:
        """The snapshot cache's counters and what each tier holds (for /metrics)."""
        return self.cache.stats()

    def after_generation_stats(self) -> AfterGenerationStats:
        """What after-generation work was done, skipped, preempted and taken over (a copy, for /metrics)."""
        return dataclasses.replace(self.scheduler.reuse.after_stats)

    def cache_report(self) -> dict:
        """/v1/cache/stats: the cache's counters and the settings that shape what it stores."""
        return {**dataclasses.asdict(self.cache.stats()), "checkpoint_interval": self.scheduler.checkpoint_interval,
                "after_generation": dataclasses.asdict(self.scheduler.reuse.after_stats),
                "spare_checkpoints": self.engine.spares.describe(), **self.engine.state.describe()}

    def flush_cache(self) -> int:
        """Drop every snapshot of the local tiers (RAM, disk; a shared tier keeps its entries for the other
        replicas) and forget the slots' live state, so that no request admitted afterwards reuses anything computed
        before (`Scheduler.flush`); returns how many entries went. Blocks until the worker has done it (at most one
        step); raises OrchestratorError when it did not within a minute."""
        return self.scheduler.flush()

    def health(self, full: bool = True) -> dict:
        """/health: slots (total, busy, free), the backend and devices computing the model; with `full`, also the
        queue length, the cache figures (which tell one tenant that another is active: behind the API key), the
        attention layout served, the speculative verification widths in use (empty: speculation off) and whether
        slots decoding together verify together (Speculation.step_group)."""
        busy = self.scheduler.slots_busy
        out = {"backend": self.engine.offload.backend, "devices": self.engine.offload.device_names,
               "slots": len(self.scheduler.slots), "slots_busy": busy, "slots_free": len(self.scheduler.slots) - busy}
        if not full:
            return out
        s = self.cache.stats()
        a = self.engine.attention
        return {**out, "queue_length": self.scheduler.queue_length,
                "attention": {"flash_attn": a.flash, "cache_type_k": a.type_k, "cache_type_v": a.type_v,
                              "decode_kernels": a.kernels},
                "speculative_widths": list(self.scheduler.speculation.widths),
                "speculative_together": self.scheduler.speculation.together,
                "cache": {"ram_entries": s.ram_entries, "ram_bytes": s.ram_bytes,
                          "ram_budget_bytes": s.ram_budget_bytes, "disk_entries": s.disk_entries}}

    def close(self) -> None:
        self.scheduler.close()
        self.engine.close()
        self.cache.close()
