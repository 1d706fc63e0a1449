"""A coding-agent loop against `python -m orchestrator serve`, through the official openai client.

    python -m orchestrator serve &                      # synthetic model, or --model your-qwen3.5.gguf
    python examples/agent_loop.py --base-url http://127.0.0.1:8080/v1

The agent has two tools (read_file, list_directory) over this repository, read-only. Every request resends the
whole conversation (system prompt, tool schemas, history, tool results), as agent frameworks do; the server
restores the deepest snapshot of that prefix and prints how many prompt tokens were cached.

With a model that emits tool calls, the loop runs them. The synthetic model has random weights and never
does, so for each task the example then plays the model's part from a fixed plan (`PLAN`): it appends the
assistant turn with the planned tool call and the tool's real result, exactly the messages a real model's
turn would have produced. Use --no-plan to disable that.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from openai import OpenAI

ROOT = Path(__file__).resolve().parent.parent

SYSTEM_PROMPT = """You are Orchard, a senior software engineer pairing with a user on a Python repository.
You can inspect the repository with tools before answering.

Rules:
- Read the relevant files before making claims about them; quote file paths exactly.
- Prefer small, reviewable changes and explain the reasoning behind each in one or two sentences.
- When a question is ambiguous, state your assumption and continue.
- Never invent APIs: if something is not in the files you read, say so.
- Keep answers under 200 words unless the user asks for detail; use fenced code blocks for code.
"""

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file",
        "description": "Read a UTF-8 text file from the repository. Returns at most max_lines lines.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path relative to the repository root, e.g. 'orchestrator/cache/snapshots.py'"},
            "max_lines": {"type": "integer", "description": "Maximum number of lines to return", "default": 80}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "list_directory",
        "description": "List the files and folders in a repository directory, with sizes in bytes.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Directory relative to the repository root; '.' for the root"}},
            "required": ["path"]}}},
]

PLAN = [
    ("What does this repository do? Look at the layout first.",
     [("list_directory", {"path": "."}), ("read_file", {"path": "README.md", "max_lines": 40})]),
    ("How does the snapshot cache decide what to evict?", [("read_file", {"path": "orchestrator/cache/snapshots.py"})]),
    ("And where are the snapshots taken during prefill?", [("read_file", {"path": "orchestrator/scheduler.py",
                                                                         "max_lines": 60})]),
]


def run_tool(name: str, args: dict) -> str:
    """Execute a tool call, read-only, inside the repository."""
    try:
        target = (ROOT / args.get("path", ".")).resolve()
        if ROOT not in (target, *target.parents):
            return "error: path is outside the repository"
        if name == "read_file":
            lines = target.read_text(encoding="utf-8").splitlines()[: int(args.get("max_lines", 80))]
            return "\n".join(lines)
        if name == "list_directory":
            return "\n".join(f"{p.name}{'/' if p.is_dir() else ''}\t{p.stat().st_size}"
                             for p in sorted(target.iterdir()) if not p.name.startswith("."))
        return f"error: unknown tool {name}"
    except OSError as e:
        return f"error: {e}"


def run(base_url: str, model: str | None = None, use_plan: bool = True, max_tokens: int = 48,
        stream: bool = False) -> list[dict]:
    """Run every task of PLAN; returns one record per request: {"turn", "prompt_tokens", "cached_tokens"}."""
    client = OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "not-needed"))
    model = model or client.models.list().data[0].id
    messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}]
    records: list[dict] = []
    call_no = 0

    def ask() -> object:
        nonlocal call_no
        if stream:
            chunks = list(client.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}))
            usage = chunks[-1].usage
            text = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
            message = {"role": "assistant", "content": text}
            by_index: dict[int, dict] = {}  # streamed tool calls, put together by index as the openai docs do
            for c in chunks:
                for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                    call = by_index.setdefault(tc.index, {"id": "", "type": "function",
                                                          "function": {"name": "", "arguments": ""}})
                    call["id"] = tc.id or call["id"]
                    call["function"]["name"] += tc.function.name or ""
                    call["function"]["arguments"] += tc.function.arguments or ""
            calls = [by_index[i] for i in sorted(by_index)]
            if calls:
                message["tool_calls"] = calls
        else:
            resp = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                  max_tokens=max_tokens, temperature=0)
            usage = resp.usage
            msg = resp.choices[0].message
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                     for c in msg.tool_calls or []]
            message = {"role": "assistant", "content": msg.content or ""}
            if calls:
                message["tool_calls"] = calls
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        records.append({"turn": len(records), "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached})
        print(f"request {len(records):2d}: prompt {usage.prompt_tokens:5d} tokens, cached {cached:5d}")
        return message, calls

    for task, planned in PLAN:
        messages.append({"role": "user", "content": task})
        plan = list(planned)
        for _step in range(6):
            message, calls = ask()
            if not calls and use_plan and plan:
                name, args = plan.pop(0)
                call_no += 1
                calls = [{"id": f"call_{call_no}", "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args)}}]
                message = {"role": "assistant", "content": "", "tool_calls": calls}
            messages.append(message)
            if not calls:
                break
            for c in calls:
                args = json.loads(c["function"]["arguments"] or "{}")
                messages.append({"role": "tool", "tool_call_id": c["id"],
                                 "content": run_tool(c["function"]["name"], args)})
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--model", default=None)
    ap.add_argument("--no-plan", action="store_true", help="only run tool calls the model itself makes")
    ap.add_argument("--stream", action="store_true")
    a = ap.parse_args()
    records = run(a.base_url, a.model, use_plan=not a.no_plan, stream=a.stream)
    total = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    print(f"{len(records)} requests, {total} prompt tokens, {cached} cached ({cached / max(total, 1):.0%})")


if __name__ == "__main__":
    main()
