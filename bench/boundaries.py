"""Boundary detection time against conversation length (template rendering only, no model).

    python -m bench boundaries [--template templates/qwen3.5.jinja] [--messages 100 800]

Builds an agent-style conversation (system, tools, then user / assistant tool call / tool result turns) of N
messages and times BoundaryDetector.char_boundaries on it (median of 3, seconds): cold (a fresh detector) and
warm (the detector saw the same conversation without its last two messages, as in an agent loop).
Writes bench/results/<date>/boundaries.json. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from bench.common import ROOT, results_dir, write_json
from orchestrator.prompt.boundaries import BoundaryDetector
from orchestrator.prompt.template import ChatTemplate

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def conversation(n: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a coding agent. " * 20}]
    k = 0
    while len(msgs) < n:
        k += 1
        msgs.append({"role": "user", "content": f"Task {k}: look at file {k}."})
        msgs.append({"role": "assistant", "content": "", "tool_calls": [{"id": f"c{k}", "type": "function",
                     "function": {"name": "read_file", "arguments": {"path": f"f{k}.py"}}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{k}", "content": f"print({k})\n" * 10})
        msgs.append({"role": "assistant", "content": f"File {k} prints {k}."})
    return msgs[:n]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--template", default=str(ROOT / "templates" / "qwen3.5.jinja"))
    ap.add_argument("--messages", type=int, nargs="+", default=[100, 800])
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    tpl = ChatTemplate.from_file(Path(a.template))
    rows = []
    for n in a.messages:
        msgs = conversation(n)
        if msgs[-1]["role"] == "assistant":
            msgs.append({"role": "user", "content": "next?"})
        text = tpl.render(msgs, TOOLS, add_generation_prompt=True)
        cold, warm = [], []
        for _ in range(3):
            det = BoundaryDetector(tpl)
            t0 = time.perf_counter()
            out = det.char_boundaries(msgs, TOOLS, text, {})
            cold.append(time.perf_counter() - t0)
            det = BoundaryDetector(tpl)
            det.char_boundaries(msgs[:-2], TOOLS, tpl.render(msgs[:-2], TOOLS, add_generation_prompt=True), {})
            t0 = time.perf_counter()
            det.char_boundaries(msgs, TOOLS, text, {})
            warm.append(time.perf_counter() - t0)
        found = sum(1 for e in out.message_ends if e is not None)
        print(f"{len(msgs)} messages, {len(text)} chars: cold {statistics.median(cold):.3f} s, "
              f"warm {statistics.median(warm):.3f} s ({found} message ends found)")
        rows.append({"messages": len(msgs), "chars": len(text), "cold_s": cold, "warm_s": warm,
                     "message_ends_found": found})
    write_json(a.out or results_dir() / "boundaries.json",
               {"template": a.template, "rows": rows, "load_average": os.getloadavg()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
