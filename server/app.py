"""Starlette app: the routes over an orchestrator `Runtime`.

Routes: POST /v1/chat/completions, POST /v1/completions (OpenAI), POST /v1/messages and /v1/messages/count_tokens
(Anthropic's Messages API), POST /v1/responses (OpenAI's Responses API, stateless), GET /v1/models,
GET /v1/models/{id}, GET /health, GET /metrics (Prometheus), GET /v1/cache/stats (JSON), POST /v1/cache/flush
(administration), GET /openapi.json. Each protocol is a module of server/protocols/ (its fields, its parsing, its
encoder); server/driver.py runs their requests. Request-level extensions: `cache_prompt` (false = cold run, the
cache is neither read nor written), `cache_salt` (tenant isolation) and `chat_template_kwargs` (e.g.
{"enable_thinking": false}). Responses add `timings` (llama-server's name).

With `Config.api_key` set, every route but /health needs `Authorization: Bearer <key>` (401 otherwise). The
operator's routes (cache flush and stats, /metrics, /health's full view) need the operator key (`--admin-key`,
else the API key; a tenant's key gets 403); cache administration (flush) is off (403) on a server without a key.
"""

from __future__ import annotations

import contextlib
import hmac
import logging

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from orchestrator.config import Config
from orchestrator.errors import Forbidden, InvalidRequest, Unauthorized
from orchestrator.runtime import Runtime

from .docs import openapi_schema
from .driver import Driver
from .errors import ANTHROPIC, EXCEPTION_HANDLERS, OPENAI, NotFound, error_body, error_response
from .protocols import anthropic
from .protocols.anthropic import MessagesEncoder, parse_messages
from .protocols.openai_chat import ChatEncoder, parse_chat
from .protocols.openai_completions import CompletionEncoder, parse_completion
from .protocols.responses import ResponsesEncoder, parse_responses

log = logging.getLogger("orchestrator.server")
REPLICA_HEADER = "x-orchestrator-replica"  # on every response: which replica served it (--replica-name)


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



class Api:
    """Handlers bound to one runtime: the generating routes hand their protocol's parser and encoder to the
    driver; the others answer from the runtime."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.driver = Driver(runtime)

    async def chat(self, request: Request):
        call = await self.driver.parse(request, parse_chat)
        prompt = await self.driver.chat_prompt(request, call)
        sub = await self.driver.submit_chat(request, call, prompt)
        encoder = ChatEncoder(call, prompt.reply, self.rt.model_id, self.rt.piece)
        return await self.driver.answer(request, sub, encoder, call.options.stream)

    async def completions(self, request: Request):
        call = await self.driver.parse(request, parse_completion)
        prompt = await self.driver.off_loop(request, self.rt.prompts.completion, call.prompt)
        sub = self.driver.submit_prompt(prompt, call.options)
        encoder = CompletionEncoder(call, self.rt.model_id, self.rt.piece)
        return await self.driver.answer(request, sub, encoder, call.options.stream)

    async def _messages_prompt(self, request: Request, route: str):
        """The Messages call and its prompt, with its clear_tool_uses edit applied where it passes its trigger."""
        call = await self.driver.parse(request, parse_messages, route)
        prompt = await self.driver.chat_prompt(request, call)
        return await anthropic.apply_context_edit(call, prompt, lambda c: self.driver.chat_prompt(request, c))

    async def messages(self, request: Request):
        call, prompt = await self._messages_prompt(request, anthropic.MESSAGES)
        sub = await self.driver.submit_chat(request, call, prompt)
        stores = self.rt.scheduler.reuse.stores(sub.job)  # whether its uncached prompt tokens are cache writes
        encoder = MessagesEncoder(call, prompt.reply, len(prompt.tokens), self.rt.model_id, stores)
        return await self.driver.answer(request, sub, encoder, call.options.stream)

    async def count_tokens(self, request: Request):
        call, prompt = await self._messages_prompt(request, anthropic.COUNT_TOKENS)
        return JSONResponse(anthropic.count_tokens(call, len(prompt.tokens)))

    async def responses(self, request: Request):
        call = await self.driver.parse(request, parse_responses)
        prompt = await self.driver.chat_prompt(request, call)
        sub = await self.driver.submit_chat(request, call, prompt)
        encoder = ResponsesEncoder(call, prompt.reply, self.rt.model_id)
        return await self.driver.answer(request, sub, encoder, call.options.stream)

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
        return Response(self.driver.metrics.render(), media_type=CONTENT_TYPE_LATEST)

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
    app.state.record_failure = api.driver.record_failure
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
            api.driver.record_failure(path, e)
        response.headers[REPLICA_HEADER] = replica
        return response

    return guarded


__all__ = ["create_app", "error_body"]
