"""The documents generated from the protocols: the OpenAPI 3.1 description served at /openapi.json, and the
docs/api.md's field tables (`python -m server.docs docs/api.md` rewrites them in place).

The OpenAPI document is hand-written, with the request limits of the running server's Config (max_tokens,
messages). The request properties are exactly each protocol's FIELDS (server/protocols/openai.py for the OpenAI
routes, anthropic.py, responses.py; tests/test_openapi.py checks it), and `additionalProperties: false` says what
the server does with anything else: 400. docs/api.md's tables are `fields.markdown` of the same tables
(tests/test_fields.py checks them).
"""

from __future__ import annotations

from typing import Any

from orchestrator.config import Config

from .fields import markdown
from .protocols import anthropic
from .protocols import responses as responses_api
from .protocols.anthropic import COUNT_TOKENS, MESSAGES
from .protocols.anthropic import FIELDS as ANTHROPIC_FIELDS
from .protocols.openai import CHAT, COMPLETION, FIELDS
from .validate import EFFORT_OFF, EFFORT_ON, MAX_BUDGET, MAX_ID_CHARS, MAX_TOP_LOGPROBS, TEMPERATURE

_NULL = {"type": "null"}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, _NULL]}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _request_properties(cfg: Config) -> dict[str, dict]:
    """JSON schema of every field in FIELDS (both endpoints)."""
    ident = _nullable({"type": "string", "maxLength": MAX_ID_CHARS})
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    tool_call = {"type": "object", "required": ["function"], "properties": {
        "id": {"type": "string"}, "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "minLength": 1},
            "arguments": {"anyOf": [{"type": "object"}, {"type": "string", "description": "a JSON object as text "
                                                                                     "(400 otherwise)"}]}}}}}
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]}
    message = {"oneOf": [
        {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"enum": ["system", "developer", "user"]}, "content": content, "name": {"type": "string"}},
         "description": "leading system and developer messages are merged into one; a later one is rendered where "
                        "the chat template renders it (400 otherwise)"},
        {"type": "object", "required": ["role"], "properties": {
            "role": {"const": "assistant"}, "content": {"anyOf": [content, _NULL]}, "name": {"type": "string"},
            "reasoning_content": {"type": "string"}, "tool_calls": {"type": "array", "items": tool_call}}},
        {"type": "object", "required": ["role", "content", "tool_call_id"], "description": "answers a tool call of "
         "the assistant message before it, bound by id: rendered in call order (400 for an id that matches no call, "
         "a call answered twice, or a turn answered in part)", "properties": {
            "role": {"const": "tool"}, "content": content, "tool_call_id": {"type": "string"}}}]}
    tool = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
            "parameters": {"type": "object"}}}}}
    max_tokens = _nullable({"type": "integer", "minimum": 1, "maximum": MAX_BUDGET})
    boolean = _nullable({"type": "boolean"})
    return {
        "model": ident,
        "messages": {"type": "array", "minItems": 1, "maxItems": cfg.max_messages, "items": message},
        "tools": _nullable({"type": "array", "items": tool}),
        "tool_choice": _nullable({"anyOf": [
            {"enum": ["auto", "none", "required"]},
            {"type": "object", "required": ["type", "function"], "properties": {
                "type": {"const": "function"},
                "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]}),
        "parallel_tool_calls": _nullable({"type": "boolean", "description": "false: at most one tool call (enforced "
                                                                          "by a grammar)"}),
        "response_format": _nullable({"type": "object", "required": ["type"], "description": "json_object and "
                                      "json_schema are enforced by a grammar (llama.cpp's sampler)", "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 64}, "description": {"type": "string"},
                "schema": {"type": "object"}, "strict": _nullable({"type": "boolean"})}}}}),
        "logprobs": _nullable({"anyOf": [{"type": "boolean"}, {"type": "integer", "minimum": 0,
                                                                "maximum": MAX_TOP_LOGPROBS}],
                               "description": "chat: true/false; completions: how many most likely tokens"}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS,
                                   "description": "needs logprobs: true"}),
        "chat_template_kwargs": _nullable({"type": "object", "description": "extra variables for the chat template, "
                                                                             "e.g. {\"enable_thinking\": false}"}),
        "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "minItems": 1, "maxItems": 1,
                              "items": {"type": "string", "minLength": 1}}]},
        "echo": boolean,
        "max_tokens": max_tokens,
        "max_completion_tokens": max_tokens,
        "temperature": _nullable({"type": "number", "minimum": TEMPERATURE[0], "maximum": TEMPERATURE[1]}),
        "top_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": 1 << 20}),
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "seed": _nullable({"type": "integer", "minimum": -(2 ** 63), "maximum": 2 ** 64 - 1}),
        "stop": _nullable({"anyOf": [{"type": "string"},
                                     {"type": "array", "maxItems": 16, "items": {"type": "string"}}]}),
        "stream": boolean,
        "stream_options": _nullable({"type": "object", "properties": {"include_usage": {"type": "boolean"}}}),
        "cache_prompt": _nullable({"type": "boolean", "description": "false: a cold run that neither reads nor "
                                                                     "writes the prefix cache"}),
        "cache_salt": _nullable({"type": "string", "minLength": 1, "maxLength": MAX_ID_CHARS,
                                 "description": "requests share cached prefixes only with the same salt"}),
        "prompt_cache_key": ident,
        "user": ident,
        "safety_identifier": ident,
        "metadata": _nullable({"type": "object"}),
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": cfg.max_choices,
                        "description": "choices from one prefill; choice i is sampled with seed + i"}),
        # accepted with their default value only (server/protocols/openai.py DEFAULT_ONLY)
        "best_of": _nullable({"const": 1}),
        "presence_penalty": _nullable({"const": 0}),
        "frequency_penalty": _nullable({"const": 0}),
        "logit_bias": _nullable({"type": "object", "maxProperties": 0}),
        "suffix": _nullable({"const": ""}),
        # hints: accepted and ignored (server/fields.py)
        "store": _nullable({"type": "boolean", "description": "a hint: nothing is stored"}),
        "service_tier": _nullable({"type": "string", "description": "a hint: one tier serves every request"}),
        "reasoning_effort": _nullable({"enum": list(EFFORT_OFF + EFFORT_ON),
                                       "description": "none/minimal: thinking off; low and above: on"}),
    }


def _request(props: dict[str, dict], endpoint: str, required: list[str]) -> dict:
    return {"type": "object", "required": required, "additionalProperties": False,
            "properties": {k: v for k, v in props.items() if endpoint in FIELDS[k]}}


def _anthropic_request_properties(cfg: Config) -> dict[str, dict]:
    """JSON schema of every field in server/protocols/anthropic.py's FIELDS (/v1/messages and its count_tokens)."""
    cache_control = {"type": "object", "required": ["type"], "additionalProperties": False, "properties": {
        "type": {"const": "ephemeral"}, "ttl": {"enum": ["5m", "1h"]}},
        "description": "a caller-chosen snapshot boundary where this block ends"}
    text = {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"const": "text"}, "text": {"type": "string"}, "cache_control": cache_control}}
    texts = {"anyOf": [{"type": "string"}, {"type": "array", "items": text}]}
    tool_result = {"type": "object", "required": ["type", "tool_use_id"], "properties": {
        "type": {"const": "tool_result"}, "tool_use_id": {"type": "string", "minLength": 1}, "content": texts,
        "is_error": {"type": "boolean"}, "cache_control": cache_control}}
    tool_use = {"type": "object", "required": ["type", "id", "name", "input"], "properties": {
        "type": {"const": "tool_use"}, "id": {"type": "string", "minLength": 1},
        "name": {"type": "string", "minLength": 1}, "input": {"type": "object"}, "cache_control": cache_control}}
    thinking = {"type": "object", "required": ["type", "thinking"], "properties": {
        "type": {"const": "thinking"}, "thinking": {"type": "string"},
        "signature": {"type": "string", "description": "this server's signature holds the thinking: a block sent "
                                                       "back with empty thinking and it renders the same"},
        "cache_control": cache_control}}
    redacted = {"type": "object", "required": ["type"], "properties": {
        "type": {"const": "redacted_thinking"}, "data": {"type": "string"}}}

    def blocks(*kinds: dict) -> dict:
        return {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"oneOf": list(kinds)}}]}

    message = {"oneOf": [
        {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"const": "user"}, "content": blocks(text, tool_result)}},
        {"type": "object", "required": ["role", "content"], "description": "not the last message (no prefill)",
         "properties": {"role": {"const": "assistant"}, "content": blocks(text, tool_use, thinking, redacted)}},
        {"type": "object", "required": ["role", "content"], "description": "Claude Code's environment: rendered "
         "where it stands (a user turn where the template takes no later system message)",
         "properties": {"role": {"const": "system"}, "content": texts}}]}
    tool = {"type": "object", "required": ["name", "input_schema"], "properties": {
        "type": {"const": "custom"}, "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
        "input_schema": {"type": "object"}, "cache_control": cache_control,
        "defer_loading": {"type": "boolean", "description": "true: left out of the prompt"}}}
    json_format = {"type": "object", "required": ["type", "schema"], "properties": {
        "type": {"const": "json_schema"}, "schema": {"type": "object"}}}

    def count(kind: str) -> dict:
        return {"type": "object", "required": ["type", "value"], "properties": {
            "type": {"const": kind}, "value": {"type": "integer", "minimum": 0}}}

    return {
        "model": {"type": "string", "maxLength": MAX_ID_CHARS},
        "messages": {"type": "array", "minItems": 1, "maxItems": cfg.max_messages, "items": message},
        "system": texts,
        "tools": {"type": "array", "items": tool},
        "tool_choice": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
            "disable_parallel_tool_use": {"type": "boolean"}}},
        "cache_control": dict(cache_control, description="automatic caching (the last block): accepted; the "
                                                          "conversation's end is always a snapshot boundary"),
        "thinking": {"oneOf": [
            {"type": "object", "required": ["type", "budget_tokens"], "properties": {
                "type": {"const": "enabled"}, "budget_tokens": {"type": "integer", "minimum": 1}}},
            {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["adaptive", "disabled"]},
                                                                    "display": {"enum": ["summarized", "omitted"]}}}]},
        "output_config": {"type": "object", "additionalProperties": False, "properties": {
            "effort": {"enum": list(EFFORT_OFF + EFFORT_ON)}, "format": json_format}},
        "output_format": dict(json_format, description="the structured-outputs beta's output_config.format"),
        "context_management": {"type": "object", "additionalProperties": False, "properties": {
            "edits": {"type": "array", "items": {"oneOf": [
                {"type": "object", "required": ["type"], "properties": {
                    "type": {"const": "clear_thinking_20251015"},
                    "keep": {"anyOf": [{"const": "all"}, count("thinking_turns")]}}},
                {"type": "object", "required": ["type"], "additionalProperties": False, "properties": {
                    "type": {"const": "clear_tool_uses_20250919"},
                    "trigger": {"anyOf": [count("input_tokens"), count("tool_uses")]}, "keep": count("tool_uses"),
                    "clear_at_least": count("input_tokens"), "exclude_tools": {"type": "array", "items": {
                        "type": "string"}},
                    "clear_tool_inputs": {"anyOf": [{"type": "boolean"}, {"type": "array", "items": {
                        "type": "string"}}]}}}]}}}},
        "container": {"type": "null", "description": "refused: no code-execution containers"},
        "mcp_servers": {"type": "null", "description": "refused: no MCP servers"},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_BUDGET},
        "stop_sequences": {"type": "array", "maxItems": 16, "items": {"type": "string"}},
        "stream": {"type": "boolean"},
        "temperature": {"type": "number", "minimum": anthropic.TEMPERATURE[0],
                        "maximum": anthropic.TEMPERATURE[1]},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1, "maximum": 1 << 20},
        "metadata": {"type": "object"},
        "service_tier": {"enum": ["auto", "standard_only"], "description": "a hint"},
        "cache_prompt": {"type": "boolean", "description": "false: a cold run that neither reads nor writes the "
                                                          "prefix cache"},
        "cache_salt": {"type": "string", "minLength": 1, "maxLength": MAX_ID_CHARS,
                       "description": "requests share cached prefixes only with the same salt"},
    }


def _responses_request(cfg: Config) -> dict:
    """The /v1/responses request: every field in server/protocols/responses.py's FIELDS (refused ones are left out, so
    `additionalProperties: false` covers them)."""
    text = {"type": "string"}
    part = {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["input_text", "output_text", "text", "refusal"]}, "text": text, "refusal": text}}
    content = {"anyOf": [text, {"type": "array", "items": part}]}
    item = {"type": "object", "description": "message (type optional with a role), reasoning, function_call, "
                                             "function_call_output, custom_tool_call, custom_tool_call_output",
            "properties": {
                "type": {"enum": ["message", "reasoning", "function_call", "function_call_output", "custom_tool_call",
                                  "custom_tool_call_output"]},
                "role": {"enum": ["system", "developer", "user", "assistant"]}, "content": content,
                "call_id": {"type": "string", "minLength": 1}, "name": {"type": "string", "minLength": 1},
                "namespace": text, "arguments": text, "input": text, "output": content,
                "summary": {"type": "array", "items": {"type": "object"}}, "encrypted_content": _nullable(text)}}
    function = {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"enum": ["function", "custom"]}, "name": {"type": "string", "minLength": 1}, "description": text,
        "parameters": {"type": "object"}, "strict": {"type": "boolean"}, "format": {"type": "object"}}}
    tool = {"oneOf": [
        function,
        {"type": "object", "required": ["type", "name", "tools"], "properties": {
            "type": {"const": "namespace"}, "name": {"type": "string", "minLength": 1}, "description": text,
            "tools": {"type": "array", "items": function}}},
        {"type": "object", "required": ["type"], "description": "hosted tools: accepted, not offered to the model",
         "properties": {"type": {"enum": list(responses_api.HOSTED)}}}]}
    effort = {"enum": list(EFFORT_OFF + EFFORT_ON)}
    summary = {"enum": ["auto", "concise", "detailed", "none"]}
    fmt = {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]}, "name": text, "schema": {"type": "object"},
        "strict": {"type": "boolean"}, "description": text}}
    ident = {"type": "string", "maxLength": MAX_ID_CHARS}
    props = {
        "model": ident,
        "input": {"anyOf": [text, {"type": "array", "minItems": 1, "maxItems": cfg.max_messages, "items": item}]},
        "instructions": _nullable(text),
        "tools": _nullable({"type": "array", "items": tool}),
        "tool_choice": _nullable({"anyOf": [{"enum": ["auto", "none", "required"]}, {
            "type": "object", "required": ["type", "name"], "properties": {
                "type": {"enum": ["function", "custom"]}, "name": text, "namespace": text}}]}),
        "parallel_tool_calls": _nullable({"type": "boolean"}),
        "text": _nullable({"type": "object", "properties": {"format": fmt,
                                                            "verbosity": {"enum": ["low", "medium", "high"]}}}),
        "reasoning": _nullable({"type": "object", "properties": {"effort": _nullable(effort),
                                                                 "summary": _nullable(summary),
                                                                 "generate_summary": _nullable(summary)}}),
        "max_output_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_BUDGET}),
        "temperature": _nullable({"type": "number", "minimum": TEMPERATURE[0], "maximum": TEMPERATURE[1]}),
        "top_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object"}),
        "store": _nullable({"const": False, "description": "responses are not stored: true is refused"}),
        "include": _nullable({"type": "array", "items": {"enum": list(responses_api.INCLUDE_NOTHING)}}),
        "top_logprobs": _nullable({"const": 0}),
        "truncation": _nullable({"enum": ["auto", "disabled"]}),
        "prompt_cache_key": _nullable(ident),
        "prompt_cache_retention": _nullable(text),
        "max_tool_calls": _nullable({"type": "integer"}),
        "service_tier": _nullable(text),
        "metadata": _nullable({"type": "object"}),
        "client_metadata": _nullable({"type": "object"}),
        "user": _nullable(ident),
        "safety_identifier": _nullable(ident),
        "cache_prompt": {"type": "boolean", "description": "false: a cold run that neither reads nor writes the "
                                                          "prefix cache"},
        "cache_salt": {"type": "string", "minLength": 1, "maxLength": MAX_ID_CHARS,
                       "description": "requests share cached prefixes only with the same salt"},
    }
    return {"type": "object", "required": ["input"], "additionalProperties": False, "properties": props}


def _responses(ok: dict, stream: bool = False, extra: tuple[int, ...] = (), error: str = "Error") -> dict:
    content = {"application/json": {"schema": ok}}
    if stream:
        # one event per chunk: `data: {chunk JSON}` ... then `data: [DONE]`
        content["text/event-stream"] = {"schema": {"type": "object", "required": ["data"],
                                                   "properties": {"data": {"type": "string"}}}}
    out: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    errors = {400: "invalid request (the body names the field in error.param)", 401: "missing or wrong API key",
              403: "turned off by the server's configuration, or the operator's route called with a tenant's key", 404: "no such model", 413: "request body too large",
              415: "the body is not JSON", 429: "all slots busy and the queue full (--queue-size); see Retry-After",
              500: "internal error", 504: "the request ran past --timeout"}
    for code in (401, 500) + extra:
        out[str(code)] = {"description": errors[code],
                          "content": {"application/json": {"schema": _ref(error)}}}
    return out


def openapi_schema(cfg: Config) -> dict:
    """The OpenAPI 3.1 document for a server running with `cfg` (limits filled in from it)."""
    props = _request_properties(cfg)
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
        "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}}}}
    finish = {"enum": ["stop", "length", "tool_calls"]}
    chat_response = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                     "properties": {
                         "id": {"type": "string"}, "object": {"const": "chat.completion"},
                         "created": {"type": "integer"}, "model": {"type": "string"},
                         "choices": {"type": "array", "minItems": 1, "items": {
                             "type": "object", "required": ["index", "message", "finish_reason"], "properties": {
                                 "index": {"type": "integer"}, "finish_reason": finish,
                                 "message": {"type": "object", "required": ["role", "content"], "properties": {
                                     "role": {"const": "assistant"},
                                     "content": {"type": ["string", "null"]},
                                     "reasoning_content": {"type": "string"},
                                     "tool_calls": {"type": "array", "items": {"type": "object"}}}}}}},
                         "usage": usage, "timings": {"type": "object"}}}
    completion_response = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                           "properties": {
                               "id": {"type": "string"}, "object": {"const": "text_completion"},
                               "created": {"type": "integer"}, "model": {"type": "string"},
                               "choices": {"type": "array", "minItems": 1, "items": {
                                   "type": "object", "required": ["index", "text", "finish_reason"], "properties": {
                                       "index": {"type": "integer"}, "text": {"type": "string"},
                                       "finish_reason": finish}}},
                               "usage": usage, "timings": {"type": "object"}}}
    model = {"type": "object", "required": ["id", "object"], "properties": {
        "id": {"type": "string"}, "object": {"const": "model"}}}
    message_response = {
        "type": "object", "required": ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence",
                                       "usage"], "properties": {
            "id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
            "model": {"type": "string"},
            "content": {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
                "type": {"enum": ["thinking", "text", "tool_use"]}}}},
            "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
            "stop_sequence": {"type": ["string", "null"]},
            "usage": {"type": "object", "required": ["input_tokens", "output_tokens", "cache_creation_input_tokens",
                                                      "cache_read_input_tokens"], "properties": {
                k: {"type": "integer", "minimum": 0} for k in ("input_tokens", "output_tokens",
                                                               "cache_creation_input_tokens",
                                                               "cache_read_input_tokens")}},
            "timings": {"type": "object"}}}
    response_object = {
        "type": "object", "required": ["id", "object", "created_at", "status", "model", "output", "usage"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": "response"}, "created_at": {"type": "integer"},
            "status": {"enum": ["completed", "incomplete"]}, "model": {"type": "string"},
            "output": {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
                "type": {"enum": ["reasoning", "message", "function_call", "custom_tool_call"]}}}},
            "usage": {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"], "properties": {
                "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"},
                "total_tokens": {"type": "integer"},
                "input_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}}}},
            "timings": {"type": "object"}}}
    anthropic_error = {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
            "type": {"type": "string"}, "message": {"type": "string"}}}}}
    aprops = _anthropic_request_properties(cfg)

    def anthropic_request(route: str, required: list[str]) -> dict:
        return {"type": "object", "required": required, "additionalProperties": False,
                "properties": {k: v for k, v in aprops.items() if route in ANTHROPIC_FIELDS[k]}}

    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
    json_body = ("application/json",)

    def body(schema: dict) -> dict:
        return {"required": True, "content": {t: {"schema": schema} for t in json_body}}

    bad_body = (400, 413, 415)
    security = [{"bearer": []}] if cfg.api_key is not None else []
    return {
        "openapi": "3.1.0",
        "info": {"title": "orchestrator", "version": "0.1.0",
                 "description": "OpenAI-compatible server with a prefix cache of llama.cpp state snapshots."},
        "security": security,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Error": error, "ChatCompletionRequest": _request(props, CHAT, ["messages"]),
                        "CompletionRequest": _request(props, COMPLETION, ["prompt"]),
                        "AnthropicError": anthropic_error,
                        "MessagesRequest": anthropic_request(MESSAGES, ["model", "max_tokens", "messages"]),
                        "CountTokensRequest": anthropic_request(COUNT_TOKENS, ["model", "messages"]),
                        "ResponsesRequest": _responses_request(cfg)}},
        "paths": {
            "/v1/chat/completions": {"post": {
                "operationId": "createChatCompletion", "summary": "chat completion (stream: server-sent events)",
                "requestBody": body(_ref("ChatCompletionRequest")),
                "responses": _responses(chat_response, stream=True, extra=bad_body + (429, 504))}},
            "/v1/completions": {"post": {
                "operationId": "createCompletion", "summary": "plain-text completion (stream: server-sent events)",
                "requestBody": body(_ref("CompletionRequest")),
                "responses": _responses(completion_response, stream=True, extra=bad_body + (429, 504))}},
            "/v1/messages": {"post": {
                "operationId": "createMessage",
                "summary": "Anthropic's Messages API (stream: server-sent events message_start ... message_stop)",
                "requestBody": body(_ref("MessagesRequest")),
                "responses": _responses(message_response, stream=True, extra=bad_body + (429, 504),
                                        error="AnthropicError")}},
            "/v1/messages/count_tokens": {"post": {
                "operationId": "countMessageTokens", "summary": "the prompt tokens of an Anthropic Messages request",
                "requestBody": body(_ref("CountTokensRequest")),
                "responses": _responses({"type": "object", "required": ["input_tokens"], "properties": {
                    "input_tokens": {"type": "integer"}}}, extra=bad_body, error="AnthropicError")}},
            "/v1/responses": {"post": {
                "operationId": "createResponse",
                "summary": "OpenAI's Responses API, stateless (stream: server-sent events response.created ... "
                           "response.completed)",
                "requestBody": body(_ref("ResponsesRequest")),
                "responses": _responses(response_object, stream=True, extra=bad_body + (429, 504))}},
            "/v1/models": {"get": {
                "operationId": "listModels", "summary": "the served model",
                "responses": _responses({"type": "object", "required": ["object", "data"], "properties": {
                    "object": {"const": "list"}, "data": {"type": "array", "items": model}}})}},
            "/v1/models/{model_id}": {"get": {
                "operationId": "retrieveModel", "summary": "the served model, by its id (404 for another id)",
                "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": _responses(model, extra=(404,))}},
            "/health": {"get": {
                "operationId": "health", "summary": "liveness and slots (no API key needed); queue and cache figures with the key",
                "security": [],
                "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}}}}}}}},
            "/metrics": {"get": {
                "operationId": "metrics", "summary": "Prometheus text exposition",
                "responses": {"200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}},
                              "401": _responses({})["401"], "403": _responses({}, extra=(403,))["403"]}}},
            "/v1/cache/stats": {"get": {
                "operationId": "cacheStats", "summary": "snapshot cache counters (JSON)",
                "responses": _responses({"type": "object", "required": ["ram_entries", "ram_bytes"], "properties": {
                    "ram_entries": {"type": "integer"}, "ram_bytes": {"type": "integer"}}}, extra=(403,))}},
            "/v1/cache/flush": {"post": {
                "operationId": "cacheFlush",
                "summary": "drop every snapshot (the operator's: --admin-key, else --api-key; 403 on a server without "
                           "a key or with a tenant's key)",
                "responses": _responses({"type": "object", "required": ["flushed_entries"], "properties": {
                    "flushed_entries": {"type": "integer"}}}, extra=(403,))}},
            "/openapi.json": {"get": {
                "operationId": "openapi", "summary": "this document",
                "responses": _responses({"type": "object"})}},
        },
    }


def readme_tables() -> dict[str, str]:
    """marker -> docs/api.md's generated table: one per route (chat, completions, messages, count_tokens,
    responses)."""
    return {"chat": markdown(FIELDS, CHAT, "`/v1/chat/completions` field"),
            "completions": markdown(FIELDS, COMPLETION, "`/v1/completions` field"),
            "messages": markdown(ANTHROPIC_FIELDS, MESSAGES, "`/v1/messages` field"),
            "count_tokens": markdown(ANTHROPIC_FIELDS, COUNT_TOKENS, "`/v1/messages/count_tokens` field"),
            "responses": markdown(responses_api.FIELDS, responses_api.RESPONSES, "`/v1/responses` field")}


def update_readme(text: str) -> str:
    """`text` with each `<!-- fields:NAME -->` … `<!-- /fields -->` block replaced by readme_tables()[NAME]."""
    for name, table in readme_tables().items():
        start, end = f"<!-- fields:{name} -->\n", "<!-- /fields -->"
        i = text.index(start) + len(start)
        text = text[:i] + table + "\n" + text[text.index(end, i):]
    return text


if __name__ == "__main__":  # python -m server.docs docs/api.md: regenerate the field tables in place
    import sys
    from pathlib import Path

    path = Path(sys.argv[1])
    path.write_text(update_readme(path.read_text()))
