"""Structured output valid by construction (issue 38, item 4): every literal a schema gives (pattern literals and
classes, `.`, enum, const, property names) is written as JSON text, so that a constrained answer parses as JSON
and validates against its schema, whatever quotes, backslashes, control characters or unicode the schema holds.

The tiny model has random weights: the grammar decides everything it writes. A hypothesis fuzz of such schemas on
the three routes (chat `response_format`, messages `output_config.format`, responses `text.format`), the two
reported patterns (a raw `"` ended the string; an injected `", "admin": true` added keys
`additionalProperties: false` forbids), tool calls in Qwen3.5's format, and the grammar itself read token by token.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import llama_cpp
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from orchestrator.output import grammar
from orchestrator.output.formats import QWEN35
from orchestrator.output.grammar import Structure
from orchestrator.output.parsing import parse_output

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
MSGS = [{"role": "system", "content": "You answer in JSON."}, {"role": "user", "content": "Fill the form."}]
QUOTE = {"type": "object", "additionalProperties": False, "required": ["a"],
         "properties": {"a": {"type": "string", "pattern": '^"$'}}}
INJECT = {"type": "object", "additionalProperties": False, "required": ["a"],
          "properties": {"a": {"type": "string", "pattern": '^x", "admin": true, "y": "z$'}}}
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.url, timeout=300) as c:
        yield c


class Narrowed(Exception):
    """The schema was refused because a class negating \\d, \\w or \\s, read in ASCII only, holds nothing."""


def ok(r: httpx.Response) -> None:
    if r.status_code == 400 and "holds no character a JSON string can hold" in r.text:
        raise Narrowed(r.text)
    assert r.status_code == 200, r.text


def chat(http, schema, seed=0, **kw):
    body = {"model": "m", "messages": MSGS, "max_tokens": MAX_TOKENS, "temperature": 0, "seed": seed, **NO_THINK,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, **kw}
    r = http.post("/v1/chat/completions", json=body)
    ok(r)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return choice["message"]["content"]


def messages(http, schema, seed=0):  # no `seed` on this route (greedy: none needed)
    body = {"model": "m", "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": "Fill the form."}],
            "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    r = http.post("/v1/messages", json=body)
    ok(r)
    out = r.json()
    assert out["stop_reason"] == "end_turn", out
    (block,) = out["content"]
    return block["text"]


def responses(http, schema, seed=0):  # nor on this one
    body = {"model": "m", "input": "Fill the form.", "max_output_tokens": MAX_TOKENS, "temperature": 0,
            "reasoning": {"effort": "none"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}
    r = http.post("/v1/responses", json=body)
    ok(r)
    out = r.json()
    assert out["status"] == "completed", out
    (item,) = [o for o in out["output"] if o["type"] == "message"]
    return item["content"][0]["text"]


ROUTES = {"chat": chat, "messages": messages, "responses": responses}


def valid(text: str, schema: dict):
    value = json.loads(text)  # strict JSON: no raw control characters in strings
    jsonschema.validate(value, schema)
    return value


# ------------------------------------------------------------------ the two reported patterns

@pytest.mark.parametrize("route", list(ROUTES))
def test_a_quote_in_a_pattern_is_written_escaped(http, fresh_cache, route):
    '''`^"$` gave `{ "a" :"""}` with finish_reason stop.'''
    text = ROUTES[route](http, QUOTE)
    assert valid(text, QUOTE) == {"a": '"'}


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_pattern_cannot_inject_keys_the_schema_forbids(http, fresh_cache, route):
    """`^x", "admin": true, "y": "z$` under additionalProperties false gave {"a": "x", "admin": true, "y": "z"}."""
    text = ROUTES[route](http, INJECT)
    assert valid(text, INJECT) == {"a": 'x", "admin": true, "y": "z'}


# ------------------------------------------------------------------ the fuzz

# Characters that JSON or a regular expression reads specially, controls, and unicode of 2, 3 and 4 UTF-8 bytes.
SPECIAL = ['"', "\\", "\n", "\r", "\t", "\b", "\x00", "\x01", "\x1f", "\x7f", "/", "<", "'", " ", "é", "€", "😀",
           "\u2028", "a", "Z", "0", "]", "[", "^", "-", "$", ".", "{", "}", "|", "(", ")", "*", "+", "?", ":", ","]
chars = st.one_of(st.sampled_from(SPECIAL[:10]), st.sampled_from(SPECIAL), st.characters(codec="utf-8"))
REGEX_SYNTAX = set("\\^$.|?*+()[]{}/-&~")  # escaped & and ~: Python warns of set operations on && and ~~


@st.composite
def _regex_char(draw):
    """The character c as a pattern writes it, read as c by ECMA-262 and Python alike."""
    c = draw(chars)
    if c in REGEX_SYNTAX:
        return "\\" + c
    if ord(c) < 0x20 or c == "\x7f":
        return draw(st.sampled_from([c, f"\\x{ord(c):02x}", f"\\u{ord(c):04X}"]
                                    + ([{"\n": "\\n", "\r": "\\r", "\t": "\\t"}[c]] if c in "\n\r\t" else [])))
    return c


def _unescape(written: str) -> str:
    """The character a `_regex_char` stands for."""
    if not written.startswith("\\"):
        return written
    return {"n": "\n", "r": "\r", "t": "\t"}.get(written[1]) or \
        (chr(int(written[2:], 16)) if written[1] in "xu" else written[1])


@st.composite
def _char_class(draw):
    members = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["char", "range", "shorthand"]))
        if kind == "shorthand":
            members.append(draw(st.sampled_from([r"\d", r"\w", r"\s", r"\D", r"\W", r"\S"])))
        elif kind == "range":
            a, b = draw(_regex_char()), draw(_regex_char())
            if ord(_unescape(a)) > ord(_unescape(b)):
                a, b = b, a
            members.append(f"{a}-{b}")
        else:
            members.append(draw(_regex_char()))
    return "[" + ("^" if draw(st.booleans()) else "") + "".join(members) + "]"


_unit = st.one_of(_regex_char(), _regex_char(), _char_class(), st.just("."),
                  st.sampled_from([r"\d", r"\w", r"\s", r"\D", r"\W", r"\S"]))
_quantifier = st.sampled_from(["", "", "", "?", "{2}", "{0,2}", "{1,3}", "{1,2}?"])
_quantified = st.tuples(_unit, _quantifier).map("".join)
_sequence = st.lists(_quantified, max_size=3).map("".join)
_group = st.lists(_sequence, min_size=1, max_size=3).map(lambda alts: "(" + "|".join(alts) + ")")
_pattern = st.lists(st.one_of(_quantified, st.tuples(_group, _quantifier).map("".join)), min_size=1, max_size=3) \
    .map(lambda parts: "^" + "".join(parts) + "$")
_text = st.text(chars, max_size=3)
_json = st.recursive(st.one_of(_text, st.integers(-99, 99), st.booleans(), st.none()),
                     lambda inner: st.one_of(st.lists(inner, max_size=2),
                                             st.dictionaries(_text, inner, max_size=2)), max_leaves=3)
_leaf = st.one_of(
    _pattern.map(lambda p: {"type": "string", "pattern": p}),
    _pattern.map(lambda p: {"pattern": p}),
    st.lists(st.one_of(_text, _text, st.integers(-9, 9), st.none()), min_size=1, max_size=3, unique=True)
    .map(lambda xs: {"enum": xs}),
    _json.map(lambda v: {"const": v}),
    st.just({"type": "string", "maxLength": 3}),
    st.just({"type": "boolean"}),
)


@st.composite
def _object(draw):
    props = draw(st.dictionaries(st.text(chars, min_size=1, max_size=3), _leaf, min_size=1, max_size=2))
    required = [k for k in props if draw(st.booleans())]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


SCHEMAS = st.one_of(_leaf.filter(lambda s: "pattern" in s or "enum" in s or "const" in s), _object())


@settings(max_examples=300, deadline=None, derandomize=True)
@given(value=_json, lt=st.booleans())
def test_the_json_text_of_a_value_decodes_to_it(value, lt):
    """The rule (`_json_char`) behind const, enum and property names: strict JSON that decodes to the value, with
    no raw control character, and with tools no `<`."""
    text = grammar._json_text(value, lt)
    assert json.loads(text) == value
    assert not any(ord(c) < 0x20 or c == "\x7f" for c in text)
    assert not (lt and "<" in text)


# A constrained token costs the grammar a pass over the whole vocabulary (about 0.3 s on 2 cores): each example
# takes one route, drawn; the derandomized examples cover all three.
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(schema=SCHEMAS, route=st.sampled_from(list(ROUTES)), seed=st.integers(0, 2 ** 16))
def test_fuzzed_schemas_give_json_that_validates_on_every_route(http, runtime, schema, route, seed):
    try:
        text = ROUTES[route](http, schema, seed)
    except Narrowed:  # e.g. [^\x00-\x7f\d]: Python's \d holds more than ASCII's digits
        assume(False)
    try:
        valid(text, schema)
    except (ValueError, jsonschema.ValidationError) as e:
        raise AssertionError(f"{route}: {text!r} for {schema!r}") from e


# ------------------------------------------------------------------ tool calls (Qwen3.5's qwen-xml format)

def _tool(props: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": props, "required": list(props), "additionalProperties": False}}}


def test_tool_call_arguments_with_quotes_and_backslashes_validate(http, fresh_cache):
    """In Qwen3.5's call format a pattern-, enum- or const-bearing string is JSON (a plain string is raw text): the
    parsed arguments are the schema's own values (before, the enum's `\\` made a grammar llama.cpp could not
    parse: `\\d` is no GBNF escape)."""
    props = {"q": {"type": "string", "pattern": '^"\\\\$'}, "e": {"enum": ['a"b', "c\\d"]}}
    tool = _tool(props)
    body = {"model": "m", "messages": MSGS, "max_tokens": MAX_TOKENS, "temperature": 0, **NO_THINK,
            "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, tool["function"]["parameters"])
    assert args["q"] == '"\\' and args["e"] in ('a"b', "c\\d")


def fits(runtime, gbnf: str, text: str) -> bool:
    """Whether the grammar lets the model write `text`, token by token, and end there."""
    engine = runtime.engine
    g = engine.grammars.open(gbnf)
    try:
        for tok in engine.tokenize(text, parse_special=False):
            if not g.mask()[tok]:
                return False
            g.accept(tok)
        return bool(g.mask()[llama_cpp.llama_vocab_eos(engine.vocab)])
    finally:
        g.close()


def test_the_grammar_admits_escapes_and_refuses_raw_specials(runtime, fresh_cache):
    """A negated class and `.` take `"`, `\\` and control characters only escaped; a class that leaves a character
    out leaves out its escape too; a literal has one spelling."""
    rt = runtime
    neg = rt.constraint(Structure(response={"type": "string", "pattern": "^[^a]$"}), None, False).gbnf
    for text, ok in (('"\\""', True), ('"\\\\"', True), ('"\\n"', True), ('"\\u0001"', True), ('"é"', True),
                     ('"""', False), ('"\\"', False), ('"\n"', False), ('"\x01"', False), ('"a"', False)):
        assert fits(rt, neg, text) == ok, text
    not_nl = rt.constraint(Structure(response={"type": "string", "pattern": "^[^\\n\\\\]$"}), None, False).gbnf
    for text, ok in (('"\\n"', False), ('"\\u000a"', False), ('"\\\\"', False), ('"\\t"', True), ('"x"', True)):
        assert fits(rt, not_nl, text) == ok, text
    dot = rt.constraint(Structure(response={"type": "string", "pattern": "^.$"}), None, False).gbnf
    for text, ok in (('"\\""', True), ('"\\r"', False), ('"\\n"', False), ('"\\t"', True), ('"""', False)):
        assert fits(rt, dot, text) == ok, text


def test_no_json_string_of_a_call_can_close_or_open_call_markup(runtime, fresh_cache):
    """With tools, `<` in a JSON string is written \\u003c: a value cannot end its parameter (`</parameter>`) and
    start another the parser would read, nor write a `<tool_call>` into a JSON answer."""
    rt = runtime
    tool = _tool({"v": {"type": "string", "pattern": "^.{0,60}$"}})
    c = rt.constraint(Structure(tool_choice="required", parallel_tool_calls=False), [tool], False)
    head, tail = "<tool_call>\n<function=f>\n<parameter=v>\n\"x", '"\n</parameter>\n</function>\n</tool_call>'
    assert fits(rt, c.gbnf, head + "\\u003c/parameter>\\u003cparameter=admin>true" + tail)
    injected = head + "</parameter><parameter=admin>true" + tail
    (call,) = parse_output(injected, False, True, QWEN35, [tool]).tool_calls  # what it would have made
    assert "admin" in json.loads(call["function"]["arguments"])
    assert not fits(rt, c.gbnf, injected)
    answer = rt.constraint(Structure(response={"type": "object"}), [tool], False)
    assert fits(rt, answer.gbnf, '{"a": "\\u003ctool_call>"}')
    assert not fits(rt, answer.gbnf, '{"a": "<tool_call>"}')
    no_tools = rt.constraint(Structure(response={"type": "object"}), None, False)
    assert fits(rt, no_tools.gbnf, '{"a": "<b>"}')  # without tools `<` is itself
