"""OpenAI's Responses API (POST /v1/responses), stateless as Codex uses it (`store: false`, the whole input every
turn), over the same prompt builder, reply shaper and scheduler as the other routes.

A request is translated into the OpenAI-style messages that server/conversation.py validates (so
tool results are bound to their calls and leading system/developer text is merged the same way), and the answer
back into Responses output items and stream events (the shapes of the openai SDK's `openai.types.responses`, and
what Codex reads: codex-rs/codex-api/src/sse/responses.rs). What the clients send: tests/fixtures/captures/codex/ and
tests/fixtures/captures/openai-agents/.

Input (`input`: a string, or a list of items; `instructions` -> a system message first):

* `message` (also without `type`, as the Agents SDK sends user turns): roles system, developer, user,
  assistant; content a string or `input_text` / `output_text` / `refusal` parts (images, files and audio are
  refused by path).
* `reasoning` -> the reasoning of the assistant turn it opens (its `content` reasoning_text if any, else its
  `summary` texts); `encrypted_content` is opaque (another provider's) and not rendered. The template decides
  whether a past turn's reasoning stays in the prompt (Qwen3.5 keeps only the reasoning after the last user
  message).
* `function_call` (`call_id`, `name`, `arguments` a JSON string, optional `namespace`) and `custom_tool_call`
  (`input` a string) -> tool calls of that assistant turn; `function_call_output` / `custom_tool_call_output`
  (`output` a string or a list of `input_text` parts) -> tool messages, bound to their calls by `call_id`.
  A `message`, `reasoning` or call item joins the assistant turn before it unless that turn already has what the
  item would start (a second message, or reasoning after the turn's output): then it starts the next turn.
* Other item types (`item_reference`, hosted tools' calls such as `web_search_call`, `compaction`) are refused
  by path: this server produces none of them and stores nothing to refer to.

Tools (per type; a tool's rendering never depends on the turn, so the prompt prefix stays the same):

* `function` (flat: name, description, parameters, strict) -> an OpenAI-style function tool; `strict` is
  accepted and not enforced unless `tool_choice` forces calls (as on /v1/chat/completions).
* `namespace` -> its function and custom tools flattened, each named `<namespace>.<name>` in the prompt; a call
  of one comes back as a `function_call` with `name` and `namespace` apart (the namespace's own description is
  not rendered).
* `custom` (freeform) -> a function tool with one string parameter `input` (the tool's `format`, text or
  grammar, is not enforced); a call comes back as a `custom_tool_call` with that `input`.
* HOSTED types (`web_search`, `file_search`, `code_interpreter`, `local_shell`, ...): run by OpenAI's servers
  (or, for local_shell/shell/apply_patch/computer, built-in actions a model is trained to emit in their own item
  types), which this server cannot run or parse: accepted, not rendered (the model cannot call them), logged at
  debug. A `tool_choice` forcing one is refused. Any other type is refused by name.

Output items: `reasoning` (the text in `content` as reasoning_text; `summary` empty: nothing summarizes it),
`message` (one output_text part), then one `function_call` / `custom_tool_call` per call. `status` is
"incomplete" with reason max_output_tokens when generation hit the budget.

`reasoning.effort` maps to the template's thinking switch (`thinking_from_effort`); absent, the template's own
default applies. `store: true` and `previous_response_id` are refused (README "/v1/responses").
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from orchestrator.config import Config
from orchestrator.errors import InvalidRequest
from orchestrator.output.grammar import Structure
from orchestrator.output.reply import Reply
from orchestrator.request import Event, Result

from .. import fields
from ..conversation import conversation
from ..errors import error_payload
from ..fields import HINT, HONOURED, REFUSED, Rule
from ..validate import (MAX_TOP_LOGPROBS, bad, body_fields, boolean, check_prompt_size, identities, json_object,
                        mapping, number, options, schema_spec, thinking_from_effort)
from .base import ChatCall, Encoder, Reading, Sse, timings

log = logging.getLogger("orchestrator.server")

RESPONSES = "responses"
_R = (RESPONSES,)
_NO_STORE = ("responses are not stored (store: true is refused): send the whole conversation as 'input' each turn; "
             "its prefix is restored from the snapshot cache all the same")

# The field policy of /v1/responses (server/fields.py; docs/api.md's table is generated from it). cache_prompt and
# cache_salt are this server's extensions, as on the other routes.
FIELDS: dict[str, Rule] = {
    "model": Rule(HONOURED, _R, "any string: one model is served"),
    "input": Rule(HONOURED, _R, "message, function_call, function_call_output, custom_tool_call(_output), "
                                "reasoning items"),
    "instructions": Rule(HONOURED, _R, "the system message, before leading system and developer messages"),
    "tools": Rule(HONOURED, _R, "function, namespace and custom tools rendered; hosted tool types accepted, not "
                                "rendered"),
    "tool_choice": Rule(HONOURED, _R, "auto, none, required or a named function (a grammar enforces it)"),
    "parallel_tool_calls": Rule(HONOURED, _R, "false: at most one call (a grammar enforces it when calls are "
                                              "forced)"),
    "text": Rule(HONOURED, _R, "format text, json_object or json_schema (a grammar enforces it); verbosity a hint"),
    "reasoning": Rule(HONOURED, _R, "effort -> the template's thinking switch; summary, generate_summary hints"),
    "max_output_tokens": Rule(HONOURED, _R, "the completion budget"),
    "temperature": Rule(HONOURED, _R, "0 to 2"),
    "top_p": Rule(HONOURED, _R, "0 to 1"),
    "stream": Rule(HONOURED, _R, "the Responses API's server-sent events"),
    "store": Rule(HONOURED, _R, "false or null: nothing is stored; true is refused (see previous_response_id)"),
    "include": Rule(HONOURED, _R, "reasoning.encrypted_content -> null; hosted tools' extras -> nothing"),
    "top_logprobs": Rule(HONOURED, _R, "0 or null only"),
    "prompt_cache_key": Rule(HONOURED, _R, "requests with the same key are routed to the same slot when they can "
                                           "be"),
    "cache_prompt": Rule(HONOURED, _R, "an extension: false is a cold run that neither reads nor writes the "
                                       "cache"),
    "cache_salt": Rule(HONOURED, _R, "an extension: requests share snapshots only with the same salt"),
    "stream_options": Rule(HINT, _R, "include_obfuscation: no obfuscation padding is sent"),
    "truncation": Rule(HINT, _R, "a prompt over the context is refused either way"),
    "prompt_cache_retention": Rule(HINT, _R, "snapshots live by the cache's LRU, not per request"),
    "max_tool_calls": Rule(HINT, _R, "limits hosted tool calls, which never happen here"),
    "service_tier": Rule(HINT, _R, "one tier serves every request"),
    "metadata": Rule(HINT, _R, "an object"),
    "client_metadata": Rule(HINT, _R, "Codex's session and turn ids"),
    "user": Rule(HINT, _R, "an identity, checked to be a short string"),
    "safety_identifier": Rule(HINT, _R, "an identity, checked to be a short string"),
    "previous_response_id": Rule(REFUSED, _R, _NO_STORE),
    "conversation": Rule(REFUSED, _R, "conversations are not stored: send the whole conversation as 'input' each "
                                      "turn"),
    "background": Rule(REFUSED, _R, "background responses need stored responses, which this server does not "
                                    "keep"),
    "prompt": Rule(REFUSED, _R, "reusable prompt templates live on OpenAI's servers: send 'instructions' and "
                                "'input' instead"),
}
# Hosted (server-run or built-in) tool types: accepted, not rendered, since the model cannot call them here.
HOSTED = ("web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
          "file_search", "code_interpreter", "image_generation", "computer", "computer_use_preview", "mcp",
          "local_shell", "shell", "apply_patch", "tool_search")
INCLUDE_NOTHING = ("reasoning.encrypted_content", "web_search_call.results", "web_search_call.action.sources",
                   "file_search_call.results", "code_interpreter_call.outputs", "computer_call_output.output.image_url",
                   "message.input_image.image_url")
SEP = "."  # <namespace>.<name>: a namespaced tool's name in the prompt


@dataclass(frozen=True)
class ToolName:
    """What a tool's name in the prompt stands for: its kind ("function" or "custom"), name and namespace."""

    kind: str
    name: str
    namespace: str | None = None


@dataclass
class ResponsesCall(ChatCall):
    """A Responses API request; late_system is the input path of a late system or developer message."""

    names: dict[str, ToolName] = field(default_factory=dict)  # prompt name -> the tool it is
    echo: dict = field(default_factory=dict)  # request settings the response object repeats


# ------------------------------------------------------------------ input

def _kind(item: Any, p: str) -> str:
    if not isinstance(item, dict):
        raise bad(f"'{p}' must be an object (an input item)", p)
    kind = item.get("type", "message" if "role" in item else None)
    if not isinstance(kind, str):
        raise bad(f"'{p}.type' must be a string (message, function_call, function_call_output, reasoning, ...)",
                  f"{p}.type")
    return kind


def _text(parts: Any, p: str, allowed: tuple[str, ...]) -> str:
    """A string, or a list of text parts of the `allowed` types, as one string."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise bad(f"'{p}' must be a string or a list of content parts", p)
    texts = []
    for j, part in enumerate(parts):
        q = f"{p}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise bad(f"'{q}.type' must be one of {', '.join(allowed)}, got {json.dumps(kind)[:40]} (images, files "
                      f"and audio are not supported)", f"{q}.type")
        key = "refusal" if kind == "refusal" else "text"
        if not isinstance(part.get(key), str):
            raise bad(f"'{q}.{key}' must be a string", f"{q}.{key}")
        texts.append(part[key])
    return "".join(texts)


def _id(item: dict, key: str, p: str) -> str:
    v = item.get(key)
    if not isinstance(v, str) or not v:
        raise bad(f"'{p}.{key}' must be a non-empty string", f"{p}.{key}")
    return v


class _Turns:
    """Input items -> OpenAI-style messages, with the input path each came from (for error messages)."""

    def __init__(self) -> None:
        self.conv: list[dict] = []
        self.origin: list[str] = []
        self.open: dict | None = None  # the assistant turn being built

    def add(self, msg: dict, p: str) -> None:
        self.open = None
        self.conv.append(msg)
        self.origin.append(p)

    def assistant(self, p: str, starts: str) -> dict:
        """The open assistant turn, or a new one if it has `starts` ('content': a message; 'reasoning': a
        reasoning item; 'call': nothing starts a new turn) already, or has output after reasoning."""
        a = self.open
        if a is None or (starts == "content" and (a["content"] or a.get("tool_calls"))) \
                or (starts == "reasoning" and (a["content"] or a.get("tool_calls") or "reasoning_content" in a)):
            a = {"role": "assistant", "content": ""}
            self.conv.append(a)
            self.origin.append(p)
            self.open = a
        return a


def _reasoning_text(item: dict, p: str) -> str:
    content = item.get("content")
    if content:
        if not isinstance(content, list):
            raise bad(f"'{p}.content' must be a list of reasoning_text parts", f"{p}.content")
        return _text([dict(c, type="text") if isinstance(c, dict) and c.get("type") == "reasoning_text" else c
                      for c in content], f"{p}.content", ("text",))
    summary = item.get("summary", [])
    if not isinstance(summary, list):
        raise bad(f"'{p}.summary' must be a list of summary_text parts", f"{p}.summary")
    parts = [dict(s, type="text") if isinstance(s, dict) and s.get("type") == "summary_text" else s for s in summary]
    for j, s in enumerate(parts):
        if not isinstance(s, dict) or s.get("type") != "text" or not isinstance(s.get("text"), str):
            raise bad(f"'{p}.summary[{j}]' must be {{\"type\": \"summary_text\", \"text\": \"...\"}}",
                      f"{p}.summary[{j}]")
    return "\n\n".join(s["text"] for s in parts)


def _call_name(item: dict, p: str) -> str:
    """A call item's tool name as the prompt has it (<namespace>.<name> for a namespaced tool)."""
    name = _id(item, "name", p)
    ns = item.get("namespace")
    if ns is not None and not isinstance(ns, str):
        raise bad(f"'{p}.namespace' must be a string", f"{p}.namespace")
    return f"{ns}{SEP}{name}" if ns else name


def _convert(body: dict, max_messages: int) -> _Turns:
    turns = _Turns()
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("'instructions' must be a string (a list of items is the input)", "instructions")
        turns.add({"role": "system", "content": instructions}, "instructions")
    raw = body.get("input")
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad("'input' must be a string or a non-empty list of input items", "input")
    if len(raw) > max_messages:
        raise bad(f"'input' holds {len(raw)} items; this server accepts at most {max_messages} (--max-messages)",
                  "input")
    for i, item in enumerate(raw):
        p = f"input[{i}]"
        kind = _kind(item, p)
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise bad(f"'{p}.role' must be system, developer, user or assistant; got {json.dumps(role)[:40]}",
                          f"{p}.role")
            if role == "assistant":
                text = _text(item.get("content"), f"{p}.content", ("output_text", "input_text", "refusal"))
                turns.assistant(p, "content")["content"] += text
            else:
                text = _text(item.get("content"), f"{p}.content", ("input_text", "text"))
                turns.add({"role": role, "content": text}, p)
        elif kind == "reasoning":
            turns.assistant(p, "reasoning")["reasoning_content"] = _reasoning_text(item, p)
        elif kind in ("function_call", "custom_tool_call"):
            call_id = _id(item, "call_id", p)
            name = _call_name(item, p)
            if kind == "function_call":
                args = item.get("arguments", "{}")
                if not isinstance(args, str):
                    raise bad(f"'{p}.arguments' must be a JSON string", f"{p}.arguments")
            else:
                if not isinstance(item.get("input"), str):
                    raise bad(f"'{p}.input' must be a string", f"{p}.input")
                args = {"input": item["input"]}
            a = turns.assistant(p, "call")
            a.setdefault("tool_calls", []).append({"id": call_id, "type": "function",
                                                   "function": {"name": name, "arguments": args}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = _id(item, "call_id", p)
            output = _text(item.get("output"), f"{p}.output", ("input_text", "output_text", "text"))
            turns.add({"role": "tool", "tool_call_id": call_id, "content": output}, p)
        else:
            raise bad(f"'{p}.type' {json.dumps(kind)[:60]} is not supported: this server takes message, reasoning, "
                      f"function_call(_output) and custom_tool_call(_output) items (it runs no hosted tools and "
                      f"stores no items to refer to)", f"{p}.type")
    return turns


_REF = re.compile(r"messages\[(\d+)\](\.tool_calls\[\d+\])?(\.function)?")


def _translate(e: InvalidRequest, turns: _Turns) -> InvalidRequest:
    """An error about the translated messages (messages[k]...), renamed to the input path item k came from."""
    def path(m: re.Match) -> str:
        k = int(m[1])
        return turns.origin[k] if k < len(turns.origin) else m[0]

    param = _REF.sub(path, e.param, count=1).replace(".tool_call_id", ".call_id") if e.param else e.param
    return InvalidRequest(_REF.sub(path, e.message), param=param, code=e.code)


# ------------------------------------------------------------------ tools

def _function(t: dict, q: str, prefix: str) -> tuple[dict, str]:
    name = _id(t, "name", q)
    if t.get("description") is not None and not isinstance(t["description"], str):
        raise bad(f"'{q}.description' must be a string", f"{q}.description")
    fn: dict[str, Any] = {"name": prefix + name}
    if t.get("description"):
        fn["description"] = t["description"]
    if t.get("type") == "custom":
        fmt = t.get("format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar")):
            raise bad(f"'{q}.format' must be {{\"type\": \"text\"}} or {{\"type\": \"grammar\", ...}}",
                      f"{q}.format")
        fn["parameters"] = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
    else:
        params = t.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad(f"'{q}.parameters' must be a JSON schema object", f"{q}.parameters")
        if t.get("strict") is not None and not isinstance(t["strict"], bool):
            raise bad(f"'{q}.strict' must be true or false", f"{q}.strict")
        if params is not None:
            fn["parameters"] = params
    return {"type": "function", "function": fn}, name


def _tools(raw: Any) -> tuple[list[dict] | None, dict[str, ToolName]]:
    """(OpenAI-style tools to render, prompt name -> ToolName). Raises InvalidRequest naming the tool."""
    if raw is None:
        return None, {}
    if not isinstance(raw, list):
        raise bad("'tools' must be a list", "tools")
    out: list[dict] = []
    names: dict[str, ToolName] = {}

    def add(t: dict, q: str, ns: str | None) -> None:
        kind = t.get("type")
        if kind not in ("function", "custom"):
            raise bad(f"'{q}.type' must be \"function\" or \"custom\" inside a namespace", f"{q}.type")
        tool, name = _function(t, q, f"{ns}{SEP}" if ns else "")
        full = tool["function"]["name"]
        if full in names:
            raise bad(f"'{q}.name': the tool name {json.dumps(full)[:80]} is given twice", f"{q}.name")
        names[full] = ToolName(kind, name, ns)
        out.append(tool)

    for j, t in enumerate(raw):
        q = f"tools[{j}]"
        kind = t.get("type") if isinstance(t, dict) else None
        if kind in ("function", "custom"):
            add(t, q, None)
        elif kind == "namespace":
            ns = _id(t, "name", q)
            inner = t.get("tools")
            if not isinstance(inner, list):
                raise bad(f"'{q}.tools' must be a list", f"{q}.tools")
            for k, u in enumerate(inner):
                if not isinstance(u, dict):
                    raise bad(f"'{q}.tools[{k}]' must be an object", f"{q}.tools[{k}]")
                add(u, f"{q}.tools[{k}]", ns)
        elif kind in HOSTED:
            log.debug("/v1/responses: %s is a %s tool, which this server cannot run: not rendered", q, kind)
        else:
            raise bad(f"'{q}.type' {json.dumps(kind)[:60]} is not supported: function, custom and namespace tools are "
                      f"rendered; the hosted types {', '.join(HOSTED)} are accepted and not offered to the model",
                      f"{q}.type")
    return out or None, names


def _tool_choice(raw: Any, names: dict[str, ToolName]) -> tuple[str, str | None]:
    """(tool choice 'auto' | 'none' | 'required', the prompt name of a forced tool or None)."""
    if raw is None or raw in ("auto", "none", "required"):
        return raw or "auto", None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in ("function", "custom"):
        name = raw.get("name")
        ns = raw.get("namespace")
        full = f"{ns}{SEP}{name}" if isinstance(ns, str) and ns else name
        if not isinstance(full, str) or full not in names or names[full].kind != kind:
            raise bad(f"'tool_choice.name' names the {kind} tool {json.dumps(full)[:60]}, which is not in 'tools'",
                      "tool_choice.name")
        return "required", full
    if kind in HOSTED or kind in ("allowed_tools", "mcp"):
        raise bad(f"'tool_choice' {json.dumps(kind)[:40]} is not supported: it forces (or restricts to) tools this "
                  f"server does not offer the model; \"auto\", \"none\", \"required\" and a named function or custom "
                  f"tool are", "tool_choice")
    raise bad("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": ...}",
              "tool_choice")


# ------------------------------------------------------------------ the request

def _text_format(raw: Any) -> dict | None:
    """The JSON schema `text.format` asks for: None for text (or null), {"type": "object"} for json_object, the
    schema of the flat {"type": "json_schema", "name", "schema", "strict"}."""
    if mapping({"text": raw}, "text") is None:
        return None
    if raw.get("verbosity") not in (None, "low", "medium", "high"):
        raise bad("'text.verbosity' must be \"low\", \"medium\" or \"high\"", "text.verbosity")
    fmt = raw.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise bad("'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                  "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}", "text.format")
    return schema_spec(fmt, "text.format")


def _reasoning(raw: Any) -> bool | None:
    """enable_thinking from `reasoning` (None: the template's default)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad("'reasoning' must be an object", "reasoning")
    effort = raw.get("effort")  # validated by thinking_from_effort
    for key in ("summary", "generate_summary"):
        if raw.get(key) not in (None, "auto", "concise", "detailed", "none"):
            raise bad(f"'reasoning.{key}' must be \"auto\", \"concise\", \"detailed\" or \"none\"", f"reasoning.{key}")
    return thinking_from_effort(effort, "reasoning.effort")


def _check_fields(body: dict) -> None:
    fields.check(body, FIELDS, RESPONSES, "/v1/responses")
    if body.get("store") not in (None, False):
        raise bad(f"'store' must be false or null: {_NO_STORE}", "store")
    identities(body, ("model", "prompt_cache_key", "user", "safety_identifier", "cache_salt"))
    for key in ("metadata", "client_metadata", "stream_options"):
        mapping(body, key)
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
            raise bad("'include' must be a list of strings", "include")
        for v in include:
            if v not in INCLUDE_NOTHING:
                raise bad(f"'include' value {json.dumps(v)[:60]} is not supported (log-probabilities are returned "
                          f"by /v1/chat/completions); accepted: {', '.join(INCLUDE_NOTHING)}", "include")
    if number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0, integer=True):
        raise bad("'top_logprobs' must be 0 or null on /v1/responses (log-probabilities are returned by "
                  "/v1/chat/completions)", "top_logprobs")
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise bad("'truncation' must be \"auto\" or \"disabled\"", "truncation")
    boolean(body, "parallel_tool_calls")


def parse_responses(body: Any, cfg: Config | None = None) -> ResponsesCall:
    """Validate a /v1/responses body against the limits of `cfg`. Raises InvalidRequest naming the field."""
    cfg = cfg or Config(cache_ram_mib=0)
    _check_fields(json_object(body))
    check_prompt_size(body_fields(body, ("instructions", "input", "tools")), cfg)
    opts = options({k: body.get(k) for k in ("max_output_tokens", "temperature", "top_p", "stream",
                                              "cache_prompt", "cache_salt")}, cfg, budget=("max_output_tokens",))
    tools, names = _tools(body.get("tools"))
    choice, forced = _tool_choice(body.get("tool_choice"), names)
    if choice == "none":
        tools = None
    structure = Structure(response=_text_format(body.get("text")), tool_choice=choice, tool_name=forced,
                          parallel_tool_calls=body.get("parallel_tool_calls") is not False,
                          response_field="text.format", schema_path="text.format.schema")
    thinking = _reasoning(body.get("reasoning"))
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    turns = _convert(body, cfg.max_messages)
    check_prompt_size(list(zip(turns.origin, turns.conv)) + [("tools", tools)], cfg)  # what will be rendered
    try:
        messages, breakpoints, late = conversation(turns.conv, len(turns.conv))
    except InvalidRequest as e:
        raise _translate(e, turns) from e
    echo = {k: body.get(k) for k in ("instructions", "max_output_tokens", "tools", "tool_choice", "reasoning",
                                      "text", "temperature", "top_p", "truncation", "metadata", "user",
                                      "prompt_cache_key", "parallel_tool_calls")}
    return ResponsesCall(messages=messages, tools=tools, names=names, template_kwargs=kwargs, options=opts,
                            structure=structure, prompt_cache_key=body.get("prompt_cache_key") or "",
                            cache_breakpoints=breakpoints,
                            late_system=None if late is None else turns.origin[late], echo=echo)


# ------------------------------------------------------------------ answers

def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, item_id: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [], "encrypted_content": None,
            "status": status}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str | None, item_id: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [] if text is None else [output_text(text)]}


def call_item(call: dict, names: dict[str, ToolName], item_id: str) -> dict:
    """An OpenAI-shaped parsed tool call as a function_call (or custom_tool_call) output item."""
    full, args = call["function"]["name"], call["function"]["arguments"]
    tool = names.get(full, ToolName("function", full))
    if tool.kind == "custom":
        try:
            value = json.loads(args).get("input")
        except (ValueError, AttributeError):
            value = None
        return {"type": "custom_tool_call", "id": item_id, "call_id": call["id"], "name": tool.name,
                "input": value if isinstance(value, str) else args, "status": "completed"}
    item = {"type": "function_call", "id": item_id, "call_id": call["id"], "name": tool.name, "arguments": args,
            "status": "completed"}
    if tool.namespace:
        item["namespace"] = tool.namespace
    return item


def usage(r: Result, reasoning_tokens: int) -> dict:
    """Responses usage; reasoning_tokens: the completion tokens generated while reasoning."""
    out = len(r.completion_tokens)
    return {"input_tokens": r.prompt_tokens, "input_tokens_details": {"cached_tokens": r.cached_tokens},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, out)},
            "total_tokens": r.prompt_tokens + out}


def response_object(rid: str, created: int, model: str, req: ResponsesCall, output: list[dict],
                    status: str, usage_: dict | None) -> dict:
    """The Response object (openai.types.responses.Response): `status` in_progress, completed or incomplete."""
    e = req.echo
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": e["instructions"], "max_output_tokens": e["max_output_tokens"], "model": model,
            "output": output, "parallel_tool_calls": e["parallel_tool_calls"] is not False,
            "previous_response_id": None, "reasoning": e["reasoning"] or {"effort": None, "summary": None},
            "store": False, "temperature": e["temperature"], "text": e["text"] or {"format": {"type": "text"}},
            "tool_choice": e["tool_choice"] or "auto", "tools": e["tools"] or [], "top_p": e["top_p"],
            "truncation": e["truncation"] or "disabled", "usage": usage_, "user": e["user"],
            "metadata": e["metadata"] or {}, "prompt_cache_key": e["prompt_cache_key"]}


class ResponsesEncoder(Encoder):
    """The Responses API's events, each `event: <type>` with its JSON (`type`, `sequence_number`):
    response.created and response.in_progress; per output item response.output_item.added, its part
    (response.content_part.added, the deltas: response.reasoning_text.delta or response.output_text.delta, their
    .done, response.content_part.done) and response.output_item.done (reasoning, then message; function calls at
    the end, each with one response.function_call_arguments.delta and .done, or response.custom_tool_call_input
    .delta and .done); then response.completed (or response.incomplete when generation hit max_output_tokens)
    carrying the whole response and its usage; response.failed if the job fails. `final`: that whole response."""

    route, kind = "/v1/responses", "responses"

    def __init__(self, call: ResponsesCall, reply: Reply, model: str) -> None:
        self.rid, self.created, self.call, self.model = new_id("resp"), int(time.time()), call, model
        self.reading = Reading(reply)
        self.seq = 0
        self.output: list[dict] = []  # finished items
        self.item: dict | None = None  # the open reasoning or message item
        self.item_text = ""
        self.response: dict = {}  # the whole response, once done

    def _event(self, kind: str, **data) -> Sse:
        body = dict(type=kind, sequence_number=self.seq, **data)
        self.seq += 1
        return kind, body

    def _response(self, output: list[dict], state: str, usage_: dict | None) -> dict:
        return response_object(self.rid, self.created, self.model, self.call, output, state, usage_)

    @staticmethod
    def _part(kind: str, text: str) -> dict:
        return output_text(text) if kind == "message" else {"type": "reasoning_text", "text": text}

    def _close(self) -> list[Sse]:
        item = self.item
        if item is None:
            return []
        self.item = None
        i, kind, text = len(self.output), item["type"], self.item_text
        ref = {"item_id": item["id"], "output_index": i, "content_index": 0}
        done = message_item(text, item["id"]) if kind == "message" else reasoning_item(text, item["id"])
        self.output.append(done)
        if kind == "message":
            lines = [self._event("response.output_text.done", **ref, text=text, logprobs=[])]
        else:
            lines = [self._event("response.reasoning_text.done", **ref, text=text)]
        return lines + [self._event("response.content_part.done", **ref, part=self._part(kind, text)),
                        self._event("response.output_item.done", output_index=i, item=done)]

    def _open(self, kind: str) -> list[Sse]:
        lines = self._close()
        item_id = new_id("msg" if kind == "message" else "rs")
        item = message_item(None, item_id, "in_progress") if kind == "message" \
            else dict(reasoning_item("", item_id, "in_progress"), content=[])
        self.item, self.item_text = item, ""
        i = len(self.output)
        return lines + [self._event("response.output_item.added", output_index=i, item=item),
                        self._event("response.content_part.added", item_id=item_id, output_index=i, content_index=0,
                                    part=self._part(kind, ""))]

    def _pieces(self, pieces: list[tuple[str, str]]) -> list[Sse]:
        lines = []
        for kind, text in pieces:
            want = "reasoning" if kind == "reasoning" else "message"
            if self.item is None or self.item["type"] != want:
                lines += self._open(want)
            self.item_text += text
            ref = {"item_id": self.item["id"], "output_index": len(self.output), "content_index": 0}
            if want == "message":
                lines.append(self._event("response.output_text.delta", **ref, delta=text, logprobs=[]))
            else:
                lines.append(self._event("response.reasoning_text.delta", **ref, delta=text))
        return lines

    def start(self) -> list[Sse]:
        opening = self._response([], "in_progress", None)
        return [self._event("response.created", response=opening),
                self._event("response.in_progress", response=opening)]

    def text(self, ev: Event) -> list[Sse]:
        return self._pieces(self.reading.push(ev.text))

    def done(self, r: Result) -> list[Sse]:
        rest, calls = self.reading.finish(r.cut)
        lines = self._pieces(rest) + self._close()
        for call in calls:
            item = call_item(call, self.call.names, new_id("fc"))
            i = len(self.output)
            ref = {"item_id": item["id"], "output_index": i}
            if item["type"] == "custom_tool_call":
                lines += [self._event("response.output_item.added", output_index=i,
                                      item=dict(item, input="", status="in_progress")),
                          self._event("response.custom_tool_call_input.delta", **ref, delta=item["input"]),
                          self._event("response.custom_tool_call_input.done", **ref, input=item["input"])]
            else:
                lines += [self._event("response.output_item.added", output_index=i,
                                      item=dict(item, arguments="", status="in_progress")),
                          self._event("response.function_call_arguments.delta", **ref, delta=item["arguments"]),
                          self._event("response.function_call_arguments.done", **ref, name=item["name"],
                                      arguments=item["arguments"])]
            self.output.append(item)
            lines.append(self._event("response.output_item.done", output_index=i, item=item))
        state = "incomplete" if r.finish_reason == "length" and not calls else "completed"
        self.response = dict(self._response(self.output, state, usage(r, self.reading.reasoning_tokens(r))),
                             timings=timings(r))
        name = "response.completed" if state == "completed" else "response.incomplete"
        return lines + [self._event(name, response=self.response)]

    def error(self, e: Exception) -> list[Sse]:
        err = error_payload(e)[0]["error"]
        failed = self._response(self.output, "failed", None)
        failed["error"] = {"code": err.get("code") or err.get("type"), "message": err["message"]}
        return self._close() + [self._event("response.failed", response=failed)]

    def final(self) -> dict:
        return self.response
