"""The request driver: the asyncio plumbing every generating route shares, whatever its protocol.

    body (size, media type, JSON, nesting) -> protocol parse -> prompt (rendered off the event loop)
    -> grammar -> Job -> Scheduler.submit -> events -> the protocol's Encoder
    -> a server-sent event stream, or the encoder's final body (the fold of the same events)

Every wait on the client is given up when it disconnects (RequestCancelled, 499) or after --timeout
(RequestTimeout, 504); every served request is observed in the metrics and logged once, every refused or failed
one counted by `record_failure`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import threading
from typing import AsyncIterator, Callable, Sequence

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from orchestrator.errors import InvalidRequest, PayloadTooLarge, RequestCancelled, RequestTimeout, \
    UnsupportedMediaType
from orchestrator.output.grammar import Constraint
from orchestrator.prompt.builder import Prompt
from orchestrator.request import Event, Job, Result
from orchestrator.runtime import Runtime

from .conversation import late_system_as_user
from .errors import error_status
from .metrics import Metrics
from .protocols.base import ChatCall, Encoder, Sse
from .validate import GenerationOptions, check_nesting

log = logging.getLogger("orchestrator.server")
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
    """`raw` parsed as JSON and checked for nesting (validate.check_nesting): InvalidRequest (400) otherwise."""
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


def _frame(event: Sse) -> str:
    """One server-sent event: `event: <name>` (when named) and `data: <JSON>`."""
    name, payload = event
    data = f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
    return data if name is None else f"event: {name}\n{data}"


@dataclasses.dataclass
class Submitted:
    """A submitted job: its events (filled from the scheduler's thread) and its cancel flag."""

    job: Job
    events: asyncio.Queue
    cancel: threading.Event


class Driver:
    """The request plumbing bound to one runtime. Holds the one probe result of the template (does it render a
    late system message) and the metrics."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.metrics = Metrics(runtime.cache_stats, runtime.after_generation_stats)
        self._late_system_ok: bool | None = None

    # ------------------------------------------------------------------ before the job

    async def parse(self, request: Request, parse: Callable, *args):
        """`parse(body, config, *args)` of the request's JSON body. Everything after reading the body (JSON
        decoding, the nesting and prompt-size checks, the conversion) runs in the thread pool, off the event
        loop: each step is linear in the body and bounded by its limit (--max-body-size, --max-prompt-size)."""
        raw = await _read_body(request, self.rt.config.max_body_bytes)
        return await self.off_loop(request, lambda: parse(_json(raw), self.rt.config, *args))

    async def off_loop(self, request: Request, fn: Callable, *args):
        """fn(*args) in the thread pool, given up when the client disconnects (RequestCancelled, 499) or after
        --timeout (RequestTimeout, 504). What the thread has started it finishes on its own, bounded by the size
        limits it checks."""
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

    async def chat_prompt(self, request: Request, call: ChatCall) -> Prompt:
        """The prompt of a chat call. A system message after the leading ones is passed to the template where the
        template renders it, and is a user message where it stands elsewhere (conversation.late_system_as_user);
        call.messages is updated, for restorable_after."""
        if call.late_system is not None and not await self._renders_late_system():
            call.messages = late_system_as_user(call.messages)
        return await self.off_loop(request, self.rt.prompts.chat, call.messages, call.tools, call.template_kwargs,
                                   call.cache_breakpoints)

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

    def _job(self, prompt: Prompt, opts: GenerationOptions, prompt_cache_key: str = "",
             restorable_after: Callable[[Sequence[int]], int | None] | None = None,
             constraint: Constraint | None = None) -> Job:
        """The job for a prompt (a prompt that does not fit the context is refused by `Runtime.submit`).
        restorable_after: for a chat prompt, whether and how the state after a given answer is restored by the
        next request (`PromptBuilder.restorable_after`). constraint: the grammar to sample under, if any."""
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
                   max_tokens=min(max_tokens, self.rt.n_ctx - len(prompt.tokens)), sampling=sampling,
                   stop=opts.stop, use_cache=opts.cache_prompt and cfg.cache_enabled, prompt_cache_key=prompt_cache_key,
                   cache_salt=opts.cache_salt, tenant=opts.cache_salt or prompt_cache_key,
                   restorable_after=restorable_after,
                   prepare_s={"render": prompt.render_s, "tokenize": prompt.tokenize_s,
                              "boundaries": prompt.boundaries_s}, logprobs=opts.logprobs, n=opts.n)

    def submit(self, job: Job) -> Submitted:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(ev: Event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ev)

        return Submitted(job, events, self.rt.submit(job, sink))

    def submit_prompt(self, prompt: Prompt, opts: GenerationOptions) -> Submitted:
        """Submit a prompt without a conversation (/v1/completions)."""
        return self.submit(self._job(prompt, opts))

    async def submit_chat(self, request: Request, call: ChatCall, prompt: Prompt) -> Submitted:
        """Build a rendered chat call's grammar (structured output, forced tool calls) and submit its job."""
        constraint = await self.off_loop(request, self.rt.constraint, call.structure, call.tools,
                                         prompt.opens_reasoning)
        job = self._job(prompt, call.options, call.prompt_cache_key, self.rt.prompts.restorable_after(
            call.messages, call.tools, call.template_kwargs, prompt), constraint)
        return self.submit(job)

    # ------------------------------------------------------------------ the answer

    async def answer(self, request: Request, sub: Submitted, encoder: Encoder, stream: bool) -> Response:
        """The job's answer in `encoder`'s protocol: its event stream, or its final body with TIER_HEADER."""
        if stream:
            return StreamingResponse(self._stream(sub, encoder), media_type="text/event-stream")
        results = await self._collect(request, sub, encoder)
        self._log(encoder.kind, results)
        return JSONResponse(encoder.final(), headers={TIER_HEADER: results[0].restore_source})

    async def _collect(self, request: Request, sub: Submitted, encoder: Encoder) -> list[Result]:
        """Feed the encoder the job's events until every choice is done, by index; the first error (any choice's)
        fails the request and cancels the other choices. A client that disconnects meanwhile cancels the job (its
        slots are freed at the next step) and the request ends as RequestCancelled (499), also when the scheduler
        delivers what was generated until then."""
        watch = asyncio.create_task(_cancel_on_disconnect(request, sub.cancel))
        results: list[Result | None] = [None] * sub.job.n
        encoder.start()
        try:
            while True:
                ev = await sub.events.get()
                if ev.kind == "text":
                    encoder.text(ev)
                elif ev.kind == "error":
                    raise ev.error
                else:
                    if watch.done() and not watch.cancelled():
                        raise RequestCancelled()  # nobody to answer
                    results[ev.index] = ev.result
                    encoder.done(ev.result)
                    if all(r is not None for r in results):
                        encoder.end(results)
                        return results
        finally:
            watch.cancel()
            sub.cancel.set()  # a no-op once done; stops the job if this handler is cancelled

    async def _stream(self, sub: Submitted, encoder: Encoder) -> AsyncIterator[str]:
        """The encoder's events as they come, then its closing line: per TEXT event (of any choice), per choice's
        result, then once all are done; or, as soon as one choice fails, its error events (the other choices are
        cancelled). Leaving early (client gone) cancels the job at its next token and counts a disconnect."""
        finished = False
        results: list[Result | None] = [None] * sub.job.n
        try:
            for event in encoder.start():
                yield _frame(event)
            while True:
                ev = await sub.events.get()
                if ev.kind == "text":
                    events = encoder.text(ev)
                elif ev.kind == "error":
                    self.record_failure(encoder.route, ev.error)
                    events = encoder.error(ev.error)
                else:
                    results[ev.index] = ev.result
                    events = encoder.done(ev.result)
                    if all(r is not None for r in results):
                        self._log(encoder.kind + "-stream", results)
                        events += encoder.end(results)
                for line in [_frame(e) for e in events]:
                    yield line
                if ev.kind == "error" or all(r is not None for r in results):
                    break
            finished = True
            if encoder.closing:
                yield encoder.closing
        finally:
            sub.cancel.set()
            if not finished:
                self.record_failure(encoder.route, RequestCancelled())

    # ------------------------------------------------------------------ observation

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
