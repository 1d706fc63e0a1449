"""Real clients against a live server (tiny model): the official openai client (streaming, tool-call history,
usage) and the pydantic-ai agent framework, through the examples in examples/."""

import importlib.util
import json
from pathlib import Path

from openai import OpenAI

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pydantic_ai_agent_runs_tools_and_hits_the_cache(live_server, runtime):
    runtime.cache.clear()
    records = load("pydantic_ai_agent").run(live_server.url + "/v1", max_tokens=8)
    plan = load("agent_loop").PLAN
    assert len(records) == len(plan) + sum(len(steps) for _, steps in plan)
    assert records[0]["cached_tokens"] == 0
    for r in records[1:]:
        # Every later run resends the system prompt, tools and history (tool calls included): a hit.
        assert 0 < r["cached_tokens"] < r["input_tokens"], r
    assert records[-1]["input_tokens"] > records[1]["input_tokens"]


def test_openai_client_streams_reasoning_content_and_usage(live_server, runtime):
    runtime.cache.clear()
    client = OpenAI(base_url=live_server.url + "/v1", api_key="unused")
    mod = load("agent_loop")
    messages = [{"role": "system", "content": mod.SYSTEM_PROMPT},
                {"role": "user", "content": "List the repository root."},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "list_directory", "arguments": json.dumps({"path": "."})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": mod.run_tool("list_directory", {"path": "."})}]
    usages, text = [], []
    for _ in range(2):
        stream = client.chat.completions.create(model="any", messages=messages, tools=mod.TOOLS, max_tokens=8,
                                                temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[-1].choices == [] or chunks[-1].choices[0].finish_reason is not None
        usages.append(chunks[-1].usage)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        text.append("".join((d.content or "") + (getattr(d, "reasoning_content", None) or "") for d in deltas))
    assert usages[0].prompt_tokens == usages[1].prompt_tokens > 0
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    assert usages[1].prompt_tokens_details.cached_tokens == usages[1].prompt_tokens  # a repeat: restored whole
    assert usages[1].completion_tokens == 8 and text[0] == text[1]  # greedy: the cached run says the same
