"""Validation of OpenAI-style request bodies into plain, checked values.

Every problem raises InvalidRequest naming the field (`param`, e.g. "messages[3].tool_calls[0].function.arguments"),
which server/errors.py turns into HTTP 400 with an OpenAI-style body.

`FIELDS` is the field policy of both endpoints (server/fields.py): every top-level field is honoured, accepted as
a hint, accepted with its default value only (`DEFAULT_ONLY`: e.g. best_of=2, presence_penalty=0.5 are refused),
or refused; a field in no table is refused by name, so a client never believes a setting took effect when it did
not. `thinking_from_effort` maps a reasoning effort to the template's thinking switch, for every route.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from orchestrator.config import Config
from orchestrator.errors import InvalidRequest
from orchestrator.output.grammar import Structure
from orchestrator.request import SamplingParams

from . import fields
from .fields import DEFAULT_ONLY as _DEFAULT_ONLY_KIND, HINT, HONOURED, Rule

ROLES = ("system", "developer", "user", "assistant", "tool")
RESERVED_TEMPLATE_VARS = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
MAX_ID_CHARS = 1024  # longest cache_salt / user / prompt_cache_key / safety_identifier accepted
MAX_TOP_LOGPROBS = 20  # most alternatives per token (OpenAI's limit for top_logprobs)
MAX_BUDGET = 2 ** 31 - 1  # the largest completion budget accepted (what is generated is capped by the server)

CHAT, COMPLETION = "chat", "completion"
_BOTH = (CHAT, COMPLETION)

# The field policy of both endpoints (server/fields.py): field -> Rule(kind, endpoints, note[, accepts]). New
# request fields are added here (and to server/openapi.py, which tests/test_openapi.py checks against this table);
# the README's tables are server.fields.markdown of it (tests/test_fields.py).
_ANY_NUMBER_ZERO = lambda v: v == 0 and not isinstance(v, bool)  # noqa: E731
FIELDS: dict[str, Rule] = {
    # what to run
    "model": Rule(HONOURED, _BOTH, "any string: the one model served answers"),
    "messages": Rule(HONOURED, (CHAT,), "see Conversations"),
    "tools": Rule(HONOURED, (CHAT,), "function tools, rendered by the template"),
    "tool_choice": Rule(HONOURED, (CHAT,), '"auto", "none" (drops the tools), "required" and a named function '
                                           "(a grammar enforces them)"),
    "parallel_tool_calls": Rule(HONOURED, (CHAT,), "false: at most one tool call (a grammar enforces it)"),
    "response_format": Rule(HONOURED, (CHAT,), "text, json_object, json_schema (a grammar enforces it)"),
    "reasoning_effort": Rule(HONOURED, (CHAT,), '"none"/"minimal": thinking off, "low" and above: on '
                                                "(`enable_thinking`; an explicit `chat_template_kwargs` wins)"),
    "chat_template_kwargs": Rule(HONOURED, (CHAT,), "variables for the template, e.g. enable_thinking"),
    "prompt": Rule(HONOURED, (COMPLETION,), "a string, or a list of one string; the caller's own markup"),
    "echo": Rule(HONOURED, (COMPLETION,), "the prompt is returned before the completion"),
    # generation
    "max_tokens": Rule(HONOURED, _BOTH, "any positive budget: generation stops at it, at --max-tokens-limit or "
                                        "where the context is full (finish_reason length)"),
    "max_completion_tokens": Rule(HONOURED, _BOTH, "wins over max_tokens, as in OpenAI's docs"),
    "temperature": Rule(HONOURED, _BOTH, "0 to 2"),
    "top_p": Rule(HONOURED, _BOTH, "0 to 1"),
    "top_k": Rule(HONOURED, _BOTH, "an extension, as in vLLM and llama.cpp"),
    "min_p": Rule(HONOURED, _BOTH, "an extension, as in vLLM and llama.cpp"),
    "seed": Rule(HONOURED, _BOTH, "reproducible sampling"),
    "stop": Rule(HONOURED, _BOTH, "up to 16 strings"),
    "stream": Rule(HONOURED, _BOTH, "server-sent events ending with [DONE]"),
    "stream_options": Rule(HONOURED, _BOTH, "include_usage"),
    "n": Rule(HONOURED, _BOTH, "1 to --parallel minus 1 (a slot is left to others): one prefill, choice i "
                               "sampled with seed + i"),
    "logprobs": Rule(HONOURED, _BOTH, "chat: true/false; completions: 0 to 20 alternatives"),
    "top_logprobs": Rule(HONOURED, (CHAT,), "0 to 20, with logprobs: true"),
    # cache control and caller identity
    "cache_prompt": Rule(HONOURED, _BOTH, "an extension: false is a cold run that neither reads nor writes the "
                                          "cache"),
    "cache_salt": Rule(HONOURED, _BOTH, "an extension: requests share snapshots only with the same salt"),
    "prompt_cache_key": Rule(HONOURED, _BOTH, "requests with the same key are routed to the same slot when they "
                                              "can be"),
    "user": Rule(HINT, _BOTH, "an identity, checked to be a short string"),
    "safety_identifier": Rule(HINT, _BOTH, "an identity, checked to be a short string"),
    "metadata": Rule(HINT, (CHAT,), "an object"),
    "store": Rule(HINT, (CHAT,), "nothing is stored for later retrieval: the answer is the same"),
    "service_tier": Rule(HINT, (CHAT,), "one tier serves every request"),
    # accepted only with their default value: another value would change the answer
    "best_of": Rule(_DEFAULT_ONLY_KIND, (COMPLETION,), "1", lambda v: v == 1 and not isinstance(v, bool)),
    "presence_penalty": Rule(_DEFAULT_ONLY_KIND, _BOTH, "0 (penalties are not implemented)", _ANY_NUMBER_ZERO),
    "frequency_penalty": Rule(_DEFAULT_ONLY_KIND, _BOTH, "0 (penalties are not implemented)", _ANY_NUMBER_ZERO),
    "logit_bias": Rule(_DEFAULT_ONLY_KIND, _BOTH, "an empty object", lambda v: v == {}),
    "suffix": Rule(_DEFAULT_ONLY_KIND, (COMPLETION,), "an empty string", lambda v: v == ""),
}

# field -> (accepts the value?, the values accepted, for the error message). null is always accepted.
DEFAULT_ONLY: dict[str, tuple[Callable[[Any], bool], str]] = {
    k: (r.accepts, r.note) for k, r in FIELDS.items() if r.kind == fields.DEFAULT_ONLY}

# reasoning effort (OpenAI's `reasoning_effort` and Responses' `reasoning.effort`, Anthropic's
# `output_config.effort`) -> the template's thinking switch. OpenAI documents "none" as no reasoning (GPT-5.1) and
# "minimal" as very few reasoning tokens; a template's switch is on or off, so both are off. Anthropic's efforts
# ("low" .. "max") all still think when the task asks for it, and so do OpenAI's "low" and above: on.
EFFORT_OFF = ("none", "minimal")
EFFORT_ON = ("low", "medium", "high", "xhigh", "max")


def thinking_from_effort(value: Any, param: str = "reasoning_effort") -> bool | None:
    """The template's thinking switch (`enable_thinking`) for a reasoning effort: False for EFFORT_OFF, True
    for EFFORT_ON, None for null (no opinion: the template's default). Raises InvalidRequest naming `param` for
    another value."""
    if value is None:
        return None
    if value in EFFORT_OFF:
        return False
    if value in EFFORT_ON:
        return True
    raise _bad(f"'{param}' must be one of {', '.join(EFFORT_OFF + EFFORT_ON)}; got {json.dumps(value)[:40]}", param)


_STRING_FIELDS = ("model", "cache_salt", "prompt_cache_key", "user", "safety_identifier")


@dataclass
class GenerationOptions:
    """Options shared by /v1/chat/completions and /v1/completions."""

    max_tokens: int | None  # as asked; None: none given
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    cache_prompt: bool
    seed: int | None = None  # as given; None = not reproducible
    cache_salt: str = ""  # "" = the shared cache; otherwise only requests with the same salt share snapshots
    logprobs: int | None = None  # None: no logprobs; k: each token's logprob with the k most likely tokens
    n: int = 1  # choices (1..cfg.parallel)


@dataclass
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None
    template_kwargs: dict[str, Any]
    options: GenerationOptions
    prompt_cache_key: str = ""  # OpenAI's; the scheduler may route requests with the same key together
    cache_breakpoints: tuple[tuple[int, int], ...] = ()  # (message index, content characters before it)
    late_system: int | None = None  # index in the request of a system message after the leading ones
    structure: Structure = field(default_factory=Structure)  # response_format, tool_choice, parallel_tool_calls


@dataclass
class CompletionRequest:
    prompt: str
    options: GenerationOptions
    echo: bool = False
    extra: dict = field(default_factory=dict)


def _bad(msg: str, param: str) -> InvalidRequest:
    return InvalidRequest(msg, param=param)


def _num(body: dict, key: str, lo: float, hi: float, default: float, integer: bool = False):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        kind = "an integer" if integer else "a number"
        raise _bad(f"'{key}' must be {kind}, got {json.dumps(v)[:40]}", key)
    if not lo <= v <= hi:
        raise _bad(f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return v


def _check_fields(body: dict, endpoint: str) -> None:
    """Refuse fields not in FIELDS for `endpoint`, DEFAULT_ONLY fields with another value, and identity fields
    that are not short strings. Raises InvalidRequest naming the field."""
    fields.check(body, FIELDS, endpoint, "/v1/chat/completions" if endpoint == CHAT else "/v1/completions")
    for key in _STRING_FIELDS:
        value = body.get(key)
        if value is not None and (not isinstance(value, str) or len(value) > MAX_ID_CHARS):
            raise _bad(f"'{key}' must be a string of at most {MAX_ID_CHARS} characters", key)
    if body.get("cache_salt") == "":  # as vLLM: an empty salt would silently share with unsalted requests
        raise _bad("'cache_salt' must be a non-empty string when given (omit it to share the common cache)",
                   "cache_salt")
    if "metadata" in body and body["metadata"] is not None and not isinstance(body["metadata"], dict):
        raise _bad("'metadata' must be an object", "metadata")
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise _bad("'store' must be true or false", "store")
    if body.get("service_tier") is not None and not isinstance(body["service_tier"], str):
        raise _bad("'service_tier' must be a string", "service_tier")


def _options(body: dict, cfg: Config, budget: tuple[str, ...] = ("max_tokens", "max_completion_tokens")
             ) -> GenerationOptions:
    """The generation options of `body`. `budget`: the route's names of the completion budget, each checked
    under its own name, the last one given winning (OpenAI: max_completion_tokens, the newer name, wins over
    max_tokens; Responses: max_output_tokens). Any positive budget is accepted: the job generates at most
    --max-tokens-limit and what the context holds, and ends with the route's length reason there, as
    llama-server does."""
    max_tokens = None
    for key in budget:
        given = _num(body, key, 1, MAX_BUDGET, None, integer=True)
        max_tokens = max_tokens if given is None else given
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 16:
        stop = tuple(stop)
    else:
        raise _bad("'stop' must be a string or a list of at most 16 strings", "stop")
    stop = tuple(s for s in stop if s)
    for key in ("stream", "cache_prompt"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise _bad(f"'{key}' must be true or false", key)
    stream_options = body.get("stream_options")
    stream_options = {} if stream_options is None else stream_options
    if not isinstance(stream_options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    if not isinstance(stream_options.get("include_usage", False), bool):
        raise _bad("'stream_options.include_usage' must be true or false", "stream_options.include_usage")
    temperature = _num(body, "temperature", 0.0, 2.0, 1.0)
    seed = _num(body, "seed", -(2 ** 63), 2 ** 64 - 1, 0, integer=True)
    sampling = SamplingParams(
        temperature=float(temperature),
        top_k=int(_num(body, "top_k", 0, 1 << 20, 0, integer=True)),
        top_p=float(_num(body, "top_p", 0.0, 1.0, 1.0)),
        min_p=float(_num(body, "min_p", 0.0, 1.0, 0.0)),
        seed=int(seed),
    )
    cache_prompt = body.get("cache_prompt")
    n = _num(body, "n", 1, 2 ** 31 - 1, 1, integer=True)
    if n > cfg.max_choices:
        raise _bad(f"'n' is {n}, but this server generates at most {cfg.max_choices} choices per request: each choice "
                   f"is generated in a slot of its own, and one of the --parallel {cfg.parallel} slots is always "
                   f"left to other requests", "n")
    return GenerationOptions(max_tokens=max_tokens, sampling=sampling, stop=stop, stream=bool(body.get("stream")),
                             include_usage=bool(stream_options.get("include_usage")),
                             cache_prompt=True if cache_prompt is None else cache_prompt, seed=body.get("seed"),
                             cache_salt=body.get("cache_salt") or "", n=n)


def _content(content: Any, param: str, allow_none: bool) -> str | list | None:
    if content is None:
        if allow_none:
            return None
        raise _bad(f"'{param}' is required", param)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"'{param}[{j}]' must be a text part {{\"type\": \"text\", \"text\": \"...\"}} "
                           f"(images are not supported)", f"{param}[{j}]")
        return "".join(p["text"] for p in content)
    raise _bad(f"'{param}' must be a string or a list of text parts", param)


def _tool_calls(calls: Any, param: str) -> list[dict]:
    if not isinstance(calls, list):
        raise _bad(f"'{param}' must be a list", param)
    out = []
    for j, call in enumerate(calls):
        p = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"'{p}.function.name' must be a non-empty string", f"{p}.function.name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError) as e:
                raise _bad(f"'{p}.function.arguments' is not valid JSON: {str(e)[:200]}",
                           f"{p}.function.arguments") from e
            check_nesting({f"{p}.function.arguments": args})  # JSON text inside the body: not checked with it
        if not isinstance(args, dict):
            raise _bad(f"'{p}.function.arguments' must be a JSON object", f"{p}.function.arguments")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise _bad(f"'{p}.id' must be a string", f"{p}.id")
        # Arguments are rendered as an object: the template writes each parameter in the order given.
        out.append({"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _message(m: Any, i: int) -> dict:
    """One message, validated (tool results are bound to their calls by _messages)."""
    p = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(f"'{p}' must be an object", p)
    role = m.get("role")
    if role not in ROLES:
        raise _bad(f"'{p}.role' must be one of {', '.join(ROLES)}; got {json.dumps(role)[:40]}", f"{p}.role")
    msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
    has_calls = role == "assistant" and m.get("tool_calls")
    msg["content"] = _content(m.get("content"), f"{p}.content", allow_none=bool(has_calls) or role == "assistant")
    if role == "assistant":
        if msg["content"] is None:
            msg["content"] = ""
        if isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        if has_calls:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{p}.tool_calls")
    elif role == "tool":
        call_id = m.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise _bad(f"'{p}.tool_call_id' must be a string", f"{p}.tool_call_id")
        msg["tool_call_id"] = call_id
    if isinstance(m.get("name"), str):
        msg["name"] = m["name"]
    return msg


def _no_call(k: int, call_id: Any, a: int | None, answered: bool = False) -> InvalidRequest:
    p = f"messages[{k}]"
    if a is None:
        why = "the message before it is neither an assistant message with tool calls nor another tool result"
    elif answered:
        why = f"an earlier tool message already answered that call of messages[{a}]"
    else:
        why = f"the assistant message messages[{a}] has no tool call with that id"
    return _bad(f"'{p}' is a tool result for the tool call id {json.dumps(call_id)[:80]}, but {why}",
                f"{p}.tool_call_id")


def _bind_results(calls: list[dict], a: int, msgs: list[dict], results: range) -> list[int]:
    """The indices of the tool results `results` (the tool messages right after the assistant message
    messages[a], whose tool calls are `calls`) in the order to render them.

    OpenAI binds a result to its call by tool_call_id, but templates (Qwen3.5's among them) write the results
    by position: so when the calls have unique ids, the results must carry exactly those ids, each once, and
    are put in call order whatever order they came in. A result whose id matches no call (or a call answered
    before) is refused, as is a turn answered in part. Calls without ids (or with repeated ids) cannot be bound
    that way: their results keep their order, each naming a call of the turn or none."""
    ids = [c["id"] for c in calls]
    if None in ids or len(set(ids)) < len(ids):
        open_ids, unnamed = {x for x in ids if x is not None}, ids.count(None)
        for k in results:
            call_id = msgs[k]["tool_call_id"]
            if call_id in open_ids:
                open_ids.discard(call_id)
            elif call_id is None and unnamed:
                unnamed -= 1
            else:
                raise _no_call(k, call_id, a)
        return list(results)
    position = {x: j for j, x in enumerate(ids)}
    by_id: dict[str, int] = {}
    for k in results:
        call_id = msgs[k]["tool_call_id"]
        if call_id not in position or call_id in by_id:
            raise _no_call(k, call_id, a, answered=call_id in by_id)
        by_id[call_id] = k
    if by_id and len(by_id) < len(ids):
        j = next(j for j, x in enumerate(ids) if x not in by_id)
        raise _bad(f"the tool call messages[{a}].tool_calls[{j}] (id {json.dumps(ids[j])[:80]}) has no tool result: "
                   f"the tool messages after an assistant message answer each of its calls once (or none of them)",
                   f"messages[{a}].tool_calls[{j}].id")
    return [by_id[x] for x in ids if x in by_id]


def _messages(raw: Any, max_messages: int) -> tuple[list[dict], list[int]]:
    """(validated messages, the index in `raw` of each), with every assistant turn's tool results in the order
    of its tool calls (see _bind_results)."""
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list", "messages")
    if len(raw) > max_messages:
        raise _bad(f"'messages' holds {len(raw)} messages; this server accepts at most {max_messages} "
                   f"(--max-messages)", "messages")
    msgs = [_message(m, i) for i, m in enumerate(raw)]
    order: list[int] = []
    i = 0
    while i < len(msgs):
        m = msgs[i]
        if m["role"] == "tool":
            raise _no_call(i, m["tool_call_id"], None)
        order.append(i)
        j = i + 1
        if m.get("tool_calls"):
            while j < len(msgs) and msgs[j]["role"] == "tool":
                j += 1
            order += _bind_results(m["tool_calls"], i, msgs, range(i + 1, j))
        i = j
    return [msgs[k] for k in order], order


def _merge_system(messages: list[dict], order: list[int], breakpoints: tuple[tuple[int, int], ...]
                  ) -> tuple[list[dict], tuple[tuple[int, int], ...], int | None]:
    """Leading system (and developer) messages merged into one system message, their texts in order and
    separated by a blank line (templates accept one system message, at the start); the caller's breakpoints
    (raw message index, characters) moved to the merged messages. Also returns the raw index of the first
    system message later in the conversation, or None."""
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    where = {raw: k for k, raw in enumerate(order)}
    offset: dict[int, int] = {}
    if n > 1:
        texts, at = [], 0
        for k in range(n):
            offset[order[k]] = at + (2 if texts and messages[k]["content"] else 0)
            if messages[k]["content"]:
                at = offset[order[k]] + len(messages[k]["content"])
                texts.append(messages[k]["content"])
        messages = [{"role": "system", "content": "\n\n".join(texts)}] + messages[n:]
        where = {raw: max(0, k - n + 1) for raw, k in where.items()}
        order = order[:1] + order[n:]
    moved = tuple((where[i], offset.get(i, 0) + c) for i, c in breakpoints)
    late = next((order[k] for k in range(1, len(messages)) if messages[k]["role"] == "system"), None)
    return messages, moved, late


def conversation(raw: Any, max_messages: int
                 ) -> tuple[list[dict], tuple[tuple[int, int], ...], int | None]:
    """OpenAI-style `messages` -> (the messages to render, the caller's cache breakpoints in them, the index in
    `raw` of the first system or developer message after the leading ones, or None).

    Validates every message; puts each assistant turn's tool results in the order of its calls; merges the
    leading system and developer messages into one. Raises InvalidRequest naming the message."""
    messages, order = _messages(raw, max_messages)
    return _merge_system(messages, order, _breakpoints(raw))


def late_system_as_user(messages: list[dict]) -> list[dict]:
    """`messages` (as conversation returns them) with every system message after the first message rendered as
    a user message where it stands, its text unchanged: for templates that refuse or drop a later system
    message (Qwen3.5 raises "System message must be at the beginning"). Where it stands, not merged into the
    system prompt: the text stays in the prompt, and the prompt before it stays the same from turn to turn
    (Claude Code sends its environment as messages[1], after the first user message; moving it to the start
    would put it before the conversation and end every shared prefix there whenever it changes)."""
    return [dict(m, role="user") if k and m["role"] == "system" else m for k, m in enumerate(messages)]


def _breakpoints(raw: list) -> tuple[tuple[int, int], ...]:
    """The caller's cache breakpoints: text parts carrying OpenAI's `"prompt_cache_breakpoint": {"mode":
    "explicit"}` ("marks the exact end of a reusable prompt prefix"), as (message index, characters of the
    message's joined content through that part). Call after _messages validated the parts."""
    out = []
    for i, m in enumerate(raw):
        parts = m.get("content")
        if not isinstance(parts, list):
            continue
        n_chars = 0
        for j, part in enumerate(parts):
            n_chars += len(part["text"])
            mark = part.get("prompt_cache_breakpoint")
            if mark is None:
                continue
            if not isinstance(mark, dict) or mark.get("mode") != "explicit":
                p = f"messages[{i}].content[{j}].prompt_cache_breakpoint"
                raise _bad(f"'{p}' must be {{\"mode\": \"explicit\"}}", p)
            out.append((i, n_chars))
    return tuple(out)


def _tools(raw: Any) -> list[dict] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise _bad("'tools' must be a list", "tools")
    for j, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise _bad(f"'tools[{j}]' must be {{\"type\": \"function\", \"function\": {{...}}}}", f"tools[{j}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"'tools[{j}].function.name' must be a non-empty string", f"tools[{j}].function.name")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise _bad(f"'tools[{j}].function.parameters' must be a JSON schema object",
                       f"tools[{j}].function.parameters")
    return raw or None


def _tool_choice(raw: Any, tools: list[dict] | None) -> tuple[str, str | None]:
    """(the tool choice: 'auto', 'none' or 'required', the function a named choice forces or None); a named
    function must be in `tools`. 'none' drops the tools from the prompt; 'required' and a named function are
    enforced by a grammar (orchestrator/output/grammar.py). Raises InvalidRequest for another shape or an
    unknown function."""
    if raw is None:
        return "auto", None
    if raw in ("auto", "none", "required"):
        return raw, None
    fn = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise _bad("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if not any(t["function"]["name"] == fn["name"] for t in tools or ()):
        raise _bad(f"'tool_choice' names the function {json.dumps(fn['name'])[:60]}, which is not in 'tools'",
                   "tool_choice.function.name")
    return "required", fn["name"]


def _response_format(raw: Any) -> dict | None:
    """The JSON schema the reply must be valid against: None for {"type": "text"} (or null),
    {"type": "object"} for {"type": "json_object"}, the schema of {"type": "json_schema", "json_schema":
    {"name", "schema", "strict", "description"}} (strict or not, the grammar enforces it). Raises
    InvalidRequest naming the field."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise _bad("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                   "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                   "response_format")
    spec = raw.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("'response_format.json_schema' must be an object with \"name\" and \"schema\"",
                   "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 64:
        raise _bad("'response_format.json_schema.name' must be a string of 1 to 64 characters",
                   "response_format.json_schema.name")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise _bad("'response_format.json_schema.strict' must be true or false", "response_format.json_schema.strict")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise _bad("'response_format.json_schema.schema' must be a JSON schema object",
                   "response_format.json_schema.schema")
    return schema


def _chat_logprobs(body: dict) -> int | None:
    """None, or the number of most likely tokens to return with each token's logprob (chat: `logprobs` true,
    `top_logprobs` 0..MAX_TOP_LOGPROBS; above 0 it needs `logprobs` true, as in OpenAI's API)."""
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise _bad("'logprobs' must be true or false", "logprobs")
    top = _num(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, None, integer=True)
    if top and not on:  # 0 asks for nothing: accepted without logprobs, as clients send it by default
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if on else None


def _completion_logprobs(body: dict) -> int | None:
    """None, or the number of most likely tokens per position (completions: `logprobs` 0..MAX_TOP_LOGPROBS)."""
    return _num(body, "logprobs", 0, MAX_TOP_LOGPROBS, None, integer=True)


MAX_NESTING = 128  # deepest JSON nesting a request body may have (objects and arrays); RecursionError-safe


def check_nesting(body: Any) -> None:
    """Refuse a body nested deeper than MAX_NESTING levels (objects and arrays), before any code recurses into
    it (escaping, rendering, hashing and the grammar converter are recursive: 950 levels raised RecursionError
    there). Iterative, linear in the body. Raises InvalidRequest naming the top-level field that holds it."""
    if not isinstance(body, dict):
        return
    for key, value in body.items():
        stack = [(value, 1)]
        while stack:
            v, depth = stack.pop()
            if depth > MAX_NESTING:
                raise _bad(f"'{key}' is nested more than {MAX_NESTING} levels deep; this server takes at most that "
                           f"many", key)
            if isinstance(v, dict):
                stack.extend((x, depth + 1) for x in v.values())
            elif isinstance(v, list):
                stack.extend((x, depth + 1) for x in v)


def check_prompt_size(fields: Iterable[tuple[str, Any]], cfg: Config) -> None:
    """Refuse a prompt too large to render before anything renders or tokenizes it: the UTF-8 bytes of every
    string under each (caller's field name, value) together (keys of objects included) against
    --max-prompt-size, and their parts (array elements: messages, content blocks, tool calls, tools) against
    --max-prompt-parts. Every route applies it twice: to the body as sent (cheap, before conversion) and to the
    conversation as it will be rendered, where one field may have grown (an Anthropic `tool_reference` becomes
    its tool's whole definition): a value that occurs several times counts every time. Stops at the first
    string past a limit, so its cost is bounded by the limit. Raises InvalidRequest naming the field where a
    limit is crossed."""
    n_bytes = n_parts = 0
    for key, value in fields:
        stack = [value]
        while stack:
            v = stack.pop()
            if isinstance(v, str):
                n_bytes += len(v) if v.isascii() else len(v.encode("utf-8", "surrogatepass"))
            elif isinstance(v, dict):
                stack.extend(v.keys())
                stack.extend(v.values())
            elif isinstance(v, list):
                n_parts += len(v)
                stack.extend(v)
            if n_bytes > cfg.max_prompt_bytes:
                raise _bad(f"'{key}' brings the prompt's text over {cfg.max_prompt_kib} KiB; this server renders "
                           f"at most that much (--max-prompt-size)", key)
            if n_parts > cfg.max_prompt_parts:
                raise _bad(f"'{key}' brings the prompt over {cfg.max_prompt_parts} parts (messages, content blocks, "
                           f"tool calls, tools); this server takes at most that many (--max-prompt-parts)", key)


def body_fields(body: dict, keys: tuple[str, ...]) -> list[tuple[str, Any]]:
    """(key, body[key]) for `keys`: the fields of a body that reach the prompt, for check_prompt_size."""
    return [(k, body.get(k)) for k in keys]


def parse_chat(body: Any, cfg: Config | None = None) -> ChatRequest:
    """Validate a /v1/chat/completions body against the limits of `cfg` (defaults: Config()).

    Raises InvalidRequest naming the field."""
    cfg = cfg or Config(cache_ram_mib=0)
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None)
    _check_fields(body, CHAT)
    check_prompt_size(body_fields(body, ("messages", "tools", "chat_template_kwargs")), cfg)
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise _bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_VARS)
    if reserved:
        raise _bad(f"'chat_template_kwargs' cannot set {', '.join(reserved)}: the server sets them",
                   "chat_template_kwargs")
    thinking = thinking_from_effort(body.get("reasoning_effort"))
    if thinking is not None and "enable_thinking" not in kwargs:  # the caller's explicit switch wins
        kwargs = {**kwargs, "enable_thinking": thinking}
    tools = _tools(body.get("tools"))
    choice, forced_name = _tool_choice(body.get("tool_choice"), tools)
    if choice == "none":
        tools = None
    key = body.get("prompt_cache_key")
    if key is not None and not isinstance(key, str):
        raise _bad("'prompt_cache_key' must be a string", "prompt_cache_key")
    if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
        raise _bad("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    structure = Structure(response=_response_format(body.get("response_format")), tool_choice=choice,
                          tool_name=forced_name, parallel_tool_calls=body.get("parallel_tool_calls") is not False)
    messages, breakpoints, late_system = conversation(body.get("messages"), cfg.max_messages)
    options = dataclasses.replace(_options(body, cfg), logprobs=_chat_logprobs(body))
    return ChatRequest(messages=messages, tools=tools, template_kwargs=dict(kwargs),
                       options=options, prompt_cache_key=key or "",
                       cache_breakpoints=breakpoints, late_system=late_system, structure=structure)


def parse_completion(body: Any, cfg: Config | None = None) -> CompletionRequest:
    """Validate a /v1/completions body against the limits of `cfg` (defaults: Config()).

    Raises InvalidRequest naming the field."""
    cfg = cfg or Config(cache_ram_mib=0)
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None)
    _check_fields(body, COMPLETION)
    check_prompt_size(body_fields(body, ("prompt",)), cfg)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise _bad("'prompt' must be a non-empty string", "prompt")
    echo = body.get("echo")
    echo = False if echo is None else echo
    if not isinstance(echo, bool):
        raise _bad("'echo' must be true or false", "echo")
    logprobs = _completion_logprobs(body)
    if echo and logprobs is not None:
        raise _bad("'logprobs' cannot be combined with 'echo': the prompt's tokens are restored from the cache or "
                   "prefilled without their log-probabilities", "logprobs")
    options = dataclasses.replace(_options(body, cfg), logprobs=logprobs)
    return CompletionRequest(prompt=prompt, options=options, echo=echo)
