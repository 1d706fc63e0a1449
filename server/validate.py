"""The validation kit every protocol shares: scalar checks that name the caller's own field, the body-wide limits
(nesting, prompt size), the caller's identity fields and the generation options.

Every problem raises InvalidRequest with `param` the field as the caller spelled it (e.g. "max_output_tokens",
"messages[3].tool_calls[0].function.arguments"); server/errors.py turns it into HTTP 400. A protocol passes its
own field names in (a route's names are never rewritten afterwards), so this module knows no protocol.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable

from orchestrator.config import Config
from orchestrator.request import SamplingParams
from orchestrator.errors import InvalidRequest

MAX_ID_CHARS = 1024  # longest model / cache_salt / user / prompt_cache_key / safety_identifier accepted
MAX_TOP_LOGPROBS = 20  # most alternatives per token (OpenAI's limit for top_logprobs)
MAX_BUDGET = 2 ** 31 - 1  # the largest completion budget accepted (what is generated is capped by the server)
MAX_STOPS = 16  # most stop strings per request
MAX_NESTING = 128  # deepest JSON nesting a request body may have (objects and arrays); RecursionError-safe
TEMPERATURE = (0, 2)  # OpenAI's range; a protocol with another passes its own to `options`
SEED = (-(2 ** 63), 2 ** 64 - 1)

# reasoning effort (OpenAI's `reasoning_effort` and Responses' `reasoning.effort`, Anthropic's
# `output_config.effort`) -> the template's thinking switch. OpenAI documents "none" as no reasoning (GPT-5.1) and
# "minimal" as very few reasoning tokens; a template's switch is on or off, so both are off. Anthropic's efforts
# ("low" .. "max") all still think when the task asks for it, and so do OpenAI's "low" and above: on.
EFFORT_OFF = ("none", "minimal")
EFFORT_ON = ("low", "medium", "high", "xhigh", "max")


@dataclass
class GenerationOptions:
    """What every generating route asks of the scheduler, whatever the protocol calls it."""

    max_tokens: int | None  # as asked; None: none given
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    cache_prompt: bool
    seed: int | None = None  # as given; None = not reproducible
    cache_salt: str = ""  # "" = the shared cache; otherwise only requests with the same salt share snapshots
    logprobs: int | None = None  # None: no logprobs; k: each token's logprob with the k most likely tokens
    n: int = 1  # choices (1..cfg.max_choices)


def bad(msg: str, param: str | None) -> InvalidRequest:
    return InvalidRequest(msg, param=param)


def json_object(body: Any) -> dict:
    """`body` itself, which must be a JSON object."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None)
    return body


def number(body: dict, key: str, lo: float, hi: float, default: Any, integer: bool = False, param: str = ""):
    """body[key] checked to be a number (an integer with `integer`) in [lo, hi]; `default` when absent or null.
    `param`: the caller's name for the field, when it is not `key`."""
    v = body.get(key)
    if v is None:
        return default
    param = param or key
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        kind = "an integer" if integer else "a number"
        raise bad(f"'{param}' must be {kind}, got {json.dumps(v)[:40]}", param)
    if not lo <= v <= hi:
        raise bad(f"'{param}' must be between {lo} and {hi}, got {v}", param)
    return v


def boolean(body: dict, key: str, param: str = "") -> bool | None:
    """body[key] checked to be true, false or absent (None)."""
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise bad(f"'{param or key}' must be true or false", param or key)
    return v


def mapping(body: dict, key: str) -> dict | None:
    """body[key] checked to be an object or absent (None)."""
    v = body.get(key)
    if v is not None and not isinstance(v, dict):
        raise bad(f"'{key}' must be an object", key)
    return v


def identities(body: dict, keys: Iterable[str], required: tuple[str, ...] = ()) -> None:
    """The caller's identity and routing strings (model, cache_salt, prompt_cache_key, user, safety_identifier):
    each a string of at most MAX_ID_CHARS characters, `required` ones present; `cache_salt`, when given, not
    empty (as vLLM: an empty salt would silently share with unsalted requests)."""
    for key in keys:
        v = body.get(key)
        if (v is None and key in required) or (v is not None and (not isinstance(v, str) or len(v) > MAX_ID_CHARS)):
            raise bad(f"'{key}' must be a string of at most {MAX_ID_CHARS} characters", key)
    if body.get("cache_salt") == "" and "cache_salt" in keys:
        raise bad("'cache_salt' must be a non-empty string when given (omit it to share the common cache)",
                  "cache_salt")


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
    raise bad(f"'{param}' must be one of {', '.join(EFFORT_OFF + EFFORT_ON)}; got {json.dumps(value)[:40]}", param)


def stops(value: Any, param: str, one_string: bool = True) -> tuple[str, ...]:
    """A stop value (a list of at most MAX_STOPS strings, or with `one_string` a string too; null: none) as its
    non-empty strings."""
    if value is None:
        return ()
    if isinstance(value, str) and one_string:
        value = [value]
    elif not (isinstance(value, list) and all(isinstance(s, str) for s in value) and len(value) <= MAX_STOPS):
        shape = "a string or a list" if one_string else "a list"
        raise bad(f"'{param}' must be {shape} of at most {MAX_STOPS} strings", param)
    return tuple(s for s in value if s)


def options(body: dict, cfg: Config, budget: tuple[str, ...] = ("max_tokens", "max_completion_tokens"),
            stop: str = "stop", one_stop_string: bool = True, temperature: tuple[float, float] = TEMPERATURE
            ) -> GenerationOptions:
    """The generation options of `body`, each field checked under the route's name for it. `budget`: the route's
    names of the completion budget, the last one given winning (OpenAI: max_completion_tokens, the newer name,
    wins over max_tokens; Responses: max_output_tokens). Any positive budget is accepted: the job generates at
    most --max-tokens-limit and what the context holds, and ends with the route's length reason there, as
    llama-server does. `stop`: the route's name of its stop strings (`one_stop_string`: a lone string is accepted
    there); `temperature`: the route's range."""
    max_tokens = None
    for key in budget:
        given = number(body, key, 1, MAX_BUDGET, None, integer=True)
        max_tokens = max_tokens if given is None else given
    stop_strings = stops(body.get(stop), stop, one_stop_string)
    stream, cache_prompt = boolean(body, "stream"), boolean(body, "cache_prompt")
    stream_options = mapping(body, "stream_options") or {}
    if not isinstance(stream_options.get("include_usage", False), bool):
        raise bad("'stream_options.include_usage' must be true or false", "stream_options.include_usage")
    temp = number(body, "temperature", float(temperature[0]), float(temperature[1]), 1.0)
    seed = number(body, "seed", *SEED, 0, integer=True)
    sampling = SamplingParams(
        temperature=float(temp),
        top_k=max(0, int(number(body, "top_k", -1, 1 << 20, 0, integer=True))),  # -1: off, as vLLM says it
        top_p=float(number(body, "top_p", 0.0, 1.0, 1.0)),
        min_p=float(number(body, "min_p", 0.0, 1.0, 0.0)),
        seed=int(seed),
    )
    n = number(body, "n", 1, 2 ** 31 - 1, 1, integer=True)
    if n > cfg.max_choices:
        raise bad(f"'n' is {n}, but this server generates at most {cfg.max_choices} choices per request: each choice "
                  f"is generated in a slot of its own, and one of the --parallel {cfg.parallel} slots is always "
                  f"left to other requests", "n")
    return GenerationOptions(max_tokens=max_tokens, sampling=sampling, stop=stop_strings, stream=bool(stream),
                             include_usage=bool(stream_options.get("include_usage")),
                             cache_prompt=True if cache_prompt is None else cache_prompt, seed=body.get("seed"),
                             cache_salt=body.get("cache_salt") or "", n=n)


def check_nesting(body: Any) -> None:
    """Refuse a body nested deeper than MAX_NESTING levels (objects and arrays), before any code recurses into
    it (escaping, rendering, hashing and the grammar converter are recursive). Iterative, linear in the body.
    Raises InvalidRequest naming the top-level field that holds it."""
    if not isinstance(body, dict):
        return
    for key, value in body.items():
        stack = [(value, 1)]
        while stack:
            v, depth = stack.pop()
            if depth > MAX_NESTING:
                raise bad(f"'{key}' is nested more than {MAX_NESTING} levels deep; this server takes at most that "
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
                raise bad(f"'{key}' brings the prompt's text over {cfg.max_prompt_kib} KiB; this server renders "
                          f"at most that much (--max-prompt-size)", key)
            if n_parts > cfg.max_prompt_parts:
                raise bad(f"'{key}' brings the prompt over {cfg.max_prompt_parts} parts (messages, content blocks, "
                          f"tool calls, tools); this server takes at most that many (--max-prompt-parts)", key)


def body_fields(body: dict, keys: tuple[str, ...]) -> list[tuple[str, Any]]:
    """(key, body[key]) for `keys`: the fields of a body that reach the prompt, for check_prompt_size."""
    return [(k, body.get(k)) for k in keys]


def schema_spec(spec: dict, param: str) -> dict:
    """The JSON schema of a json_schema output format ({"name", "schema", "strict", "description"}), each part
    checked under the caller's `param` for the format (e.g. "response_format.json_schema", "text.format")."""
    name = spec.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 64:
        raise bad(f"'{param}.name' must be a string of 1 to 64 characters", f"{param}.name")
    boolean(spec, "strict", f"{param}.strict")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise bad(f"'{param}.schema' must be a JSON schema object", f"{param}.schema")
    return schema
