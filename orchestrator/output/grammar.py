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
import time
from dataclasses import dataclass
from typing import Any

from llama_cpp.llama_grammar import INVALID_RULE_CHARS_RE, SchemaConverter

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
MAX_PATTERN_CHARS = 4096
# The converter writes an object's optional properties as every suffix of their list (_build_object_rule's
# get_recursive_refs): quadratic in their number, and recursive (RecursionError near 1,000).
MAX_OPTIONAL = 100
_BOUND_KEYS = ("minLength", "maxLength", "minItems", "maxItems")
# Pairs no value can meet when min > max. llama.cpp computes `max - min` unsigned for a repetition `x{min,max}`
# (llama_grammar_parser::handle_repetitions) and adds rules without end: they are refused here, by name.
_PAIRS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"),
          ("minimum", "maximum"), ("exclusiveMinimum", "maximum"), ("minimum", "exclusiveMaximum"),
          ("exclusiveMinimum", "exclusiveMaximum"))
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


@dataclass(frozen=True)
class Budget:
    """Work one grammar may cost to build: `nodes`, the most JSON values (objects, arrays, strings, numbers: enum
    members and property names included) in all of a request's schemas together (--grammar-max-schema); `build_s`,
    seconds the schema converter may take (--grammar-budget; checked at each rule it adds)."""

    nodes: int = 20000
    build_s: float = 5.0


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _scan(text: str, gbnf: bool = False) -> tuple[list[tuple[int, int]], str]:
    """The (lo, hi) code points of each range `a-b` in the character classes `[...]` of a regular expression (or,
    with `gbnf`, of GBNF text, whose string literals "..." are skipped), and the text outside classes and
    literals. Escapes \\xHH, \\uHHHH, \\UHHHHHHHH and \\c are read as llama.cpp's parser reads them
    (llama-grammar.cpp parse_char)."""
    ranges, outside, i, n = [], [], 0, len(text)

    def char(j: int) -> tuple[int, int]:
        if text[j] == "\\" and j + 1 < n:
            kind = text[j + 1]
            width = {"x": 2, "u": 4, "U": 8}.get(kind)
            if width and re.fullmatch(r"[0-9a-fA-F]+", text[j + 2:j + 2 + width] or "-"):
                return int(text[j + 2:j + 2 + width], 16), j + 2 + width
            return ord({"n": "\n", "r": "\r", "t": "\t"}.get(kind, kind)), j + 2
        return ord(text[j]), j + 1

    while i < n:
        c = text[i]
        if c == "\\":
            outside.append(text[i:i + 2])
            i += 2
        elif c == '"' and gbnf:
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
        elif c == "[":
            i += 1
            if i < n and text[i] == "^":
                i += 1
            first = True
            while i < n and (text[i] != "]" or first):
                first = False
                lo, i = char(i)
                if i + 1 < n and text[i] == "-" and text[i + 1] != "]":
                    hi, i = char(i + 1)
                    ranges.append((lo, hi))
            i += 1
        else:
            outside.append(c)
            i += 1
    return ranges, "".join(outside)


def _check_schema(schema: Any, param: str, count: list[int], budget: Budget, depth: int = 0) -> None:
    """Raise InvalidRequest (naming `param`) for what this server's grammars cannot hold or llama.cpp cannot
    survive: nesting deeper than 100; more than `budget.nodes` values in all (`count` is the running total);
    a length or count bound, or a pattern quantifier, above MAX_BOUND; contradictory bounds (minLength >
    maxLength, minimum > maximum, a pattern's {m,n} with m > n); an empty character range in a pattern
    ([b-a]); an empty enum; a pattern longer than MAX_PATTERN_CHARS; more than MAX_OPTIONAL optional properties
    in one object."""
    count[0] += 1
    if count[0] > budget.nodes:
        raise InvalidRequest(f"'{param}' has more than {budget.nodes} schema values (properties, enum members and "
                             f"the like) in this request; this server takes at most {budget.nodes} "
                             f"(--grammar-max-schema)", param=param)
    if depth > 100:
        raise InvalidRequest(f"'{param}' is nested more than 100 levels deep", param=param)
    if isinstance(schema, dict):
        for lo_key, hi_key in _PAIRS:
            lo, hi = schema.get(lo_key), schema.get(hi_key)
            if _number(lo) and _number(hi) and (lo > hi or (lo == hi and "exclusive" in lo_key + hi_key)):
                raise InvalidRequest(f"'{param}' has {lo_key} {lo} above {hi_key} {hi}: no value meets both",
                                     param=param)
        props = schema.get("properties")
        if isinstance(props, dict):
            required = schema.get("required") if isinstance(schema.get("required"), list) else []
            optional = len(set(props) - {k for k in required if isinstance(k, str)})
            if optional > MAX_OPTIONAL:
                raise InvalidRequest(f"'{param}' has an object with {optional} optional properties; this server's "
                                     f"grammars take at most {MAX_OPTIONAL} (list more of them in 'required')",
                                     param=param)
        if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
            raise InvalidRequest(f"'{param}' has an enum that is not a non-empty array: no value meets it",
                                 param=param)
        for key, value in schema.items():
            bounds = [value] if key in _BOUND_KEYS and isinstance(value, int) else []
            if key == "pattern" and isinstance(value, str):
                if len(value) > MAX_PATTERN_CHARS:
                    raise InvalidRequest(f"'{param}' has a pattern of {len(value)} characters; this server takes "
                                         f"at most {MAX_PATTERN_CHARS}", param=param)
                pairs = [(int(m.group(1)), int(m.group(2))) for m in _QUANTIFIER.finditer(value) if m.group(2)]
                if any(lo > hi for lo, hi in pairs):
                    raise InvalidRequest(f"'{param}' has a pattern quantifier {{m,n}} with m above n", param=param)
                empty = [(lo, hi) for lo, hi in _scan(value)[0] if lo > hi]
                if empty:
                    raise InvalidRequest(f"'{param}' has a pattern with an empty character range "
                                         f"({chr(empty[0][0])}-{chr(empty[0][1])}): no character is in it",
                                         param=param)
                bounds = [int(n) for m in _QUANTIFIER.finditer(value) for n in m.groups() if n]
            if any(b > MAX_BOUND for b in bounds):
                raise InvalidRequest(f"'{param}' has a bound above {MAX_BOUND} ({key}); this server's grammars "
                                     f"take at most {MAX_BOUND}", param=param)
            count[0] += 1  # the key
            _check_schema(value, param, count, budget, depth + 1)
    elif isinstance(schema, list):
        for item in schema:
            _check_schema(item, param, count, budget, depth + 1)


def _check_gbnf(text: str, param: str) -> None:
    """The last line before llama.cpp parses a grammar, whatever wrote it: refuse (naming `param`) a repetition
    {m,n} with m > n (llama.cpp would add rules without end) and an empty character range (it would accept no
    character: llama_grammar_accept_str then throws through ctypes). String literals are skipped."""
    ranges, outside = _scan(text, gbnf=True)
    for m in _QUANTIFIER.finditer(outside):
        if m.group(2) and int(m.group(1)) > int(m.group(2)):
            raise InvalidRequest(f"the grammar built from '{param}' has a repetition {m.group(0)} with its minimum "
                                 f"above its maximum: check the schema's bounds", param=param)
    if any(lo > hi for lo, hi in ranges):
        raise InvalidRequest(f"the grammar built from '{param}' has an empty character range: check the schema's "
                             f"patterns", param=param)


class _Converter(SchemaConverter):
    """llama-cpp-python's converter with linear rule naming and a time budget.

    Upstream `_add_rule` looks for a free name `NAME0`, `NAME1`, … from 0 each time, quadratic in the names
    that sanitize alike (20,000 non-ASCII property names: 43 s, issue 26 H5); here each sanitized name keeps
    its next free index, and a rule already added under a name is found by its text. `_resolve_ref` names a
    rule after the whole reference (`s1#/$defs/Node`), not its last part, so that two schemas' `$defs` of the
    same name stay two rules."""

    def __init__(self, deadline: float, build_s: float) -> None:
        super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        self._deadline, self._build_s = deadline, build_s
        self._next: dict[str, int] = {}
        self._named: dict[tuple[str, str], str] = {}

    def _tick(self) -> None:
        if time.perf_counter() > self._deadline:
            raise InvalidRequest(f"turning the schema into a grammar took more than {self._build_s:g} s "
                                 f"(--grammar-budget): simplify the schema")

    def _add_rule(self, name, rule):
        self._tick()
        esc = INVALID_RULE_CHARS_RE.sub("-", name)
        if esc not in self._rules or self._rules[esc] == rule:
            key = esc
        elif (key := self._named.get((esc, rule))) is None or self._rules.get(key) != rule:
            i = self._next.get(esc, 0)
            while f"{esc}{i}" in self._rules:
                i += 1
            self._next[esc] = i + 1
            key = f"{esc}{i}"
        self._rules[key] = rule
        self._named[(esc, rule)] = key
        return key

    def visit(self, schema, name):
        self._tick()
        return super().visit(schema, name)

    def _resolve_ref(self, ref):
        ref_name = INVALID_RULE_CHARS_RE.sub("-", ref)
        if ref_name not in self._rules and ref not in self._refs_being_resolved:
            self._refs_being_resolved.add(ref)
            ref_name = self.visit(self._refs[ref], ref_name)
            self._refs_being_resolved.remove(ref)
        return ref_name


@dataclass(frozen=True)
class Structure:
    """A chat request's structured-output settings, validated (server/schemas.py).

    response: None (free text) or the JSON schema the reply must be valid against (`json_object`:
    {"type": "object"}; `json_schema`: its schema).
    tool_choice: "auto" or "required" ("none" drops the tools before this). tool_name: the function a named
    tool_choice forces, else None. parallel_tool_calls: False allows at most one call.
    response_field, schema_path, tool_choice_field: the request's own names for these (chat's by default;
    /v1/responses says `text.format`, /v1/messages `output_config.format`), which errors name.
    """

    response: dict | None = None
    tool_choice: str = "auto"
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    response_field: str = "response_format"
    schema_path: str = "response_format.json_schema.schema"
    tool_choice_field: str = "tool_choice"

    @property
    def param(self) -> str:
        """The field a grammar built from this structure is named by in errors."""
        return self.response_field if self.response is not None else self.tool_choice_field


@dataclass(frozen=True)
class Constraint:
    """A grammar for the sampler: GBNF text with root rule `root`; `triggers`: texts that start it (lazy), or
    empty (it constrains the first token on)."""

    gbnf: str
    triggers: tuple[str, ...] = ()


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a GBNF string literal: JSON's escapes are GBNF's


class _Rules:
    """One converter for a whole grammar (its rule names are unique across the schemas it visits) plus this
    module's rules, within one `Budget`."""

    def __init__(self, budget: Budget = Budget()) -> None:
        self.budget = budget
        self.conv = _Converter(time.perf_counter() + budget.build_s, budget.build_s)
        self._count = [0]  # schema values seen so far, all schemas of the request together
        self._urls = 0

    def check(self, schema: Any, param: str) -> None:
        """`_check_schema` against this grammar's budget (InvalidRequest naming `param`)."""
        _check_schema(schema, param, self._count, self.budget)

    def json(self, schema: dict, name: str, param: str) -> str:
        """The rule name for JSON values valid against `schema`. Raises InvalidRequest (naming `param`) for a
        schema the converter cannot handle or one over the budget.

        A `$ref` at the root (pydantic's recursive models: `{"$ref": "#/$defs/Node", "$defs": {...}}`) is
        resolved here: upstream `resolve_refs` does not look into a node's other keys once it met its `$ref`,
        so the `$defs` would stay unresolved."""
        self.check(schema, param)
        schema = copy.deepcopy(schema)  # resolve_refs rewrites $ref in place
        self._urls += 1
        url = f"s{self._urls}"  # one per schema: two schemas' "#/$defs/X" are two rules
        try:
            root_ref = schema.pop("$ref", None) if isinstance(schema, dict) else None
            self.conv.resolve_refs(schema, url)
            if root_ref is not None:
                if not isinstance(root_ref, str) or not root_ref.startswith("#/"):
                    raise ValueError(f"Unsupported ref {root_ref!r}")
                target = schema
                for sel in root_ref[2:].split("/"):
                    target = target[sel]
                self.conv._refs[url + root_ref] = target
                schema = {"$ref": url + root_ref}
            return self.conv.visit(schema, name)
        except (AssertionError, ValueError, KeyError, TypeError, AttributeError, RecursionError, IndexError) as e:
            raise InvalidRequest(f"'{param}' is not a JSON schema this server can turn into a grammar "
                                 f"({type(e).__name__}: {str(e)[:200]}); supported: llama.cpp's JSON-schema subset "
                                 f"(types, properties, required, items, enum, const, anyOf/oneOf, allOf, $ref to "
                                 f"#/..., string pattern, minLength/maxLength, minItems/maxItems)", param=param) from e
        except InvalidRequest as e:
            e.param = e.param or param
            if "turning the schema" in e.message:
                e.message = f"'{param}': {e.message}"
            raise

    def add(self, name: str, rule: str) -> str:
        return self.conv._add_rule(name, rule)

    def text(self, root: str, param: str) -> str:
        """The grammar with root rule `root`. Raises InvalidRequest (naming `param`) above MAX_GRAMMAR_CHARS, or
        for what `_check_gbnf` refuses."""
        rules = self.conv._rules
        if "char" in rules:
            rules["char"] = _JSON_CHAR
        rules["root"] = root
        text = self.conv.format_grammar()
        if len(text) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(f"the grammar for '{param}' would be {len(text)} characters; this server takes at "
                                 f"most {MAX_GRAMMAR_CHARS}: simplify the schema", param=param)
        _check_gbnf(text, param)
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
        if plain_string(schema):
            rules.check(schema, where)  # its bounds go straight into the grammar (_raw_string)
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


def build(structure: Structure, tools: list[dict] | None, fmt: OutputFormat, opens_reasoning: bool,
          budget: Budget = Budget()) -> Constraint | None:
    """The grammar that enforces `structure` on a reply in format `fmt` (None when nothing is constrained).

    tools: the request's tools (after tool_choice "none" dropped them). opens_reasoning: the prompt ends inside
    an open reasoning block. budget: what building it may cost (all schemas together). Raises InvalidRequest naming the field for a schema the converter cannot handle, a
    format without a tool-call grammar, or a constraint this format cannot express (harmony)."""
    forced = bool(tools) and structure.tool_choice == "required"
    one_call = bool(tools) and not structure.parallel_tool_calls
    if structure.response is None and not forced and not one_call:
        return None
    if fmt.name == "harmony":
        param = structure.response_field if structure.response is not None else \
            structure.tool_choice_field if forced else "parallel_tool_calls"
        raise InvalidRequest(f"'{param}' cannot be enforced for this model: its harmony output (channels) has no "
                             f"grammar here", param=param)
    rules = _Rules(budget)
    many = structure.parallel_tool_calls
    if forced:
        body = _calls(rules, fmt, tools, structure.tool_name, many, structure.tool_choice_field)
    elif structure.response is not None:
        response = rules.json(structure.response, "response", structure.schema_path)
        body = response
        if tools:  # the model may still call a tool instead of answering
            body = f"{response} | {_calls(rules, fmt, tools, None, many, structure.response_field)}"
    else:  # tool_choice auto, at most one call: free text until a call starts, then exactly one call
        return Constraint(rules.text(_calls(rules, fmt, tools, None, False, "parallel_tool_calls"), "tools"),
                          triggers=fmt.call_starts)
    param = structure.tool_choice_field if forced else structure.response_field
    if opens_reasoning and fmt.think is not None:
        close = fmt.think[1]
        return Constraint(rules.text(f'{_literal(close)} "\\n"? "\\n"? ({body})', param), triggers=(close,))
    return Constraint(rules.text(body, param))
