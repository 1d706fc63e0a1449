"""One streamed request to one system: time to first token, total time, output text, reported token counts.

TTFT is measured from sending the request to the first streamed chunk that carries generated text (content,
reasoning_content or tool-call text); a response with no text at all takes the time of its last chunk.
Output is the concatenation of all generated text, compared with the same system's cold run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Iterator

import httpx

SEED = 1234


@dataclass
class Outcome:
    """Measured result of one request. Times in seconds; token counts as the server reports them (None if not)."""

    ok: bool
    ttft_s: float
    total_s: float
    output: str
    prompt_tokens: int | None
    cached_tokens: int | None
    error: str = ""
    server_timings: dict | None = None
    completion_tokens: int | None = None


def _chunk_text(api: str, obj: dict) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    ch = choices[0]
    if api == "prompt":
        return ch.get("text") or ""
    d = ch.get("delta") or {}
    out = (d.get("reasoning_content") or "") + (d.get("content") or "")
    for tc in d.get("tool_calls") or []:
        f = tc.get("function") or {}
        out += (f.get("name") or "") + (f.get("arguments") or "")
    return out


def request_body(api: str, kind: str, chat: dict, prompt_text: str, max_tokens: int, cold: bool) -> dict:
    """The JSON body for one system: greedy, fixed seed, streamed with usage."""
    common = {"max_tokens": max_tokens, "temperature": 0.0, "seed": SEED, "stream": True}
    if kind != "llama-cpp-python":
        common["stream_options"] = {"include_usage": True}
        common["cache_prompt"] = not cold
    if api == "chat":
        return {**chat, **common}
    return {"prompt": prompt_text, **common}


def sse_events(resp: httpx.Response, t0: float = 0.0,
               timeout_s: float | None = None) -> Iterator[tuple[str | None, dict]]:
    """(event, JSON object) of an SSE stream until `data: [DONE]` or its end; event is the object's "type", else the
    last `event:` line (Anthropic and Responses streams), else None (OpenAI chunks). With `timeout_s`, raises
    TimeoutError once that many seconds have passed since `t0` (perf_counter); json.JSONDecodeError on a malformed
    chunk."""
    event = None
    for line in resp.iter_lines():
        if timeout_s is not None and time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"request exceeded {timeout_s:.0f} s")
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            obj = json.loads(data)
            yield obj.get("type") or event, obj


def sse_chunks(resp: httpx.Response, t0: float, timeout_s: float) -> Iterator[dict]:
    """The JSON objects of an OpenAI-style SSE stream (sse_events without the event names)."""
    return (obj for _, obj in sse_events(resp, t0, timeout_s))


def send(client: httpx.Client, base_url: str, api: str, body: dict, timeout_s: float = 900.0) -> Outcome:
    """POST `body` to the system's endpoint and read the SSE stream (each read bounded; whole call bounded)."""
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    t0 = time.perf_counter()
    ttft = None
    out: list[str] = []
    prompt_tokens = cached = completion = None
    timings = None
    try:
        with client.stream("POST", base_url + path, json=body,
                           timeout=httpx.Timeout(timeout_s, connect=10.0)) as resp:
            if resp.status_code != 200:
                resp.read()
                return Outcome(False, 0.0, time.perf_counter() - t0, "", None, None,
                               f"HTTP {resp.status_code}: {resp.text[:300]}")
            for obj in sse_chunks(resp, t0, timeout_s):
                text = _chunk_text(api, obj)
                if text:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    out.append(text)
                u = obj.get("usage")
                if u:
                    prompt_tokens = u.get("prompt_tokens", prompt_tokens)
                    completion = u.get("completion_tokens", completion)
                    details = u.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        cached = details["cached_tokens"]
                if obj.get("timings"):
                    timings = obj["timings"]
    except (httpx.HTTPError, TimeoutError, json.JSONDecodeError) as e:
        return Outcome(False, ttft or 0.0, time.perf_counter() - t0, "".join(out), None, None, repr(e))
    total = time.perf_counter() - t0
    if timings and cached is None and "cache_n" in timings:
        cached = timings["cache_n"]
    if timings and prompt_tokens is None and "prompt_n" in timings:
        prompt_tokens = timings["prompt_n"] + timings.get("cache_n", 0)
    if timings and completion is None and "predicted_n" in timings:
        completion = timings["predicted_n"]
    return Outcome(True, ttft if ttft is not None else total, total, "".join(out), prompt_tokens, cached,
                   server_timings=timings, completion_tokens=completion)
