"""Helpers for the tests that run real agent clients against a live server: a recorder of the requests they
send, the server's refusal and token counters, and the captured request shapes under bench/captures/."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import httpx

from orchestrator.runtime import Runtime

from .conftest import LiveServer, make_config

CAPTURES = Path(__file__).resolve().parent.parent / "bench" / "captures"


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
    """A captured request (method, path, headers, body) of bench/captures/<client>/<name>.json."""
    return json.loads((CAPTURES / client / f"{name}.json").read_text())


@contextlib.contextmanager
def recorded_server(model: Path, **config):
    """A Runtime of `model` served by a LiveServer whose requests a Recorder keeps: yields (rt, srv, recorder)."""
    rt = Runtime.start(make_config(model, **config))
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
