"""Starlette app: OpenAI-compatible routes over an orchestrator `Runtime`.

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/messages and /v1/messages/count_tokens
(Anthropic's Messages API, server/anthropic.py), POST /v1/responses (OpenAI's Responses API, stateless:
server/responses.py), GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics
(Prometheus), GET /v1/cache/stats (JSON), POST /v1/cache/flush (administration), GET /openapi.json.
Request-level extensions: `cache_prompt` (false = cold run, the cache is neither read nor written),
`cache_salt` (tenant isolation) and `chat_template_kwargs` (e.g. {"enable_thinking": false}). Responses add
`timings` (llama-server's name).

With `Config.api_key` set, every route but /health needs `Authorization: Bearer <key>` (401 otherwise). The
operator's routes (cache flush and stats, /metrics, /health's full view) need the operator key (`--admin-key`,
else the API key; a tenant's key gets 403); cache administration (flush) is off (403) on a server without a key.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import secrets
import threading
import time
import uuid
from typing import AsyncIterator, Callable, Sequence

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from orchestrator.config import Config
from orchestrator.errors import (Forbidden, InvalidRequest, PayloadTooLarge, RequestCancelled, RequestTimeout,
                                 Unauthorized,
                                 UnsupportedMediaType)
from orchestrator.output.grammar import Constraint
from orchestrator.output.parsing import ParsedOutput
from orchestrator.prompt.builder import Prompt
from orchestrator.runtime import Runtime
from orchestrator.request import Event, Job, Result

from .errors import (ANTHROPIC, EXCEPTION_HANDLERS, OPENAI, NotFound, anthropic_payload, error_body, error_payload,
                     error_response, error_status)
from .metrics import Metrics
from .openapi import openapi_schema
from . import anthropic
from .anthropic import MessagesRequest, parse_messages
from . import logprobs
from . import responses
from .responses import ResponsesRequest, parse_responses
from .schemas import GenerationOptions, check_nesting, late_system_as_user, parse_chat, parse_completion

log = logging.getLogger("orchestrator.server")
REPLICA_HEADER = "x-orchestrator-replica"  # on every response: which replica served it (--replica-name)
TIER_HEADER = "x-orchestrator-cache-tier"  # on non-streamed results: live, ram, disk, remote or none


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def _read_body(request: Request, limit_bytes: int) -> bytes:
    """The request body, read at most `limit_bytes` bytes far.

    Raises UnsupportedMediaType (415) for a Content-Type other than JSON (none at all is accepted),
    PayloadTooLarge (413) past the limit, RequestCancelled (499) when the client leaves meanwhile.
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
    except ClientDisconnect as e:  # counted as a disconnect (499), like one while the answer is computed
        raise RequestCancelled() from e
    return b"".join(chunks)


def _json(raw: bytes):
    """`raw` parsed as JSON and checked for nesting (schemas.check_nesting): InvalidRequest (400) otherwise."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"the request body is not valid JSON: {str(e)[:200]}") from e
    check_nesting(body)
    return body


async def _cancel_on_disconnect(request: Request, cancel: threading.Event) -> None:
    """Set `cancel` when the client disconnects (ASGI http.disconnect; the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancel.set()
            return


# Who may call a route: anyone (/health), a tenant (the API), the operator (administration).
PUBLIC, TENANT, OPERATOR = "public", "tenant", "operator"


def _authorize(request: Request, *keys: str) -> str:
    """The one of `keys` the request carries as `Authorization: Bearer <key>`, or Anthropic's `x-api-key: <key>`
    (constant-time compares, every key compared); raises Unauthorized when it carries none of them."""
    header = request.headers.get("authorization")
    if header is None and "x-api-key" in request.headers:
        header = "Bearer " + request.headers["x-api-key"]
    if header is None:
        raise Unauthorized("missing API key: send the header 'Authorization: Bearer <key>' (this server was "
                           "started with --api-key)")
    scheme, _, token = header.strip().partition(" ")
    matched = [k for k in keys if hmac.compare_digest(token.strip().encode(), k.encode())]
    if scheme.lower() != "bearer" or not matched:
        raise Unauthorized("incorrect API key provided")
    return matched[0]


def _allow(request: Request, cfg: Config, who: str) -> None:
    """Check that the request may call a route for `who` (PUBLIC, TENANT or OPERATOR). Tenants need --api-key's
    key (or the operator's); the operator's routes need the operator key (Config.operator_key: --admin-key, else
    --api-key): a tenant's key there is Forbidden (403), no key or a wrong one Unauthorized (401). Without any
    key, every route is open."""
    keys = [k for k in (cfg.api_key, cfg.admin_key) if k is not None]
    if who == PUBLIC or not keys:
        return
    if who == TENANT:
        if cfg.api_key is not None:
            _authorize(request, *keys)
        return
    if _authorize(request, *keys) != cfg.operator_key:
        raise Forbidden("this route is the operator's: send the key of --admin-key")


def _usage(results: Sequence[Result]) -> dict:
    """OpenAI's usage of a request's choices: the prompt counted once (it is prefilled once), the completion tokens
    of every choice."""
    first = results[0]
    completion = sum(len(r.completion_tokens) for r in results)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}


def _tier_header(r: Result) -> dict:
    """The header naming where a non-streamed result's prefix came from: live, ram, disk, remote or none (a stream's
    headers leave before that is known: its last chunk's usage and timings say it)."""
    return {TIER_HEADER: r.restore_source}


def _timings(r: Result) -> dict:
    return {"cache_source": r.restore_source, "restore_ms": round(r.restore_s * 1e3, 3),
            "prefill_ms": round(r.prefill_s * 1e3, 3), "snapshot_ms": round(r.snapshot_s * 1e3, 3),
            "ttft_ms": round(r.ttft_s * 1e3, 3),
            "total_ms": round(r.total_s * 1e3, 3), "snapshots_saved": r.snapshots_saved}


class Api:
    """Handlers bound to one runtime."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.metrics = Metrics(runtime.cache_stats, runtime.after_generation_stats)
        self._late_system_ok: bool | None = None  # does the template render a system message mid-conversation?

    def _job(self, prompt: Prompt, opts: GenerationOptions, prompt_cache_key: str = "",
             restorable_after: Callable[[Sequence[int]], bool] | None = None,
             constraint: Constraint | None = None) -> Job:
        """The job for a prompt (a prompt that does not fit the context is refused by `Runtime.submit`).
        restorable_after: for a chat prompt, whether the state after a given answer is worth storing
        (`PromptBuilder.restorable_after`). constraint: the grammar to sample under, if any."""
        n_ctx = self.rt.n_ctx
        n = len(prompt.tokens)
        cfg = self.rt.config
        # The completion budget: the request's, else the server's default, else until the context is full; never
        # more than --max-tokens-limit or the context left. A larger request is served up to that, ending with
        # its route's length reason (finish_reason length, stop_reason max_tokens, status incomplete).
        max_tokens = min(opts.max_tokens or cfg.max_tokens_default or cfg.max_tokens_limit, cfg.max_tokens_limit)
        sampling = opts.sampling
        if opts.seed is None:  # OpenAI: without a seed, sampling is not reproducible
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(32))
        if constraint is not None:
            sampling = dataclasses.replace(sampling, grammar=constraint.gbnf, grammar_triggers=constraint.triggers)
        return Job(prompt_tokens=prompt.tokens, boundaries=prompt.boundaries,
                   max_tokens=min(max_tokens, n_ctx - n), sampling=sampling, stop=opts.stop,
                   use_cache=opts.cache_prompt and self.rt.config.cache_enabled, prompt_cache_key=prompt_cache_key,
                   cache_salt=opts.cache_salt, tenant=opts.cache_salt or prompt_cache_key,
                   restorable_after=restorable_after,
                   prepare_s={"render": prompt.render_s, "tokenize": prompt.tokenize_s,
                              "boundaries": prompt.boundaries_s}, logprobs=opts.logprobs, n=opts.n)

    def _submit(self, job: Job) -> tuple[asyncio.Queue, threading.Event]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(ev: Event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ev)

        cancel = self.rt.submit(job, sink)
        return events, cancel

    def _log(self, kind: str, results: Sequence[Result]) -> None:
        """Observe and log a served request: choice 0's figures (the prompt is served once), the completion tokens
        of all its choices."""
        r = results[0]
        drafted, accepted = sum(x.drafted_tokens for x in results), sum(x.accepted_tokens for x in results)
        self.metrics.observe(r, drafted, accepted)
        log.info("%s prompt=%d cached=%d tier=%s completion=%d%s%s total_ms=%.1f ttft_ms=%.1f %s", kind,
                 r.prompt_tokens, r.cached_tokens, r.restore_source, sum(len(x.completion_tokens) for x in results),
                 f" choices={len(results)}" if len(results) > 1 else "",
                 f" drafted={drafted} accepted={accepted}" if drafted else "", r.total_s * 1e3, r.ttft_s * 1e3,
                 " ".join(f"{name}_ms={s * 1e3:.1f}" for name, s in r.phases.items()))

    def record_failure(self, route: str, exc: Exception) -> None:
        """Count and log a refused or failed request (status 499: the client disconnected)."""
        status, code = error_status(exc)
        self.metrics.failed(route, status, code)
        level = logging.WARNING if status in (429, 504) or status >= 500 else logging.INFO
        log.log(level, "refused %s status=%d code=%s: %s", route, status, code,
                str(getattr(exc, "message", exc))[:200])

    async def _collect(self, request: Request, events: asyncio.Queue, cancel: threading.Event,
                       n: int = 1) -> list[Result]:
        """Wait for the non-streamed results of a job's `n` choices, by index; the first error (any choice's)
        fails the request and cancels the other choices. A client that disconnects meanwhile cancels the job (its
        slots are freed at the next step) and the request ends as RequestCancelled (499), also when the scheduler
        delivers what was generated until then."""
        watch = asyncio.create_task(_cancel_on_disconnect(request, cancel))
        results: list[Result | None] = [None] * n
        try:
            while True:
                ev = await events.get()
                if ev.kind == "done":
                    if watch.done() and not watch.cancelled():
                        raise RequestCancelled()  # nobody to answer
                    results[ev.index] = ev.result
                    if all(r is not None for r in results):
                        return results
                if ev.kind == "error":
                    raise ev.error
        finally:
            watch.cancel()
            cancel.set()  # a no-op once done; stops the job if this handler is cancelled

    async def _stream(self, events: asyncio.Queue, cancel: threading.Event, route: str, kind: str,
                      on_text: Callable[[Event], list[str]], on_done: Callable[[Result], list[str]],
                      on_error: Callable[[Exception], list[str]], n: int = 1,
                      on_end: Callable[[list[Result]], list[str]] | None = None) -> AsyncIterator[str]:
        """The lines of a server-sent event stream: on_text per TEXT event (of any of the job's `n` choices, as
        they come), on_done per choice's result, then on_end with all results by index; or, as soon as one choice
        fails, on_error (the other choices are cancelled). Leaving early (client gone) cancels the job at its next
        token and counts a disconnect."""
        finished = False
        results: list[Result | None] = [None] * n
        try:
            while True:
                ev = await events.get()
                if ev.kind == "text":
                    for line in on_text(ev):
                        yield line
                elif ev.kind == "error":
                    self.record_failure(route, ev.error)
                    for line in on_error(ev.error):
                        yield line
                    break
                else:
                    results[ev.index] = ev.result
                    for line in on_done(ev.result):
                        yield line
                    if any(r is None for r in results):
                        continue
                    self._log(kind, results)
                    for line in on_end(results) if on_end else ():
                        yield line
                    break
            finished = True
        finally:
            cancel.set()
            if not finished:
                self.record_failure(route, RequestCancelled())

    async def _lines(self, events: asyncio.Queue, cancel: threading.Event, route: str, kind: str,
                     on_text: Callable[[Event], list[str]], on_done: Callable[[Result], list[str]],
                     on_error: Callable[[Exception], list[str]]) -> AsyncIterator[str]:
        """`_stream`'s lines of a one-choice job, closed as soon as the caller stops reading (not when collected:
        closing cancels the job and counts a disconnect)."""
        inner = self._stream(events, cancel, route, kind, on_text, on_done, on_error)
        try:
            async for line in inner:
                yield line
        finally:
            await inner.aclose()

    def _openai_sse(self, events: asyncio.Queue, cancel: threading.Event, route: str, kind: str,
                    on_text: Callable[[Event], list[dict]], on_done: Callable[[Result], list[dict]],
                    first: list[dict] = (), n: int = 1,
                    on_end: Callable[[list[Result]], list[dict]] = lambda results: []) -> AsyncIterator[str]:
        """OpenAI's server-sent events: `data: {payload}` per payload (`first` ones at once; on_done per choice,
        on_end once all `n` are done), an error body if the job fails, then `data: [DONE]`."""
        def lines(payloads) -> list[str]:
            return [f"data: {json.dumps(p, ensure_ascii=False)}\n\n" for p in payloads]

        async def gen() -> AsyncIterator[str]:
            for line in lines(first):
                yield line
            inner = self._stream(events, cancel, route, kind, lambda ev: lines(on_text(ev)),
                                 lambda r: lines(on_done(r)), lambda e: lines([error_payload(e)[0]]), n,
                                 lambda results: lines(on_end(results)))
            try:
                async for line in inner:
                    yield line
            finally:
                await inner.aclose()  # now, not when collected: it cancels the job and counts a disconnect
            yield "data: [DONE]\n\n"

        return gen()

    async def _chat_prompt(self, request: Request, req) -> Prompt:
        """The prompt of a ChatRequest, MessagesRequest or ResponsesRequest. A system message after the leading ones is passed to
        the template where the template renders it, and is a user message where it stands elsewhere
        (server/schemas.py late_system_as_user); req.messages is updated, for restorable_after."""
        if req.late_system is not None and not await self._renders_late_system():
            req.messages = late_system_as_user(req.messages)
        return await self._off_loop(request, self.rt.prompts.chat, req.messages, req.tools, req.template_kwargs,
                                       req.cache_breakpoints)

    async def _submit_chat(self, request: Request, req, prompt: Prompt | None = None
                           ) -> tuple[Prompt, Job, asyncio.Queue, threading.Event]:
        """Render a ChatRequest, ResponsesRequest or MessagesRequest (unless `prompt` is its rendered prompt), build
        its grammar (structured output, forced tool calls) and submit its job: (prompt, job, events, cancel)."""
        prompt = prompt or await self._chat_prompt(request, req)
        constraint = await self._off_loop(request, self.rt.constraint, req.structure, req.tools,
                                          prompt.opens_reasoning)
        job = self._job(prompt, req.options, req.prompt_cache_key, self.rt.prompts.restorable_after(
            req.messages, req.tools, req.template_kwargs, prompt), constraint)
        events, cancel = self._submit(job)
        return prompt, job, events, cancel

    async def _renders_late_system(self) -> bool:
        """Whether the template renders a system message after a user and an assistant message (Qwen3's writes
        a system turn there; Qwen3.5's raises; DeepSeek-R1's drops it, which counts as no). Probed once."""
        if self._late_system_ok is None:
            text = "late system message probe"
            probe = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                     {"role": "system", "content": text}, {"role": "user", "content": "d"}]
            try:
                prompt = await run_in_threadpool(self.rt.prompts.chat, probe, None, {})
                self._late_system_ok = text in prompt.text
            except InvalidRequest:
                self._late_system_ok = False
        return self._late_system_ok

    async def _parse(self, request: Request, parse: Callable, *args):
        """`parse(body, config, *args)` of the request's JSON body. Everything after reading the body (JSON
        decoding, the nesting and prompt-size checks, the conversion) runs in the thread pool, off the event
        loop, where every other request's bytes are moved: each step is linear in the body and bounded by its
        limit (--max-body-size, --max-prompt-size)."""
        raw = await _read_body(request, self.rt.config.max_body_bytes)
        return await self._off_loop(request, lambda: parse(_json(raw), self.rt.config, *args))

    async def _off_loop(self, request: Request, fn: Callable, *args):
        """fn(*args) in the thread pool, given up when the client disconnects (RequestCancelled, 499) or after
        --timeout (RequestTimeout, 504): a request's prompt work (parsing, rendering, tokenizing, boundaries,
        the grammar check) answers within its time limit. What the thread has started it finishes on its own,
        bounded by the size limits it checks."""
        work = asyncio.ensure_future(run_in_threadpool(fn, *args))
        gone = asyncio.ensure_future(_cancel_on_disconnect(request, threading.Event()))
        limit = self.rt.config.timeout or None
        try:
            done, _ = await asyncio.wait({work, gone}, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if work in done:
            return work.result()
        work.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody waits for it any more
        if gone in done:
            raise RequestCancelled()
        raise RequestTimeout(limit)

    # ------------------------------------------------------------------ routes

    async def chat(self, request: Request):
        req = await self._parse(request, parse_chat)
        prompt, job, events, cancel = await self._submit_chat(request, req)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.options.stream:
            return StreamingResponse(self._chat_stream(events, cancel, cid, created, prompt, req),
                                     media_type="text/event-stream")
        results = await self._collect(request, events, cancel, job.n)
        self._log("chat", results)
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": self.rt.model_id,
            "choices": [self._chat_choice(r, prompt, req) for r in results],
            "usage": _usage(results), "timings": _timings(results[0])}, headers=_tier_header(results[0]))

    def _chat_choice(self, r: Result, prompt: Prompt, req) -> dict:
        """One entry of a chat completion's `choices`: the message parsed from choice r.index's text."""
        out = prompt.reply.parse(r.text, r.cut)
        return {"index": r.index, "message": prompt.reply.message(out), "finish_reason": "tool_calls" if out.tool_calls else
                r.finish_reason, "logprobs": None if r.logprobs is None else logprobs.chat(r.logprobs, self.rt.piece)}

    def _chat_stream(self, events: asyncio.Queue, cancel: threading.Event, cid: str, created: int,
                     prompt: Prompt, req) -> AsyncIterator[str]:
        """OpenAI's chunks, each of one choice (its `index`; with n > 1 choices their chunks interleave as they
        are generated, each choice opening with its role chunk and ending with its finish_reason chunk); with
        stream_options.include_usage every chunk carries "usage": null and one last chunk with no choices carries
        the usage of all choices, as OpenAI sends them, and the `timings` a non-streamed body has (llama-server
        sends its own in the last chunk)."""
        n = req.options.n
        parsers = [prompt.reply.stream() for _ in range(n)]
        keys = {"reasoning": "reasoning_content", "content": "content"}
        with_usage = req.options.include_usage
        held: list[list] = [[] for _ in range(n)]  # per choice: logprobs of tokens whose text no chunk carried yet
        seen = [0] * n  # per choice: logprobs received with TEXT events

        def chunk(delta: dict | None, finish: str | None = None, i: int = 0) -> dict:
            choices = [] if delta is None else [{"index": i, "delta": delta, "finish_reason": finish,
                                                 "logprobs": None}]
            body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.rt.model_id,
                    "choices": choices}
            if with_usage:
                body["usage"] = None
            return body

        def attach(chunks: list[dict], i: int) -> list[dict]:
            """Put choice i's held logprobs on the first of `chunks` (each token's once, in order)."""
            if held[i] and chunks:
                chunks[0]["choices"][0]["logprobs"] = logprobs.chat(held[i], self.rt.piece)
                held[i].clear()
            return chunks

        def on_text(ev: Event) -> list[dict]:
            i = ev.index
            held[i].extend(ev.logprobs)
            seen[i] += len(ev.logprobs)
            return attach([chunk({keys[k]: piece}, i=i) for k, piece in parsers[i].push(ev.text)], i)

        def on_done(r: Result) -> list[dict]:
            i = r.index
            rest, calls = parsers[i].finish(r.cut)
            held[i].extend((r.logprobs or [])[seen[i]:])
            out = [chunk({keys[k]: piece}, i=i) for k, piece in rest]
            if calls:
                out.append(chunk({"tool_calls": [dict(c, index=j) for j, c in enumerate(calls)]}, i=i))
            out.append(chunk({}, "tool_calls" if calls else r.finish_reason, i))
            return attach(out, i)

        def on_end(results: list[Result]) -> list[dict]:
            return [dict(chunk(None), usage=_usage(results), timings=_timings(results[0]))] if with_usage else []

        return self._openai_sse(events, cancel, "/v1/chat/completions", "chat-stream", on_text, on_done,
                                first=[chunk({"role": "assistant", "content": ""}, i=i) for i in range(n)], n=n,
                                on_end=on_end)

    async def completions(self, request: Request):
        req = await self._parse(request, parse_completion)
        prompt = await self._off_loop(request, self.rt.prompts.completion, req.prompt)
        job = self._job(prompt, req.options)
        events, cancel = self._submit(job)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        model = self.rt.model_id
        n = job.n
        lps = [logprobs.CompletionLogprobs(self.rt.piece, len(req.prompt)) for _ in range(n)]  # per choice
        if req.options.stream:
            with_usage = req.options.include_usage
            seen = [0] * n  # per choice: logprobs sent with text chunks

            def body(text: str | None, finish: str | None = None, entries=None, i: int = 0) -> dict:
                choices = [] if text is None else [{"index": i, "text": text, "finish_reason": finish,
                                                    "logprobs": None if entries is None else lps[i].block(entries)}]
                out = {"id": cid, "object": "text_completion", "created": created, "model": model,
                       "choices": choices}
                if with_usage:
                    out["usage"] = None
                return out

            def on_text(ev: Event) -> list[dict]:
                seen[ev.index] += len(ev.logprobs)
                return [body(ev.text, None, ev.logprobs if job.logprobs is not None else None, ev.index)]

            def on_done(r: Result) -> list[dict]:
                return [body("", r.finish_reason, None if r.logprobs is None else r.logprobs[seen[r.index]:],
                             r.index)]

            def on_end(results: list[Result]) -> list[dict]:
                return ([dict(body(None), usage=_usage(results), timings=_timings(results[0]))] if with_usage
                        else [])

            gen = self._openai_sse(events, cancel, "/v1/completions", "completion-stream", on_text, on_done,
                                   first=[body(req.prompt, i=i) for i in range(n)] if req.echo else [], n=n,
                                   on_end=on_end)
            return StreamingResponse(gen, media_type="text/event-stream")
        results = await self._collect(request, events, cancel, n)
        self._log("completion", results)
        return JSONResponse({
            "id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": r.index, "text": (req.prompt + r.text) if req.echo else r.text,
                         "finish_reason": r.finish_reason,
                         "logprobs": None if r.logprobs is None else lps[r.index].block(r.logprobs)} for r in results],
            "usage": _usage(results), "timings": _timings(results[0])}, headers=_tier_header(results[0]))

    # ------------------------------------------------------------------ Anthropic Messages API

    async def _messages_prompt(self, request: Request, route: str) -> tuple[MessagesRequest, Prompt]:
        """The request and its prompt, with its clear_tool_uses edit applied where the rendered prompt passes the
        edit's trigger (server/context_edits.py): rendered again with the old tool results cleared, kept if it
        frees at least clear_at_least tokens."""
        req = await self._parse(request, parse_messages, route)
        prompt = await self._chat_prompt(request, req)
        edit = req.clear_tool_uses
        if edit is None or not edit.triggered(len(prompt.tokens), req.messages):
            return req, prompt
        messages, breakpoints, n_cleared = edit.apply(req.messages, req.cache_breakpoints)
        if not n_cleared:
            return req, prompt
        # req.messages already has its late system messages as the template takes them (_chat_prompt above)
        cleared = dataclasses.replace(req, messages=messages, cache_breakpoints=breakpoints, late_system=None)
        edited = await self._chat_prompt(request, cleared)
        freed = len(prompt.tokens) - len(edited.tokens)
        if freed < max(edit.clear_at_least, 1):
            return req, prompt
        cleared.applied_edits = [edit.applied(n_cleared, freed)]
        return cleared, edited

    async def messages(self, request: Request):
        req, prompt = await self._messages_prompt(request, anthropic.MESSAGES)
        prompt, job, events, cancel = await self._submit_chat(request, req, prompt)
        mid = f"msg_{uuid.uuid4().hex}"
        stores = self.rt.scheduler.reuse.stores(job)  # whether its uncached prompt tokens are cache writes
        if req.options.stream:
            return StreamingResponse(self._messages_stream(events, cancel, mid, prompt, req, stores),
                                     media_type="text/event-stream")
        r = (await self._collect(request, events, cancel))[0]
        self._log("messages", [r])
        out = prompt.reply.parse(r.text, r.cut)
        reason, sequence = self._stop_reason(r, bool(out.tool_calls), req.options.stop)
        return JSONResponse({
            "id": mid, "type": "message", "role": "assistant", "model": self.rt.model_id,
            "content": anthropic.content_blocks(out, req.omit_thinking), "stop_reason": reason, "stop_sequence": sequence,
            "usage": anthropic.usage(r, stores), **anthropic.context_management(req), "timings": _timings(r)},
            headers=_tier_header(r))

    def _stop_reason(self, r: Result, has_calls: bool, stop: tuple[str, ...]) -> tuple[str, str | None]:
        """Anthropic's (stop_reason, stop_sequence); which stop string ended the text is read from the text of
        all completion tokens, the stop string included (Result.text ends before it)."""
        full = self.rt.detokenize(r.completion_tokens) \
            if stop and r.finish_reason == "stop" else r.text
        return anthropic.stop_reason(r, has_calls, stop, full)

    def _messages_stream(self, events: asyncio.Queue, cancel: threading.Event, mid: str, prompt: Prompt,
                         req: MessagesRequest, stores: bool) -> AsyncIterator[str]:
        """Anthropic's events: message_start, then per content block content_block_start, its deltas and
        content_block_stop (thinking, text; tool_use blocks at the end, each input as one input_json_delta),
        message_delta (stop reason, final usage) and message_stop; an error event if the job fails.

        message_start's usage is already the final input split (anthropic.input_usage: input_tokens without the
        cache_read_input_tokens and cache_creation_input_tokens; message_delta repeats it with the output
        tokens): it is sent with the job's first event, whose TEXT carries the tokens restored at admission
        (Event.cached_tokens), or with the result. Claude Code adds up message_start's figures, replaced by
        message_delta's only where those are above 0, so both must agree. `stores`: the job stores snapshots
        (`Reuse.stores`)."""
        parser = prompt.reply.stream()
        block = {"index": -1, "type": None}
        thinking: list[str] = []  # the open thinking block's text, for its signature
        held: list[str] | None = []  # lines before message_start (None once it is sent)

        def opening(cached: int, stored: bool = stores) -> list[str]:
            """message_start (once), then the lines held until it could be sent."""
            nonlocal held
            if held is None:
                return []
            lines, held = held, None
            return [event("message_start", {"message": {
                "id": mid, "type": "message", "role": "assistant", "model": self.rt.model_id, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {**anthropic.input_usage(len(prompt.tokens), cached, stored), "output_tokens": 0}}})
                    ] + lines

        def on_text(ev: Event) -> list[str]:
            out = pieces(parser.push(ev.text))
            if held is not None and ev.cached_tokens is None:  # not from the scheduler: wait for the result
                held.extend(out)
                return []
            return opening(ev.cached_tokens or 0) + out

        def event(name: str, data: dict) -> str:
            return f"event: {name}\ndata: {json.dumps(dict(type=name, **data), ensure_ascii=False)}\n\n"

        def close() -> list[str]:
            if block["type"] is None:
                return []
            out = []
            if block["type"] == "thinking":  # as Anthropic: the signature is the block's last delta
                out.append(event("content_block_delta", {"index": block["index"], "delta": {
                    "type": "signature_delta", "signature": anthropic.signature("".join(thinking))}}))
                thinking.clear()
            block["type"] = None
            return out + [event("content_block_stop", {"index": block["index"]})]

        def start(content_block: dict) -> list[str]:
            out = close()
            block["index"] += 1
            block["type"] = content_block["type"]
            return out + [event("content_block_start", {"index": block["index"], "content_block": content_block})]

        def pieces(items) -> list[str]:
            out = []
            for kind, text in items:
                if kind == "reasoning":
                    if block["type"] != "thinking":
                        out += start({"type": "thinking", "thinking": "", "signature": ""})
                    thinking.append(text)
                    if req.omit_thinking:  # display "omitted": the text travels in the signature only
                        continue
                    delta = {"type": "thinking_delta", "thinking": text}
                else:
                    if block["type"] != "text":
                        out += start({"type": "text", "text": ""})
                    delta = {"type": "text_delta", "text": text}
                out.append(event("content_block_delta", {"index": block["index"], "delta": delta}))
            return out

        def on_done(r: Result) -> list[str]:
            rest, calls = parser.finish(r.cut)
            out = pieces(rest)
            for call in calls:
                use = anthropic.tool_use(call)
                out += start(dict(use, input={}))
                out.append(event("content_block_delta", {"index": block["index"], "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(use["input"], ensure_ascii=False)}}))
            out += close()
            reason, sequence = self._stop_reason(r, bool(calls), req.options.stop)
            out.append(event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                               "usage": anthropic.usage(r, stores),
                                               **anthropic.context_management(req)}))
            out.append(event("message_stop", {}))
            return opening(r.cached_tokens) + out

        def on_error(e: Exception) -> list[str]:  # failed before any text: reported as neither read nor written
            return opening(0, False) + close() + [event("error", {"error": anthropic_payload(e)[0]["error"]})]

        async def gen() -> AsyncIterator[str]:
            async for line in self._lines(events, cancel, "/v1/messages", "messages-stream",
                                          on_text, on_done, on_error):
                yield line

        return gen()

    async def count_tokens(self, request: Request):
        req, prompt = await self._messages_prompt(request, anthropic.COUNT_TOKENS)
        body = {"input_tokens": len(prompt.tokens)}
        if req.applied_edits:  # as Anthropic's count_tokens reports context editing: the length before it
            freed = sum(e["cleared_input_tokens"] for e in req.applied_edits)
            body["context_management"] = {"original_input_tokens": len(prompt.tokens) + freed}
        return JSONResponse(body)

    # ------------------------------------------------------------------ OpenAI Responses API

    async def responses(self, request: Request):
        req = await self._parse(request, parse_responses)
        prompt, job, events, cancel = await self._submit_chat(request, req)
        rid, created = responses.new_id("resp"), int(time.time())
        if req.options.stream:
            return StreamingResponse(self._responses_stream(events, cancel, rid, created, prompt, req),
                                     media_type="text/event-stream")
        r = (await self._collect(request, events, cancel))[0]
        self._log("responses", [r])
        out = prompt.reply.parse(r.text, r.cut)
        return JSONResponse(dict(responses.response_object(
            rid, created, self.rt.model_id, req, responses.output_items(out, req.names), responses.status(r, out),
            self._responses_usage(r, out)), timings=_timings(r)), headers=_tier_header(r))

    def _responses_usage(self, r: Result, out) -> dict:
        reasoning = len(self.rt.engine.tokenize(out.reasoning, parse_special=False)) if out.reasoning else 0
        return responses.usage(r, reasoning)

    def _responses_stream(self, events: asyncio.Queue, cancel: threading.Event, rid: str, created: int,
                          prompt: Prompt, req: ResponsesRequest) -> AsyncIterator[str]:
        """The Responses API's events, each `event: <type>` with its JSON (`type`, `sequence_number`):
        response.created and response.in_progress; per output item response.output_item.added, its part
        (response.content_part.added, the deltas: response.reasoning_text.delta or response.output_text.delta,
        their .done, response.content_part.done) and response.output_item.done (reasoning, then message; function
        calls at the end, each with one response.function_call_arguments.delta and .done, or
        response.custom_tool_call_input.delta and .done); then response.completed (or response.incomplete when
        generation hit max_output_tokens) carrying the whole response and its usage; response.failed if the job
        fails."""
        parser = prompt.reply.stream()
        model = self.rt.model_id
        seq = [0]
        output: list[dict] = []  # finished items
        cur: dict = {"item": None, "text": ""}  # the open reasoning or message item

        def event(kind: str, **data) -> str:
            body = dict(type=kind, sequence_number=seq[0], **data)
            seq[0] += 1
            return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

        def part(kind: str, text: str) -> dict:
            return responses.output_text(text) if kind == "message" else {"type": "reasoning_text", "text": text}

        def close() -> list[str]:
            item = cur["item"]
            if item is None:
                return []
            cur["item"] = None
            i, kind, text = len(output), item["type"], cur["text"]
            ref = {"item_id": item["id"], "output_index": i, "content_index": 0}
            done = responses.message_item(text, item["id"]) if kind == "message" \
                else responses.reasoning_item(text, item["id"])
            output.append(done)
            if kind == "message":
                lines = [event("response.output_text.done", **ref, text=text, logprobs=[])]
            else:
                lines = [event("response.reasoning_text.done", **ref, text=text)]
            return lines + [event("response.content_part.done", **ref, part=part(kind, text)),
                            event("response.output_item.done", output_index=i, item=done)]

        def open_item(kind: str) -> list[str]:
            lines = close()
            item_id = responses.new_id("msg" if kind == "message" else "rs")
            item = responses.message_item(None, item_id, "in_progress") if kind == "message" \
                else dict(responses.reasoning_item("", item_id, "in_progress"), content=[])
            cur["item"], cur["text"] = item, ""
            i = len(output)
            return lines + [event("response.output_item.added", output_index=i, item=item),
                            event("response.content_part.added", item_id=item_id, output_index=i, content_index=0,
                                  part=part(kind, ""))]

        def pieces(items) -> list[str]:
            lines = []
            for kind, text in items:
                want = "reasoning" if kind == "reasoning" else "message"
                if cur["item"] is None or cur["item"]["type"] != want:
                    lines += open_item(want)
                cur["text"] += text
                ref = {"item_id": cur["item"]["id"], "output_index": len(output), "content_index": 0}
                if want == "message":
                    lines.append(event("response.output_text.delta", **ref, delta=text, logprobs=[]))
                else:
                    lines.append(event("response.reasoning_text.delta", **ref, delta=text))
            return lines

        def on_done(r: Result) -> list[str]:
            rest, calls = parser.finish(r.cut)
            lines = pieces(rest) + close()
            for call in calls:
                item = responses.call_item(call, req.names, responses.new_id("fc"))
                i = len(output)
                ref = {"item_id": item["id"], "output_index": i}
                if item["type"] == "custom_tool_call":
                    lines += [event("response.output_item.added", output_index=i,
                                    item=dict(item, input="", status="in_progress")),
                              event("response.custom_tool_call_input.delta", **ref, delta=item["input"]),
                              event("response.custom_tool_call_input.done", **ref, input=item["input"])]
                else:
                    lines += [event("response.output_item.added", output_index=i,
                                    item=dict(item, arguments="", status="in_progress")),
                              event("response.function_call_arguments.delta", **ref, delta=item["arguments"]),
                              event("response.function_call_arguments.done", **ref, name=item["name"],
                                    arguments=item["arguments"])]
                output.append(item)
                lines.append(event("response.output_item.done", output_index=i, item=item))
            out = ParsedOutput(content="".join(x["content"][0]["text"] for x in output if x["type"] == "message"
                                               and x["content"]),
                               reasoning="".join(x["content"][0]["text"] for x in output if x["type"] == "reasoning"
                                                 and x["content"]) or None, tool_calls=calls)
            state = responses.status(r, out)
            final = responses.response_object(rid, created, model, req, output, state, self._responses_usage(r, out))
            name = "response.completed" if state == "completed" else "response.incomplete"
            return lines + [event(name, response=dict(final, timings=_timings(r)))]

        def on_error(e: Exception) -> list[str]:
            err = error_payload(e)[0]["error"]
            failed = responses.response_object(rid, created, model, req, output, "failed", None)
            failed["error"] = {"code": err.get("code") or err.get("type"), "message": err["message"]}
            return close() + [event("response.failed", response=failed)]

        async def gen() -> AsyncIterator[str]:
            start = responses.response_object(rid, created, model, req, [], "in_progress", None)
            yield event("response.created", response=start)
            yield event("response.in_progress", response=start)
            async for line in self._lines(events, cancel, "/v1/responses", "responses-stream",
                                          lambda ev: pieces(parser.push(ev.text)), on_done, on_error):
                yield line

        return gen()

    # ------------------------------------------------------------------ models, metrics, cache, health

    def _model_card(self) -> dict:
        return {"id": self.rt.model_id, "object": "model", "created": 0, "owned_by": "orchestrator",
                "meta": self.rt.model_meta()}

    def warm_up(self) -> None:
        """Pay the first request's one-off costs at start, not in its time to first token: anyio's worker thread
        and the modules its first use imports, the template's first render with its boundary probes (about 60 ms
        of the first request's on the tiny preset: py-spy of a fresh server). Renders a one-message chat; a
        template that rejects it is left to the first request to report."""
        try:
            self.rt.prompts.chat([{"role": "user", "content": "hi"}], None, {})
        except InvalidRequest:
            log.debug("the warm-up chat was refused by the template", exc_info=True)

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request):
        model_id = request.path_params["model_id"]
        if model_id != self.rt.model_id:
            raise NotFound(f"The model {model_id[:200]!r} does not exist: this server serves "
                           f"{self.rt.model_id!r}", param="model", code="model_not_found")
        return JSONResponse(self._model_card())

    async def prometheus(self, request: Request):
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def cache_stats(self, request: Request):
        return JSONResponse(self.rt.cache_report())

    async def cache_flush(self, request: Request):
        """Administration: drop every snapshot of the local tiers and the slots' live state (Runtime.flush_cache).
        The operator's; off (403) on a server without a key."""
        if self.rt.config.operator_key is None:
            raise Forbidden("cache administration is off: start the server with --admin-key (or --api-key) to "
                            "enable it")
        n = await run_in_threadpool(self.rt.flush_cache)  # waits for the worker's step, off the event loop
        log.warning("cache flushed by an administration request: %d entries dropped", n)
        return JSONResponse({"flushed_entries": n})

    async def openapi(self, request: Request):
        return JSONResponse(openapi_schema(self.rt.config))

    async def health(self, request: Request):
        """Public: status and slots for a load balancer; queue and cache figures only for the operator (or on a
        server without a key), since they show other tenants' activity."""
        try:
            _allow(request, self.rt.config, OPERATOR)
            full = True
        except (Unauthorized, Forbidden):
            full = False
        return JSONResponse({"status": "ok", **self.rt.health(full)})


def create_app(runtime: Runtime) -> Starlette:
    """The Starlette app for a started runtime. The caller owns the runtime (and closes it)."""
    api = Api(runtime)
    cfg = runtime.config

    def route(path: str, handler, method: str, who: str = TENANT, flavor: str = OPENAI) -> Route:
        return Route(path, _guard(api, path.replace(":path", ""), handler, cfg, who, flavor), methods=[method])

    routes = [
        route("/v1/chat/completions", api.chat, "POST"),
        route("/v1/completions", api.completions, "POST"),
        route("/v1/messages", api.messages, "POST", flavor=ANTHROPIC),
        route("/v1/messages/count_tokens", api.count_tokens, "POST", flavor=ANTHROPIC),
        route("/v1/responses", api.responses, "POST"),
        route("/v1/models", api.models, "GET"),
        route("/v1/models/{model_id:path}", api.model, "GET"),
        route("/health", api.health, "GET", who=PUBLIC),
        route("/metrics", api.prometheus, "GET", who=OPERATOR),
        route("/v1/cache/stats", api.cache_stats, "GET", who=OPERATOR),
        route("/v1/cache/flush", api.cache_flush, "POST", who=OPERATOR),
        route("/openapi.json", api.openapi, "GET"),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await run_in_threadpool(api.warm_up)  # run_in_threadpool: the route's own path, warmed
        yield

    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS, lifespan=lifespan)
    app.state.record_failure = api.record_failure
    return app


def _guard(api: Api, path: str, handler, cfg: Config, who: str, flavor: str):
    """Check the caller's key for `who` (`_allow`), then run the route, turning any exception into
    an error response in the route's flavor (OpenAI's or Anthropic's shape) here, so the connection stays usable
    (an exception that reaches Starlette's outermost middleware is re-raised and closes the keep-alive
    connection); every such refusal or failure is counted and logged. Every response names the replica
    (REPLICA_HEADER)."""
    replica = cfg.replica

    async def guarded(request: Request):
        try:
            _allow(request, cfg, who)
            response = await handler(request)
        except Exception as e:  # noqa: BLE001 - mapped to 4xx/5xx in one place: server/errors.py
            response = error_response(e, flavor)
            api.record_failure(path, e)
        response.headers[REPLICA_HEADER] = replica
        return response

    return guarded


__all__ = ["create_app", "error_body"]
