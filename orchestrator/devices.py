"""Which ggml backends and devices this llama.cpp build has, which of them a model offloads to, and the
resulting compute layout (`Offload`: what the startup log, /health, the calibration key and the state
fingerprint name).

Source: ggml-backend.h's device registry (ggml_backend_dev_count / _get / _by_name / _get_props /
_backend_reg, ggml_backend_reg_name), bound here with ctypes on llama-cpp-python's own libggml
(`llama_cpp._ggml.libggml`; llama_cpp.py binds none of them). A CPU-only build has one device, "CPU".

Selection (`select_devices`) mirrors llama.cpp's llama_prepare_model_devices (src/llama.cpp of the llama.cpp
vendored by llama-cpp-python 0.3.36) so that the list passed as llama_model_params.devices is what llama.cpp
would have picked itself: every GPU device (one per device id), else the integrated GPUs; CPU and ACCEL
devices are never offload targets. llama-server's `--device a,b` / `--device none` and `-sm none -mg N` choose
from it; the engine then passes the chosen list explicitly, so what is reported is what llama.cpp uses.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import llama_cpp
from llama_cpp._ggml import libggml as _g

from .errors import ModelLoadError

# enum ggml_backend_dev_type (ggml-backend.h)
CPU, GPU, IGPU, ACCEL, META = range(5)
_TYPE_NAMES = {CPU: "cpu", GPU: "gpu", IGPU: "igpu", ACCEL: "accel", META: "meta"}


class _Caps(ctypes.Structure):  # struct ggml_backend_dev_caps
    _fields_ = [("async_", ctypes.c_bool), ("host_buffer", ctypes.c_bool),
                ("buffer_from_host_ptr", ctypes.c_bool), ("events", ctypes.c_bool), ("mmap_support", ctypes.c_bool)]


class _Props(ctypes.Structure):  # struct ggml_backend_dev_props
    _fields_ = [("name", ctypes.c_char_p), ("description", ctypes.c_char_p), ("memory_free", ctypes.c_size_t),
                ("memory_total", ctypes.c_size_t), ("type", ctypes.c_int), ("device_id", ctypes.c_char_p),
                ("caps", _Caps), ("_reserved", ctypes.c_byte * 64)]  # room should the struct grow


def _bind(name: str, restype, *argtypes):
    fn = getattr(_g, name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


_dev_count = _bind("ggml_backend_dev_count", ctypes.c_size_t)
_dev_get = _bind("ggml_backend_dev_get", ctypes.c_void_p, ctypes.c_size_t)
_dev_props = _bind("ggml_backend_dev_get_props", None, ctypes.c_void_p, ctypes.POINTER(_Props))
_dev_reg = _bind("ggml_backend_dev_backend_reg", ctypes.c_void_p, ctypes.c_void_p)
_reg_name = _bind("ggml_backend_reg_name", ctypes.c_char_p, ctypes.c_void_p)


def _text(b: bytes | None) -> str:
    return b.decode("utf-8", "replace") if b else ""


@dataclass(frozen=True)
class Device:
    """One ggml device. name: ggml's ("CPU", "Vulkan0", "CUDA0", "MTL0"), what --device takes; backend: its
    backend's name ("CPU", "Vulkan", "CUDA", "Metal"); description: the driver's ("NVIDIA H200",
    "llvmpipe (LLVM 15.0.6, 256 bits)", the CPU's model name); kind: cpu, gpu, igpu or accel; device_id: the
    PCI bus id where known, else ""; memory_total: bytes."""

    name: str
    backend: str
    description: str
    kind: str
    device_id: str
    memory_total: int
    handle: int  # ggml_backend_dev_t, for llama_model_params.devices

    @property
    def offloads(self) -> bool:
        """Whether llama.cpp offloads layers to it (GPU and integrated GPU devices)."""
        return self.kind in ("gpu", "igpu")


def available() -> list[Device]:
    """Every ggml device of this build, in registry order (llama_backend_init need not have run)."""
    out = []
    for i in range(_dev_count()):
        dev = _dev_get(i)
        props = _Props()
        _dev_props(dev, ctypes.byref(props))
        out.append(Device(name=_text(props.name), backend=_text(_reg_name(_dev_reg(dev))),
                          description=_text(props.description), kind=_TYPE_NAMES.get(props.type, str(props.type)),
                          device_id=_text(props.device_id), memory_total=int(props.memory_total), handle=dev))
    return out


def default_devices(devices: Sequence[Device]) -> list[Device]:
    """llama.cpp's own choice: the GPU devices (RPC ones first, the first of several with one device id), else the
    integrated GPUs (those of the first integrated GPU's backend)."""
    gpus, seen = [], set()
    for d in devices:
        if d.kind == "gpu" and not (d.device_id and d.device_id in seen):
            gpus.append(d)
            seen.add(d.device_id)
    if gpus:
        return sorted(gpus, key=lambda d: d.backend != "RPC")
    igpus = [d for d in devices if d.kind == "igpu"]
    return [d for d in igpus if d.backend == igpus[0].backend]


def select_devices(names: Sequence[str] | None, main_gpu: int | None,
                   devices: Sequence[Device] | None = None) -> list[Device]:
    """The devices a model offloads to. names: llama-server's --device list (["none"]: none; None: llama.cpp's
    default choice); main_gpu: keep only that one of them (llama-server's `-sm none -mg N`; ignored when there is
    none). Raises ModelLoadError naming the devices there are when a name is unknown or a CPU device, or main_gpu
    is out of range."""
    devices = available() if devices is None else list(devices)
    offloadable = ", ".join(d.name for d in devices if d.kind != "cpu") or "none: a CPU-only build"
    if names is None:
        chosen = default_devices(devices)
    elif list(names) == ["none"]:
        chosen = []
    else:
        by_name = {d.name: d for d in devices}
        chosen = []
        for n in names:
            d = by_name.get(n)
            if d is None or d.kind == "cpu":
                raise ModelLoadError(f"--device {n}: no such offload device (this build has: {offloadable})")
            chosen.append(d)
    if main_gpu is not None and chosen:  # without offload devices llama.cpp ignores it (as llama-server does)
        if not 0 <= main_gpu < len(chosen):
            raise ModelLoadError(f"--main-gpu {main_gpu}: there are {len(chosen)} offload devices "
                                 f"({', '.join(d.name for d in chosen) or 'none'})")
        chosen = [chosen[main_gpu]]
    return chosen


def device_array(devices: Sequence[Device]):
    """A NULL-terminated ggml_backend_dev_t array for llama_model_params.devices (the caller keeps it alive
    until the model is loaded)."""
    return (ctypes.c_void_p * (len(devices) + 1))(*[d.handle for d in devices], None)


@dataclass(frozen=True)
class Offload:
    """Where a model's layers and KV are computed. devices: the offload devices, in llama.cpp's split order;
    n_gpu_layers: layers on them, of n_layers = the model's layers + 1 (the output layer counts: llama.cpp's
    llama_model::n_gpu_layers, load_tensors); kv_offload: llama_context_params.offload_kqv (KV and attention
    on the device of their layer); cpu: the CPU device's description and ggml-cpu's kernel features
    (llama_print_system_info), which decide the CPU's numerics."""

    devices: tuple[Device, ...]
    n_gpu_layers: int
    n_layers: int
    kv_offload: bool
    cpu: str

    @classmethod
    def of(cls, devices: Sequence[Device], n_gpu_layers: int, n_layer: int, kv_offload: bool) -> "Offload":
        """The layout llama.cpp builds for `n_gpu_layers` (< 0: all) on `devices` of a model of `n_layer` layers:
        no device, no offload (llama-model.cpp load_tensors: act_gpu_layers)."""
        n_layers = n_layer + 1
        on_device = 0 if not devices else (n_layers if n_gpu_layers < 0 else min(n_gpu_layers, n_layers))
        cpu = next((d.description for d in available() if d.kind == "cpu"), "")
        info = _text(llama_cpp.llama_print_system_info())
        return cls(tuple(devices) if on_device else (), on_device, n_layers, kv_offload and on_device > 0,
                   f"{cpu} | {info}")

    @classmethod
    def cpu(cls) -> "Offload":
        """The CPU-only layout without a model (n_layers 0): the key of a CPU measurement made before any model
        loads (runtime.Runtime._repacking)."""
        return cls.of((), 0, -1, False)

    @property
    def backend(self) -> str:
        """The backend(s) computing the layers: "CPU", "Vulkan", "CUDA", or e.g. "Vulkan+CPU" when part of the
        layers stay on the CPU."""
        names = list(dict.fromkeys(d.backend for d in self.devices))
        if self.n_gpu_layers < self.n_layers:
            names.append("CPU")
        return "+".join(names)

    @property
    def device_names(self) -> list[str]:
        """The devices holding layers: ggml's names ("Vulkan0"), or ["CPU"]."""
        return [d.name for d in self.devices] or ["CPU"]

    def describe(self) -> str:
        """One line for the startup log."""
        if not self.devices:
            return f"all {self.n_layers} layers on the CPU ({self.cpu.split(' | ')[0] or 'CPU'})"
        devs = ", ".join(f"{d.name} ({d.description}, {d.memory_total / 2**30:.1f} GiB)" for d in self.devices)
        kv = "KV on the device" if self.kv_offload else "KV on the host (--no-kv-offload)"
        return f"{self.n_gpu_layers}/{self.n_layers} layers on {devs}; {kv}"

    def key(self) -> str:
        """What decides the numerics of a computed state and of a kernel measurement: the devices' backends and
        descriptions (not their indices: two identical GPUs compute alike), the layer split, KV placement, and
        the CPU's kernel features (calibration.CalibrationFile, runtime.state_fingerprint)."""
        return repr((tuple((d.backend, d.description) for d in self.devices), self.n_gpu_layers, self.n_layers,
                     self.kv_offload, self.cpu))
