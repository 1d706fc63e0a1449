"""GPU offload on the CPU build: the flags parse and reach llama.cpp's model and context parameters, device
selection follows llama.cpp's rules, a CPU-only build serves as before, and a calibration or a stored state of
one compute layout is never taken for another's (orchestrator/devices.py)."""

import argparse
import ctypes
import logging
import subprocess
import sys
import types

import pytest

from orchestrator import calibration, cli
from orchestrator.devices import Device, Offload, available, select_devices
from orchestrator.engine import Attention, Engine
from orchestrator.errors import EngineError, ModelLoadError
from orchestrator.runtime import model_file_digest, state_fingerprint
from orchestrator.state import HybridState

from .conftest import assert_same_as_cold


def parse(*flags):
    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers(dest="command"))
    return cli._config(parser.parse_args(["serve", *flags]))


def dev(name, backend, kind, device_id="", description=None):
    return Device(name, backend, description or f"{backend} device", kind, device_id, 8 << 30, 0)


CPU_DEV = dev("CPU", "CPU", "cpu", description="AMD EPYC")
VK0 = dev("Vulkan0", "Vulkan", "gpu", "0000:01:00.0", "NVIDIA H200")
VK1 = dev("Vulkan1", "Vulkan", "gpu", "0000:02:00.0", "NVIDIA H200")
CUDA0 = dev("CUDA0", "CUDA", "gpu", "0000:01:00.0", "NVIDIA H200")  # the same card as Vulkan0
IGPU = dev("Vulkan2", "Vulkan", "igpu", "", "AMD Radeon 780M")
BLAS = dev("BLAS", "BLAS", "accel")


def test_offload_flags_parse_with_llama_servers_spelling():
    d = parse()
    assert (d.n_gpu_layers, d.devices, d.main_gpu, d.kv_offload) == (-1, None, None, True)
    cfg = parse("-ngl", "12", "--device", "Vulkan0,Vulkan1", "--main-gpu", "1", "--no-kv-offload")
    assert (cfg.n_gpu_layers, cfg.devices, cfg.main_gpu, cfg.kv_offload) == (12, ("Vulkan0", "Vulkan1"), 1, False)
    assert parse("--n-gpu-layers", "all").n_gpu_layers == -1 and parse("--gpu-layers", "auto").n_gpu_layers == -1
    assert parse("-ngl", "0").n_gpu_layers == 0
    assert parse("-dev", "none").devices == ("none",) and parse("-mg", "0", "-nkvo").main_gpu == 0


def test_bad_offload_flags_exit_before_loading_anything():
    for flags in (["-ngl", "-2"], ["-ngl", "many"], ["--device", ","], ["--device", "none,Vulkan0"],
                  ["--main-gpu", "-1"]):
        r = subprocess.run([sys.executable, "-m", "orchestrator", "serve", *flags], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and "error:" in r.stderr, (flags, r.stderr)


def test_device_selection_follows_llama_cpp():
    every = [CPU_DEV, VK0, CUDA0, VK1, IGPU, BLAS]
    assert select_devices(None, None, every) == [VK0, VK1]  # GPUs, one per device id; no iGPU beside them
    assert select_devices(None, None, [CPU_DEV, IGPU, BLAS]) == [IGPU]  # integrated GPUs only without a GPU
    assert select_devices(None, None, [CPU_DEV, BLAS]) == []
    assert select_devices(["CUDA0"], None, every) == [CUDA0]
    assert select_devices(["Vulkan1", "Vulkan0"], None, every) == [VK1, VK0]
    assert select_devices(["none"], None, every) == []
    assert select_devices(None, 1, every) == [VK1]
    assert select_devices(None, 0, [CPU_DEV]) == []  # no offload device: --main-gpu is ignored, as llama.cpp does
    with pytest.raises(ModelLoadError, match="Vulkan7.*Vulkan0, CUDA0, Vulkan1, Vulkan2, BLAS"):
        select_devices(["Vulkan7"], None, every)
    with pytest.raises(ModelLoadError, match="--device CPU"):
        select_devices(["CPU"], None, every)
    with pytest.raises(ModelLoadError, match="--main-gpu 2: there are 2"):
        select_devices(None, 2, every)


def test_this_build_lists_its_cpu_device():
    devices = available()
    assert [d.kind for d in devices].count("cpu") == 1
    assert all(d.name and d.backend for d in devices)


def test_offload_layout_counts_layers_as_llama_cpp_does():
    assert Offload.of([VK0], -1, 24, True).n_gpu_layers == 25  # the output layer counts
    assert Offload.of([VK0], 99, 24, True).n_gpu_layers == 25
    part = Offload.of([VK0], 10, 24, True)
    assert (part.n_gpu_layers, part.backend, part.device_names) == (10, "Vulkan+CPU", ["Vulkan0"])
    full = Offload.of([CUDA0], -1, 24, False)
    assert (full.backend, full.kv_offload, full.device_names) == ("CUDA", False, ["CUDA0"])
    none = Offload.of([], -1, 24, True)
    assert (none.n_gpu_layers, none.backend, none.device_names, none.kv_offload) == (0, "CPU", ["CPU"], False)
    assert none.key() == Offload.of([VK0], 0, 24, True).key()  # no layer on the device: a CPU layout
    keys = {o.key() for o in (none, part, full, Offload.of([VK0], -1, 24, True), Offload.of([VK0], -1, 24, False),
                              Offload.of([VK0], 11, 24, True), Offload.of([VK1], 10, 24, True))}
    assert len(keys) == 6  # Vulkan1 is the same card model as Vulkan0: the same numerics, the same key


def test_engine_passes_the_offload_settings_to_llama_cpp(tiny_model, caplog):
    with caplog.at_level(logging.WARNING, logger="orchestrator.engine"):
        e = Engine(tiny_model, n_ctx=256, n_batch=64, n_threads=2, n_gpu_layers=5, kv_offload=False, main_gpu=0)
    try:
        assert e.model_params.n_gpu_layers == 5 and e.context_params.offload_kqv is False
        chosen = ctypes.cast(e.model_params.devices, ctypes.POINTER(ctypes.c_void_p))
        assert chosen[0] is None  # an explicit, empty (NULL-terminated) device list: this build has no GPU
        assert (e.offload.backend, e.offload.n_gpu_layers, e.offload.n_layers) == ("CPU", 0, 9)
        assert "-ngl 5: no offload device" in caplog.text
    finally:
        e.close()
    e = Engine(tiny_model, n_ctx=256, n_batch=64, n_threads=2)
    try:
        assert e.model_params.n_gpu_layers == -1 and e.context_params.offload_kqv is True
    finally:
        e.close()
    with pytest.raises(ModelLoadError, match="--device Vulkan0: no such offload device"):
        Engine(tiny_model, n_ctx=256, n_batch=64, devices=["Vulkan0"])


def test_a_cpu_only_build_serves_as_before_and_health_names_the_backend(start, caplog):
    with caplog.at_level(logging.INFO, logger="orchestrator"):
        rt = start(n_gpu_layers=99, main_gpu=0, kv_offload=False)
    assert rt.engine.model_params.n_gpu_layers == 99 and rt.engine.context_params.offload_kqv is False
    assert "backend CPU: all 9 layers on the CPU" in caplog.text
    health = rt.health()
    assert (health["backend"], health["devices"]) == ("CPU", ["CPU"])
    msgs = [{"role": "system", "content": "You answer in one word. " * 12}, {"role": "user", "content": "Why?"}]
    assert_same_as_cold(rt, msgs)
    again = assert_same_as_cold(rt, msgs[:1] + [{"role": "user", "content": "How?"}])
    assert again.result.cached_tokens > 0


def test_a_cpu_calibration_is_never_reused_for_a_gpu(tmp_path, tiny_model):
    file, digest = tmp_path / "calibration.json", model_file_digest(tiny_model)
    cpu, gpu = Offload.of([], -1, 8, True), Offload.of([VK0], -1, 8, True)
    calibration.CalibrationFile(file, digest, 256, False, cpu).put(7)
    assert calibration.CalibrationFile(file, digest, 256, False, cpu).get() == 7
    assert calibration.CalibrationFile(file, digest, 256, False, gpu).get() is None
    assert calibration.CalibrationFile(file, digest, 256, False, Offload.of([VK0], 4, 8, True)).get() is None
    assert calibration.CalibrationFile(file, digest, 256, False).get() is None  # no layout: not trusted


def test_a_calibration_is_never_reused_under_other_kernel_switches(tmp_path, tiny_model, monkeypatch):
    """GGML_CPU_TILED_MM=0 makes min_segment 2 where it is 8 with the tiled matmul on (bench/results/2026-12-05/
    tiled-matmul): a value measured with the switch must not be served without it, nor the other way round."""
    file, digest, cpu = tmp_path / "calibration.json", model_file_digest(tiny_model), Offload.of([], -1, 8, True)
    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")
    calibration.CalibrationFile(file, digest, 256, False, cpu).put(2)
    assert calibration.CalibrationFile(file, digest, 256, False, cpu).get() == 2
    monkeypatch.delenv("GGML_CPU_TILED_MM")
    assert calibration.CalibrationFile(file, digest, 256, False, cpu).get() is None
    calibration.CalibrationFile(file, digest, 256, False, cpu).put(8)
    monkeypatch.setenv("GGML_CPU_TILED_MM_FORCE", "1")
    assert calibration.CalibrationFile(file, digest, 256, False, cpu).get() is None
    monkeypatch.delenv("GGML_CPU_TILED_MM_FORCE")
    monkeypatch.setenv("ORCHESTRATOR_UNRELATED", "1")  # only llama.cpp's and ggml's own variables count
    assert calibration.CalibrationFile(file, digest, 256, False, cpu).get() == 8


def test_a_state_of_one_offload_layout_is_refused_by_another(tiny_model):
    def engine(offload, min_segment=8):
        return types.SimpleNamespace(n_ctx=1024, n_seq_max=1, attention=Attention(), use_extra_bufts=False,
                                     state=HybridState(split_layout=True), offload=offload,
                                     min_segment=min_segment, odd_ubatches=False)

    digest = model_file_digest(tiny_model)
    cpu = state_fingerprint(tiny_model, engine(Offload.of([], -1, 8, True)), digest)
    assert state_fingerprint(tiny_model, engine(Offload.of([], -1, 8, False)), digest) == cpu
    layouts = [Offload.of([VK0], -1, 8, True), Offload.of([VK0], -1, 8, False), Offload.of([VK0], 5, 8, True),
               Offload.of([CUDA0], -1, 8, True), Offload((), 0, 9, False, "another CPU | AVX2 = 1 |")]
    prints = {state_fingerprint(tiny_model, engine(o), digest) for o in layouts}
    assert cpu not in prints and len(prints) == len(layouts)
    # a state prefilled under another chunk rule (min_segment 8 where 64 is exact: flash attention over F16) is
    # not what a cold prefill computes now
    assert state_fingerprint(tiny_model, engine(Offload.of([], -1, 8, True), 64), digest) != cpu


def test_a_device_backend_where_no_split_is_exact_serves_anyway_and_says_so(tiny_model, monkeypatch, caplog):
    def inexact(engine, *a, **k):
        raise EngineError("prefill splits into segments of up to 24 tokens change the logits")

    monkeypatch.setattr(calibration, "measure_min_segment", inexact)
    e = Engine(tiny_model, n_ctx=256, n_batch=64, n_threads=2)
    try:
        file = calibration.CalibrationFile(None, b"x", 64, False, e.offload)
        with pytest.raises(EngineError):  # the CPU: refuse, as before
            calibration.calibrate(e, file, "off")
        e.offload = Offload((VK0,), 9, 9, True, "cpu")
        with caplog.at_level(logging.WARNING, logger="orchestrator.calibration"):
            facts = calibration.calibrate(e, file, "off")
        assert facts.min_segment == e.min_segment == calibration.UNEXACT_MIN_SEGMENT
        assert "serving anyway" in caplog.text and "Vulkan" in caplog.text
    finally:
        e.close()
