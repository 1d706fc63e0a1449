"""The gate's exact matmuls (orchestrator/native/exact_matmuls.c): each is used only where it agrees bit for bit
with the loaded ggml-cpu's one-row kernel, a kernel that sums otherwise is refused, and a verification computed
with them gives the same logits, bit for bit, as ggml's own row-by-row reference path."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import numpy as np
import pytest

from orchestrator import kernels
from orchestrator.engine import Attention, Engine
from orchestrator.models.synth import ensure_model


def _flags() -> set[str]:
    line = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _gate() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """The gate's library (installed by reference_matmuls) and the ggml-cpu llama_cpp loaded."""
    kernels.reference_matmuls()
    return ctypes.CDLL(str(kernels._gate_library())), kernels._library("ggml-cpu")


def _kquant_check(gate: ctypes.CDLL, ggml_cpu: ctypes.CDLL, q4_K: str, q6_K: str) -> int:
    check = gate.orchestrator_exact_kquants
    check.argtypes, check.restype = [ctypes.c_void_p] * 4, ctypes.c_int
    return check(kernels._address(ggml_cpu, q4_K), kernels._address(ggml_cpu, q6_K),
                 kernels._address(ggml_cpu, "quantize_row_q8_K"), kernels._address(ggml_cpu, "ggml_barrier"))


def test_the_kernels_this_cpu_can_run_agree_with_the_library_and_are_used():
    """On x86 with AVX2/FMA/F16C the Q4_K and Q6_K kernels, with AVX512F the F16 one, agree with llama-cpp-python's
    own build at install; elsewhere (aarch64) there are none and ggml computes row by row."""
    if not kernels.has_llamafile():
        assert kernels.reference_matmuls() == "vec_dot"
        return
    flags = _flags()
    expected = set()
    if platform.machine() == "x86_64" and {"avx2", "fma", "f16c"} <= flags:
        expected |= {"Q4_K", "Q6_K"}
    if platform.machine() == "x86_64" and {"avx512f", "f16c"} <= flags:
        expected.add("F16")
    assert set(kernels.gate_tinyblas() or ()) == expected
    assert kernels.reference_matmuls().endswith(" ".join(k for k in ("F16", "Q4_K", "Q6_K") if k in expected))


def test_the_check_refuses_kernels_that_sum_otherwise():
    """The check compares, it does not assume: given each other's one-row kernels as the library's, the Q4_K and Q6_K
    copies agree with neither (0), where with the right ones every copy the CPU runs agrees (AVX2 copies: bits 1
    and 2; AVX512 copies: 4 and 8). The F16 check refuses BF16's kernel."""
    if platform.machine() != "x86_64" or not {"avx2", "fma", "f16c"} <= _flags() or not kernels.has_llamafile():
        pytest.skip("the exact kernels are x86 (AVX2) only; elsewhere test_the_kernels_this_cpu_can_run covers it")
    gate, ggml_cpu = _gate()
    wide = {"avx512f", "avx512vl", "avx512bw", "avx512dq"} <= _flags()
    assert _kquant_check(gate, ggml_cpu, "ggml_vec_dot_q4_K_q8_K", "ggml_vec_dot_q6_K_q8_K") == (15 if wide else 3)
    assert _kquant_check(gate, ggml_cpu, "ggml_vec_dot_q6_K_q8_K", "ggml_vec_dot_q4_K_q8_K") == 0
    f16 = gate.orchestrator_exact_f16
    f16.argtypes, f16.restype = [ctypes.c_void_p], ctypes.c_int
    assert f16(kernels._address(ggml_cpu, "ggml_vec_dot_bf16")) == 0
    assert f16(kernels._address(ggml_cpu, "ggml_vec_dot_f16")) == (1 if "avx512f" in _flags() else 0)


def test_the_tensor_layout_check_agrees_with_this_ggml_and_refuses_another():
    """The K-quant matmul reads `struct ggml_tensor` (native/ggml_abi.h): its layout is checked against tensors the
    loaded ggml builds (1 here), and a tensor that is not what the check asked for (a 1-D one where it asked a
    2-D one: what a moved field reads like) is refused (0), so another layout means ggml's row-by-row path."""
    gate, _ = _gate()
    base = kernels._library("ggml-base")
    abi = gate.orchestrator_exact_abi
    abi.argtypes, abi.restype = [ctypes.c_void_p] * 4, ctypes.c_int
    names = ["ggml_init", "ggml_new_tensor_2d", "ggml_mul_mat", "ggml_free"]
    assert abi(*(kernels._address(base, n) for n in names)) == 1
    names[1] = "ggml_new_tensor_1d"
    assert abi(*(kernels._address(base, n) for n in names)) == 0


@pytest.mark.parametrize("preset", ["tiny-q4", "tiny"])
def test_a_verification_with_the_exact_kernels_equals_ggmls_row_by_row_one(preset):
    """tiny-q4 (Q4_K and Q6_K weights) and tiny (F16 weights), both over an F16 KV cache: a 16-token verification
    under reference kernels gives the same logits, bit for bit, with the gate's exact matmuls as with ggml's own
    row-by-row path (`orchestrator_exact_use(0)`), at two contexts; and the exact path is the one served."""
    gate, _ = _gate()
    served = kernels.gate_tinyblas() or ()
    if not ({"Q4_K", "Q6_K"} if preset == "tiny-q4" else {"F16"}) <= set(served):
        pytest.skip(f"this CPU runs no exact kernel for {preset}'s matmuls (served: {served})")
    use = gate.orchestrator_exact_use
    use.argtypes, use.restype = [ctypes.c_int], None
    e = Engine(ensure_model(preset), n_ctx=1024, n_batch=64, attention=Attention(kernels="reference"))
    try:
        prompt = [100 + (37 * i) % 900 for i in range(300)]
        draft = [200 + (13 * i) % 700 for i in range(16)]
        for context in (40, 300):
            e.clear(0)
            e.decode(0, prompt[:context], 0, want_logits=False)
            snap = e.save_state(0)
            logits = {}
            for mask in (0, 7):
                use(mask)
                e.load_state(0, snap)
                e.verify(0, draft, context)
                logits[mask] = np.stack([e.logits(i) for i in range(len(draft))])
            assert logits[7].tobytes() == logits[0].tobytes(), context
    finally:
        use(7)
        e.close()
