"""CPU weight repacking (llama.cpp's "extra buffer types"): whether the served model is loaded with it, chosen per
model and CPU at start (`--use-extra-bufts {auto,on,off}`, Config.use_extra_bufts).

llama.cpp can repack some weight types into interleaved layouts that faster ggml-cpu kernels read
(vendor/llama.cpp/ggml/src/ggml-cpu/repack.cpp, `ggml_repack_get_optimal_repack_type`: Q4_0, Q4_K and IQ4_NL on
AVX2; Q4_0, Q4_K, Q5_K, Q6_K and IQ4_NL on NEON with dotprod or i8mm, where llama.cpp turns it on by default; AMX
tiles on AMX CPUs). Other kernels compute other numerics, so the exactness facts (calibration.py) are measured
again with it, and with llama-cpp-python 0.3.36 a Q4_K_M model repacked for AMX segfaults on any llama_decode of
more than one token (Sapphire Rapids, llama-server too). A segfault cannot be caught, so repacking is tried in a
child process (`probe`), never in the server's.

`auto` chooses, in this order:
  off  where layers are offloaded to a device (repacking applies to CPU weights; not measured there);
  off  on a CPU with AMX (the crash above; until it is fixed upstream);
  off  where the child crashes, fails or times out (the log says how);
  off  where repacking is not exact: no prefill ubatch size is bit-identical to a larger one
       (calibration.measure_min_segment raises), or batched decoding that is invariant without it is not with it
       (calibration.check_batch_invariance, at the configured number of slots, up to 4);
  on   where it is exact and one prefill plus decode steps (PREFILL_TOKENS, DECODE_STEPS) take at most 0.97 of
       the time without it (a smaller gain is inside the 2-5% spread of one measurement on these machines);
       else off.
The choice and its figures are kept in the calibration file beside min_segment, and logged.

The child: `python -m orchestrator.repacking MODEL --threads T --batch B --slots S [--all]` prints one JSON object
(`Measured` for "off" and "on"), measuring each way alone (one model loaded at a time), repacked first: where
that is not exact it stops there (null for "off") unless --all.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from dataclasses import asdict, astuple, dataclass
from pathlib import Path

log = logging.getLogger("orchestrator.repacking")

GAIN = 0.97  # repacking is kept where it takes at most this share of the time without it
PROBE_TIMEOUT = 900.0  # seconds the child may take (a 27B model loads twice)
PREFILL_TOKENS = 256  # the timed work: one prefill of this many tokens, then DECODE_STEPS one-token steps
DECODE_STEPS = 16


@dataclass(frozen=True)
class Measured:
    """One way of loading the model, measured in the child. min_segment and odd: calibration.measure_segments,
    None where it finds no exact size (then nothing else is measured unless asked: the times are 0);
    batch_invariant: calibration.check_batch_invariance at `slots` (False at 1 slot);
    prefill_s: one prefill of PREFILL_TOKENS tokens, decode_s: DECODE_STEPS one-token steps after it, in
    seconds, each the best of three runs."""

    min_segment: int | None
    batch_invariant: bool
    prefill_s: float
    decode_s: float
    inexact: str = ""  # why min_segment is None: calibration.measure_segments's error
    odd: bool = False  # exact in odd-length ubatches only (calibration.Segments)

    @property
    def seconds(self) -> float:
        """The timed work: the prefill and the decode steps."""
        return self.prefill_s + self.decode_s


@dataclass(frozen=True)
class Choice:
    """The outcome of `choose`: use_extra_bufts, why (one line for the log), and the measurements behind it."""

    use_extra_bufts: bool
    reason: str
    off: Measured | None = None
    on: Measured | None = None
    kept: bool = True  # False: a passing cause (a timeout, no process), measured again at the next start

    def describe(self) -> str:
        """The measurements in one line: min_segment, batch invariance and seconds, without and with."""
        if self.off is None or self.on is None:
            return self.reason
        return "; ".join(f"{name}: min_segment {m.min_segment}, batched decoding "
                         f"{'invariant' if m.batch_invariant else 'not invariant'}, prefill "
                         f"{PREFILL_TOKENS / max(m.prefill_s, 1e-9):.0f} tokens/s, decode "
                         f"{DECODE_STEPS / max(m.decode_s, 1e-9):.1f} tokens/s"
                         for name, m in (("without", self.off), ("with", self.on)))

    def to_json(self) -> dict:
        return {"use_extra_bufts": self.use_extra_bufts, "reason": self.reason,
                "off": asdict(self.off) if self.off else None, "on": asdict(self.on) if self.on else None}

    @classmethod
    def from_json(cls, data: object) -> "Choice | None":
        try:
            return cls(bool(data["use_extra_bufts"]), str(data["reason"]),
                       Measured(**data["off"]) if data["off"] else None,
                       Measured(**data["on"]) if data["on"] else None)
        except (TypeError, KeyError, ValueError):
            return None


def amx(cpu_flags: str) -> bool:
    """Whether /proc/cpuinfo's flags line names AMX tiles (amx_tile, amx_int8, amx_bf16)."""
    return any(f.startswith("amx") for f in cpu_flags.split())


def decide(off: Measured | None, on: Measured) -> Choice:
    """The rule of the module docstring, from the two measurements (off: None where `on` was not exact and
    the child did not measure further)."""
    if on.min_segment is None:
        return Choice(False, f"repacked kernels are not exact here: {on.inexact or 'no prefill split is'}", off, on)
    if off is None:
        raise ValueError("an exact repacked measurement needs one without repacking to compare with")
    if off.batch_invariant and not on.batch_invariant:
        return Choice(False, "repacked kernels make batched decoding differ from decoding alone", off, on)
    ratio = on.seconds / off.seconds
    if ratio > GAIN:
        return Choice(False, f"repacked kernels are exact but not faster ({ratio:.2f}x the time)", off, on)
    return Choice(True, f"repacked kernels are exact and faster ({ratio:.2f}x the time)", off, on)


def probe(model: Path, threads: int, n_batch: int, slots: int, timeout: float = PROBE_TIMEOUT,
          python: str = sys.executable) -> Choice:
    """Measure both ways in a child process and `decide`. A child that crashes, fails or runs past `timeout`
    seconds gives Choice(False, reason naming the signal, exit status or its last stderr line)."""
    cmd = [python, "-m", __name__, str(model), "--threads", str(threads), "--batch", str(n_batch),
           "--slots", str(slots)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Choice(False, f"the repacking probe ran past {timeout:.0f} s", kept=False)
    except OSError as e:
        return Choice(False, f"the repacking probe could not start: {e}", kept=False)
    if done.returncode != 0:
        how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit status {done.returncode}"
        last = (done.stderr.strip().splitlines() or [""])[-1][:300]
        return Choice(False, f"the repacking probe failed ({how}){': ' + last if last else ''}")
    try:
        data = json.loads(done.stdout.strip().splitlines()[-1])
        return decide(Measured(**data["off"]) if data["off"] else None, Measured(**data["on"]))
    except (IndexError, KeyError, TypeError, ValueError) as e:
        return Choice(False, f"the repacking probe answered nothing readable ({e})")


def _measure(model: Path, threads: int, n_batch: int, slots: int, extra_bufts: bool, always: bool) -> Measured:
    """Load the model one way and measure it (`Measured`); where no min_segment is exact, only that unless
    `always`."""
    from . import calibration
    from .engine import Engine
    from .errors import EngineError

    engine = Engine(model, n_ctx=1024, n_batch=n_batch, n_threads=threads, use_extra_bufts=extra_bufts,
                    n_seq_max=slots, devices=["none"])
    try:
        inexact, odd = "", False
        try:
            min_segment, odd = astuple(calibration.measure_segments(engine))
        except EngineError as e:
            min_segment, inexact = None, e.message
            if not always:
                return Measured(None, False, 0.0, 0.0, inexact)
        engine.calibrate(min_segment or calibration.UNEXACT_MIN_SEGMENT, odd=odd)
        invariant = calibration.check_batch_invariance(engine)
        tokens = [1000 + (37 * i) % 5000 for i in range(min(PREFILL_TOKENS, n_batch))]
        prefill = decode = float("inf")
        for _ in range(3):
            engine.clear(0)
            start = time.perf_counter()
            engine.decode(0, tokens, 0, want_logits=False)
            middle = time.perf_counter()
            for i in range(DECODE_STEPS):
                engine.decode(0, [2000 + i], len(tokens) + i)
            prefill, decode = min(prefill, middle - start), min(decode, time.perf_counter() - middle)
        engine.clear(0)
        return Measured(min_segment, invariant, prefill, decode, inexact, odd)
    finally:
        engine.close()


def split_deltas(model: Path, threads: int, n_batch: int, extra_bufts: bool, n: int = 56) -> dict[int, float]:
    """The diagnostic behind measure_min_segment, for every size: m -> the largest |Δlogit| of the last token of
    an n-token prefill split into m + (n - m) or (n - m) + m tokens, against it whole (0.0: bit-identical), for
    m = 2 .. n // 2 - 4."""
    from .calibration import split_delta
    from .engine import Engine

    engine = Engine(model, n_ctx=1024, n_batch=n_batch, n_threads=threads, use_extra_bufts=extra_bufts,
                    devices=["none"])
    try:
        tokens = [1000 + (37 * i) % 5000 for i in range(n)]
        engine.decode(0, tokens, 0)
        ref = engine.logits().copy()
        return {m: split_delta(engine, tokens, ref, m) for m in range(2, n // 2 - 3)}
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m orchestrator.repacking", description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--all", action="store_true", help="measure both ways fully even where repacking is not exact")
    p.add_argument("--splits", action="store_true", help="print, both ways, the largest |Δlogit| of a prefill split "
                   "at every size (split_deltas) instead")
    a = p.parse_args(argv)
    if a.splits:
        for bufts in (False, True):
            deltas = split_deltas(a.model, a.threads, a.batch, bufts)
            print(f"repacking {'on' if bufts else 'off'}: " + " ".join(f"{m}:{'=' if d == 0 else f'{d:.2g}'}"
                                                                      for m, d in deltas.items()), flush=True)
        return
    slots = max(1, min(a.slots, 4))
    on = _measure(a.model, a.threads, a.batch, slots, True, a.all)
    off = _measure(a.model, a.threads, a.batch, slots, False, a.all) if on.min_segment or a.all else None
    print(json.dumps({"off": asdict(off) if off else None, "on": asdict(on)}))


if __name__ == "__main__":
    main()
