"""Claude Code (the real CLI at the version tests/agents/package-lock.json pins) against a live server on loopback
(tiny model): `claude -p`, then `claude -c -p` continuing the session. Both exit 0, nothing is refused, the second
turn restores at least 90% of its prompt, and each request's answer from the cache equals its cold run. Then
`claude -p --output-format stream-json --verbose`, which asks for thinking display "updates": served (not refused,
so the CLI keeps the field), and the usage the CLI adds up from the stream is the prompt, once.

The random-weight model never ends a turn, and Claude Code exits 1 on a `max_tokens` stop ("Claude's response
exceeded the 16 output token maximum"), so the answers the CLI reads are scripted (conftest.scripted: thinking,
then a short text, stop reason end_turn); everything before them (parsing, rendering, restore, prefill, the
generation itself) is the real run, and the same requests are then checked against cold runs of the model.

What the CLI sends (system[0] a billing line, messages[1] a system message, thinking adaptive with display
omitted, context_management, output_config, a deferred tool) is captured in tests/fixtures/captures/claude-code/."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from server.protocols.anthropic import SIGNATURE_PREFIX, parse_messages
from server.conversation import late_system_as_user

from .agent_support import counters, recorded_server
from .conftest import assert_same_as_cold, scripted


@pytest.fixture(scope="module")
def served(tiny_model):
    with recorded_server(tiny_model) as served:
        yield served


def claude(agent_bin, tmp_path, url: str, *args: str) -> subprocess.CompletedProcess:
    home = tmp_path / "home"
    work = tmp_path / "work"
    home.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "x",
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "16",  # the random model writes gibberish: keep each answer short
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
           "DISABLE_ERROR_REPORTING": "1"}
    return subprocess.run([str(agent_bin / "claude"), *args], cwd=work, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL,  # -p reads a piped stdin to its end
                          timeout=600)


def test_claude_code_two_turns_are_served_and_the_second_restores_the_first(agent_bin, served, tmp_path,
                                                                           monkeypatch):
    rt, srv, recorder = served
    scripted(rt, monkeypatch, "Greeting them.\n</think>\n\nHi.", finish_reason="stop")
    before = counters(srv.url)
    first = claude(agent_bin, tmp_path, srv.url, "-p", "Say hi")
    assert first.returncode == 0, first.stderr + first.stdout
    rt.scheduler.drain()  # the after-generation snapshot lands before the next turn
    mid = counters(srv.url)
    second = claude(agent_bin, tmp_path, srv.url, "-c", "-p", "Say bye")
    assert second.returncode == 0, second.stderr + second.stdout
    rt.scheduler.drain()
    after = counters(srv.url)
    assert after["errors"] == before["errors"], after["error_lines"]  # nothing refused, nothing failed
    turn2_prompt, turn2_cached = after["prompt"] - mid["prompt"], after["cached"] - mid["cached"]
    assert turn2_prompt > 4000  # Claude Code's system prompt and tools
    assert turn2_cached >= 0.9 * turn2_prompt, (turn2_cached, turn2_prompt)

    monkeypatch.undo()
    messages = [body for path, body in recorder.bodies if path == "/v1/messages"]
    assert len(messages) == 2
    turn1, turn2 = messages
    assert turn2["messages"][0] == turn1["messages"][0] and turn2["system"] == turn1["system"]
    answer = turn2["messages"][2]["content"]  # turn 1's answer, as the CLI sends it back
    assert {"type": "text", "text": "Hi."} in answer
    assert all(b["signature"].startswith(SIGNATURE_PREFIX) for b in answer if b["type"] == "thinking"), answer
    for body in messages:  # the answers restored from the CLI's snapshots equal cold runs
        req = parse_messages(body, rt.config)
        assert req.late_system is not None  # messages[1] is a system message: rendered as a user turn
        assert_same_as_cold(rt, late_system_as_user(req.messages), req.tools, **req.template_kwargs)


def test_claude_code_stream_json_keeps_its_thinking_display_and_counts_each_prompt_token_once(agent_bin, served,
                                                                                             tmp_path, monkeypatch):
    rt, srv, recorder = served
    scripted(rt, monkeypatch, "Greeting them.\n</think>\n\nHi.", finish_reason="stop")
    before = counters(srv.url)
    seen = len(recorder.bodies)
    run = claude(agent_bin, tmp_path, srv.url, "-p", "--output-format", "stream-json", "--verbose", "Say hi")
    assert run.returncode == 0, run.stderr + run.stdout
    rt.scheduler.drain()
    after = counters(srv.url)
    assert after["errors"] == before["errors"], after["error_lines"]  # nothing refused (no 4xx), nothing failed
    (body,) = [b for path, b in recorder.bodies[seen:] if path == "/v1/messages"]  # one request: not retried
    assert body["thinking"] == {"type": "adaptive", "display": "updates"}
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    (result,) = [line for line in lines if line.get("type") == "result"]
    assert result["is_error"] is False and result["result"] == "Hi."
    usage = result["usage"]  # what the CLI added up from message_start and message_delta
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"] \
        == after["prompt"] - before["prompt"]
