"""Run `python -m llama_cpp.server` with llama.cpp CPU weight repacking off.

llama-cpp-python 0.3.36's server has no setting for `use_extra_bufts`, and with repacking on, prefill of the
Q4_K_M model with more than one token per batch segfaults on this project's CPUs (docs/operations.md, "CPU weight
repacking"). This wrapper makes `llama_model_default_params()` return use_extra_bufts=False, the same as
llama-server's --no-repack and orchestrator's default, then hands over to llama_cpp.server's own entry point
with the same command line. Nothing else in llama_cpp.server is changed.

    python bench/llama_cpp_server_norepack.py --model M.gguf --cache true --cache_type ram ...
"""

from __future__ import annotations

import runpy
import sys

import llama_cpp.llama_cpp as lib

_default = lib.llama_model_default_params


def _no_repack():
    p = _default()
    p.use_extra_bufts = False
    return p


lib.llama_model_default_params = _no_repack

if __name__ == "__main__":
    sys.argv[0] = "llama_cpp.server"
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
