"""The examples/ agent loop, through the official openai client, against a live server."""

import importlib.util
from pathlib import Path


def load_example():
    path = Path(__file__).resolve().parent.parent / "examples" / "agent_loop.py"
    spec = importlib.util.spec_from_file_location("agent_loop", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_agent_loop_hits_the_cache_on_every_turn_after_the_first(live_server, runtime):
    runtime.cache.clear()
    records = load_example().run(live_server.url + "/v1", max_tokens=16)
    assert len(records) >= 6
    assert records[0]["cached_tokens"] == 0
    for r in records[1:]:
        assert 0 < r["cached_tokens"] < r["prompt_tokens"], r
    # Tool results append to the conversation: each request reuses at least the whole previous prompt's
    # shared part, so reuse grows with the conversation.
    assert records[-1]["cached_tokens"] > records[1]["cached_tokens"]


def test_agent_loop_streaming(live_server, runtime):
    runtime.cache.clear()
    records = load_example().run(live_server.url + "/v1", max_tokens=8, stream=True)
    assert all(r["cached_tokens"] > 0 for r in records[1:])
