"""ggml-cpu's reference kernels for a llama.cpp context's decode steps and verifications, its optimized kernels
for prefill: the switch that makes speculative verification exact at any width.

Why. On ggml-cpu a K-quant matmul of 8 or more rows takes the tiled kernel (ggml/src/ggml-cpu/tiled/), fewer take
the one-row `vec_dot` kernels, and the two round differently; so a verification of 8+ tokens differs from
one-token decoding, and exact widths stop at 7 (docs/correctness.md). `ggml_backend_cpu_set_use_ref` (ggml-cpu.h)
makes a CPU backend compute with its reference paths: the tiled matmul and flash attention's tiled and split-KV
paths are skipped and ops are not fused, so every row of a ubatch runs the kernels a one-row ubatch runs. Set
for decode steps and verifications only, they agree at every width, while prefill keeps the tiled kernels
(which min_segment is measured for). The environment's `GGML_CPU_TILED_MM=0` does the same for verification but
for prefill too, at 0.44x prefill speed on the qwen3.5-0.8b preset (bench/results/2026-12-05/tiled-matmul).

The reference paths do not gate llamafile's tinyBLAS, which takes every F32/F16/BF16 matmul of 2+ rows (the
attention matmuls over an F16 KV cache with flash attention off: the default layout) and sums in another order
than the one-row kernels (its quantized matmuls sum as they do). `gate_tinyblas` makes the reference paths decline
it for float matrices (native/tinyblas_gate.c), so that the default
layout's decode steps and verifications agree at every width, as in a ggml-cpu built without llamafile, while
prefill keeps tinyBLAS (`reference_matmuls`).

Row by row is what exactness needs of the sums, not of the work: the gate also computes reference-path F16 x F16
and Q4_K/Q5_K/Q6_K matmuls of several rows itself (native/exact_matmuls.c), each element summed in the one-row
kernel's order but each weight or KV row unpacked once for all rows, where the kernel agreed bit for bit with the
loaded library's at install. A 16-token verification then costs 0.63-0.72x (qwen3.5-0.8b preset) and 0.89-0.90x
(Gemma 3 270M) of ggml's row-by-row one (bench/results/2026-12-07/exact-matmuls).

One more kernel depends on the row count under the reference paths: with a quantized K cache llama.cpp rotates Q
and K by a Hadamard matrix (llama-kv-cache.cpp `attn_rot_k`), as a dedicated op normally, as a plain F32 matmul
under them; with one KV head (Gemma 3 270M) that matmul has one row per token, which takes `vec_dot` for one
token and llamafile's tinyBLAS for more. So contexts that use reference kernels are made with the rotation off
(`LLAMA_ATTN_ROT_DISABLE`, read when a context is created: `rotation_off`).

How the context's backend is reached: llama.h has no accessor for a context's backends, but libllama exports
`llama_context::get_sched() const` (the C++ method behind the C `struct llama_context`; Itanium ABI: `this` is
the first argument), and libggml the scheduler's `ggml_backend_sched_get_n_backends/get_backend`. Where a build
lacks any of them (`KernelsUnavailable`) the runtime keeps the default kernels: calibration then measures the
widths those give, as before."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import llama_cpp

from .config import cache_root

log = logging.getLogger(__name__)

_GET_SCHED = "_ZNK13llama_context9get_schedEv"  # llama_context::get_sched() const
_ROTATION = "LLAMA_ATTN_ROT_DISABLE"


class KernelsUnavailable(Exception):
    """This llama-cpp-python build exposes no way to switch a context's CPU kernels."""


def _library(name: str) -> ctypes.CDLL:
    """The shared library `name` (libggml-base, libggml-cpu) that llama_cpp loaded: from LLAMA_CPP_LIB_PATH where
    set (llama_cpp/llama_cpp.py reads it), else from llama-cpp-python's own lib folder. Another copy would be
    another library, whose functions reach the loaded one's backends only by luck."""
    lib_dir = Path(os.environ.get("LLAMA_CPP_LIB_PATH") or Path(llama_cpp.__file__).parent / "lib")
    for candidate in (*_mapped(lib_dir, f"lib{name}.so"), f"lib{name}.so", f"lib{name}.dylib", f"{name}.dll"):
        if (lib_dir / candidate).exists():
            return ctypes.CDLL(str(lib_dir / candidate))
    raise KernelsUnavailable(f"llama-cpp-python {llama_cpp.__version__} has no {name} library in {lib_dir}")


def _mapped(lib_dir: Path, prefix: str) -> list[str]:
    """File names in `lib_dir` starting with `prefix` that this process has mapped (/proc/self/maps; none
    elsewhere). pip installs libggml-cpu.so, .so.0 and .so.0.25.3 as copies, and libllama loads .so.0: opening
    another name maps a second copy of the library, whose tables only the first has initialised."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    names = {Path(line.split()[-1]).name for line in maps.splitlines() if str(lib_dir.resolve()) in line}
    return sorted(n for n in names if n.startswith(prefix))


def _api() -> tuple:
    """(get_sched, n_backends, get_backend, is_cpu, set_use_ref) from the loaded libraries, typed. Raises
    KernelsUnavailable where one is missing."""
    try:
        get_sched = llama_cpp.llama_cpp._lib[_GET_SCHED]
        base, cpu = _library("ggml-base"), _library("ggml-cpu")
        n_backends, get_backend = base.ggml_backend_sched_get_n_backends, base.ggml_backend_sched_get_backend
        is_cpu, set_use_ref = cpu.ggml_backend_is_cpu, cpu.ggml_backend_cpu_set_use_ref
    except (AttributeError, OSError) as e:
        raise KernelsUnavailable(f"llama-cpp-python {llama_cpp.__version__}: {e}") from None
    get_sched.argtypes, get_sched.restype = [ctypes.c_void_p], ctypes.c_void_p
    n_backends.argtypes, n_backends.restype = [ctypes.c_void_p], ctypes.c_int
    get_backend.argtypes, get_backend.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_void_p
    is_cpu.argtypes, is_cpu.restype = [ctypes.c_void_p], ctypes.c_bool
    set_use_ref.argtypes, set_use_ref.restype = [ctypes.c_void_p, ctypes.c_bool], None
    return get_sched, n_backends, get_backend, is_cpu, set_use_ref


def has_llamafile() -> bool:
    """Whether the loaded ggml-cpu was built with llamafile's tinyBLAS (`GGML_LLAMAFILE`, on by default), which
    computes F16, F32 and BF16 matmuls of two or more rows, reference paths or not unless gated
    (`gate_tinyblas`), with other sums than the one-row `vec_dot` kernels: then the default attention layout
    (flash attention off over F16) has no exact verification width. Built without it
    (CMAKE_ARGS="-DGGML_LLAMAFILE=OFF"), every matmul of a reference-path decode step or verification runs
    `vec_dot` row by row, and that layout verified widths 2..16 and 20..32 exactly on tiny-q4, the qwen3.5-0.8b
    preset and Gemma 3 270M (bench/results/2026-12-07/no-llamafile). True where it cannot be asked (the old
    answer: no exact width there)."""
    try:
        fn = _library("ggml-cpu").ggml_cpu_has_llamafile
    except (AttributeError, OSError, KernelsUnavailable):
        return True
    fn.argtypes, fn.restype = [], ctypes.c_int
    return bool(fn())


_NATIVE = Path(__file__).parent / "native"
_GATE_SOURCES = ("tinyblas_gate.c", "exact_matmuls.c")  # with the headers beside them


def _gate_library() -> Path:
    """native/tinyblas_gate.c and native/exact_matmuls.c compiled to a shared library, kept under
    cache_root()/native by the sources' digest and the machine (compiled once, about 0.5 s, with $CC or cc: a
    machine that built llama-cpp-python from source has one). Raises KernelsUnavailable where it cannot be
    compiled."""
    sources = [_NATIVE / name for name in _GATE_SOURCES]
    h = hashlib.blake2b(platform.machine().encode(), digest_size=8)
    for path in sorted(_NATIVE.glob("*.[ch]")):
        h.update(path.name.encode() + path.read_bytes())
    target = cache_root() / "native" / f"tinyblas_gate-{h.hexdigest()}.so"
    if target.is_file():
        return target
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise KernelsUnavailable("no C compiler (cc, or $CC) to compile the tinyBLAS gate")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([compiler, "-O3", "-shared", "-fPIC", "-o", str(built), *map(str, sources)],
                           check=True, capture_output=True, timeout=120)
            os.replace(built, target)  # atomic: a concurrent start sees the whole file or none
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        raise KernelsUnavailable(f"compiling the tinyBLAS gate failed: {e} {detail.decode(errors='replace')}") \
            from None
    return target


def _address(library: ctypes.CDLL, name: str) -> int | None:
    """The address of an exported function, or None where the library has no such symbol."""
    try:
        return ctypes.cast(getattr(library, name), ctypes.c_void_p).value
    except AttributeError:
        return None


def gate_tinyblas() -> tuple[str, ...] | None:
    """Keep llamafile's tinyBLAS out of the reference paths for F32/F16/BF16 matrices (native/tinyblas_gate.c):
    after this, where it returns a value, ggml-cpu's float matmuls under `ggml_backend_cpu_set_use_ref` sum every
    element as the one-row `vec_dot` kernels do, as in a build without llamafile, while computations without it
    (prefill) keep tinyBLAS, and quantized matrices keep it everywhere (its sums are vec_dot's there).

    The value names the matmuls the gate then computes itself for the reference paths, every element summed as
    the one-row kernel sums it but with each weight or KV row unpacked once for all rows of the ubatch
    (native/exact_matmuls.c): "F16" (F16 x F16, the default layout's attention; AVX512F), "Q4_K", "Q5_K",
    "Q6_K" (K-quant weights; AVX2). Each is used only where it agreed bit for bit with the loaded library's own
    kernel at install (`orchestrator_exact_f16`, `orchestrator_exact_kquants`), the K-quant ones also only where
    the loaded ggml lays out `struct ggml_tensor` as they read it (`orchestrator_exact_abi`); the others stay row
    by row in ggml.
    Idempotent (the library is opened once by the loader; slots already gated are counted, not patched again, and
    a check asked again answers from its last answer); process-wide, like the library it patches. None where the
    loaded ggml-cpu has no llamafile slot to gate, or the gate cannot be compiled or installed (logged once per
    call, at debug: has_llamafile decides what that means)."""
    try:
        library = ctypes.CDLL(str(_gate_library()))
    except (OSError, KernelsUnavailable) as e:
        log.debug("tinyBLAS gate unavailable: %s", e)
        return None
    gate = library.orchestrator_gate_tinyblas
    gate.argtypes, gate.restype = [ctypes.c_char_p], ctypes.c_int
    if gate(b"libggml-cpu") <= 0:
        return None
    try:
        ggml_cpu = _library("ggml-cpu")
    except KernelsUnavailable:
        return ()
    llama_cpp.llama_backend_init()  # ggml_cpu_init: vec_dot_f16's leftovers convert through a table it fills
    exact_f16, exact_kquants = library.orchestrator_exact_f16, library.orchestrator_exact_kquants
    exact_f16.argtypes, exact_f16.restype = [ctypes.c_void_p], ctypes.c_int
    exact_kquants.argtypes, exact_kquants.restype = [ctypes.c_void_p] * 5, ctypes.c_int
    f16 = exact_f16(_address(ggml_cpu, "ggml_vec_dot_f16")) == 1
    try:  # the K-quant matmul reads ggml_tensor fields: only where the loaded ggml lays them out as it expects
        ggml_base = _library("ggml-base")
        abi = library.orchestrator_exact_abi
        abi.argtypes, abi.restype = [ctypes.c_void_p] * 4, ctypes.c_int
        abi(*(_address(ggml_base, name) for name in ("ggml_init", "ggml_new_tensor_2d", "ggml_mul_mat", "ggml_free")))
    except KernelsUnavailable:
        pass
    kquants = exact_kquants(*(_address(ggml_cpu, name) for name in (
        "ggml_vec_dot_q4_K_q8_K", "ggml_vec_dot_q6_K_q8_K", "ggml_vec_dot_q5_K_q8_K", "quantize_row_q8_K",
        "ggml_barrier")))
    # kquants: the copies that agreed, AVX2 1 Q4_K, 2 Q6_K, 4 Q5_K; AVX512 the same times 8
    return tuple(name for name, on in (("F16", f16), ("Q4_K", kquants & 9), ("Q5_K", kquants & 36),
                                       ("Q6_K", kquants & 18)) if on)


def reference_matmuls() -> str:
    """How ggml-cpu's reference paths compute a matmul of two or more rows: "tinyBLAS" (llamafile's, built in and
    not gated), "vec_dot" (a build without llamafile), "vec_dot, tinyBLAS gated" (`gate_tinyblas`, installed here
    where it can be), or that followed by ", exact F16 Q4_K Q5_K Q6_K" naming the matmuls the gate computes itself in
    the one-row kernels' order. Under all but the first every matmul sums each element as the one-row kernels do,
    and the default attention layout (flash attention off over F16), which tinyBLAS makes inexact at every width,
    verifies exactly at widths 2..32 (bench/results/2026-12-07/no-llamafile, and tinyblas-gate for the gate)."""
    if not has_llamafile():
        return "vec_dot"
    exact = gate_tinyblas()
    if exact is None:
        return "tinyBLAS"
    return "vec_dot, tinyBLAS gated" + (", exact " + " ".join(exact) if exact else "")


def unavailable() -> str | None:
    """Why this build cannot switch a context's kernels, or None where it can."""
    try:
        _api()
    except KernelsUnavailable as e:
        return str(e)
    return None


class ReferenceKernels:
    """The CPU backends of one llama.cpp context, switched between reference (`use(True)`) and optimized kernels
    (`use(False)`, llama.cpp's default). The setting is read at each graph computation (ggml-cpu.cpp
    `ggml_backend_cpu_graph_compute`), so it applies to the next llama_decode; switching costs a ctypes call per
    CPU backend, made only when it changes. Raises KernelsUnavailable (constructor) where the build exports no
    way in, or the context has no CPU backend. Engine thread only, like the context."""

    def __init__(self, ctx) -> None:
        get_sched, n_backends, get_backend, is_cpu, self._set = _api()
        reference_matmuls()  # the gate, where it can be installed, before any reference computation
        sched = get_sched(ctx)
        if not sched:
            raise KernelsUnavailable("the context has no backend scheduler")
        self._backends = [b for b in (get_backend(sched, i) for i in range(n_backends(sched))) if b and is_cpu(b)]
        if not self._backends:
            raise KernelsUnavailable("the context has no CPU backend")
        self.reference = False

    def use(self, reference: bool) -> None:
        """Compute the next llama_decode calls with the reference kernels (True) or the optimized ones."""
        if reference != self.reference:
            for backend in self._backends:
                self._set(backend, reference)
            self.reference = reference


@contextlib.contextmanager
def rotation_off(off: bool) -> Iterator[None]:
    """While creating a context with reference kernels (`off`): llama.cpp's Hadamard rotation of Q and K over a
    quantized K cache turned off (module docstring), unless the environment already sets it; restored after."""
    if not off or _ROTATION in os.environ:
        yield
        return
    os.environ[_ROTATION] = "1"
    try:
        yield
    finally:
        os.environ.pop(_ROTATION, None)
