"""One round of the default attention layout's cost (flash attention off, F16 KV cache) in this process's ggml-cpu:
a cold prefill of CONTEXT tokens, then 32 one-token decode steps, with KERNELS ("default" or "reference") for
decode steps. Run once per round and library, alternating (LLAMA_CPP_LIB_PATH picks the library: the one
llama-cpp-python built, or ggml-cpu built with -DGGML_LLAMAFILE=OFF, see README.md).

    python cost.py MODEL CONTEXT KERNELS      # prints one line: prefill tokens/s, decode ms/step"""
import os
import sys
import time
from pathlib import Path

import numpy as np

from orchestrator.engine import Attention, Engine

model, ctx, kernels = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
e = Engine(model, n_ctx=ctx + 256, n_batch=512, n_threads=2, attention=Attention(False, "f16", "f16", kernels))
e.calibrate(8)
prompt = [1000 + (41 * i) % 5000 for i in range(ctx)]
t = time.perf_counter()
e.decode(0, prompt, 0)
prefill = time.perf_counter() - t
tok, steps = int(np.argmax(e.logits())), 32
t = time.perf_counter()
for i in range(steps):
    e.decode(0, [tok], ctx + i)
    tok = int(np.argmax(e.logits()))
decode = (time.perf_counter() - t) / steps
print(f"lib={os.environ.get('LLAMA_CPP_LIB_PATH', 'llama-cpp-python')} kernels={kernels} context={ctx} "
      f"prefill {ctx / prefill:.1f} tokens/s decode {decode * 1000:.2f} ms/step last={tok}", flush=True)
