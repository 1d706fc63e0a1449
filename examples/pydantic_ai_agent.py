"""A pydantic-ai agent against `python -m orchestrator serve`, through pydantic-ai's OpenAI chat model.

    python -m orchestrator serve &                      # synthetic model, or --model your-qwen3.5.gguf
    python examples/pydantic_ai_agent.py --base-url http://127.0.0.1:8080/v1

The agent has the same read-only tools as examples/agent_loop.py (read_file, list_directory). pydantic-ai sends
the whole conversation on every model request (system prompt, tool schemas, history, tool calls with their
arguments as JSON strings, tool results); the server restores the deepest snapshot of that prefix. The script
prints the prompt and cached tokens of every run (pydantic-ai's usage: input_tokens, cache_read_tokens).

A model that calls tools gets them run by pydantic-ai itself. The synthetic model has random weights and never
calls one, so for each task the example then plays the model's part from the fixed plan of agent_loop.py: it
replaces the model's text reply by the planned tool call, runs the tool, and lets the agent go on from the
tool's result. Use --no-plan to disable that.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic_ai import Agent
from pydantic_ai.messages import ModelRequest, ModelResponse, ToolCallPart, ToolReturnPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_loop import PLAN, SYSTEM_PROMPT, run_tool  # noqa: E402  (the same tools, prompt and plan)


def make_agent(base_url: str, model: str, max_tokens: int, thinking: bool = False) -> Agent:
    """An agent on the server's model with read_file and list_directory tools (greedy, short replies; Qwen3.5's
    thinking off unless `thinking`, so a short reply is an answer rather than cut-off reasoning)."""
    chat = OpenAIChatModel(model, provider=OpenAIProvider(base_url=base_url, api_key="not-needed"))
    agent = Agent(chat, system_prompt=SYSTEM_PROMPT, model_settings={
        "max_tokens": max_tokens, "temperature": 0.0,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": thinking}}})

    @agent.tool_plain
    def read_file(path: str, max_lines: int = 80) -> str:
        """Read a UTF-8 text file from the repository. Returns at most max_lines lines.

        Args:
            path: Path relative to the repository root, e.g. 'orchestrator/cache/snapshots.py'
            max_lines: Maximum number of lines to return
        """
        return run_tool("read_file", {"path": path, "max_lines": max_lines})

    @agent.tool_plain
    def list_directory(path: str) -> str:
        """List the files and folders in a repository directory, with sizes in bytes.

        Args:
            path: Directory relative to the repository root; '.' for the root
        """
        return run_tool("list_directory", {"path": path})

    return agent


def run(base_url: str, model: str = "any", use_plan: bool = True, max_tokens: int = 32) -> list[dict]:
    """Run every task of PLAN; returns one record per agent run: {"run", "input_tokens", "cached_tokens"}."""
    agent = make_agent(base_url, model, max_tokens)
    history: list = []
    records: list[dict] = []
    call_no = 0

    def record(result) -> None:
        usage = result.usage  # a property in pydantic-ai 2 (a method before)
        records.append({"run": len(records), "input_tokens": usage.input_tokens,
                        "cached_tokens": usage.cache_read_tokens, "requests": usage.requests})
        print(f"run {len(records):2d}: {usage.requests} request(s), prompt {usage.input_tokens:5d} tokens, "
              f"cached {usage.cache_read_tokens:5d}")

    for task, planned in PLAN:
        result = agent.run_sync(task, message_history=history)
        record(result)
        history = result.all_messages()
        for name, args in planned if use_plan else []:
            if any(isinstance(p, ToolCallPart) for p in history[-1].parts):
                break  # the model called a tool itself; pydantic-ai already ran it
            call_no += 1
            call_id = f"call_{call_no}"
            # The planned call replaces the model's last text reply, as a real tool-calling model's turn would.
            history = history[:-1] + [
                ModelResponse(parts=[ToolCallPart(name, json.dumps(args), call_id)]),
                ModelRequest(parts=[ToolReturnPart(name, run_tool(name, args), call_id)])]
            result = agent.run_sync(None, message_history=history)
            record(result)
            history = result.all_messages()
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--model", default="any")
    ap.add_argument("--no-plan", action="store_true", help="only run tool calls the model itself makes")
    a = ap.parse_args()
    records = run(a.base_url, a.model, use_plan=not a.no_plan)
    total = sum(r["input_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    print(f"{len(records)} runs, {total} prompt tokens, {cached} cached ({cached / max(total, 1):.0%})")


if __name__ == "__main__":
    main()
