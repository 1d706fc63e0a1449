"""Starlette app: OpenAI-compatible routes over an orchestrator `Runtime`.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics (Prometheus),
GET /v1/cache/stats (JSON), POST /v1/cache/flush (administration), GET /openapi.json.
Request-level extensions: `cache_prompt` (false = cold run, the cache is neither read nor written),
`cache_salt` (tenant isolation) and `chat_template_kwargs` (e.g. {"enable_thinking": false}). Responses add
`timings` (llama-server's name).

With `Config.api_key` set, every route but /health needs `Authorization: Bearer <key>` (401 otherwise); cache
administration (flush) is off (403) on a server without a key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import secrets
import threading
import time
import uuid
from typing import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from orchestrator.config import Config
from orchestrator.errors import Forbidden, InvalidRequest, PayloadTooLarge, Unauthorized, UnsupportedMediaType
from orchestrator.parsing import make_stream_parser, parse_output
from orchestrator.prompt import Prompt
from orchestrator.runtime import Runtime
from orchestrator.request import Event, Job, Result

from .errors import EXCEPTION_HANDLERS, error_body, error_payload, error_response
from .metrics import Metrics
from .openapi import openapi_schema
from .schemas import GenerationOptions, parse_chat, parse_completion

log = logging.getLogger("orchestrator.server")


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def _json_body(request: Request, limit_bytes: int):
    """The request body parsed as JSON, read at most `limit_bytes` bytes far.

    Raises UnsupportedMediaType (415) for a Content-Type other than JSON (none at all is accepted),
    PayloadTooLarge (413) past the limit, InvalidRequest (400) for a body that is not JSON.
    """
    content_type = request.headers.get("content-type")
    if content_type is not None and not _is_json(content_type):
        raise UnsupportedMediaType(f"the request body must be JSON (Content-Type: application/json), got "
                                   f"Content-Type {content_type[:80]!r}", param="Content-Type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit_bytes:
        raise PayloadTooLarge(limit_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit_bytes:
                raise PayloadTooLarge(limit_bytes)
            chunks.append(chunk)
    except ClientDisconnect as e:
        raise InvalidRequest("the client disconnected before sending the whole body") from e
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"the request body is not valid JSON: {str(e)[:200]}") from e


async def _cancel_on_disconnect(request: Request, cancel: threading.Event) -> None:
    """Set `cancel` when the client disconnects (ASGI http.disconnect; the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancel.set()
            return


def _authorize(request: Request, api_key: str) -> None:
    """Raise Unauthorized unless the request carries `Authorization: Bearer <api_key>` (constant-time compare)."""
    header = request.headers.get("authorization")
    if header is None:
        raise Unauthorized("missing API key: send the header 'Authorization: Bearer <key>' (this server was "
                           "started with --api-key)")
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise Unauthorized("incorrect API key provided")


def _usage(r: Result) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": len(r.completion_tokens),
            "total_tokens": r.prompt_tokens + len(r.completion_tokens),
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}


def _timings(r: Result) -> dict:
    return {"cache_source": r.restore_source, "restore_ms": round(r.restore_s * 1e3, 3),
            "prefill_ms": round(r.prefill_s * 1e3, 3), "snapshot_ms": round(r.snapshot_s * 1e3, 3),
            "ttft_ms": round(r.ttft_s * 1e3, 3),
            "total_ms": round(r.total_s * 1e3, 3), "snapshots_saved": r.snapshots_saved}


class Api:
    """Handlers bound to one runtime."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.metrics = Metrics(runtime.cache_stats)

    def _job(self, prompt: Prompt, opts: GenerationOptions, prompt_cache_key: str = "") -> Job:
        """The job for a prompt (a prompt that does not fit the context is refused by `Runtime.submit`)."""
        n_ctx = self.rt.n_ctx
        n = len(prompt.tokens)
        cfg = self.rt.config
        max_tokens = opts.max_tokens or min(cfg.max_tokens_default, cfg.max_tokens_limit)
        sampling = opts.sampling
        if opts.seed is None:  # OpenAI: without a seed, sampling is not reproducible
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(32))
        return Job(prompt_tokens=prompt.tokens, boundaries=prompt.snapshot_positions(),
                   max_tokens=min(max_tokens, n_ctx - n), sampling=sampling, stop=opts.stop,
                   use_cache=opts.cache_prompt and self.rt.config.cache_enabled, prompt_cache_key=prompt_cache_key,
                   cache_salt=opts.cache_salt)

    def _submit(self, job: Job) -> tuple[asyncio.Queue, threading.Event]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(ev: Event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ev)

        cancel = self.rt.submit(job, sink)
        return events, cancel

    def _log(self, kind: str, r: Result) -> None:
        self.metrics.observe(r)
        log.info("%s prompt=%d cached=%d tier=%s restore_ms=%.1f prefill_ms=%.1f completion=%d total_ms=%.1f",
                 kind, r.prompt_tokens, r.cached_tokens, r.restore_source, r.restore_s * 1e3, r.prefill_s * 1e3,
                 len(r.completion_tokens), r.total_s * 1e3)

    async def _collect(self, request: Request, events: asyncio.Queue, cancel: threading.Event) -> Result:
        """Wait for a non-streamed result; a client that disconnects meanwhile cancels the job (its slot is
        freed at the next step)."""
        watch = asyncio.create_task(_cancel_on_disconnect(request, cancel))
        try:
            while True:
                ev = await events.get()
                if ev.kind == "done":
                    return ev.result
                if ev.kind == "error":
                    raise ev.error
        finally:
            watch.cancel()
            cancel.set()  # a no-op once done; stops the job if this handler is cancelled

    async def _sse(self, events: asyncio.Queue, cancel: threading.Event, kind: str,
                   on_text: Callable[[str], list[dict]], on_done: Callable[[Result], list[dict]]) -> AsyncIterator[str]:
        """Server-sent events: one `data:` line per payload from on_text / on_done, an error body if the job
        fails, then `data: [DONE]`. Leaving early (client gone) cancels the job at its next token."""
        def line(payload: dict) -> str:
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        try:
            while True:
                ev = await events.get()
                if ev.kind == "text":
                    for payload in on_text(ev.text):
                        yield line(payload)
                elif ev.kind == "error":
                    yield line(error_payload(ev.error)[0])
                    break
                else:
                    self._log(kind, ev.result)
                    for payload in on_done(ev.result):
                        yield line(payload)
                    break
            yield "data: [DONE]\n\n"
        finally:
            cancel.set()

    # ------------------------------------------------------------------ routes

    async def chat(self, request: Request):
        cfg = self.rt.config
        req = parse_chat(await _json_body(request, cfg.max_body_bytes), cfg)
        prompt = await run_in_threadpool(self.rt.prompts.chat, req.messages, req.tools, req.template_kwargs,
                                         req.cache_breakpoints)
        job = self._job(prompt, req.options, req.prompt_cache_key)
        events, cancel = self._submit(job)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.options.stream:
            return StreamingResponse(self._chat_stream(events, cancel, cid, created, prompt, req),
                                     media_type="text/event-stream")
        r = await self._collect(request, events, cancel)
        self._log("chat", r)
        out = parse_output(r.text, prompt.opens_reasoning, req.parse_tools, self.rt.prompts.output_format)
        message = {"role": "assistant", "content": out.content}
        if out.reasoning is not None:
            message["reasoning_content"] = out.reasoning
        if out.tool_calls:
            message["tool_calls"] = out.tool_calls
        finish = "tool_calls" if out.tool_calls else r.finish_reason
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": self.rt.model_id,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": _usage(r), "timings": _timings(r)})

    def _chat_stream(self, events: asyncio.Queue, cancel: threading.Event, cid: str, created: int,
                     prompt: Prompt, req) -> AsyncIterator[str]:
        parser = make_stream_parser(prompt.opens_reasoning, req.parse_tools, self.rt.prompts.output_format)
        keys = {"reasoning": "reasoning_content", "content": "content"}

        def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> dict:
            body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.rt.model_id,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
            if usage is not None:
                body["usage"] = usage
            return body

        def on_text(text: str) -> list[dict]:
            return [chunk({keys[k]: piece}) for k, piece in parser.push(text)]

        def on_done(r: Result) -> list[dict]:
            rest, calls = parser.finish()
            out = [chunk({keys[k]: piece}) for k, piece in rest]
            if calls:
                out.append(chunk({"tool_calls": [dict(c, index=i) for i, c in enumerate(calls)]}))
            out.append(chunk({}, "tool_calls" if calls else r.finish_reason,
                             _usage(r) if req.options.include_usage else None))
            return out

        async def gen() -> AsyncIterator[str]:
            yield f"data: {json.dumps(chunk({'role': 'assistant', 'content': ''}))}\n\n"
            async for line in self._sse(events, cancel, "chat-stream", on_text, on_done):
                yield line

        return gen()

    async def completions(self, request: Request):
        cfg = self.rt.config
        req = parse_completion(await _json_body(request, cfg.max_body_bytes), cfg)
        prompt = await run_in_threadpool(self.rt.prompts.completion, req.prompt)
        job = self._job(prompt, req.options)
        events, cancel = self._submit(job)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        model = self.rt.model_id
        if req.options.stream:
            def body(text: str, finish: str | None) -> dict:
                return {"id": cid, "object": "text_completion", "created": created, "model": model,
                        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}

            def on_done(r: Result) -> list[dict]:
                last = body("", r.finish_reason)
                if req.options.include_usage:
                    last["usage"] = _usage(r)
                return [last]

            gen = self._sse(events, cancel, "completion-stream", lambda t: [body(t, None)], on_done)
            return StreamingResponse(gen, media_type="text/event-stream")
        r = await self._collect(request, events, cancel)
        self._log("completion", r)
        text = (req.prompt + r.text) if req.echo else r.text
        return JSONResponse({
            "id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": r.finish_reason, "logprobs": None}],
            "usage": _usage(r), "timings": _timings(r)})

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{
            "id": self.rt.model_id, "object": "model", "created": 0, "owned_by": "orchestrator",
            "meta": self.rt.model_meta()}]})

    async def prometheus(self, request: Request):
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def cache_stats(self, request: Request):
        return JSONResponse(self.rt.cache_report())

    async def cache_flush(self, request: Request):
        """Administration: drop every snapshot in every tier. Off (403) on a server without --api-key."""
        if self.rt.config.api_key is None:
            raise Forbidden("cache administration is off: start the server with --api-key to enable it")
        n = self.rt.flush_cache()
        log.warning("cache flushed by an administration request: %d entries dropped", n)
        return JSONResponse({"flushed_entries": n})

    async def openapi(self, request: Request):
        return JSONResponse(openapi_schema(self.rt.config))

    async def health(self, request: Request):
        return JSONResponse({"status": "ok", **self.rt.health()})


def create_app(runtime: Runtime) -> Starlette:
    """The Starlette app for a started runtime. The caller owns the runtime (and closes it)."""
    api = Api(runtime)
    cfg = runtime.config
    routes = [
        Route("/v1/chat/completions", _guard(api.chat, cfg), methods=["POST"]),
        Route("/v1/completions", _guard(api.completions, cfg), methods=["POST"]),
        Route("/v1/models", _guard(api.models, cfg), methods=["GET"]),
        Route("/health", _guard(api.health, cfg, public=True), methods=["GET"]),
        Route("/metrics", _guard(api.prometheus, cfg), methods=["GET"]),
        Route("/v1/cache/stats", _guard(api.cache_stats, cfg), methods=["GET"]),
        Route("/v1/cache/flush", _guard(api.cache_flush, cfg), methods=["POST"]),
        Route("/openapi.json", _guard(api.openapi, cfg), methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS)


def _guard(handler, cfg: Config, public: bool = False):
    """Check the API key (unless `public` or none is configured), then run the route, turning any exception into
    an error response here, so the connection stays usable (an exception that reaches Starlette's outermost
    middleware is re-raised and closes the keep-alive connection)."""
    async def guarded(request: Request):
        try:
            if cfg.api_key is not None and not public:
                _authorize(request, cfg.api_key)
            return await handler(request)
        except Exception as e:  # noqa: BLE001 - mapped to 4xx/5xx in one place: server/errors.py
            return error_response(e)

    return guarded


__all__ = ["create_app", "error_body"]
