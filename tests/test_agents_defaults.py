"""Every agent client at its own defaults against a server at its defaults (issue 39): Claude Code, Codex,
opencode and pi (the CLIs tests/agents/package-lock.json pins), aider (pip, its own venv) and the OpenAI Agents SDK,
each set up exactly as README.md's section for it says (its code blocks are read from the README: a flag, variable
or setting the client does not know cannot be documented) with only the base URL, key and model name given: no
completion budget, thinking left as the client sends it. The server is `serve --model M` as a user starts it
(the CLI's defaults: context from the model, no default budget, 4 slots, disk tier), with only the snapshot RAM
bounded for this shared 2-core machine.

Each client runs three turns. Every run exits 0, nothing is refused (orchestrator_request_errors_total unchanged),
every answer ends (finish_reason "stop", no `length` cut), and every later turn restores at least 90% of its
prompt (aider: all of it through the message before the one it rewrites, which is where its prompts diverge; the
Agents SDK program, whose whole conversation is 300 tokens: all of the conversation before it).

The answers come from the synthetic model whose answers end (conftest's `ending_model`: random weights, but
`</think>` and `<|im_end|>` become likely after a few dozen tokens), so nothing the clients read is scripted."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import cli
from orchestrator.request import Event
from server.protocols.responses import parse_responses
from server.protocols.openai_chat import parse_chat

from .agent_support import README_URL, Recorder, counters, readme_blocks, recorded_server, shell_lines
from .conftest import AGENTS_DIR

RESTORED = 0.9  # the share of each later turn's prompt restored from the cache
CLIENT_TIMEOUT = 600  # seconds one client run may take
AIDER_VENV = AGENTS_DIR / "aider-venv"
AIDER_REQUIREMENTS = AGENTS_DIR / "aider-requirements.txt"


def user_config(model: Path):
    """The Config of `python -m orchestrator serve --model MODEL --cache-ram 2048`: the CLI's defaults, the
    snapshot RAM bounded for a machine shared with other test runs."""
    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers(dest="cmd"))
    return cli._config(parser.parse_args(["serve", "--model", str(model), "--cache-ram", "2048"]))


@pytest.fixture(scope="module")
def served(ending_model):
    """(runtime, live server, recorder of the request bodies)."""
    config = user_config(ending_model)
    assert config.max_tokens_default is None and config.ctx_size is None  # no budget, the model's context
    with recorded_server(config) as served:
        yield served


class Answers:
    """Every job the server runs while installed: (turn, job, result), `turn` as set when the job was submitted."""

    def __init__(self, rt, monkeypatch) -> None:
        self.turn = 0
        self.done: list[tuple[int, object, object]] = []
        submit = rt.scheduler.submit

        def wrapped(job, sink, *args):
            turn = self.turn

            def wrap(ev: Event) -> None:
                if ev.kind == "done":
                    self.done.append((turn, job, ev.result))
                sink(ev)

            return submit(job, wrap, *args)

        monkeypatch.setattr(rt.scheduler, "submit", wrapped)

    def check(self, turns: int, restored: bool = True) -> list[float]:
        """Every turn ran, every answer ended (no cut) and (`restored`) every later turn restored RESTORED of its
        prompt; returns each turn's restored share."""
        assert {t for t, _, _ in self.done} == set(range(1, turns + 1)), [t for t, _, _ in self.done]
        assert all(r.finish_reason == "stop" for _, _, r in self.done), [r.finish_reason for _, _, r in self.done]
        assert all(r.completion_tokens for _, _, r in self.done)
        shares = []
        for turn in range(1, turns + 1):
            prompt = sum(r.prompt_tokens for t, _, r in self.done if t == turn)
            cached = sum(r.cached_tokens for t, _, r in self.done if t == turn)
            shares.append(cached / prompt)
            if turn > 1 and restored:
                assert cached >= RESTORED * prompt, (turn, cached, prompt, self.summary())
        return shares

    def summary(self) -> list[tuple]:
        return [(t, r.prompt_tokens, r.cached_tokens, len(r.completion_tokens), r.finish_reason)
                for t, _, r in self.done]


@contextlib.contextmanager
def session(served, monkeypatch):
    """Answers installed for one test; on leaving, nothing refused."""
    rt, srv, _ = served
    rt.scheduler.drain()
    before = counters(srv.url)
    answers = Answers(rt, monkeypatch)
    yield answers
    rt.scheduler.drain()
    after = counters(srv.url)
    assert after["errors"] == before["errors"], after["error_lines"]  # no 4xx or 5xx


def run(argv: list[str], cwd: Path, env: dict, stdin: str | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, cwd=cwd, env={"PATH": os.environ["PATH"], **env}, input=stdin,
                          stdin=None if stdin is not None else subprocess.DEVNULL,  # -p modes read a piped stdin
                          capture_output=True, text=True, timeout=CLIENT_TIMEOUT)
    assert done.returncode == 0, (argv, done.stderr[-3000:], done.stdout[-3000:])
    return done


def turns(answers: Answers, rt, argvs: list[list[str]], cwd: Path, env: dict) -> None:
    """Run each argv as turn 1, 2, ... (the after-generation snapshot lands between turns, as a person's pause
    lets it)."""
    for turn, argv in enumerate(argvs, 1):
        answers.turn = turn
        run(argv, cwd, env)
        rt.scheduler.drain()


def bodies_since(recorder: Recorder, start: int, path: str) -> list[dict]:
    return [b for p, b in recorder.bodies[start:] if p == path]


def git_repo(path: Path) -> Path:
    path.mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=path, check=True)
    (path / "README.md").write_text("# scratch\n\nA scratch repository.\n")
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "add", "."], cwd=path, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"], cwd=path,
                   check=True)
    return path


def readme_cli(heading: str, url: str, program: Path) -> tuple[dict[str, str], list[str], list[str]]:
    """README.md's shell block of a CLI client: (its exported variables, the argv of its first turn and of its
    continuing turn, the prompt left off, the program replaced by `program`)."""
    env, commands = shell_lines(readme_blocks(heading, "sh")[0].replace(README_URL, url))
    assert len(commands) == 2, commands
    first, later = ([str(program), *c[1:-1]] for c in commands)  # the last word is the prompt
    return env, first, later


def test_claude_code_at_its_defaults(agent_bin, served, tmp_path, monkeypatch):
    """`claude -p`, then `claude -c -p` twice, with only README.md's variables: thinking on (adaptive), its own
    budget (128,000: above --max-tokens-limit, served up to it)."""
    rt, srv, recorder = served
    env, first, later = readme_cli("Claude Code", srv.url, agent_bin / "claude")
    assert set(env) <= {"ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC",
                        "DISABLE_AUTOUPDATER", "DISABLE_TELEMETRY"}, env  # no budget, no thinking switch
    assert first[1:] == ["-p"] and later[1:] == ["-c", "-p"]
    (tmp_path / "work").mkdir()
    start = len(recorder.bodies)
    with session(served, monkeypatch) as answers:
        turns(answers, rt, [first + ["Say hi"], later + ["Say it again"], later + ["Now say bye"]], tmp_path / "work",
              {"HOME": str(tmp_path / "home"), **env})
    shares = answers.check(3)
    messages = bodies_since(recorder, start, "/v1/messages")
    assert len(messages) >= 3
    assert all(b["thinking"]["type"] != "disabled" and b["max_tokens"] > rt.config.max_tokens_limit
               for b in messages), [(b.get("thinking"), b["max_tokens"]) for b in messages]
    print("claude code: restored", shares, answers.summary())


def codex_setup(agent_bin: Path, url: str, tmp_path: Path) -> tuple[str, Path, dict]:
    """(the codex program, a scratch repository, its environment) with README.md's config.toml in a scratch
    CODEX_HOME: no output budget, no reasoning effort."""
    (config,) = readme_blocks("Codex CLI", "toml", url)
    assert "model_reasoning_effort" not in config and "max_output_tokens" not in config
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text(config)
    env = {"HOME": str(home), "CODEX_HOME": str(home / ".codex"), "OPENAI_API_KEY": "unused"}
    return str(agent_bin / "codex"), git_repo(tmp_path / "repo"), env


def test_codex_at_its_defaults(agent_bin, served, tmp_path, monkeypatch):
    """`codex exec` three times in one repository with README.md's config.toml: no output budget, no reasoning
    effort (thinking on)."""
    rt, srv, recorder = served
    codex, repo, env = codex_setup(agent_bin, srv.url, tmp_path)
    start = len(recorder.bodies)
    with session(served, monkeypatch) as answers:
        turns(answers, rt, [[codex, "exec", p] for p in ("Say hi.", "Say hi again.", "Say bye.")], repo, env)
    shares = answers.check(3)
    responses = bodies_since(recorder, start, "/v1/responses")
    assert len(responses) >= 3
    assert all("max_output_tokens" not in b and (b.get("reasoning") or {}).get("effort") in (None, "medium", "high")
               for b in responses), [(b.get("max_output_tokens"), b.get("reasoning")) for b in responses]
    print("codex: restored", shares, answers.summary())


def test_opencode_at_its_defaults(agent_bin, served, tmp_path, monkeypatch):
    """`opencode run`, then `opencode run --continue` twice, with README.md's opencode.json in its config
    directory: its own budget (32,000), no thinking switch."""
    rt, srv, recorder = served
    (config,) = readme_blocks("opencode", "json", srv.url)
    env, first, later = readme_cli("opencode", srv.url, agent_bin / "opencode")
    assert first[1:] == ["run"] and later[1:] == ["run", "--continue"]
    home = tmp_path / "home"
    (home / ".config" / "opencode").mkdir(parents=True)
    (home / ".config" / "opencode" / "opencode.json").write_text(config)
    repo = git_repo(tmp_path / "repo")
    start = len(recorder.bodies)
    with session(served, monkeypatch) as answers:
        turns(answers, rt, [first + ["Say hi"], later + ["Say it again"], later + ["Now say bye"]], repo,
              {"HOME": str(home), **env})
    shares = answers.check(3)
    chats = bodies_since(recorder, start, "/v1/chat/completions")
    assert len(chats) >= 4  # turn 1 also asks for the session's title
    assert all("chat_template_kwargs" not in b and "reasoning_effort" not in b for b in chats)
    print("opencode: restored", shares, answers.summary())


def test_pi_at_its_defaults(agent_bin, served, tmp_path, monkeypatch):
    """`pi --model orchestrator/qwen3.5 -p`, then `-c -p` twice, with README.md's models.json ("reasoning": true:
    reasoning_effort "medium", thinking on; pi's own max_completion_tokens)."""
    rt, srv, recorder = served
    (models,) = readme_blocks("pi", "json", srv.url)
    env, first, later = readme_cli("pi", srv.url, agent_bin / "pi")
    assert first[1:] == ["--model", "orchestrator/qwen3.5", "-p"] and later[1:] == first[1:-1] + ["-c", "-p"]
    home = tmp_path / "home"
    (home / ".pi" / "agent").mkdir(parents=True)
    (home / ".pi" / "agent" / "models.json").write_text(models)
    (tmp_path / "work").mkdir()
    start = len(recorder.bodies)
    with session(served, monkeypatch) as answers:
        turns(answers, rt, [first + ["Say hi"], later + ["Say it again"], later + ["Now say bye"]], tmp_path / "work",
              {"HOME": str(home), **env})
    shares = answers.check(3)
    chats = bodies_since(recorder, start, "/v1/chat/completions")
    assert len(chats) == 3 and all(b["reasoning_effort"] == "medium" for b in chats)
    print("pi: restored", shares, answers.summary())


NETWORK_ERRORS = re.compile(r"NewConnectionError|Failed to establish a new connection|Temporary failure in name "
                            r"resolution|Name or service not known|Network is unreachable|ConnectTimeout|"
                            r"Could not fetch URL|ProxyError", re.I)


@pytest.fixture(scope="session")
def aider_bin() -> Path:
    """aider at the version tests/agents/aider-requirements.txt pins, installed on first use with pip into a venv
    of its own, tests/agents/aider-venv (its pinned dependencies conflict with this project's; a few minutes
    once). Skips, saying so, only where pip cannot reach the package index."""
    stamp = AIDER_VENV / ".installed-requirements"
    wanted = AIDER_REQUIREMENTS.read_bytes()
    if not stamp.exists() or stamp.read_bytes() != wanted:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(AIDER_VENV)], check=True, timeout=300)
        done = subprocess.run([str(AIDER_VENV / "bin" / "python"), "-m", "pip", "install", "-q",
                               "--disable-pip-version-check", "-r", str(AIDER_REQUIREMENTS)],
                              capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            out = done.stdout + done.stderr
            if NETWORK_ERRORS.search(out):
                pytest.skip(f"aider could not be installed: pip cannot reach the package index:\n{out[-1500:]}")
            pytest.fail(f"pip install -r {AIDER_REQUIREMENTS} failed:\n{out[-3000:]}")
        stamp.write_bytes(wanted)
    return AIDER_VENV / "bin"


def aider_setup(served, aider_bin: Path, tmp_path: Path) -> tuple[list[str], dict, Path]:
    """README.md's aider command (the program from aider_bin), a scratch HOME and a repository."""
    _, srv, _ = served
    env, commands = shell_lines(readme_blocks("aider", "sh", srv.url)[0])
    (command,) = commands
    assert command[0] == "aider" and not env
    settings = readme_blocks("aider", "yaml")[0]  # the thinking-off settings name the model of the command
    assert re.match(r"- name: (\S+)\n", settings).group(1) == command[command.index("--model") + 1]
    (tmp_path / "home").mkdir()
    return [str(aider_bin / "aider"), *command[1:]], {"HOME": str(tmp_path / "home")}, git_repo(tmp_path / "repo")


def restored_through_the_shared_messages(rt, answers: Answers, requests: list) -> list[tuple[int, int, int]]:
    """Each request after the first restores at least everything through the last message it shares with the one
    before: the whole earlier conversation where it grows by appending, or through the message before the first
    one that differs (aider rewrites the last user message of the request before, its instruction block dropped).
    The answer itself is not in that count: Qwen3.5's template renders an earlier turn without its reasoning, so
    the generated tokens are not a prefix of the next prompt. `requests`: parsed chat or Responses requests, one
    per job. Returns (cached, that message's end, prompt) per later request."""
    assert len(requests) == len(answers.done)
    seen = []
    for prev, req, (_, _, result) in zip(requests, requests[1:], answers.done[1:]):
        pairs = list(zip(prev.messages, req.messages))
        shared = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
        through = rt.prompts.chat(req.messages, req.tools, req.template_kwargs).boundaries.message_ends[shared - 1]
        seen.append((result.cached_tokens, through, result.prompt_tokens))
        assert result.cached_tokens >= through, seen
    return seen


def test_aider_piped_at_its_defaults(aider_bin, served, tmp_path, monkeypatch):
    """README.md's aider command with `--message`, three runs in one repository: no budget, no thinking switch."""
    rt, srv, recorder = served
    argv, env, repo = aider_setup(served, aider_bin, tmp_path)
    start = len(recorder.bodies)
    with session(served, monkeypatch) as answers:
        turns(answers, rt, [argv + ["--message", p] for p in ("Say hi", "Say it again", "Now say bye")], repo, env)
    answers.check(3, restored=False)  # each run's new message is a quarter of its prompt: checked below
    chats = bodies_since(recorder, start, "/v1/chat/completions")
    assert len(chats) == 3 and all("max_tokens" not in b and "chat_template_kwargs" not in b for b in chats)
    requests = [parse_chat(b, rt.config) for b in chats]
    print("aider piped:", restored_through_the_shared_messages(rt, answers, requests), answers.summary())


def test_aider_interactive_at_its_defaults(aider_bin, served, tmp_path, monkeypatch):
    """README.md's aider command, interactive: three prompts typed on its input (`--yes-always` answers its
    questions), then /exit. Each turn rewrites the previous user message; the restore reaches the one before."""
    rt, srv, recorder = served
    argv, env, repo = aider_setup(served, aider_bin, tmp_path)
    start = len(recorder.bodies)
    with session(served, monkeypatch) as answers:
        answers.turn = 1
        run(argv + ["--yes-always"], repo, env, stdin="Say hi\nSay it again\nNow say bye\n/exit\n")
    answers.check(1, restored=False)  # one process: its turns are the requests, checked below
    chats = bodies_since(recorder, start, "/v1/chat/completions")
    assert len(chats) == 3 and all("max_tokens" not in b for b in chats)
    requests = [parse_chat(b, rt.config) for b in chats]
    print("aider interactive:", restored_through_the_shared_messages(rt, answers, requests), answers.summary())


def test_openai_agents_sdk_at_its_defaults(served, monkeypatch):
    """README.md's Agents SDK program as it stands (a function tool, a model name, no settings: no budget, no
    reasoning field), three turns, each carrying the conversation over."""
    import agents

    rt, srv, recorder = served
    (program,) = readme_blocks("OpenAI Agents SDK", "python", srv.url)
    assert "ModelSettings" not in program and "model=" in program
    run_once = agents.Runner.run

    async def counted(*args, **kw):
        answers.turn += 1
        return await run_once(*args, **kw)

    monkeypatch.setattr(agents.Runner, "run", counted)
    start = len(recorder.bodies)
    with session(served, monkeypatch) as answers:
        exec(compile(program, "README.md (OpenAI Agents SDK)", "exec"), {"__name__": "readme"})
    answers.check(3, restored=False)  # a 300-token conversation: each answer is a sixth of the next prompt
    responses = bodies_since(recorder, start, "/v1/responses")
    assert len(responses) >= 3
    assert all("max_output_tokens" not in b and "reasoning" not in b and b["tools"][0]["name"] == "find_book"
               for b in responses), responses[0]
    requests = [parse_responses(b, rt.config) for b in responses]
    print("agents sdk:", restored_through_the_shared_messages(rt, answers, requests), answers.summary())


def test_codex_reports_the_servers_usage(agent_bin, served, tmp_path, monkeypatch):
    """`codex exec --json` twice: the usage each turn reports (turn.completed) is the sum of the server's figures
    for that turn's requests: prompt tokens, cached tokens, completion tokens."""
    rt, srv, _ = served
    codex, repo, env = codex_setup(agent_bin, srv.url, tmp_path)
    with session(served, monkeypatch) as answers:
        for turn, prompt in enumerate(("Say hi.", "Say bye."), 1):
            answers.turn = turn
            out = run([codex, "exec", "--json", prompt], repo, env).stdout
            rt.scheduler.drain()
            events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            (usage,) = [e["usage"] for e in events if e["type"] == "turn.completed"]
            results = [r for t, _, r in answers.done if t == turn]
            assert usage["input_tokens"] == sum(r.prompt_tokens for r in results), (usage, answers.summary())
            assert usage["cached_input_tokens"] == sum(r.cached_tokens for r in results), (usage, answers.summary())
            assert usage["output_tokens"] == sum(len(r.completion_tokens) for r in results), usage
            assert 0 < usage["reasoning_output_tokens"] < usage["output_tokens"], usage  # thinking on: both parts
            print("codex usage", turn, usage)
    assert answers.done[-1][2].cached_tokens > 0.9 * answers.done[-1][2].prompt_tokens
