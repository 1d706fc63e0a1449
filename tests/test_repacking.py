"""--use-extra-bufts auto: llama.cpp CPU weight repacking chosen per model and CPU in a child process
(orchestrator/repacking.py), a crash of that child never reaching the server, the choice kept and logged."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import numpy as np
import pytest

from orchestrator import calibration, repacking
from orchestrator.config import Config
from orchestrator.errors import EngineError
from orchestrator.models.synth import ensure_model
from orchestrator.repacking import Choice, Measured, decide
from orchestrator.runtime import Runtime

from .conftest import make_config

EXACT = Measured(min_segment=8, batch_invariant=True, prefill_s=0.75, decode_s=0.25)


def test_repacking_is_kept_only_where_exact_and_faster():
    assert decide(EXACT, Measured(8, True, 0.90, 0.0)).use_extra_bufts
    assert decide(EXACT, Measured(16, True, 0.97, 0.0)).use_extra_bufts  # a larger min_segment is still exact
    slower = decide(EXACT, Measured(8, True, 0.98, 0.0))
    assert not slower.use_extra_bufts and "not faster" in slower.reason
    inexact = decide(None, Measured(None, False, 0.0, 0.0, "prefill splits change the logits at 13 tokens"))
    assert not inexact.use_extra_bufts and "not exact here: prefill splits change the logits at 13" in inexact.reason
    lost = decide(EXACT, Measured(8, False, 0.5, 0.0))
    assert not lost.use_extra_bufts and "batched decoding" in lost.reason
    # invariance that unpacked decoding lacks too is not lost
    assert decide(Measured(8, False, 1.0, 0.0), Measured(8, False, 0.5, 0.0)).use_extra_bufts


class SplitEngine:
    """measure_min_segment's view of an engine: prefill segments in, last logits out. `exact(n)` says whether a
    segment of n tokens computes what it computes inside a larger ubatch."""

    def __init__(self, exact):
        self.exact, self.n_batch, self.segments = exact, 512, []

    def clear(self, seq):
        self.segments = []

    def decode(self, seq, tokens, pos, want_logits=True):
        self.segments.append(len(tokens))

    def logits(self):
        return np.array([float(all(self.exact(n) for n in self.segments))])


def test_min_segment_is_confirmed_above_the_size_found():
    """Kernels that compute rows in groups of 4 (llama.cpp's repacked weights) are exact at 8, 12, 16, 20 and 24
    tokens only: every size up to 24 is tested, so 23 differs and nothing is exact. With the earlier sizes
    (2..10, 12, 16, 24) the threshold read would be 12; the confirmation above it (13) refuses it too."""
    grouped = SplitEngine(lambda n: n >= 8 and n % 4 == 0)
    assert calibration.measure_min_segment(SplitEngine(lambda n: n >= 8)) == 8
    with pytest.raises(EngineError, match="at 23 tokens on this model and CPU, and 24 cannot be confirmed"):
        calibration.measure_min_segment(grouped)
    with pytest.raises(EngineError, match="at 13 tokens though 12 were exact"):
        calibration.measure_min_segment(grouped, sizes=(2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 24))
    parity = SplitEngine(lambda n: n >= 8 and n % 2 == 0)  # ARM i8mm: two rows at a time in even ubatches
    with pytest.raises(EngineError, match="at 23 tokens"):
        calibration.measure_min_segment(parity)
    with pytest.raises(EngineError, match="up to 24 tokens"):
        calibration.measure_min_segment(SplitEngine(lambda n: n > 24))


class TiledEngine(SplitEngine):
    """A split engine whose kernels change at `tile` rows, as ggml-cpu's flash attention over F16 does at 64: a
    ubatch computes as the whole prompt did only when both are on the same side of the tile."""

    def __init__(self, tile, n_batch=512):
        super().__init__(lambda n: True)
        self.tile, self.n_batch = tile, n_batch

    def logits(self):
        sides = [n >= self.tile for n in self.segments]
        return np.array([min(sides), max(sides)], dtype=float)


def test_min_segment_is_probed_past_a_tiled_kernel():
    """The 56-token probe cannot see a switch at 64 rows: it reads 2, and a 40-token ubatch then differs from a
    200-token prompt's whole. Told of the tile (Attention.tiled_queries), the probe finds it; a switch further up
    than the longer reference confirms, or a --batch-size too small to hold it, is refused rather than served
    inexact."""
    assert calibration.measure_min_segment(TiledEngine(64)) == 2
    assert calibration.measure_min_segment(TiledEngine(64), tiled=64) == 64
    with pytest.raises(EngineError, match="at 64 tokens .* 128 cannot be confirmed"):  # a switch above the one
        calibration.measure_min_segment(TiledEngine(80), tiled=64)  # the layout names is refused, not served
    with pytest.raises(EngineError, match="--batch-size 128 is too small"):
        calibration.measure_min_segment(TiledEngine(64, n_batch=128), tiled=64)


def test_choice_round_trips_through_the_calibration_file_format():
    choice = decide(EXACT, Measured(8, True, 0.5, 0.0))
    assert Choice.from_json(json.loads(json.dumps(choice.to_json()))) == choice
    assert Choice.from_json({"use_extra_bufts": True}) is None
    assert Choice.from_json("garbage") is None


def _script(tmp_path, body: str):
    path = tmp_path / "child.sh"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_a_crashing_probe_turns_repacking_off_and_is_remembered(tmp_path, tiny_model):
    choice = repacking.probe(tiny_model, 2, 256, 2, python=_script(tmp_path, "kill -SEGV $$"))
    assert not choice.use_extra_bufts and "signal 11" in choice.reason and choice.kept
    failed = repacking.probe(tiny_model, 2, 256, 2, python=_script(tmp_path, "echo 'no such model' >&2; exit 3"))
    assert not failed.use_extra_bufts and "(exit status 3): no such model" in failed.reason and failed.kept


def test_a_probe_past_its_time_is_off_and_measured_again(tmp_path, tiny_model):
    choice = repacking.probe(tiny_model, 2, 256, 2, timeout=0.5, python=_script(tmp_path, "sleep 30"))
    assert not choice.use_extra_bufts and "ran past" in choice.reason and not choice.kept


def test_the_probe_finds_repacked_q4_k_inexact_on_avx2():
    """The real child on tiny-q4 (Q4_K_M). With AVX2, llama.cpp repacks Q4_K into 8x8 blocks and computes rows 4
    at a time: exact only at multiples of 4, so repacking stays off and nothing else is measured (on AMX CPUs
    the child may crash instead: contained, off too). Measured on AMD EPYC (Zen 3) and the 0.8b too:
    bench/results/2026-12-03/repacking."""
    if "avx2" not in (calibration.cpu_flags() or "").split():
        pytest.skip("no AVX2: llama.cpp repacks no Q4_K weights on this CPU")
    choice = repacking.probe(ensure_model("tiny-q4"), 2, 256, 2)
    assert not choice.use_extra_bufts
    if choice.on is None:
        assert "signal" in choice.reason and repacking.amx(calibration.cpu_flags() or ""), choice.reason
    else:
        assert choice.on.min_segment is None and choice.off is None
        assert "not exact here: prefill splits change the logits" in choice.reason, choice.reason
        # the diagnostic behind it: bit-identical at multiples of 4 from 8 tokens, not between
        done = subprocess.run([sys.executable, "-m", "orchestrator.repacking", str(ensure_model("tiny-q4")),
                               "--batch", "256", "--splits"], capture_output=True, text=True, timeout=600)
        line = next(ln for ln in done.stdout.splitlines() if ln.startswith("repacking on:"))
        exact = {int(m) for m, d in (item.split(":") for item in line.split()[2:]) if d == "="}
        assert {8, 12, 16, 20, 24} <= exact and not exact & {9, 13, 17, 21}, line


def test_auto_is_measured_once_per_model_and_cpu_then_read_back(tmp_path, monkeypatch, caplog):
    model = ensure_model("tiny-q4")
    file = tmp_path / "calibration.json"
    measured = Choice(True, "repacked kernels are exact and faster (0.50x the time)", EXACT, Measured(8, True, 0.5, 0.0))
    calls = []
    monkeypatch.setattr(repacking, "probe", lambda *a, **k: calls.append(a) or measured)
    # a CPU without AMX (with AMX auto is off before any probe: test_auto_is_off_without_a_probe_on_amx_cpus)
    monkeypatch.setattr(calibration, "cpu_flags", lambda: "flags\t\t: fpu avx2 avx512f avx512_vnni")
    cfg = make_config(model, calibration_file=file, use_extra_bufts="auto", parallel=2)
    with caplog.at_level(logging.INFO, logger="orchestrator"):
        resolved = Runtime._repacking(cfg, model, b"digest")
    assert resolved.use_extra_bufts == "on" and resolved.extra_bufts
    assert calls == [(model, cfg.threads, cfg.batch_size, 2)]
    assert "CPU weight repacking on (--use-extra-bufts auto): repacked kernels are exact and faster" in caplog.text
    monkeypatch.setattr(repacking, "probe", lambda *a, **k: pytest.fail("measured again"))
    assert Runtime._repacking(cfg, model, b"digest").use_extra_bufts == "on"
    # another slot count is another measurement (batch invariance is checked at the served width)
    monkeypatch.setattr(repacking, "probe", lambda *a, **k: Choice(False, "not faster", EXACT, EXACT))
    assert Runtime._repacking(make_config(model, calibration_file=file, use_extra_bufts="auto", parallel=3),
                              model, b"digest").use_extra_bufts == "off"


def test_auto_is_off_without_a_probe_on_amx_cpus(monkeypatch, tiny_model):
    monkeypatch.setattr(calibration, "cpu_flags", lambda: "flags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8")
    monkeypatch.setattr(repacking, "probe", lambda *a, **k: pytest.fail("probed on AMX"))
    cfg = Runtime._repacking(make_config(tiny_model, use_extra_bufts="auto"), tiny_model, b"digest")
    assert cfg.use_extra_bufts == "off"


def test_on_and_off_are_served_as_given(monkeypatch, tiny_model):
    monkeypatch.setattr(repacking, "probe", lambda *a, **k: pytest.fail("probed"))
    for value in ("on", "off"):
        assert Runtime._repacking(make_config(tiny_model, use_extra_bufts=value), tiny_model, b"d") \
            .use_extra_bufts == value
    with pytest.raises(ValueError, match="not resolved"):
        Config(use_extra_bufts="auto").extra_bufts
