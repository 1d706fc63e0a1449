"""The field policy (server/fields.py): one table per API, docs/api.md's tables generated from them, and the
effort -> thinking switch mapping every route uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.errors import InvalidRequest
from server import docs, fields
from server.protocols import anthropic, openai
from server.fields import DEFAULT_ONLY, HINT, REFUSED
from server.protocols.openai_chat import parse_chat
from server.validate import thinking_from_effort

API_DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"
MSGS = [{"role": "user", "content": "hi"}]


def test_the_api_doc_tables_are_generated_from_the_policy():
    text = API_DOC.read_text()
    assert docs.update_readme(text) == text, "run: python -m server.docs docs/api.md"
    for name, table in docs.readme_tables().items():
        assert f"<!-- fields:{name} -->\n{table}\n<!-- /fields -->" in text


def test_every_rule_is_complete():
    for table in (openai.FIELDS, anthropic.FIELDS):
        for key, rule in table.items():
            assert rule.routes and rule.note, key
            assert (rule.accepts is not None) == (rule.kind == DEFAULT_ONLY), key


@pytest.mark.parametrize("table,route,where", [(openai.FIELDS, openai.CHAT, "/v1/chat/completions"),
                                               (anthropic.FIELDS, anthropic.MESSAGES, "/v1/messages")])
def test_hints_pass_refused_fields_and_unknown_ones_are_named(table, route, where):
    for key, rule in table.items():
        if route in rule and rule.kind == HINT:
            fields.check({key: {}}, table, route, where)
        if route in rule and rule.kind == REFUSED:
            with pytest.raises(InvalidRequest) as e:
                fields.check({key: {}}, table, route, where)
            assert e.value.param == key and rule.note in e.value.message
            fields.check({key: None}, table, route, where)  # null: not asked for
    with pytest.raises(InvalidRequest) as e:
        fields.check({"frobnicate": 1}, table, route, where)
    assert e.value.param == "frobnicate" and where in e.value.message


def test_effort_maps_to_the_thinking_switch():
    assert thinking_from_effort(None) is None
    assert [thinking_from_effort(v) for v in ("none", "minimal")] == [False, False]
    assert all(thinking_from_effort(v) for v in ("low", "medium", "high", "xhigh", "max"))
    with pytest.raises(InvalidRequest) as e:
        thinking_from_effort("turbo", "output_config.effort")
    assert e.value.param == "output_config.effort"


def test_reasoning_effort_sets_enable_thinking_unless_the_caller_set_it():
    assert parse_chat({"messages": MSGS, "reasoning_effort": "medium"}).template_kwargs == {"enable_thinking": True}
    assert parse_chat({"messages": MSGS, "reasoning_effort": "none"}).template_kwargs == {"enable_thinking": False}
    assert parse_chat({"messages": MSGS}).template_kwargs == {}
    explicit = {"messages": MSGS, "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}
    assert parse_chat(explicit).template_kwargs == {"enable_thinking": False}
