"""pi (the real CLI at the version tests/agents/package-lock.json pins) with a model marked "reasoning": true, and
aider's two-prompt session replayed from its captured requests (tests/fixtures/captures/aider/), against a live
server on loopback (tiny model). pi's request (reasoning_effort "medium") is served and its cached answer equals the
cold run; aider's second turn restores at least through the message before the one it rewrote."""

from __future__ import annotations

import json
import os
import subprocess

import httpx
import pytest

from server.protocols.openai_chat import parse_chat

from .agent_support import capture, counters, recorded_server
from .conftest import assert_same_as_cold


@pytest.fixture(scope="module")
def served(tiny_model):
    with recorded_server(tiny_model) as served:
        yield served


def test_pi_with_a_reasoning_model_is_served(agent_bin, served, tmp_path):
    rt, srv, recorder = served
    home = tmp_path / "home"
    (home / ".pi" / "agent").mkdir(parents=True)
    (home / ".pi" / "agent" / "models.json").write_text(json.dumps({"providers": {"orchestrator": {
        "baseUrl": srv.url + "/v1", "api": "openai-completions", "apiKey": "unused",
        "models": [{"id": "qwen3.5", "reasoning": True, "maxTokens": 16}]}}}))
    before = counters(srv.url)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "PI_OFFLINE": "1"}
    done = subprocess.run([str(agent_bin / "pi"), "--no-session", "--model", "orchestrator/qwen3.5", "-p", "Say hi"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=600)
    assert done.returncode == 0, done.stderr + done.stdout
    rt.scheduler.drain()
    assert counters(srv.url)["errors"] == before["errors"]
    (body,) = [b for path, b in recorder.bodies if path == "/v1/chat/completions"]
    assert body["reasoning_effort"] == "medium" and body["store"] is False
    req = parse_chat(body, rt.config)
    assert req.template_kwargs == {"enable_thinking": True}
    assert_same_as_cold(rt, req.messages, req.tools, **req.template_kwargs)


def test_aiders_second_turn_restores_through_the_message_before_the_rewritten_one(served):
    rt, srv, _ = served
    rt.scheduler.drain()
    rt.cache.clear()
    turn1, turn2 = capture("aider", "turn1")["body"], capture("aider", "turn2")["body"]
    # the shapes: turn 2 sends turn 1's last user message back without the instruction block appended to it
    rewritten = len(turn1["messages"]) - 1
    assert turn2["messages"][:rewritten] == turn1["messages"][:rewritten]
    assert turn1["messages"][rewritten]["content"].startswith(turn2["messages"][rewritten]["content"])
    assert len(turn1["messages"][rewritten]["content"]) > len(turn2["messages"][rewritten]["content"]) + 500

    def ask(body, **extra):
        r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 8, **extra},
                       timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    ask(turn1)
    rt.scheduler.drain()
    warm = ask(turn2)
    req = parse_chat(turn2, rt.config)
    before = rt.prompts.chat(req.messages, req.tools, req.template_kwargs).boundaries.message_ends[rewritten - 1]
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= before
    cold = ask(turn2, cache_prompt=False)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
