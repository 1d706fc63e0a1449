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

from llama_cpp.llama_grammar import INVALID_RULE_CHARS_RE, SchemaConverter, _build_repetition

from ..errors import InvalidRequest
from .formats import OutputFormat, plain_string

# JSON strings may not hold raw control characters (RFC 8259); llama-cpp-python 0.3.36's converter allows them,
# its JSON grammar (JSON_GBNF) does not: the converter's `char` rule is replaced by JSON_GBNF's characters (less
# the surrogate code points, which no valid UTF-8 encodes). In a grammar with tool calls, `<` is written \u003c
# (`_JSON_CHAR_LT`, see `_json_char`).
_JSON_CHAR = (r'[^"\\\x7F\x00-\x1F\uD800-\uDFFF] | '
              r'"\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])')
_JSON_CHAR_LT = _JSON_CHAR.replace('[^"', '[^<"', 1)
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


# ------------------------------------------------------------------ JSON text, valid by construction
# Every literal a schema gives is written in the grammar as the JSON text that encodes it (RFC 8259), so that the
# reply, read as JSON, decodes to the schema's own value: enum and const values, property names, and each
# character a pattern's literals, classes and `.` admit. `_json_char` is that rule, for one character: `"` is
# written \", `\` as \\, a control character as \b \f \n \r \t or \u00XX; DEL (left out of JSON_GBNF's raw
# characters) and lone surrogates (no UTF-8 holds them) are \u-escaped too; and in a grammar with tool calls
# (`lt`) so is `<` (\u003c), so that no JSON string in it can close a call's markup (`</parameter>`,
# `</tool_call>`) nor open one (`<tool_call>`) for the reply parser. A class or `.` admits a special character in
# its escaped form only. Formats (date, time, uuid) write digits, hex, `-`, `:`, `.`, `T`, `Z` and `+`: nothing to
# escape.
_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_MAX_CODE = 0x10FFFF
_SURROGATES = ((0xD800, 0xDFFF),)


def _json_char(c: str, lt: bool = False) -> str:
    """The JSON text of the character `c` inside a JSON string (see above)."""
    if (short := _SHORT_ESCAPES.get(c)) is not None:
        return short
    o = ord(c)
    if o < 0x20 or o == 0x7F or 0xD800 <= o <= 0xDFFF or (lt and c == "<"):
        return f"\\u{o:04x}"
    return c


def _specials(lt: bool) -> list[tuple[int, int]]:
    """The code points `_json_char` escapes, lone surrogates aside (as ranges)."""
    return _union([(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F)] + ([(0x3C, 0x3C)] if lt else []))


def _json_text(value: Any, lt: bool = False) -> str:
    """The JSON text of `value` as the grammar writes it (json.dumps' layout, strings by `_json_char`). Raises
    ValueError for a number JSON cannot hold (NaN, Infinity), TypeError for what is not JSON."""
    if isinstance(value, str):
        return '"' + "".join(_json_char(c, lt) for c in value) + '"'
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("an object key that is not a string")
        return "{" + ", ".join(f"{_json_text(k, lt)}: {_json_text(v, lt)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_json_text(v, lt) for v in value) + "]"
    return json.dumps(value, allow_nan=False)


def _gbnf_literal(text: str) -> str:
    """A GBNF string literal that matches exactly `text` (llama.cpp's parse_char escapes; ASCII only)."""
    out = []
    for c in text:
        o = ord(c)
        if c in '"\\':
            out.append("\\" + c)
        elif c in "\n\r\t":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[c])
        elif o < 0x20 or o == 0x7F:
            out.append(f"\\x{o:02x}")
        elif o < 0x80:
            out.append(c)
        else:
            out.append(f"\\u{o:04x}" if o <= 0xFFFF else f"\\U{o:08x}")
    return '"' + "".join(out) + '"'


def _union(ranges) -> list[tuple[int, int]]:
    """Sorted, disjoint, non-adjacent inclusive code point ranges covering `ranges`."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges, within=((0, _MAX_CODE),)) -> list[tuple[int, int]]:
    """The code points of `within` outside `ranges`."""
    out, ranges = [], _union(ranges)
    for lo, hi in _union(within):
        for a, b in ranges:
            if b < lo or a > hi:
                continue
            if a > lo:
                out.append((lo, a - 1))
            lo = b + 1
            if lo > hi:
                break
        if lo <= hi:
            out.append((lo, hi))
    return out


def _class_char(o: int) -> str:
    """One code point inside a GBNF character class."""
    c = chr(o)
    if c.isascii() and c.isalnum():
        return c
    return f"\\x{o:02x}" if o < 0x80 else f"\\u{o:04x}" if o <= 0xFFFF else f"\\U{o:08x}"


def _char_set(ranges, lt: bool) -> str:
    """A GBNF expression for the JSON text, inside a JSON string, of one character out of `ranges`: a class of
    the characters written as themselves, and JSON's escapes (`_json_char`) of those written escaped. Lone
    surrogates are left out. Raises ValueError when no character is left."""
    chars, specials = _complement(_SURROGATES, ranges), _specials(lt)
    plain = _complement(specials, chars)
    alts = []
    if plain:
        alts.append("[" + "".join(_class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}"
                                  for lo, hi in plain) + "]")
    escaped = [o for lo, hi in _complement(_complement(specials), chars) for o in range(lo, hi + 1)]
    if escaped:
        short = [_SHORT_ESCAPES[chr(o)][1] for o in escaped if chr(o) in _SHORT_ESCAPES]
        long = [o for o in escaped if chr(o) not in _SHORT_ESCAPES]
        parts = ["[" + "".join(_class_char(ord(c)) for c in short) + "]"] if short else []
        by_prefix: dict[str, list[str]] = {}  # \u00XX by its first three digits; the last one in either case
        for o in long:
            by_prefix.setdefault(f"u{o >> 4:03x}", []).extend(dict.fromkeys(f"{o & 15:x}{o & 15:X}"))
        parts += [f"{_gbnf_literal(prefix)} [{''.join(lows)}]" for prefix, lows in by_prefix.items()]
        alts.append('"\\\\" ' + (parts[0] if len(parts) == 1 else "(" + " | ".join(parts) + ")"))
    if not alts:
        raise ValueError("a pattern's character class holds no character a JSON string can hold")
    return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"


# Patterns: the regular expressions both ECMA-262 (JSON Schema's dialect) and Python's `re` (the `jsonschema`
# package's) read alike; a construct they read apart is refused, or (\D, \W, \S and classes negating \d, \w, \s)
# narrowed to ASCII, where they agree.
_ASCII = ((0, 0x7F),)
# \d, \w, \s and their negations, in ASCII: (what both engines put in it, what either does). Python's \s
# (str.isspace) also holds \x1C-\x1F, ECMA's does not; beyond ASCII they differ more (Python's \d holds every
# Unicode digit): a class escape stands for its ASCII part, and a negated class that holds one is read in ASCII.
_SPACE_BOTH, _SPACE_EITHER = [(0x09, 0x0D), (0x20, 0x20)], [(0x09, 0x0D), (0x1C, 0x20)]
_DIGIT, _WORD = [(0x30, 0x39)], [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SHORTHANDS = {"d": (_DIGIT, _DIGIT), "w": (_WORD, _WORD), "s": (_SPACE_BOTH, _SPACE_EITHER),
               "D": (_complement(_DIGIT, _ASCII),) * 2, "W": (_complement(_WORD, _ASCII),) * 2,
               "S": (_complement(_SPACE_EITHER, _ASCII), _complement(_SPACE_BOTH, _ASCII))}
_CHAR_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B}
_DOT = _complement([(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)])  # ECMA's `.` (Python's also takes \r, …)


class _Pattern:
    """A JSON schema `pattern` (anchored: ^…$) as the GBNF of a JSON string's content (`rule`): alternation,
    groups ((…), (?:…)), quantifiers (*, +, ?, {m}, {m,}, {m,n}, lazy or not), classes, `.`, \\d \\w \\s and
    their negations, \\n \\r \\t \\f \\v \\0 \\xHH \\uHHHH, escaped punctuation. Every character by `_char_set`
    (`_json_char`'s escapes). Raises ValueError for what it does not take (lookaround, backreferences, word
    boundaries, anchors inside, \\p, …)."""

    def __init__(self, conv: "_Converter", name: str, pattern: str) -> None:
        self.conv, self.name, self.lt = conv, name, conv._lt
        body = pattern[1:-1]
        if len(pattern) < 2 or pattern[0] != "^" or pattern[-1] != "$" or \
                (len(body) - len(body.rstrip("\\"))) % 2:  # an escaped \$ ends no pattern
            raise ValueError('Pattern must start with "^" and end with "$"')
        self.p, self.i = body, 0
        self.sub: dict[str, str] = {}  # repeated units made rules, by their text

    def rule(self) -> str:
        body = self.alternation()
        if self.i < len(self.p):
            raise ValueError(f"unbalanced ')' at index {self.i + 1} of the pattern")
        return body

    def fail(self, what: str) -> ValueError:
        return ValueError(f"the pattern's {what} at index {self.i + 1} is not supported")

    def alternation(self) -> str:
        seqs = [self.sequence()]
        while self.i < len(self.p) and self.p[self.i] == "|":
            self.i += 1
            seqs.append(self.sequence())
        return seqs[0] if len(seqs) == 1 else "(" + " | ".join(seqs) + ")"

    def sequence(self) -> str:
        items: list[str] = []
        text: list[str] = []  # a run of literal characters, as JSON text

        def flush() -> None:
            if text:
                items.append(_gbnf_literal("".join(text)))
                text.clear()

        while self.i < len(self.p) and self.p[self.i] not in "|)":
            atom, lit = self.atom()
            quantified = self.quantifier(atom)
            if quantified is None and lit is not None:
                text.append(lit)
                continue
            flush()
            if quantified is None:
                items.append(atom)
            elif quantified:
                items.append(quantified)
        flush()
        return " ".join(items) if items else '""'

    def quantifier(self, atom: str) -> str | None:
        """The repetition of `atom` the pattern asks for at i (None: none; "": zero times)."""
        p, i = self.p, self.i
        if i >= len(p) or p[i] not in "*+?{":
            return None
        if p[i] == "{":
            m = re.match(r"\{(\d+)(,(\d*))?\}", p[i:])
            if m is None:
                raise self.fail("'{' (not a quantifier {m}, {m,}, {m,n})")
            lo = int(m.group(1))
            hi = lo if m.group(2) is None else int(m.group(3)) if m.group(3) else None
            if hi is not None and lo > hi:
                raise ValueError(f"Invalid quantifier {m.group(0)} in the pattern")
            self.i += len(m.group(0))
            if not re.fullmatch(r"[\w-]+", atom):  # a rule of its own, repeated by name
                if atom not in self.sub:
                    self.sub[atom] = self.conv._add_rule(f"{self.name}-{len(self.sub) + 1}", atom)
                atom = self.sub[atom]
            rep = _build_repetition(atom, lo, hi)
            out = f"({rep})" if rep else ""
        else:
            out = f"{atom}{p[i]}"
            self.i += 1
        if self.i < len(p) and p[self.i] == "?":  # lazy: the same strings
            self.i += 1
        if self.i < len(p) and p[self.i] in "*+?{":
            raise self.fail("repeated quantifier")
        return out

    def atom(self) -> tuple[str, str | None]:
        """The GBNF of the unit at i, and its JSON text when it is one literal character."""
        p = self.p
        c = p[self.i]
        if c in "*+?{":
            raise self.fail(f"quantifier {c!r} with nothing to repeat")
        if c in "^$":
            raise self.fail(f"anchor {c!r} inside the pattern")
        if c == "(":
            self.i += 1
            if p.startswith("?:", self.i):
                self.i += 2
            elif p.startswith("?", self.i):
                raise self.fail("group syntax (?")
            inner = self.alternation()
            if self.i >= len(p) or p[self.i] != ")":
                raise ValueError("Unbalanced parentheses in the pattern")
            self.i += 1
            return f"({inner})", None
        if c == "[":
            return self.char_class(), None
        if c == ".":
            self.i += 1
            return self.conv._add_rule("dot", _char_set(_DOT, self.lt)), None
        if c == "\\":
            ranges, code = self.escape(in_class=False)
        else:
            self.i += 1
            ranges, code = None, ord(c)
        if code is None:
            return _char_set(ranges[0], self.lt), None
        if 0xD800 <= code <= 0xDFFF:
            raise self.fail("surrogate code point")
        return _gbnf_literal(_json_char(chr(code), self.lt)), _json_char(chr(code), self.lt)

    def escape(self, in_class: bool) -> tuple[tuple | None, int | None]:
        """The escape at i: ((ranges both engines read in it, ranges either does), None) for a class escape (\\d
        …), (None, code point) for a character."""
        p = self.p
        if self.i + 1 >= len(p):
            raise ValueError("the pattern ends in a lone '\\'")
        e = p[self.i + 1]
        self.i += 2
        if e in _SHORTHANDS:
            return _SHORTHANDS[e], None
        if e in _CHAR_ESCAPES:
            return None, _CHAR_ESCAPES[e]
        if e == "b" and in_class:
            return None, 0x08
        if e == "0" and not (self.i < len(p) and p[self.i].isdigit()):
            return None, 0
        if e in "xu":
            width = 2 if e == "x" else 4
            digits = p[self.i:self.i + width]
            if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                self.i -= 2
                raise self.fail(f"escape \\{e} (not \\{e}{'H' * width})")
            self.i += width
            return None, int(digits, 16)
        if e.isascii() and not e.isalnum():
            return None, ord(e)
        self.i -= 2
        raise self.fail(f"escape \\{e}")

    def char_class(self) -> str:
        p = self.p
        self.i += 1
        negated = self.i < len(p) and p[self.i] == "^"
        self.i += negated
        if self.i < len(p) and p[self.i] == "]":
            raise self.fail("class starting with ']' (read apart by ECMA-262 and Python; write \\])")
        sure: list[tuple[int, int]] = []  # in the class for both engines
        maybe: list[tuple[int, int]] = []  # in it for either
        shorthand = False
        while True:
            if self.i >= len(p):
                raise ValueError("Unbalanced square brackets in the pattern")
            if p[self.i] == "]":
                self.i += 1
                break
            lo_sets, lo = self.class_atom()
            if self.i + 1 < len(p) and p[self.i] == "-" and p[self.i + 1] != "]":
                self.i += 1
                _, hi = self.class_atom()
                if lo is None or hi is None:
                    raise self.fail("range with a class escape")
                if lo > hi:
                    raise ValueError(f"the pattern has an empty character range ({chr(lo)}-{chr(hi)})")
                sure.append((lo, hi))
                maybe.append((lo, hi))
            elif lo is None:
                shorthand = True
                sure.extend(lo_sets[0])
                maybe.extend(lo_sets[1])
            else:
                sure.append((lo, lo))
                maybe.append((lo, lo))
        if negated:
            return _char_set(_complement(maybe, _ASCII if shorthand else ((0, _MAX_CODE),)), self.lt)
        return _char_set(_union(sure), self.lt)

    def class_atom(self) -> tuple[tuple | None, int | None]:
        c = self.p[self.i]
        if c == "\\":
            return self.escape(in_class=True)
        self.i += 1
        return None, ord(c)


class _Converter(SchemaConverter):
    """llama-cpp-python's converter with linear rule naming, a time budget, and every literal of the schema
    written as JSON text (`_json_char`): patterns (`_Pattern`), const and enum values, property names.

    Upstream `_add_rule` looks for a free name `NAME0`, `NAME1`, … from 0 each time, quadratic in the names
    that sanitize alike (20,000 non-ASCII property names: 43 s, issue 26 H5); here each sanitized name keeps
    its next free index, and a rule already added under a name is found by its text. `_resolve_ref` names a
    rule after the whole reference (`s1#/$defs/Node`), not its last part, so that two schemas' `$defs` of the
    same name stay two rules."""

    def __init__(self, deadline: float, build_s: float, lt: bool = False) -> None:
        super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        self._deadline, self._build_s = deadline, build_s
        self._lt = lt  # a grammar with tool calls: JSON strings write `<` as \u003c
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

    def _visit_pattern(self, pattern, name):
        if not isinstance(pattern, str):
            raise TypeError("a pattern that is not a string")
        body = _Pattern(self, name, pattern).rule()
        return self._add_rule(name, f'"\\"" {body} "\\"" space')

    def _generate_constant_rule(self, value):
        return _gbnf_literal(_json_text(value, self._lt))

    def _format_literal(self, literal):
        # Upstream's visit passes this JSON text only: json.dumps of a property name (_build_object_rule).
        return _gbnf_literal(_json_text(json.loads(literal), self._lt))

    def _resolve_ref(self, ref):
        ref_name = INVALID_RULE_CHARS_RE.sub("-", ref)
        if ref_name not in self._rules and ref not in self._refs_being_resolved:
            self._refs_being_resolved.add(ref)
            ref_name = self.visit(self._refs[ref], ref_name)
            self._refs_being_resolved.remove(ref)
        return ref_name


@dataclass(frozen=True)
class Structure:
    """A chat request's structured-output settings, validated (server/protocols/).

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
    return _gbnf_literal(text)


class _Rules:
    """One converter for a whole grammar (its rule names are unique across the schemas it visits) plus this
    module's rules, within one `Budget`."""

    def __init__(self, budget: Budget = Budget(), lt: bool = False) -> None:
        self.budget = budget
        self.conv = _Converter(time.perf_counter() + budget.build_s, budget.build_s, lt)
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
            rules["char"] = _JSON_CHAR_LT if self.conv._lt else _JSON_CHAR
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
    rules = _Rules(budget, lt=bool(tools))  # the reply parser reads calls out of the whole reply
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
