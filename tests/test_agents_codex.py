"""The real clients of POST /v1/responses on loopback against a live server (tiny model): the Codex CLI (pinned in
tests/agents/package.json, installed by the `agent_bin` fixture) and the OpenAI Agents SDK (openai-agents, the
[test] extra) with its default model, which speaks the Responses API.

Each test runs the client as its users do, then checks that nothing was refused (orchestrator_request_errors_total
unchanged), that the next turn restored its prefix (cached_tokens), and replays every request the client sent,
greedy, with the cache and cold (cache_prompt: false): the same answer.

The random-weight model never ends an answer by itself: every answer would stop at the output budget, which the
Responses API reports as status "incomplete" (response.incomplete), and Codex reports that as an error
("Incomplete response returned, reason: max_output_tokens"). So these tests end the model's answers as a trained
model's would (finish_reason "stop", the text unchanged) and, for the Agents SDK's tool round, script what the model
says (conftest.scripted)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

import server.app
from orchestrator.request import Event

from .agent_support import readme_blocks
from .conftest import serving

MAX_TOKENS = 8  # the server's default budget (-n/--max-tokens): Codex 0.171 sends no output budget
# (model_max_output_tokens is ignored: "unrecognized configuration setting")


class Session:
    """What a client sent and what it got: the /v1/responses bodies (as parsed by the route) and each job's
    result; `say`: texts the model says instead of its own, in order (then its own); every answer ends with
    finish_reason "stop"."""

    def __init__(self, rt, monkeypatch, say: list[str] = ()) -> None:
        self.bodies: list[dict] = []
        self.results = []
        self.say = list(say)
        parse = server.app.parse_responses

        def record(body, cfg=None):
            self.bodies.append(json.loads(json.dumps(body)))
            return parse(body, cfg)

        monkeypatch.setattr(server.app, "parse_responses", record)
        submit = rt.scheduler.submit

        def fake(job, sink, *args):
            text = self.say.pop(0) if self.say else None
            sent = []

            def wrap(ev: Event) -> None:
                if text is not None and ev.kind == "text":
                    if not sent:
                        sent.append(True)
                        sink(Event("text", text=text))
                    return
                if ev.kind == "done":
                    result = dataclasses.replace(ev.result, finish_reason="stop",
                                                 text=ev.result.text if text is None else text)
                    if text is not None and not sent:
                        sink(Event("text", text=text))
                    self.results.append(result)
                    ev = Event("done", result=result)
                sink(ev)

            return submit(job, wrap, *args)

        monkeypatch.setattr(rt.scheduler, "submit", fake)


def errors_total(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("orchestrator_request_errors_total{"))


def assert_replays_equal_cold(url: str, bodies: list[dict]) -> None:
    """Each body again, greedy and not streamed: with the cache, then cold: the same output."""
    for body in bodies:
        body = {**body, "stream": False, "temperature": 0}
        warm = httpx.post(url + "/v1/responses", json=body, timeout=600).json()
        cold = httpx.post(url + "/v1/responses", json={**body, "cache_prompt": False}, timeout=600).json()
        assert cold["usage"]["input_tokens_details"]["cached_tokens"] == 0
        assert warm["usage"]["input_tokens"] == cold["usage"]["input_tokens"]
        strip = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in warm["output"]]
        assert strip == [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in cold["output"]]


@pytest.fixture(scope="module")
def served(tiny_model):
    with serving(tiny_model, max_tokens_default=MAX_TOKENS) as (rt, srv):
        yield rt, srv


def codex_exec(bin_dir: Path, home: Path, repo: Path, prompt: str) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home / ".codex"),
           "OPENAI_API_KEY": "unused", "NO_COLOR": "1"}
    return subprocess.run([str(bin_dir / "codex"), "exec", prompt], cwd=repo, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=600)


def test_codex_exec_twice_in_one_repository(agent_bin, served, tmp_path, monkeypatch):
    rt, srv = served
    home, repo = tmp_path / "home", tmp_path / "repo"
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text(readme_blocks("Codex CLI", "toml", srv.url)[0])  # README's
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / "README.md").write_text("# scratch\n")
    session = Session(rt, monkeypatch)
    before = errors_total(srv.url)
    for prompt in ("Say hi.", "Say hi again."):
        run = codex_exec(agent_bin, home, repo, prompt)
        assert run.returncode == 0, run.stderr[-2000:]
    assert errors_total(srv.url) == before
    assert len(session.bodies) == 2 and all(b["store"] is False and b["stream"] for b in session.bodies)
    first, second = session.results
    assert first.cached_tokens == 0 and second.cached_tokens >= 0.8 * second.prompt_tokens
    monkeypatch.undo()
    assert_replays_equal_cold(srv.url, session.bodies[1:])


def test_openai_agents_sdk_two_turns_with_a_function_tool(served, monkeypatch):
    from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled
    from openai import AsyncOpenAI
    from openai.types.shared import Reasoning

    rt, srv = served
    calls = []

    @function_tool
    def find_book(title: str) -> str:
        """Find a book in the library's catalogue."""
        calls.append(title)
        return f"{title}: shelf 12, two copies available."

    call = "<tool_call>\n<function=find_book>\n<parameter=title>\nDune\n</parameter>\n</function>\n</tool_call>"
    session = Session(rt, monkeypatch, say=[call, "Dune is on shelf 12."])
    before = errors_total(srv.url)
    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0),
                              use_for_tracing=False)
    agent = Agent(name="Librarian", instructions="You are the help desk of a public library.", tools=[find_book],
                  model_settings=ModelSettings(max_tokens=MAX_TOKENS, reasoning=Reasoning(effort="none")))

    async def two_turns():
        first = await Runner.run(agent, "Is Dune on the shelf?")
        second = await Runner.run(agent, first.to_input_list() + [{"role": "user", "content": "Thanks. Who wrote it?"}])
        return first, second

    first, second = asyncio.run(two_turns())
    assert calls == ["Dune"] and first.final_output == "Dune is on shelf 12."
    assert isinstance(second.final_output, str)
    assert errors_total(srv.url) == before
    assert len(session.bodies) == 3
    assert [i.get("type") for i in session.bodies[1]["input"]][1:] == ["function_call", "function_call_output"]
    # Both later requests restore the first one's prompt but its generation prompt: Qwen3.5's template renders
    # the tool-calling assistant turn with an empty think block only while it follows the last user message,
    # so turn 2 diverges there (the template's rule, not the route's)
    assert all(r.cached_tokens >= session.results[0].prompt_tokens - 8 for r in session.results[1:])
    monkeypatch.undo()
    assert_replays_equal_cold(srv.url, session.bodies)
