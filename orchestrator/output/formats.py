"""Output formats per template family: reasoning tags, where tool calls start, and how they are parsed.

The format is chosen from the chat template's source (the family it belongs to), never from the model name:
the template both tells the model how to call tools and renders earlier calls back in that syntax. Formats, with
the template text that identifies each (checked in this order) and the call syntax the model writes:

* harmony (gpt-oss; `<|channel|>`): `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}`,
  parsed by orchestrator/harmony.py.
* qwen-xml (Qwen3.5, Qwen3-Coder; `<function=` and `<parameter=`):
  `<tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n</function>\n</tool_call>`.
* deepseek-r1 (DeepSeek-R1 distills; `tool▁calls▁begin`): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function
  <｜tool▁sep｜>NAME\n```json\n{…}\n```<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`.
* mistral (Mistral Nemo; `[TOOL_CALLS]`): `[TOOL_CALLS][{"name": NAME, "arguments": {…}, "id": …}, …]`.
* nemotron (Nemotron Nano v2; `<TOOLCALL>`): `<TOOLCALL>[{"name": NAME, "arguments": {…}}, …]</TOOLCALL>`.
* lfm2 (LFM2, LFM2.5; `<|tool_call_start|>` or `List of tools: [`): `<|tool_call_start|>[NAME(k=v, …), …]
  <|tool_call_end|>`, Python call syntax with JSON literals allowed (llama.cpp common/parsers/lfm2.cpp).
* llama3-json (Llama 3.1; `<|python_tag|>`, or `"parameters"` with `<|start_header_id|>`): the whole reply is
  `{"name": NAME, "parameters": {…}}`, or it follows `<|python_tag|>`.
* hermes (Qwen3, Granite 4.0; `<tool_call>`), also the fallback (SmolLM3, Gemma 2, unknown templates):
  `<tool_call>\n{"name": NAME, "arguments": {…}}\n</tool_call>`.

Reasoning is text inside `<think>…</think>` for every format whose template mentions `<think>` (harmony: the
analysis channel). Syntax facts are from the templates in tests/templates and llama.cpp's chat parsers
(common/chat*.cpp, common/parsers/lfm2.cpp, gpt-oss.cpp).

A parse function takes the generated text from the first call-start marker on and returns OpenAI-shaped tool
calls (arguments as a JSON string); text it cannot parse gives no calls, and the caller keeps it as content.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable

THINK = ("<think>", "</think>")


def tool_call(name: str, arguments: Any) -> dict:
    """An OpenAI-shaped tool call; `arguments` (a mapping, or a JSON string that is kept) becomes a JSON string."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def _json_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _json_prefix(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of `text` (after whitespace) and where it ends; None if there is none."""
    start = len(text) - len(text.lstrip())
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None


def _named_calls(items: Any, args_keys: tuple[str, ...] = ("arguments",)) -> list[dict]:
    """Calls from JSON objects {"name": …, "<args key>": {…}}; [] unless every item has that shape."""
    items = items if isinstance(items, list) else [items]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        key = next((k for k in args_keys if k in item), None)
        args = item.get(key, {}) if key else {}
        if isinstance(args, str):  # some models write the arguments as a JSON string
            args = _json_value(args)
        if not isinstance(args, dict):
            return []
        calls.append(tool_call(item["name"], args))
    return calls


_QWEN_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
_QWEN_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def plain_string(schema: Any) -> bool:
    """Whether a parameter schema is a plain string (type "string" without enum, const, pattern or format): the
    qwen-xml format writes such a value as raw text."""
    return (isinstance(schema, dict) and schema.get("type") == "string"
            and not any(k in schema for k in ("enum", "const", "pattern", "format")))


def _plain_params(tools: list[dict] | None, name: str) -> set[str]:
    for t in tools or ():
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k for k, v in props.items() if plain_string(v)} if isinstance(props, dict) else set()
    return set()


def parse_qwen_xml(text: str, tools: list[dict] | None = None) -> list[dict]:
    """Qwen3.5 / Qwen3-Coder: a parameter value that parses as JSON keeps its type, otherwise it is a string;
    with the request's `tools`, a value of a plain-string parameter (`plain_string`) stays its raw text even
    where it parses as JSON ("42" stays "42")."""
    calls = []
    for m in _QWEN_CALL.finditer(text):
        name = m.group(1).strip()
        raw = _plain_params(tools, name)
        calls.append(tool_call(name, {k.strip(): v if k.strip() in raw else _json_value(v)
                                      for k, v in _QWEN_PARAM.findall(m.group(2))}))
    return calls


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_hermes(text: str) -> list[dict]:
    """`<tool_call>{"name": …, "arguments": {…}}</tool_call>` blocks (Qwen3, Granite 4.0, Hermes)."""
    calls: list[dict] = []
    for body in _HERMES_CALL.findall(text):
        found = _named_calls(_json_value(body), ("arguments", "parameters"))
        if not found:
            return []
        calls += found
    return calls


_DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>\s*(?:function)?\s*<｜tool▁sep｜>\s*([^\n]+?)\s*\n```(?:json)?\s*\n(.*?)\n```\s*<｜tool▁call▁end｜>",
    re.S)


def parse_deepseek_r1(text: str) -> list[dict]:
    """DeepSeek-R1: one fenced JSON block of arguments per call, inside <｜tool▁calls▁begin｜>…"""
    calls = []
    for name, body in _DEEPSEEK_CALL.findall(text):
        args = _json_value(body)
        if not isinstance(args, dict):
            return []
        calls.append(tool_call(name, args))
    return calls


def _after(marker: str, text: str) -> str | None:
    i = text.find(marker)
    return None if i < 0 else text[i + len(marker):]


def parse_mistral(text: str) -> list[dict]:
    """Mistral: `[TOOL_CALLS]` then a JSON list of {"name", "arguments", "id"}."""
    rest = _after("[TOOL_CALLS]", text)
    found = _json_prefix(rest) if rest is not None else None
    return _named_calls(found[0]) if found else []


def parse_nemotron(text: str) -> list[dict]:
    """Nemotron Nano v2: `<TOOLCALL>[{"name", "arguments"}, …]</TOOLCALL>`."""
    rest = _after("<TOOLCALL>", text)
    found = _json_prefix(rest) if rest is not None else None
    if not found or not rest[found[1]:].lstrip().startswith("</TOOLCALL>"):
        return []
    return _named_calls(found[0])


_PY_LITERALS = {"true": True, "false": False, "null": None}


def _py_value(node: ast.AST) -> Any:
    if isinstance(node, ast.Name) and node.id in _PY_LITERALS:
        return _PY_LITERALS[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_py_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_py_value(k): _py_value(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def parse_lfm2(text: str) -> list[dict]:
    """LFM2 / LFM2.5: `<|tool_call_start|>[name(k=v, …), …]<|tool_call_end|>`, values as Python or JSON literals."""
    calls = []
    for body in re.findall(r"<\|tool_call_start\|>(.*?)<\|tool_call_end\|>", text, re.S):
        try:
            tree = ast.parse(body.strip(), mode="eval").body
            nodes = tree.elts if isinstance(tree, ast.List) else [tree]
            for node in nodes:
                if not isinstance(node, ast.Call) or node.args:
                    return []
                calls.append(tool_call(ast.unparse(node.func), {kw.arg: _py_value(kw.value) for kw in node.keywords}))
        except (SyntaxError, ValueError, TypeError):
            return []
    return calls


def parse_llama3_json(text: str) -> list[dict]:
    """Llama 3.1: `{"name": …, "parameters": {…}}` (optionally after `<|python_tag|>`; several joined by `;`)."""
    rest = _after("<|python_tag|>", text)
    rest = (text if rest is None else rest).strip()
    calls: list[dict] = []
    while rest:
        found = _json_prefix(rest)
        if not found:
            return []
        more = _named_calls(found[0], ("parameters", "arguments"))
        if not more:
            return []
        calls += more
        rest = rest[found[1]:].strip().lstrip(";").strip()
    return calls


@dataclass(frozen=True)
class OutputFormat:
    """How one template family's generated text splits into reasoning, content and tool calls.

    think: (open, close) reasoning tags, or None. call_starts: markers where tool-call text begins (content
    stops there). parse_calls: tool-call text (from the first marker on) -> OpenAI tool calls.
    """

    name: str
    think: tuple[str, str] | None
    call_starts: tuple[str, ...]
    parse_calls: Callable[..., list[dict]]
    reasoning_field: str = "reasoning_content"  # the message field the template reads earlier reasoning from
    typed_args: bool = False  # parse_calls(text, tools): the tools' schemas type the argument values

    def calls(self, text: str, tools: list[dict] | None = None) -> list[dict]:
        """parse_calls on `text`, with the request's tools where the format needs them (`typed_args`)."""
        return self.parse_calls(text, tools) if self.typed_args else self.parse_calls(text)

    def template_messages(self, messages: list[dict]) -> list[dict]:
        """`messages` as the family's template expects them: gpt-oss's reads an assistant turn's reasoning from
        `thinking` and rejects a tool-call turn with both content and thinking (llama.cpp's gpt-oss handler
        moves the field and drops that content the same way)."""
        if self.reasoning_field == "reasoning_content":
            return messages
        out = []
        for m in messages:
            if "reasoning_content" in m:
                m = dict(m)
                m[self.reasoning_field] = m.pop("reasoning_content")
                if m.get("tool_calls"):
                    m["content"] = ""
            out.append(m)
        return out


def _format(name, call_starts, parse, source: str) -> OutputFormat:
    return OutputFormat(name, THINK if "<think>" in source or "</think>" in source else None, call_starts, parse,
                        typed_args=parse is parse_qwen_xml)


HARMONY = OutputFormat("harmony", None, (), lambda text: [], "thinking")  # parsed by orchestrator/harmony.py

_RULES: tuple[tuple[Callable[[str], bool], str, tuple[str, ...], Callable[[str], list[dict]]], ...] = (
    (lambda s: "<function=" in s and "<parameter=" in s, "qwen-xml", ("<tool_call>",), parse_qwen_xml),
    (lambda s: "tool▁calls▁begin" in s, "deepseek-r1", ("<｜tool▁calls▁begin｜>",), parse_deepseek_r1),
    (lambda s: "[TOOL_CALLS]" in s, "mistral", ("[TOOL_CALLS]",), parse_mistral),
    (lambda s: "<TOOLCALL>" in s, "nemotron", ("<TOOLCALL>",), parse_nemotron),
    (lambda s: "<|tool_call_start|>" in s or "List of tools: [" in s, "lfm2", ("<|tool_call_start|>",), parse_lfm2),
    (lambda s: "<|python_tag|>" in s or ("<|start_header_id|>" in s and '"parameters"' in s), "llama3-json",
     ("<|python_tag|>", '{"name"'), parse_llama3_json),
)


def detect_format(template_source: str) -> OutputFormat:
    """The output format of the family `template_source` belongs to (table in the module docstring)."""
    if "<|channel|>" in template_source:
        return HARMONY
    for matches, name, starts, parse in _RULES:
        if matches(template_source):
            return _format(name, starts, parse, template_source)
    return _format("hermes", ("<tool_call>",), parse_hermes, template_source)


QWEN35 = OutputFormat("qwen-xml", THINK, ("<tool_call>",), parse_qwen_xml, typed_args=True)
