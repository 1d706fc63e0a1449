"""Helpers for the tests that run real agent clients against a live server: a recorder of the requests they
send, the server's refusal and token counters, the captured request shapes under tests/fixtures/captures/, and
README.md's code blocks for each client (what a test runs is what the README documents)."""

from __future__ import annotations

import contextlib
import json
import re
import shlex
from pathlib import Path

import httpx

from orchestrator.config import Config
from orchestrator.runtime import Runtime

from .conftest import LiveServer, make_config

CAPTURES = Path(__file__).resolve().parent / "fixtures" / "captures"


class Recorder:
    """ASGI middleware that keeps every POST body it passes on: `bodies` is a list of (path, parsed JSON)."""

    def __init__(self, app) -> None:
        self.app = app
        self.bodies: list[tuple[str, dict]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.bodies.append((scope["path"], json.loads(b"".join(chunks) or b"null")))
            return message

        return await self.app(scope, recording_receive, send)


def counters(url: str) -> dict[str, float]:
    """Totals from /metrics: refused or failed requests (all labels), prompt tokens, cached prompt tokens; and the
    error counter's lines (route, status, code), for the message of a failed assertion."""
    text = httpx.get(url + "/metrics", timeout=30).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))

    return {"errors": total("orchestrator_request_errors_total"), "prompt": total("orchestrator_prompt_tokens_total"),
            "cached": total("orchestrator_cached_tokens_total"),
            "error_lines": re.findall(r"^orchestrator_request_errors_total\{.*$", text, re.M)}


def capture(client: str, name: str) -> dict:
    """A captured request (method, path, headers, body) of tests/fixtures/captures/<client>/<name>.json."""
    return json.loads((CAPTURES / client / f"{name}.json").read_text())


@contextlib.contextmanager
def recorded_server(model: Path | Config, **config):
    """A Runtime of `model` (make_config's overrides `config`; or a whole Config) served by a LiveServer whose
    requests a Recorder keeps: yields (rt, srv, recorder)."""
    rt = Runtime.start(model if isinstance(model, Config) else make_config(model, **config))
    recorders: list[Recorder] = []

    def wrap(app):
        recorders.append(Recorder(app))
        return recorders[0]

    srv = LiveServer(rt, wrap=wrap)
    try:
        yield rt, srv, recorders[0]
    finally:
        srv.stop()
        rt.close()


README = Path(__file__).resolve().parent.parent / "README.md"
README_URL = "http://127.0.0.1:8080"  # the server's default address, as README.md's client sections write it


def readme_blocks(heading: str, lang: str, url: str | None = None) -> list[str]:
    """The fenced code blocks of language `lang` in README.md's section titled `heading` (up to the next heading of
    its level or above), in order; with `url`, the server's default address in them replaced by it (each block of
    a client's setup names it, which is asserted). So a test runs what the README documents."""
    text = README.read_text()
    found = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.M)
    assert found, f"README.md has no section {heading!r}"
    rest = text[found.end():]
    end = re.search(rf"^#{{1,{len(found.group(1))}}} ", rest, re.M)
    blocks = re.findall(rf"^```{re.escape(lang)}\n(.*?)^```", rest[:end.start()] if end else rest, re.M | re.S)
    assert blocks, f"README.md's {heading!r} has no {lang} block"
    if url is not None:
        assert all(README_URL in b for b in blocks), (heading, lang)
        blocks = [b.replace(README_URL, url) for b in blocks]
    return blocks


def shell_lines(block: str) -> tuple[dict[str, str], list[list[str]]]:
    """A README shell block as (the variables its `export` lines set, the argv of each other command; `a && b` is
    two commands; comments and line continuations are dropped)."""
    env: dict[str, str] = {}
    commands: list[list[str]] = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0] == "export":
            env.update(w.split("=", 1) for w in words[1:])
            continue
        command: list[str] = []
        for w in words + ["&&"]:
            if w == "&&":
                commands.append(command)
                command = []
            else:
                command.append(w)
    return env, commands
