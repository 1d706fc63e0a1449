"""Caller-chosen cache breakpoints, prompt_cache_key, and canonical tool-call arguments, end to end on a live
server (tiny model). Every cached response is compared with the same request run cold (cache_prompt=false)."""

import json

import pytest

from server.protocols.openai_chat import parse_chat

pytestmark = pytest.mark.usefixtures("fresh_cache")

SYSTEM = "You are a meticulous assistant for a public library; cite the shelf for every book you mention. " * 3
BREAK = {"mode": "explicit"}


def body(messages, **kw):
    out = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0}
    out.update(kw)
    return out


def post(client, b):
    r = client.post("/v1/chat/completions", json=b)
    assert r.status_code == 200, r.text
    return r.json()


def prompt_of(runtime, b):
    req = parse_chat(b)
    return runtime.prompts.chat(req.messages, req.tools, req.template_kwargs, req.cache_breakpoints)


def same_as_cold(client, b):
    warm = post(client, b)
    cold = post(client, dict(b, cache_prompt=False))
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    return warm


def history(n_turns):
    msgs = [{"role": "system", "content": SYSTEM}]
    for i in range(n_turns):
        msgs += [{"role": "user", "content": f"Question {i}: which shelf holds volume {i} of the atlas?"},
                 {"role": "assistant", "content": f"Volume {i} is on shelf {i % 7}."}]
    return msgs


@pytest.mark.parametrize("marked", [True, False])
def test_breakpoint_outside_the_window_is_restored_by_a_branch(client, runtime, marked):
    msgs = history(8) + [{"role": "user", "content": "And the index?"}]
    # Message 3 (a user message) lies outside the last-`window` messages the detector checks by itself.
    part = {"type": "text", "text": msgs[3]["content"], **({"prompt_cache_breakpoint": BREAK} if marked else {})}
    msgs[3] = {"role": "user", "content": [part]}
    first = body(msgs)
    p1 = prompt_of(runtime, first)
    assert p1.boundaries.message_ends[3] is None
    same_as_cold(client, first)
    branch = body(msgs[:4] + [{"role": "assistant", "content": "Let me check the catalogue."},
                              {"role": "user", "content": "Please hurry."}])
    r = same_as_cold(client, branch)
    cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
    if marked:
        (offset,) = p1.boundaries.extra
        assert cached == offset == prompt_of(runtime, branch).boundaries.message_ends[3]
    else:
        assert cached == p1.boundaries.system_end


def test_breakpoint_inside_a_message_after_a_shared_document(client, runtime):
    doc = "Catalogue excerpt: " + " ".join(f"title {i} shelf {i % 9};" for i in range(120))

    def ask(question):
        return body([{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": [{"type": "text", "text": doc, "prompt_cache_breakpoint": BREAK},
                                                  {"type": "text", "text": "\n\n" + question}]}])

    first = ask("Where is title 7?")
    p1 = prompt_of(runtime, first)
    (offset,) = p1.boundaries.extra
    assert p1.boundaries.system_end < offset < p1.boundaries.message_ends[1]
    same_as_cold(client, first)
    r = same_as_cold(client, ask("Which shelf has the most titles?"))
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == offset


def test_bad_breakpoint_and_cache_key_are_400(client):
    bad = body([{"role": "user", "content": [{"type": "text", "text": "hi", "prompt_cache_breakpoint": True}]}])
    r = client.post("/v1/chat/completions", json=bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].prompt_cache_breakpoint"
    r = client.post("/v1/chat/completions", json=body([{"role": "user", "content": "hi"}], prompt_cache_key=7))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_key"


def test_prompt_cache_key_is_accepted_and_passed_on(client, runtime, monkeypatch):
    seen = []
    submit = runtime.scheduler.submit
    monkeypatch.setattr(runtime.scheduler, "submit", lambda job, sink, *a: seen.append(job) or submit(job, sink, *a))
    post(client, body([{"role": "user", "content": "hi"}], prompt_cache_key="agent-42"))
    post(client, body([{"role": "user", "content": "hi"}]))
    assert [j.prompt_cache_key for j in seen] == ["agent-42", ""]


# ---------------------------------------------------------------- canonical tool-call arguments

TOOLS = [{"type": "function", "function": {"name": "find_book", "description": "Find a book's shelf.",
          "parameters": {"type": "object", "properties": {"title": {"type": "string"}, "copies": {"type": "integer"},
                                                          "filters": {"type": "object"}}}}}]


def tool_turn(arguments):
    return body([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is Dune?"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "call_1", "type": "function", "function": {"name": "find_book", "arguments": arguments}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": '{"shelf": "F-12"}'}], tools=TOOLS)


ARGS = {"title": "Dune", "copies": 2, "filters": {"lang": "en", "format": ["paperback", "hardcover"]}}


def test_tool_arguments_with_other_spacing_are_the_same_prompt(client, runtime):
    spaced = tool_turn(json.dumps(ARGS, indent=2))
    compact = tool_turn(json.dumps(ARGS, separators=(",", ":")))
    as_object = tool_turn(ARGS)
    tokens = {tuple(prompt_of(runtime, b).tokens) for b in (spaced, compact, as_object)}
    assert len(tokens) == 1
    same_as_cold(client, spaced)
    r = same_as_cold(client, compact)
    # The whole prompt is shared: the first request's prompt end and logits are restored, nothing is prefilled.
    n = len(prompt_of(runtime, compact).tokens)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == n


def test_tool_arguments_in_another_key_order_are_another_prompt(client, runtime):
    first = tool_turn(json.dumps(ARGS))
    reordered = tool_turn(json.dumps(dict(reversed(list(ARGS.items())))))
    p1, p2 = prompt_of(runtime, first), prompt_of(runtime, reordered)
    assert p1.tokens != p2.tokens  # Qwen3.5 renders the parameters in the order given
    same_as_cold(client, first)
    r = same_as_cold(client, reordered)
    cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == p2.boundaries.message_ends[1]  # through the user message, not into the tool call
    assert p1.tokens[:cached] == p2.tokens[:cached]
