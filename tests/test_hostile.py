"""Hostile input (issue 26): requests built to crash, wedge or exhaust the server, each answered with a 400 or a
bounded answer, against `python -m orchestrator serve` in a subprocess (an abort in llama.cpp would end it:
`alive` checks), followed by a normal request that must be served as before (same text, same cached_tokens).
Then a hypothesis fuzz over JSON schemas: every request gets a 200 whose content validates, or a 400.

Bounded time: every client call has a timeout (a wedged server fails the test), none is asserted as speed.
"""

from __future__ import annotations

import json
import re
import threading

import httpx
import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.errors import InvalidRequest
from orchestrator.grammar_guard import GrammarFailed, GrammarLimits, GrammarPool
from orchestrator.output import grammar
from orchestrator.output.formats import QWEN35
from orchestrator.output.grammar import Structure

from .conftest import serve_process

KEY = "sk-hostile-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
NORMAL = {"model": "m", "max_tokens": 4, "temperature": 0, **NO_THINK,
          "messages": [{"role": "system", "content": "You are a careful assistant. " * 12},
                       {"role": "user", "content": "Name a colour."}]}
CLIENT_S = 600  # the most any one call may take before the test counts the server as wedged


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """(url, process): 2 slots, an API key, a disk tier, small prompt limits and a 1 s grammar budget."""
    tmp = tmp_path_factory.mktemp("hostile")
    proc, url = serve_process(tiny_model, tmp / "serve.log", "--ctx-size", "4096", "--threads", "2", "--parallel",
                              "2", "--cache-ram", "256", "--cache-disk-dir", str(tmp / "snapshots"), "--timeout",
                              "300", "--grammar-budget", "1", "--max-prompt-size", "1024",
                              env={"ORCHESTRATOR_API_KEY": KEY})
    yield url, proc
    proc.terminate()
    proc.wait(timeout=60)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=AUTH, timeout=CLIENT_S)


def chat(url: str, **kw) -> httpx.Response:
    return post(url, "/v1/chat/completions", {**NORMAL, **kw})


@pytest.fixture(scope="module")
def baseline(server):
    """The normal request's answer once its prefix is cached: (content, cached_tokens)."""
    url, _ = server
    chat(url).raise_for_status()
    r = chat(url).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    return r["choices"][0]["message"]["content"], r["usage"]["prompt_tokens_details"]["cached_tokens"]


def assert_still_serving(server, baseline) -> None:
    url, proc = server
    assert proc.poll() is None, "the server process died"
    r = chat(url)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["choices"][0]["message"]["content"],
            body["usage"]["prompt_tokens_details"]["cached_tokens"]) == baseline


def assert_400(r: httpx.Response, param: str | None = None) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param, err
    return err


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def tool(props: dict, required=()) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": props, "required": list(required)}}}


# ------------------------------------------------------------------ H1-H7


def test_h1_an_empty_character_range_is_refused_by_name(server, baseline):
    url, _ = server
    r = chat(url, response_format=schema_format({"type": "string", "pattern": "^[b-a]$"}))
    assert "empty character range" in assert_400(r, "response_format.json_schema.schema")["message"]
    assert_still_serving(server, baseline)


@pytest.mark.parametrize("extra", [{"tool_choice": "required"}, {"parallel_tool_calls": False}])
def test_h2_contradictory_bounds_are_refused_by_name(server, baseline, extra):
    url, _ = server
    r = chat(url, tools=[tool({"x": {"type": "string", "minLength": 10, "maxLength": 5}}, ["x"])], **extra)
    err = assert_400(r, "tools[0].function.parameters.properties.x")
    assert "minLength 10 above maxLength 5" in err["message"]
    assert_still_serving(server, baseline)


def test_h3_an_ambiguous_pattern_stops_at_the_budget_and_others_are_served_meanwhile(server, baseline):
    """`(a?){1000}`: llama.cpp's filtering of one token outgrows any budget; the request fails with a 400 that
    names the budget (or, should the filtering stay within it, gets a valid 200), while a normal request sent
    during it is answered."""
    url, _ = server
    out = {}
    hostile = threading.Thread(target=lambda: out.setdefault("r", chat(
        url, max_tokens=16, response_format=schema_format({"type": "string", "pattern": "^(a?){1000}$"}))))
    hostile.start()
    other = chat(url)
    hostile.join(CLIENT_S)
    assert other.status_code == 200, other.text
    r = out["r"]
    if r.status_code == 200:
        assert r.json()["choices"][0]["finish_reason"] == "length" or \
            jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]),
                                {"type": "string", "pattern": "^(a?){1000}$"}) is None
    else:
        assert assert_400(r)["code"] == "grammar_failed"
    assert_still_serving(server, baseline)


def test_h4_a_large_enum_gets_a_valid_answer_or_a_400(server, baseline):
    url, _ = server
    schema = {"enum": [f"v{i:04d}" for i in range(5000)]}
    r = chat(url, max_tokens=12, response_format=schema_format(schema))
    if r.status_code == 200:
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), _enforced(schema))
    else:
        assert_400(r)
    assert_still_serving(server, baseline)


def test_h5_a_schema_over_the_size_limit_is_refused_before_conversion(server, baseline):
    url, _ = server
    names = [f"ключ{i}" for i in range(20000)]
    schema = {"type": "object", "properties": {k: {"type": "integer"} for k in names}, "required": names}
    r = chat(url, response_format=schema_format(schema))
    assert "--grammar-max-schema" in assert_400(r, "response_format.json_schema.schema")["message"]
    assert_still_serving(server, baseline)


def test_h6_ten_thousand_breakpoints_are_counted_and_served(server, baseline):
    url, _ = server
    blocks = [{"type": "text", "text": f"<|im_end|>{i} ", "cache_control": {"type": "ephemeral"}}
              for i in range(10000)]
    r = post(url, "/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": blocks}]})
    assert r.status_code == 200, r.text
    assert r.json()["input_tokens"] > 10000
    parts = [{"type": "text", "text": f"a<|im_start|>{i} ", "prompt_cache_breakpoint": {"mode": "explicit"}}
             for i in range(10000)]
    r = chat(url, max_tokens=1, messages=[{"role": "user", "content": parts}])
    assert r.status_code in (200, 400), r.text  # 400: the prompt is longer than the 4,096-token context
    if r.status_code == 400:
        assert r.json()["error"]["code"] == "context_length_exceeded"
    assert_still_serving(server, baseline)


@pytest.mark.parametrize("text", ["lorem ipsum " * 1_250_000, "<|im_end|>" * 1_500_000])
def test_h7_fifteen_megabytes_of_text_are_refused_before_rendering(server, baseline, text):
    url, _ = server
    r = post(url, "/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 400, r.text  # Anthropic's shape: the message names the field
    assert "'messages'" in r.json()["error"]["message"] and "--max-prompt-size" in r.json()["error"]["message"]
    r = chat(url, messages=[{"role": "user", "content": text}])
    assert "--max-prompt-size" in assert_400(r, "messages")["message"]
    assert_still_serving(server, baseline)


def test_health_without_the_key_says_only_status_and_slots(server, baseline):
    url, _ = server
    public = httpx.get(url + "/health", timeout=CLIENT_S).json()
    # status, slots, and what computes the model (no tenant's activity: that is behind the key)
    assert public == {"status": "ok", "slots": 2, "slots_busy": 0, "slots_free": 2, "backend": "CPU",
                      "devices": ["CPU"]}
    keyed = httpx.get(url + "/health", headers=AUTH, timeout=CLIENT_S).json()
    assert keyed["cache"]["ram_entries"] > 0 and "queue_length" in keyed


# ------------------------------------------------------------------ static checks and the converter


@pytest.mark.parametrize("schema,words", [
    ({"type": "string", "pattern": "^x[\\w\\d]+[z-a]$"}, "empty character range (z-a)"),
    ({"type": "string", "pattern": "^a{5,2}$"}, "quantifier"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems 3 above maxItems 1"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "minimum 5 above maximum 4"),
    ({"type": "integer", "exclusiveMinimum": 4, "exclusiveMaximum": 4}, "exclusiveMinimum 4"),
    ({"enum": []}, "enum"),
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(101)}}, "101 optional"),
])
def test_schemas_no_value_meets_are_refused_by_name(schema, words):
    with pytest.raises(InvalidRequest, match=re.escape(words)) as e:
        grammar.build(Structure(response=schema), None, QWEN35, False)
    assert e.value.param == "response_format.json_schema.schema"


def test_the_last_check_before_llama_cpp_reads_the_grammar_text():
    """Whatever wrote the grammar: a repetition {m,n} with m > n or an empty class is refused; the same text
    inside a string literal, and JSON's own character classes, are not."""
    for bad in ('root ::= [^<]{10,5}', 'root ::= "a" [b-a]', 'root ::= [\\x20-\\x10]'):
        with pytest.raises(InvalidRequest):
            grammar._check_gbnf(bad, "p")
    grammar._check_gbnf('root ::= "[b-a]{5,1}" ' + grammar._JSON_CHAR + ' [a-z]{1,3}', "p")


def test_names_that_sanitize_alike_and_defs_of_two_schemas_get_rules_of_their_own():
    """The linear naming (issue 26 H5) keeps every rule: non-ASCII property names that all sanitize to "-", and
    two tools' `$defs` of the same name, each get their own rule."""
    rules = grammar._Rules()
    names = ["ä", "ö", "ü"]
    root = rules.json({"type": "object", "properties": {k: {"const": k} for k in names}, "required": names},
                      "r", "p")
    a = rules.json({"$ref": "#/$defs/X", "$defs": {"X": {"const": 1}}}, "a", "p")
    b = rules.json({"$ref": "#/$defs/X", "$defs": {"X": {"const": 2}}}, "b", "p")
    text = rules.text(f"{root} | {a} | {b}", "p")
    for k in names:  # the converter writes each const with JSON's \\u escapes
        assert json.dumps(k)[1:-1] in text
    assert "s2-defs-X ::= \"1\"" in text and "s3-defs-X ::= \"2\"" in text


# ------------------------------------------------------------------ the grammar process itself


@pytest.fixture(scope="module")
def pool(tiny_model):
    p = GrammarPool(tiny_model, GrammarLimits(token_s=1.0, memory_mib=256), keep=1)
    yield p
    p.close()


def test_what_would_abort_the_server_ends_only_the_grammar_process(pool, tiny_model):
    """Grammars the static checks would refuse, given to llama.cpp directly: an abort (a token the grammar does
    not allow, accepted: llama_grammar_accept_impl throws through ctypes), a runaway allocation (x{10,5}) and an
    exponential filtering (an ambiguous repetition) each end the child with GrammarFailed; the pool serves on."""
    g = pool.open('root ::= "a" [b-a]')
    a = int(np.flatnonzero(g.mask())[0])
    g.accept(a)
    assert not g.mask().any()  # a dead end: the sampler refuses it (GrammarFailed) before any accept
    g.accept(a)  # what llama.cpp's own chain would do next: it throws, the child aborts
    with pytest.raises(GrammarFailed, match="aborted"):
        g.mask()
    g.close()
    with pytest.raises(GrammarFailed, match="aborted|parse|budget"):
        pool.open('root ::= [^<]{10,5}')  # unsigned max - min: allocates until --grammar-memory (or the budget)
    rules = " ".join(f"o{i}" for i in range(300))
    opts = "\n".join(f"o{i} ::= x?" for i in range(300))
    with pytest.raises(GrammarFailed, match="budget"):
        g = pool.open(f'root ::= "q" {rules}\nx ::= "a" | "a" "a"\n{opts}')
        for _ in range(4):
            g.accept(int(np.flatnonzero(g.mask())[0]))
    g = pool.open('root ::= "ok"')
    assert g.mask().any()
    g.close()


# ------------------------------------------------------------------ schema fuzz

_PATTERNS = ["^[a-c]+$", "^[b-a]$", "^(ab|cd)?x$", "^[0-9]{2,4}$", "^[0-9]{4,2}$", "^(a?){30}$", "^\\w{1,3}$",
             "^[^\"]*$", "^.{0,5}$"]
_bounds = st.one_of(st.none(), st.integers(0, 12))


@st.composite
def _string(draw):
    s = {"type": "string"}
    for key in ("minLength", "maxLength"):
        if (v := draw(_bounds)) is not None:
            s[key] = v
    if draw(st.booleans()):
        s["pattern"] = draw(st.sampled_from(_PATTERNS))
    return s


@st.composite
def _integer(draw):
    s = {"type": "integer"}
    for key in ("minimum", "maximum"):
        if (v := draw(st.one_of(st.none(), st.integers(-50, 50)))) is not None:
            s[key] = v
    return s


_leaf = st.one_of(_string(), _integer(), st.just({"type": "boolean"}),
                  st.builds(lambda xs: {"enum": xs}, st.lists(st.text("abcxyz", min_size=1, max_size=4),
                                                             min_size=0, max_size=30)))


def _compound(inner):
    obj = st.builds(lambda props, req: {"type": "object", "properties": props,
                                        "required": [k for k in props if req]},
                    st.dictionaries(st.sampled_from(["a", "b", "c", "ä"]), inner, max_size=3), st.booleans())

    @st.composite
    def arr(draw):
        s = {"type": "array", "items": draw(inner)}
        for key in ("minItems", "maxItems"):
            if (v := draw(st.one_of(st.none(), st.integers(0, 4)))) is not None:
                s[key] = v
        return s

    return st.one_of(obj, arr())


SCHEMAS = st.recursive(_leaf, _compound, max_leaves=6)
NUMERIC_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _enforced(schema):
    """`schema` less what the grammar does not enforce: numeric bounds (llama-cpp-python 0.3.36's JSON-schema
    converter, and llama.cpp's common/json-schema-to-grammar.cpp of the same release, write any integer for
    {"type": "integer", "maximum": 0}; docs/api.md "Structured output")."""
    if isinstance(schema, dict):
        return {k: _enforced(v) for k, v in schema.items() if k not in NUMERIC_BOUNDS}
    if isinstance(schema, list):
        return [_enforced(v) for v in schema]
    return schema


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(schema=SCHEMAS)
def test_fuzzed_schemas_get_a_valid_200_or_a_400_and_the_server_serves_on(server, schema):
    url, proc = server
    r = chat(url, max_tokens=24, response_format=schema_format(schema))
    assert proc.poll() is None, f"the server died on {schema}"
    assert r.status_code in (200, 400), r.text
    if r.status_code == 200:
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), _enforced(schema))
    assert chat(url).status_code == 200
