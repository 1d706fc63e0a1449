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


def _kquant_check(gate: ctypes.CDLL, ggml_cpu: ctypes.CDLL, q4_K: str, q6_K: str, q5_K: str) -> int:
    check = gate.orchestrator_exact_kquants
    check.argtypes, check.restype = [ctypes.c_void_p] * 5, ctypes.c_int
    names = (q4_K, q6_K, q5_K, "quantize_row_q8_K", "ggml_barrier")
    return check(*(kernels._address(ggml_cpu, name) for name in names))


def test_the_kernels_this_cpu_can_run_agree_with_the_library_and_are_used():
    """On x86 with AVX2/FMA/F16C the Q4_K, Q5_K and Q6_K kernels, with AVX512F the F16 one, agree with
    llama-cpp-python's own build at install; elsewhere (aarch64) there are none and ggml computes row by row."""
    if not kernels.has_llamafile():
        assert kernels.reference_matmuls() == "vec_dot"
        return
    flags = _flags()
    expected = set()
    if platform.machine() == "x86_64" and {"avx2", "fma", "f16c"} <= flags:
        expected |= {"Q4_K", "Q5_K", "Q6_K"}
    if platform.machine() == "x86_64" and {"avx512f", "f16c"} <= flags:
        expected.add("F16")
    assert set(kernels.gate_tinyblas() or ()) == expected
    assert kernels.reference_matmuls().endswith(" ".join(k for k in ("F16", "Q4_K", "Q5_K", "Q6_K") if k in expected))


def test_the_check_refuses_kernels_that_sum_otherwise():
    """The check compares, it does not assume: given each other's one-row kernels as the library's, the Q4_K, Q6_K
    and Q5_K copies agree with none (0), where with the right ones every copy the CPU runs agrees (AVX2 copies:
    bits 1, 2, 4; AVX512 copies: 8, 16, 32). The F16 check refuses BF16's kernel."""
    if platform.machine() != "x86_64" or not {"avx2", "fma", "f16c"} <= _flags() or not kernels.has_llamafile():
        pytest.skip("the exact kernels are x86 (AVX2) only; elsewhere test_the_kernels_this_cpu_can_run covers it")
    gate, ggml_cpu = _gate()
    wide = {"avx512f", "avx512vl", "avx512bw", "avx512dq"} <= _flags()
    q4, q5, q6 = "ggml_vec_dot_q4_K_q8_K", "ggml_vec_dot_q5_K_q8_K", "ggml_vec_dot_q6_K_q8_K"
    assert _kquant_check(gate, ggml_cpu, q4, q6, q5) == (63 if wide else 7)
    assert _kquant_check(gate, ggml_cpu, q6, q5, q4) == 0
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


def _q5_k_m(tmp_path_factory) -> Path:
    """The tiny F16 preset quantized Q5_K_M by llama.cpp's quantizer: its rows 256 wide or more are Q5_K (8
    matrices), the narrower ones Q5_1 and Q8_0 (llama.cpp's fallback for rows that are not whole K-quant blocks)."""
    import llama_cpp

    out = tmp_path_factory.mktemp("q5") / "tiny-q5_k_m.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = 17  # LLAMA_FTYPE_MOSTLY_Q5_K_M
    assert llama_cpp.llama_model_quantize(str(ensure_model("tiny")).encode(), str(out).encode(),
                                          ctypes.byref(params)) == 0
    return out


@pytest.mark.parametrize("preset,types", [("tiny-q4", {"Q4_K", "Q6_K"}), ("tiny", {"F16"}),
                                          ("tiny-q5_k_m", {"Q5_K"})])
def test_a_verification_with_the_exact_kernels_equals_ggmls_row_by_row_one(preset, types, tmp_path_factory):
    """tiny-q4 (Q4_K and Q6_K weights), tiny (F16 weights) and tiny quantized Q5_K_M, all over an F16 KV cache: a
    16-token verification under reference kernels gives the same logits, bit for bit, with the gate's exact
    matmuls as with ggml's own row-by-row path (`orchestrator_exact_use(0)`), at two contexts; and the exact path
    is the one served."""
    gate, _ = _gate()
    served = kernels.gate_tinyblas() or ()
    if not types <= set(served):
        pytest.skip(f"this CPU runs no exact kernel for {preset}'s matmuls (served: {served})")
    use = gate.orchestrator_exact_use
    use.argtypes, use.restype = [ctypes.c_int], None
    model = _q5_k_m(tmp_path_factory) if preset == "tiny-q5_k_m" else ensure_model(preset)
    e = Engine(model, n_ctx=1024, n_batch=64, attention=Attention(kernels="reference"))
    try:
        prompt = [100 + (37 * i) % 900 for i in range(300)]
        draft = [200 + (13 * i) % 700 for i in range(16)]
        for context in (40, 300):
            e.clear(0)
            e.decode(0, prompt[:context], 0, want_logits=False)
            snap = e.save_state(0)
            logits = {}
            for mask in (0, 15):
                use(mask)
                e.load_state(0, snap)
                e.verify(0, draft, context)
                logits[mask] = np.stack([e.logits(i) for i in range(len(draft))])
            assert logits[15].tobytes() == logits[0].tobytes(), context
    finally:
        use(15)
        e.close()
