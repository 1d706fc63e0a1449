"""Structured output: the GBNF grammar that llama.cpp's grammar sampler enforces for a chat request.

What a request may constrain (`Structure`): the reply as JSON (`response_format` `json_object`, or `json_schema`
with its schema), a tool call (`tool_choice` `"required"` or a named function), at most one tool call
(`parallel_tool_calls: false`). JSON grammars come from llama-cpp-python's converter
(`llama_cpp.llama_grammar.SchemaConverter`, the module behind `json_schema_to_gbnf`); this module only puts them
in the template family's tool-call syntax and after the reasoning:

* qwen-xml (Qwen3.5, Qwen3-Coder): `<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n…</function>\\n
  </tool_call>`, a parameter per property of the tool's schema (required ones always, optional ones may be
  left out, in the schema's order). A plain string value (type "string" without enum, const, pattern or format)
  is raw text, as the template writes it; it may not contain `</` (which would close the parameter). Any other
  value is JSON for the property's schema.
* hermes (Qwen3, Granite 4.0, the fallback): `<tool_call>\\n{"name": NAME, "arguments": {…}}\\n</tool_call>`.
* Other families: refused (InvalidRequest naming the field).

Reasoning: when the prompt opens a reasoning block (Qwen3.5 with thinking on), the grammar is lazy (llama.cpp's
grammar triggers): nothing is constrained until the reasoning's closing tag, and the grammar starts with that
tag. `parallel_tool_calls: false` with `tool_choice` `"auto"` is lazy too: free text until a call starts, then
exactly one call and the end.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any

from llama_cpp.llama_grammar import SchemaConverter

from ..errors import InvalidRequest
from .formats import OutputFormat, plain_string

# JSON strings may not hold raw control characters (RFC 8259); llama-cpp-python 0.3.36's converter allows them,
# its JSON grammar (JSON_GBNF) does not: the converter's `char` rule is replaced by JSON_GBNF's characters.
_JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
_CALL_FORMATS = ("qwen-xml", "hermes")
# The converter spells a bound of n as n nested groups, which llama.cpp's grammar parser and sampler walk
# recursively: larger bounds are refused rather than risk the worker's stack. Grammars above MAX_GRAMMAR_CHARS too.
MAX_BOUND = 1000
MAX_GRAMMAR_CHARS = 1 << 20
_BOUND_KEYS = ("minLength", "maxLength", "minItems", "maxItems")
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _check_bounds(schema: Any, param: str, depth: int = 0) -> None:
    """Raise InvalidRequest (naming `param`) for a length or count bound, or a pattern quantifier, above
    MAX_BOUND anywhere in `schema`."""
    if depth > 100:
        raise InvalidRequest(f"'{param}' is nested more than 100 levels deep", param=param)
    if isinstance(schema, dict):
        for key, value in schema.items():
            bounds = [value] if key in _BOUND_KEYS and isinstance(value, int) else []
            if key == "pattern" and isinstance(value, str):
                bounds = [int(n) for m in _QUANTIFIER.finditer(value) for n in m.groups() if n]
            if any(b > MAX_BOUND for b in bounds):
                raise InvalidRequest(f"'{param}' has a bound above {MAX_BOUND} ({key}); this server's grammars "
                                     f"take at most {MAX_BOUND}", param=param)
            _check_bounds(value, param, depth + 1)
    elif isinstance(schema, list):
        for item in schema:
            _check_bounds(item, param, depth + 1)


@dataclass(frozen=True)
class Structure:
    """A chat request's structured-output settings, validated (server/schemas.py).

    response: None (free text) or the JSON schema the reply must be valid against (`json_object`:
    {"type": "object"}; `json_schema`: its schema).
    tool_choice: "auto" or "required" ("none" drops the tools before this). tool_name: the function a named
    tool_choice forces, else None. parallel_tool_calls: False allows at most one call.
    """

    response: dict | None = None
    tool_choice: str = "auto"
    tool_name: str | None = None
    parallel_tool_calls: bool = True


@dataclass(frozen=True)
class Constraint:
    """A grammar for the sampler: GBNF text with root rule `root`; `triggers`: texts that start it (lazy), or
    empty (it constrains the first token on)."""

    gbnf: str
    triggers: tuple[str, ...] = ()


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a GBNF string literal: JSON's escapes are GBNF's


class _Rules:
    """One SchemaConverter for a whole grammar (its rule names are unique across the schemas it visits) plus
    this module's rules."""

    def __init__(self) -> None:
        self.conv = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)

    def json(self, schema: dict, name: str, param: str) -> str:
        """The rule name for JSON values valid against `schema`. Raises InvalidRequest (naming `param`) for a
        schema the converter cannot handle."""
        _check_bounds(schema, param)
        schema = copy.deepcopy(schema)  # resolve_refs rewrites $ref in place
        try:
            self.conv.resolve_refs(schema, "request")
            return self.conv.visit(schema, name)
        except (AssertionError, ValueError, KeyError, TypeError, AttributeError, RecursionError, IndexError) as e:
            raise InvalidRequest(f"'{param}' is not a JSON schema this server can turn into a grammar "
                                 f"({type(e).__name__}: {str(e)[:200]}); supported: llama.cpp's JSON-schema subset "
                                 f"(types, properties, required, items, enum, const, anyOf/oneOf, allOf, $ref to "
                                 f"#/..., string pattern, minLength/maxLength, minItems/maxItems)", param=param) from e

    def add(self, name: str, rule: str) -> str:
        return self.conv._add_rule(name, rule)

    def text(self, root: str, param: str) -> str:
        """The grammar with root rule `root`. Raises InvalidRequest (naming `param`) above MAX_GRAMMAR_CHARS."""
        rules = self.conv._rules
        if "char" in rules:
            rules["char"] = _JSON_CHAR
        rules["root"] = root
        text = self.conv.format_grammar()
        if len(text) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(f"the grammar for '{param}' would be {len(text)} characters; this server takes at "
                                 f"most {MAX_GRAMMAR_CHARS}: simplify the schema", param=param)
        return text


def _raw_string(rules: _Rules, schema: dict, name: str) -> str:
    """Raw text for a plain string parameter of the qwen-xml format: no `</`, within minLength..maxLength."""
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    if isinstance(lo, int) and (hi is None or isinstance(hi, int)) and (lo > 0 or hi is not None):
        return rules.add(name, f"[^<]{{{lo},{'' if hi is None else hi}}}")  # bounded: '<' left out entirely
    return rules.add(name, '([^<] | "<"+ [^/<])* "<"*')


def _qwen_call(rules: _Rules, fn: dict, i: int) -> str:
    name = fn["name"]
    params = fn.get("parameters") or {}
    props = params.get("properties") or {}
    if not isinstance(props, dict):
        raise InvalidRequest(f"'tools[{i}].function.parameters.properties' must be an object",
                             param=f"tools[{i}].function.parameters")
    required = set(params.get("required") or ())
    parts = []
    for k, schema in props.items():
        where = f"tools[{i}].function.parameters.properties.{k}"
        if not isinstance(schema, dict):
            raise InvalidRequest(f"'{where}' must be a JSON schema object", param=where)
        rule = f"tool{i}-{k}"
        value = _raw_string(rules, schema, rule) if plain_string(schema) else rules.json(schema, rule, where)
        arg = rules.add(f"tool{i}-{k}-arg", f'{_literal(f"<parameter={k}>" + chr(10))} {value} '
                                            f'{_literal(chr(10) + "</parameter>" + chr(10))}')
        parts.append(arg if k in required else f"{arg}?")
    head = _literal(f"<tool_call>\n<function={name}>\n")
    return rules.add(f"tool{i}-call", f'{head} {" ".join(parts)} {_literal("</function>" + chr(10) + "</tool_call>")}')


def _hermes_call(rules: _Rules, fn: dict, i: int) -> str:
    schema = {"type": "object", "properties": {"name": {"const": fn["name"]},
                                               "arguments": fn.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"]}
    body = rules.json(schema, f"tool{i}", f"tools[{i}].function.parameters")
    return rules.add(f"tool{i}-call", f'{_literal("<tool_call>" + chr(10))} {body} '
                                      f'{_literal(chr(10) + "</tool_call>")}')


def _calls(rules: _Rules, fmt: OutputFormat, tools: list[dict], only: str | None, many: bool, param: str) -> str:
    """The rule for one tool call (or, with `many`, one or more) of `tools` (or only the function `only`)."""
    if fmt.name not in _CALL_FORMATS:
        raise InvalidRequest(f"'{param}' cannot be enforced for this model: its chat template's tool-call format "
                             f"({fmt.name}) has no grammar here (supported: {', '.join(_CALL_FORMATS)})", param=param)
    make = _qwen_call if fmt.name == "qwen-xml" else _hermes_call
    alts = [make(rules, t["function"], i) for i, t in enumerate(tools) if only in (None, t["function"]["name"])]
    one = rules.add("tool-call", " | ".join(alts))
    return rules.add("tool-calls", f'{one} ("\\n" {one})*') if many else one


def build(structure: Structure, tools: list[dict] | None, fmt: OutputFormat, opens_reasoning: bool
          ) -> Constraint | None:
    """The grammar that enforces `structure` on a reply in format `fmt` (None when nothing is constrained).

    tools: the request's tools (after tool_choice "none" dropped them). opens_reasoning: the prompt ends inside
    an open reasoning block. Raises InvalidRequest naming the field for a schema the converter cannot handle, a
    format without a tool-call grammar, or a constraint this format cannot express (harmony)."""
    forced = bool(tools) and structure.tool_choice == "required"
    one_call = bool(tools) and not structure.parallel_tool_calls
    if structure.response is None and not forced and not one_call:
        return None
    if fmt.name == "harmony":
        param = "response_format" if structure.response is not None else \
            "tool_choice" if forced else "parallel_tool_calls"
        raise InvalidRequest(f"'{param}' cannot be enforced for this model: its harmony output (channels) has no "
                             f"grammar here", param=param)
    rules = _Rules()
    many = structure.parallel_tool_calls
    if forced:
        body = _calls(rules, fmt, tools, structure.tool_name, many, "tool_choice")
    elif structure.response is not None:
        response = rules.json(structure.response, "response", "response_format.json_schema.schema")
        body = response
        if tools:  # the model may still call a tool instead of answering
            body = f"{response} | {_calls(rules, fmt, tools, None, many, 'response_format')}"
    else:  # tool_choice auto, at most one call: free text until a call starts, then exactly one call
        return Constraint(rules.text(_calls(rules, fmt, tools, None, False, "parallel_tool_calls"), "tools"),
                          triggers=fmt.call_starts)
    param = "tool_choice" if forced else "response_format"
    if opens_reasoning and fmt.think is not None:
        close = fmt.think[1]
        return Constraint(rules.text(f'{_literal(close)} "\\n"? "\\n"? ({body})', param), triggers=(close,))
    return Constraint(rules.text(body, param))
