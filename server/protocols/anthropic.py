"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens) over the same prompt builder and
scheduler as the OpenAI routes.

A request is translated into the OpenAI-style messages that server/conversation.py validates (so tool results are
bound to their calls and leading system text is handled the same way), and the answer back into Anthropic's
content blocks and stream events:

* `system` (a string or text blocks) -> the system message; user text blocks -> a user message; each
  `tool_result` block -> a tool message (before the user's text blocks of the same message); assistant
  `text` / `thinking` / `tool_use` blocks -> content / reasoning_content / tool_calls; `redacted_thinking` is
  opaque and not rendered.
* `cache_control: {"type": "ephemeral"}` on a block marks a caller-chosen snapshot boundary, as OpenAI's
  `prompt_cache_breakpoint` does: where a text block ends, where a tool result ends, or (on a tool_use or
  thinking block) where the assistant message ends. On a tool definition it is accepted and needs nothing: the
  tools block always ends at a snapshot boundary.
* `thinking` {"type": "enabled" | "adaptive"} renders the template with thinking on; absent or "disabled", off
  (`enable_thinking`, as Anthropic's default is no thinking); `output_config.effort` "none"/"minimal" turns it
  off (server/validate.py thinking_from_effort). `display`: "omitted" answers thinking blocks with their signature
  only; "summarized" (the default), "updates" (what Claude Code 2.1.x asks for with `--output-format stream-json`
  or `json --verbose`) and "highlights" (its short-titles mode) stream the thinking as it is generated: this
  server has no summarizer, so every display that shows thinking shows it whole. Answered thinking blocks carry a
  `signature` that holds their text, so a block sent back without it (`display: "omitted"`) renders the same.
* What Claude Code 2.1.x sends (tests/fixtures/captures/claude-code/): its billing line (system[0], a hash that changes
  per session) is left out of the prompt; a message with role "system" is rendered where it stands (as a user
  turn where the template takes no later system message: server/driver.py); tools with `defer_loading` are not
  rendered, a `tool_reference` block renders the referenced tool's definition; `context_management`'s
  clear_thinking_20251015 edit is applied as Anthropic documents it.
* The top-level fields' policy (honoured, hint, refused) is FIELDS (server/fields.py).

Usage: `cache_read_input_tokens` is the prompt tokens restored from the cache; `cache_creation_input_tokens`
the prompt tokens prefilled by a request that stores snapshots (all the uncached ones: the state is stored at
the boundaries, near the end of the prompt, and after generation; none on a cold run); `input_tokens` the rest
(prompt tokens neither read from nor written to the cache). The three add up to the prompt, and are known once
the request is admitted: a stream's message_start waits for that (MessagesEncoder) and carries the same figures
as message_delta and the non-streamed message.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from orchestrator.config import Config
from orchestrator.errors import InvalidRequest
from orchestrator.output.grammar import Structure
from orchestrator.prompt.builder import Prompt
from orchestrator.output.reply import Reply
from orchestrator.request import Event, Result

from .. import fields
from ..conversation import BREAKPOINT, conversation
from ..errors import anthropic_payload
from ..fields import HINT, HONOURED, REFUSED, Rule
from ..validate import (GenerationOptions, bad, body_fields, check_prompt_size, identities, json_object, mapping,
                        options, thinking_from_effort)
from .base import ChatCall, Encoder, Reading, Sse, timings
from .context_edits import EDIT as CLEAR_TOOL_USES
from .context_edits import ClearToolUses

MESSAGES, COUNT_TOKENS = "messages", "count_tokens"
PATHS = {MESSAGES: "/v1/messages", COUNT_TOKENS: "/v1/messages/count_tokens"}
TEMPERATURE = (0, 1)  # Anthropic's range

# The field policy of both routes (server/fields.py): field -> Rule(kind, routes, note). cache_prompt and
# cache_salt are this server's extensions, as on the OpenAI routes. docs/api.md's table is server.fields.markdown
# of it (tests/test_fields.py).
_BOTH = (MESSAGES, COUNT_TOKENS)
FIELDS: dict[str, Rule] = {
    "model": Rule(HONOURED, _BOTH, "any string: the one model served answers"),
    "messages": Rule(HONOURED, _BOTH, "roles user, assistant and system (see Claude Code)"),
    "system": Rule(HONOURED, _BOTH, "a string or text blocks; a block starting `x-anthropic-billing-header:` is "
                                    "dropped"),
    "tools": Rule(HONOURED, _BOTH, "client tools; `defer_loading: true` ones are left out of the prompt"),
    "tool_choice": Rule(HONOURED, _BOTH, '"none" drops the tools; "any" and "tool" force a call, '
                                         "`disable_parallel_tool_use` at most one (a grammar enforces them)"),
    "thinking": Rule(HONOURED, _BOTH, 'enabled/adaptive: thinking on; disabled or absent: off; `display: '
                                      '"omitted"` answers thinking blocks with their signature only, "summarized", '
                                      '"updates" and "highlights" stream the thinking whole'),
    "output_config": Rule(HONOURED, _BOTH, '`effort`: "low" and above keep thinking as `thinking` says; '
                                           "`format` json_schema: a grammar enforces it"),
    "output_format": Rule(HONOURED, _BOTH, "the structured-outputs beta's name for `output_config.format`"),
    "context_management": Rule(HONOURED, _BOTH, "`clear_thinking_20251015` and `clear_tool_uses_20250919` edits "
                                                "are applied (see Claude Code)"),
    "cache_control": Rule(HONOURED, _BOTH, "automatic caching: the conversation's end is always a boundary"),
    "max_tokens": Rule(HONOURED, (MESSAGES,), "required; thinking counts against it"),
    "stop_sequences": Rule(HONOURED, (MESSAGES,), "up to 16 strings"),
    "stream": Rule(HONOURED, (MESSAGES,), "Anthropic's events"),
    "temperature": Rule(HONOURED, (MESSAGES,), "{:g} to {:g}".format(*TEMPERATURE)),
    "top_p": Rule(HONOURED, (MESSAGES,), "0 to 1"),
    "top_k": Rule(HONOURED, (MESSAGES,), "0 or more; -1 accepted as off"),
    "cache_prompt": Rule(HONOURED, (MESSAGES,), "an extension: false is a cold run"),
    "cache_salt": Rule(HONOURED, (MESSAGES,), "an extension: requests share snapshots only with the same salt"),
    "metadata": Rule(HINT, _BOTH, "an object (Claude Code's user_id)"),
    "service_tier": Rule(HINT, (MESSAGES,), "one tier serves every request"),
    "container": Rule(REFUSED, _BOTH, "this server runs no code-execution containers"),
    "mcp_servers": Rule(REFUSED, _BOTH, "this server connects to no MCP servers (run them in the client)"),
}
BILLING_LINE = "x-anthropic-billing-header:"  # Claude Code's system[0]; its hash changes with the first message
SIGNATURE_PREFIX = "orchestrator1."  # a thinking block's signature from this server: the thinking, base64url
TOOL_CHOICES = ("auto", "any", "tool", "none")
THINKING = ("enabled", "adaptive", "disabled")
# thinking.display: "omitted" sends no thinking text; the others show it (whole: nothing here summarizes). Claude
# Code 2.1.x sends "updates" (stream-json output), "omitted" (plain -p) and "highlights" (its titles mode).
THINKING_DISPLAY = ("summarized", "omitted", "updates", "highlights")
_MARK = BREAKPOINT  # the breakpoint mark server/conversation.py reads on a text part


@dataclass
class MessagesCall(ChatCall):
    """A Messages API request (options None for count_tokens)."""

    omit_thinking: bool = False  # thinking.display "omitted": thinking blocks carry their signature only
    clear_tool_uses: ClearToolUses | None = None  # a context_management edit, applied once rendered
    applied_edits: list[dict] = field(default_factory=list)  # the answer's context_management.applied_edits


def _cache_control(block: dict, p: str) -> bool:
    """Whether `block` carries a valid cache_control mark; raises for an invalid one."""
    cc = block.get("cache_control")
    if cc is None:
        return False
    if not isinstance(cc, dict) or cc.get("type") != "ephemeral" or cc.get("ttl", "5m") not in ("5m", "1h") \
            or set(cc) - {"type", "ttl"}:
        name = f"{p}.cache_control" if p else "cache_control"
        raise bad(f"'{name}' must be {{\"type\": \"ephemeral\"}}, optionally with \"ttl\" \"5m\" or \"1h\"",
                  name)
    return True


def _text_part(block: dict, p: str) -> dict:
    if not isinstance(block.get("text"), str):
        raise bad(f"'{p}.text' must be a string", f"{p}.text")
    if block.get("citations"):
        raise bad(f"'{p}.citations' is not supported", f"{p}.citations")
    part = {"type": "text", "text": block["text"]}
    if _cache_control(block, p):
        part["prompt_cache_breakpoint"] = _MARK
    return part


def _kind(block: Any, p: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad(f"'{p}' must be a content block (an object with a \"type\")", p)
    return block["type"]


def _text_blocks(content: Any, p: str) -> list[dict]:
    """A string or a list of text blocks -> text parts (images and documents are refused)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(f"'{p}' must be a string or a list of text blocks", p)
    parts = []
    for j, block in enumerate(content):
        q = f"{p}[{j}]"
        if _kind(block, q) != "text":
            raise bad(f"'{q}.type' must be \"text\", got {json.dumps(block['type'])[:40]} (images and documents "
                      f"are not supported)", f"{q}.type")
        parts.append(_text_part(block, q))
    return parts


def signature(thinking: str) -> str:
    """The signature of a thinking block this server answers: the thinking itself, so that a client that
    receives only the signature (`display: "omitted"`) and sends the block back gets the same prompt."""
    return SIGNATURE_PREFIX + base64.urlsafe_b64encode(thinking.encode()).decode()


def _thinking_text(block: dict, q: str) -> str:
    """A thinking block's text: its `thinking`, or, when that is empty, what this server's signature holds (an
    omitted display); another provider's signature is opaque and adds nothing."""
    text, sig = block.get("thinking"), block.get("signature")
    if not isinstance(text, str):
        raise bad(f"'{q}.thinking' must be a string", f"{q}.thinking")
    if sig is not None and not isinstance(sig, str):
        raise bad(f"'{q}.signature' must be a string", f"{q}.signature")
    if not text and sig and sig.startswith(SIGNATURE_PREFIX):
        try:
            return base64.b64decode(sig[len(SIGNATURE_PREFIX):], altchars=b"-_", validate=True).decode()
        except (binascii.Error, ValueError, UnicodeDecodeError) as e:
            raise bad(f"'{q}.signature' is not a signature this server made", f"{q}.signature") from e
    return text


def _result_parts(content: Any, q: str, deferred: dict[str, str]) -> list[dict]:
    """A tool_result's content -> text parts. A `tool_reference` block (the answer of a tool search) is the
    referenced deferred tool's definition, as JSON text: the tool is "loaded" where the search answered, so the
    tools block at the start of the prompt stays the same from turn to turn."""
    if not isinstance(content, list):
        return _text_blocks(content, q)
    blocks = []
    for j, block in enumerate(content):
        if isinstance(block, dict) and block.get("type") == "tool_reference":
            name = block.get("tool_name")
            if not isinstance(name, str) or name not in deferred:
                r = f"{q}[{j}].tool_name"
                raise bad(f"'{r}' {json.dumps(name)[:60]} is not a tool with defer_loading in 'tools'", r)
            block = {"type": "text", "text": deferred[name]}
        blocks.append(block)
    return _text_blocks(blocks, q)


def _user(m: dict, p: str, blocks: list, conv: list[dict], origin: list, deferred: dict[str, str]) -> None:
    texts = []
    for j, block in enumerate(blocks):
        q = f"{p}.content[{j}]"
        kind = _kind(block, q)
        if kind == "text":
            texts.append(_text_part(block, q))
        elif kind == "tool_result":
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str) or not tool_use_id:
                raise bad(f"'{q}.tool_use_id' must be a non-empty string", f"{q}.tool_use_id")
            if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
                raise bad(f"'{q}.is_error' must be true or false", f"{q}.is_error")
            content = block.get("content")
            parts = [] if content is None else _result_parts(content, f"{q}.content", deferred)
            if _cache_control(block, q):
                parts.append({"type": "text", "text": "", "prompt_cache_breakpoint": _MARK})
            conv.append({"role": "tool", "tool_call_id": tool_use_id, "content": parts})
            origin.append((q, []))
        else:
            raise bad(f"'{q}.type' {json.dumps(kind)[:40]} is not supported in a user message: text and "
                      f"tool_result blocks are (images and documents are not)", f"{q}.type")
    if texts:
        conv.append({"role": "user", "content": texts})
        origin.append((p, []))


def _assistant(m: dict, p: str, blocks: list, conv: list[dict], origin: list, keep_thinking: bool) -> None:
    parts: list[dict] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    call_paths: list[str] = []
    mark_end = False
    for j, block in enumerate(blocks):
        q = f"{p}.content[{j}]"
        kind = _kind(block, q)
        if kind == "text":
            parts.append(_text_part(block, q))
        elif kind == "thinking":
            text = _thinking_text(block, q)
            if keep_thinking:  # else cleared by a clear_thinking_20251015 edit
                reasoning.append(text)
            mark_end |= _cache_control(block, q)
        elif kind == "redacted_thinking":  # encrypted by another provider: nothing to render
            mark_end |= _cache_control(block, q)
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not block["id"]:
                raise bad(f"'{q}.id' must be a non-empty string", f"{q}.id")
            if not isinstance(block.get("name"), str) or not block["name"]:
                raise bad(f"'{q}.name' must be a non-empty string", f"{q}.name")
            if not isinstance(block.get("input"), dict):
                raise bad(f"'{q}.input' must be an object", f"{q}.input")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": block["input"]}})
            call_paths.append(q)
            mark_end |= _cache_control(block, q)
        else:
            raise bad(f"'{q}.type' {json.dumps(kind)[:40]} is not supported in an assistant message: text, "
                      f"thinking, redacted_thinking and tool_use blocks are", f"{q}.type")
    if mark_end:  # a mark on a block that is not text: the end of the message
        parts.append({"type": "text", "text": "", "prompt_cache_breakpoint": _MARK})
    msg: dict[str, Any] = {"role": "assistant", "content": parts}
    if reasoning:
        msg["reasoning_content"] = "\n".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    conv.append(msg)
    origin.append((p, call_paths))


def _system_parts(system: Any) -> list[dict]:
    """`system` -> text parts, without Claude Code's billing line (`x-anthropic-billing-header: cc_version=…;
    cc_entrypoint=…; cch=…;`, system[0]): a line for Anthropic's billing, not for the model, whose hash changes
    with the session's first message (captured: tests/fixtures/captures/claude-code/) and would end every prefix shared
    between sessions right after the tools."""
    parts = _text_blocks(system, "system")
    return [part for part in parts if not part["text"].startswith(BILLING_LINE)]


def _thinking_turns(raw: list, keep: int | None) -> set[int]:
    """The indices of the assistant messages whose thinking is kept: all (keep None), or the last `keep` of
    those that carry thinking blocks (a clear_thinking_20251015 edit)."""
    with_thinking = [i for i, m in enumerate(raw) if isinstance(m, dict) and m.get("role") == "assistant"
                     and isinstance(m.get("content"), list)
                     and any(isinstance(b, dict) and b.get("type") in ("thinking", "redacted_thinking")
                             for b in m["content"])]
    if keep is None:
        return set(range(len(raw)))
    return set(with_thinking[len(with_thinking) - keep:]) if keep else set()


def _convert(body: dict, max_messages: int, keep_thinking: int | None, deferred: dict[str, str]
             ) -> tuple[list[dict], list[tuple[str, list[str]]]]:
    """(OpenAI-style messages, the Anthropic path each came from, with the paths of its tool_use blocks).
    keep_thinking: the number of most recent assistant turns with thinking whose thinking is rendered (None:
    all); deferred: the tools with defer_loading, by name, for tool_reference blocks."""
    conv: list[dict] = []
    origin: list[tuple[str, list[str]]] = []
    system = body.get("system")
    if system is not None:
        conv.append({"role": "system", "content": _system_parts(system)})
        origin.append(("system", []))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty list", "messages")
    if len(raw) > max_messages:
        raise bad(f"'messages' holds {len(raw)} messages; this server accepts at most {max_messages} "
                  f"(--max-messages)", "messages")
    kept = _thinking_turns(raw, keep_thinking)
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"'{p}' must be an object", p)
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise bad(f"'{p}.role' must be \"user\", \"assistant\" or \"system\"; got {json.dumps(role)[:40]}",
                      f"{p}.role")
        content = m.get("content")
        if isinstance(content, str):
            blocks = [{"type": "text", "text": content}]
        elif isinstance(content, list) and content:
            blocks = content
        else:
            raise bad(f"'{p}.content' must be a string or a non-empty list of content blocks", f"{p}.content")
        if role == "system":  # Claude Code's environment (messages[1]); rendered by server/driver.py's rule
            conv.append({"role": "system", "content": _text_blocks(blocks, f"{p}.content")})
            origin.append((p, []))
        elif role == "user":
            _user(m, p, blocks, conv, origin, deferred)
        else:
            _assistant(m, p, blocks, conv, origin, i in kept)
    if raw[-1]["role"] == "assistant":
        p = f"messages[{len(raw) - 1}].role"
        raise bad(f"'{p}': the last message must be a user message; continuing a partial assistant message "
                  f"(prefill) is not supported", p)
    return conv, origin


def _context_management(raw: Any) -> tuple[int | None, ClearToolUses | None]:
    """context_management -> (how many of the latest assistant turns with thinking keep it (None: all), the
    tool-result clearing to apply once the prompt is rendered), as Anthropic documents the edits
    (platform.claude.com/docs/en/build-with-claude/context-editing): clear_thinking_20251015 with `keep` "all" or
    {"type": "thinking_turns", "value": N} (default 1); clear_tool_uses_20250919 (context_edits.py)."""
    if raw is None:
        return None, None
    if not isinstance(raw, dict) or not isinstance(raw.get("edits", []), list) or set(raw) - {"edits"}:
        raise bad("'context_management' must be {\"edits\": [...]}", "context_management")
    keep: int | None = None
    clear: ClearToolUses | None = None
    for j, edit in enumerate(raw.get("edits", [])):
        q = f"context_management.edits[{j}]"
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind == "clear_thinking_20251015":
            value = edit.get("keep", {"type": "thinking_turns", "value": 1})
            if value == "all":
                continue
            n = value.get("value") if isinstance(value, dict) and value.get("type") == "thinking_turns" else None
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise bad(f"'{q}.keep' must be \"all\" or {{\"type\": \"thinking_turns\", \"value\": N}}",
                          f"{q}.keep")
            keep = n if keep is None else min(keep, n)
        elif kind == CLEAR_TOOL_USES:
            if clear is not None:
                raise bad(f"'{q}': only one {CLEAR_TOOL_USES} edit may be given", q)
            clear = ClearToolUses.parse(edit, q)
        else:
            raise bad(f"'{q}.type' must be clear_thinking_20251015 or {CLEAR_TOOL_USES}; got "
                      f"{json.dumps(kind)[:60]}", f"{q}.type")
    return keep, clear


def _output_config(raw: Any) -> bool | None:
    """output_config -> the thinking switch its `effort` asks for (server/validate.py thinking_from_effort), or
    None. Its `format` is read by _output_format."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad("'output_config' must be an object", "output_config")
    for key in raw:
        if key not in ("effort", "format") and raw[key] is not None:
            raise bad(f"'output_config.{str(key)[:40]}' is not supported: effort and format are",
                      f"output_config.{key}")
    return thinking_from_effort(raw.get("effort"), "output_config.effort")


def _output_format(body: dict) -> tuple[dict | None, str]:
    """(the JSON schema the answer's text must be valid against, or None; the field it came from), from
    Anthropic's structured outputs: `output_config.format` {"type": "json_schema", "schema": {...}}, or the
    beta's top-level `output_format` of the same shape (not both)."""
    config = body.get("output_config")
    found = [(f, v) for f, v in (("output_config.format", config.get("format") if isinstance(config, dict) else None),
                                 ("output_format", body.get("output_format"))) if v is not None]
    if not found:
        return None, "output_config.format"
    if len(found) > 1:
        raise bad("give 'output_config.format' or 'output_format', not both", "output_format")
    param, raw = found[0]
    if not isinstance(raw, dict) or raw.get("type") != "json_schema" or not isinstance(raw.get("schema"), dict):
        raise bad(f"'{param}' must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}", param)
    return raw["schema"], param


_REF = re.compile(r"messages\[(\d+)\](\.tool_calls\[(\d+)\])?")
_SUFFIXES = ((".tool_call_id", ".tool_use_id"), (".function.arguments", ".input"), (".function.name", ".name"))


def _translate(e: InvalidRequest, origin: list[tuple[str, list[str]]]) -> InvalidRequest:
    """An error about the translated messages, renamed to the Anthropic request's paths."""
    def sub(m: re.Match) -> str:
        base, calls = origin[int(m[1])]
        return calls[int(m[3])] if m[2] and int(m[3]) < len(calls) else base

    param = e.param
    if param:
        param = _REF.sub(sub, param, count=1)
        for old, new in _SUFFIXES:
            param = param.replace(old, new)
    return InvalidRequest(_REF.sub(sub, e.message), param=param, code=e.code)


def _tools(raw: Any) -> tuple[list[dict] | None, dict[str, str]]:
    """(the OpenAI-style tools to render, the JSON text of each tool with `defer_loading: true`, by name). Deferred tools are not
    rendered, as Anthropic's tool search documents ("not loaded into context" until a search references them,
    see _result_parts): Claude Code sends a placeholder that way ("never call this tool")."""
    if raw is None:
        return None, {}
    if not isinstance(raw, list):
        raise bad("'tools' must be a list", "tools")
    out: list[dict] = []
    deferred: dict[str, str] = {}
    for j, t in enumerate(raw):
        q = f"tools[{j}]"
        if not isinstance(t, dict):
            raise bad(f"'{q}' must be an object", q)
        if t.get("type") not in (None, "custom"):
            raise bad(f"'{q}.type' {json.dumps(t['type'])[:60]} is a server tool, which this server does not run; "
                      f"client tools (\"custom\", or no type) are supported", f"{q}.type")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad(f"'{q}.name' must be a non-empty string", f"{q}.name")
        if not isinstance(t.get("input_schema"), dict):
            raise bad(f"'{q}.input_schema' must be a JSON schema object", f"{q}.input_schema")
        if t.get("description") is not None and not isinstance(t["description"], str):
            raise bad(f"'{q}.description' must be a string", f"{q}.description")
        _cache_control(t, q)  # valid marks only; the tools block always ends at a snapshot boundary
        fn: dict[str, Any] = {"name": t["name"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        fn["parameters"] = t["input_schema"]
        if t.get("defer_loading") is not None and not isinstance(t["defer_loading"], bool):
            raise bad(f"'{q}.defer_loading' must be true or false", f"{q}.defer_loading")
        if t.get("defer_loading"):
            deferred[t["name"]] = json.dumps(fn, ensure_ascii=False)  # one string, however often referenced
        else:
            out.append({"type": "function", "function": fn})
    return out or None, deferred


def _tool_choice(raw: Any, tools: list[dict] | None) -> tuple[str, str | None, bool]:
    """(the choice, as grammar.Structure's tool_choice: "auto", "required" or "none"; the tool a "tool" choice
    names; whether several calls may be made). "none" drops the tools from the prompt; "any" and "tool" are
    enforced by a grammar (output/grammar.py), as is `disable_parallel_tool_use`."""
    if raw is None:
        return "auto", None, True
    if not isinstance(raw, dict) or raw.get("type") not in TOOL_CHOICES:
        raise bad("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"} (with \"name\" for "
                  "\"tool\")", "tool_choice")
    if raw.get("disable_parallel_tool_use") is not None and not isinstance(raw["disable_parallel_tool_use"], bool):
        raise bad("'tool_choice.disable_parallel_tool_use' must be true or false",
                  "tool_choice.disable_parallel_tool_use")
    if raw["type"] == "tool" and not any(t["function"]["name"] == raw.get("name") for t in tools or ()):
        raise bad(f"'tool_choice.name' names the tool {json.dumps(raw.get('name'))[:60]}, which is not in 'tools'",
                  "tool_choice.name")
    choice = {"auto": "auto", "none": "none"}.get(raw["type"], "required")
    return choice, raw.get("name") if raw["type"] == "tool" else None, not raw.get("disable_parallel_tool_use")


def _thinking(raw: Any) -> tuple[bool, bool]:
    """(thinking on?, display omitted?)."""
    if raw is None:
        return False, False
    if not isinstance(raw, dict) or raw.get("type") not in THINKING:
        raise bad("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": \"adaptive\"} or "
                  "{\"type\": \"disabled\"}", "thinking")
    if raw.get("display") not in (None,) + THINKING_DISPLAY:
        # ends in the hosted API's wording, which Claude Code reads to retry without the field
        raise bad(f"'thinking.display' {json.dumps(raw['display'])[:40]} is not a display: thinking.{raw['type']}"
                  f".display: Input should be " + ", ".join(f"'{d}'" for d in THINKING_DISPLAY[:-1])
                  + f" or '{THINKING_DISPLAY[-1]}'", "thinking.display")
    if raw["type"] == "enabled":
        budget = raw.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise bad("'thinking.budget_tokens' must be a positive integer", "thinking.budget_tokens")
    return raw["type"] != "disabled", raw.get("display") == "omitted"


def _generation(body: dict, cfg: Config) -> GenerationOptions:
    """The generation options of a /v1/messages body, each under its Messages API name."""
    if body.get("max_tokens") is None:
        raise bad("'max_tokens' is required", "max_tokens")
    mapping(body, "metadata")
    if body.get("service_tier") is not None and body["service_tier"] not in ("auto", "standard_only"):
        raise bad("'service_tier' must be \"auto\" or \"standard_only\"", "service_tier")
    keys = ("max_tokens", "temperature", "top_p", "top_k", "stream", "cache_prompt", "cache_salt", "stop_sequences")
    return options({k: body.get(k) for k in keys}, cfg, stop="stop_sequences", one_stop_string=False,
                   temperature=TEMPERATURE)


def parse_messages(body: Any, cfg: Config | None = None, route: str = MESSAGES) -> MessagesCall:
    """Validate a /v1/messages (or, with route=COUNT_TOKENS, a /v1/messages/count_tokens) body against the
    limits of `cfg`. Raises InvalidRequest naming the field."""
    cfg = cfg or Config(cache_ram_mib=0)
    fields.check(json_object(body), FIELDS, route, PATHS[route])
    identities(body, ("model", "cache_salt"), required=("model",))
    check_prompt_size(body_fields(body, ("system", "messages", "tools")), cfg)  # count_tokens too
    _cache_control(body, "")  # a valid mark only: the end of the last message is always a boundary
    options = _generation(body, cfg) if route == MESSAGES else None
    tools, deferred = _tools(body.get("tools"))
    choice, name, parallel = _tool_choice(body.get("tool_choice"), tools)
    if choice == "none":
        tools = None
    thinking, omit = _thinking(body.get("thinking"))
    effort = _output_config(body.get("output_config"))  # an effort can only turn thinking off, never on
    kwargs = {"enable_thinking": thinking and effort is not False}
    schema, format_field = _output_format(body)
    structure = Structure(response=schema, tool_choice=choice, tool_name=name, parallel_tool_calls=parallel,
                          response_field=format_field, schema_path=f"{format_field}.schema")
    keep_thinking, clear = _context_management(body.get("context_management"))
    conv, origin = _convert(body, cfg.max_messages, keep_thinking, deferred)
    # what will be rendered: tool_reference blocks have become their tools' definitions
    check_prompt_size([(path, m) for m, (path, _) in zip(conv, origin)] + [("tools", tools)], cfg)
    try:
        messages, breakpoints, late = conversation(conv, len(conv))
    except InvalidRequest as e:
        raise _translate(e, origin) from e
    return MessagesCall(messages=messages, tools=tools, template_kwargs=kwargs, options=options,
                           cache_breakpoints=breakpoints, late_system=late, omit_thinking=omit,
                           structure=structure, clear_tool_uses=clear)


async def apply_context_edit(call: MessagesCall, prompt: Prompt,
                             render: Callable[[MessagesCall], Awaitable[Prompt]]) -> tuple[MessagesCall, Prompt]:
    """(call, prompt) with the call's clear_tool_uses edit applied where the rendered `prompt` passes the edit's
    trigger (server/protocols/context_edits.py): `render`ed again with the old tool results cleared, kept if that
    frees at least clear_at_least tokens (and at least one); else the call and prompt as they were."""
    edit = call.clear_tool_uses
    if edit is None or not edit.triggered(len(prompt.tokens), call.messages):
        return call, prompt
    messages, breakpoints, n_cleared = edit.apply(call.messages, call.cache_breakpoints)
    if not n_cleared:
        return call, prompt
    # call.messages already has its late system messages as the template takes them (Driver.chat_prompt)
    cleared = dataclasses.replace(call, messages=messages, cache_breakpoints=breakpoints, late_system=None)
    edited = await render(cleared)
    freed = len(prompt.tokens) - len(edited.tokens)
    if freed < max(edit.clear_at_least, 1):
        return call, prompt
    cleared.applied_edits = [edit.applied(n_cleared, freed)]
    return cleared, edited


# ------------------------------------------------------------------ answers

def tool_use(call: dict) -> dict:
    """An OpenAI-shaped parsed tool call as a tool_use block, its id in the Messages API's form (`toolu_…`, as
    the hosted API writes them; the parser's `call_…` id keeps its random part)."""
    args = call["function"]["arguments"]
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": json.loads(args) if isinstance(args, str) else args}


def stop_reason(r: Result, has_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a result."""
    if has_calls:
        return "tool_use", None
    if r.finish_reason == "length":
        return "max_tokens", None
    if r.stop_sequence is not None:
        return "stop_sequence", r.stop_sequence
    return "end_turn", None


def input_usage(prompt_tokens: int, cached: int, stores: bool) -> dict:
    """The prompt's part of Anthropic's usage, known once the request is admitted (`cached`: the tokens restored;
    `stores`: whether it stores snapshots, `Reuse.stores`): input_tokens + cache_creation_input_tokens +
    cache_read_input_tokens = the prompt. The same figures in message_start, message_delta and the message:
    Claude Code adds message_delta's figures over message_start's only where they are above 0."""
    created = prompt_tokens - cached if stores else 0
    return {"input_tokens": prompt_tokens - cached - created, "cache_creation_input_tokens": created,
            "cache_read_input_tokens": cached}


def usage(r: Result, stores: bool) -> dict:
    """Anthropic's usage of a result (`input_usage`, and the completion tokens)."""
    prompt = input_usage(r.prompt_tokens, r.cached_tokens, stores)
    return {"input_tokens": prompt["input_tokens"], "output_tokens": len(r.completion_tokens),
            "cache_creation_input_tokens": prompt["cache_creation_input_tokens"],
            "cache_read_input_tokens": prompt["cache_read_input_tokens"]}


def count_tokens(call: MessagesCall, n_tokens: int) -> dict:
    """/v1/messages/count_tokens' answer for a prompt of `n_tokens`; with an applied context edit, as Anthropic
    reports context editing there: the length before it too."""
    body: dict = {"input_tokens": n_tokens}
    if call.applied_edits:
        freed = sum(e["cleared_input_tokens"] for e in call.applied_edits)
        body["context_management"] = {"original_input_tokens": n_tokens + freed}
    return body


class MessagesEncoder(Encoder):
    """Anthropic's events: message_start, then per content block content_block_start, its deltas and
    content_block_stop (thinking, text; tool_use blocks at the end, each input as one input_json_delta),
    message_delta (stop reason, final usage) and message_stop; an error event if the job fails. `final`: the
    message, its content the blocks those events built.

    message_start's usage is already the final input split (`input_usage`; message_delta repeats it with the
    output tokens): it is sent with the job's first event, whose TEXT carries the tokens restored at admission
    (Event.cached_tokens), or with the result. Claude Code adds up message_start's figures, replaced by
    message_delta's only where those are above 0, so both must agree. `stores`: the job stores snapshots
    (`Reuse.stores`), so its uncached prompt tokens are cache writes."""

    route, kind = "/v1/messages", "messages"

    def __init__(self, call: MessagesCall, reply: Reply, n_prompt: int, model: str, stores: bool) -> None:
        self.mid, self.call, self.model, self.n_prompt, self.stores = f"msg_{uuid.uuid4().hex}", call, model, \
            n_prompt, stores
        self.reading = Reading(reply)
        self.blocks: list[dict] = []  # the content blocks so far; the last is open while `open`
        self.open = False
        self.thinking: list[str] = []  # the open thinking block's text, for its signature
        self.held: list[Sse] | None = []  # events before message_start (None once it is sent)
        self.tail: dict = {}  # message_delta's delta and usage, once done

    def _opening(self, cached: int, stored: bool | None = None) -> list[Sse]:
        """message_start (once), then the events held until it could be sent."""
        if self.held is None:
            return []
        held, self.held = self.held, None
        split = input_usage(self.n_prompt, cached, self.stores if stored is None else stored)
        return [_event("message_start", {"message": {
            "id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {**split, "output_tokens": 0}}})] + held

    def _close(self) -> list[Sse]:
        if not self.open:
            return []
        self.open = False
        block, index, out = self.blocks[-1], len(self.blocks) - 1, []
        if block["type"] == "thinking":  # as Anthropic: the signature is the block's last delta
            block["signature"] = signature("".join(self.thinking))
            out.append(_event("content_block_delta", {"index": index, "delta": {
                "type": "signature_delta", "signature": block["signature"]}}))
            self.thinking.clear()
        return out + [_event("content_block_stop", {"index": index})]

    def _start(self, block: dict) -> list[Sse]:
        out = self._close()
        self.blocks.append(dict(block))
        self.open = True
        return out + [_event("content_block_start", {"index": len(self.blocks) - 1, "content_block": block})]

    def _pieces(self, pieces: list[tuple[str, str]]) -> list[Sse]:
        out = []
        for kind, text in pieces:
            open_type = self.blocks[-1]["type"] if self.open else None
            if kind == "reasoning":
                if open_type != "thinking":
                    out += self._start({"type": "thinking", "thinking": "", "signature": ""})
                self.thinking.append(text)
                if self.call.omit_thinking:  # display "omitted": the text travels in the signature only
                    continue
                self.blocks[-1]["thinking"] += text
                delta = {"type": "thinking_delta", "thinking": text}
            else:
                if open_type != "text":
                    out += self._start({"type": "text", "text": ""})
                self.blocks[-1]["text"] += text
                delta = {"type": "text_delta", "text": text}
            out.append(_event("content_block_delta", {"index": len(self.blocks) - 1, "delta": delta}))
        return out

    def text(self, ev: Event) -> list[Sse]:
        out = self._pieces(self.reading.push(ev.text))
        if self.held is not None and ev.cached_tokens is None:  # not from the scheduler: wait for the result
            self.held.extend(out)
            return []
        return self._opening(ev.cached_tokens or 0) + out

    def done(self, r: Result) -> list[Sse]:
        rest, calls = self.reading.finish(r.cut)
        out = self._pieces(rest)
        for call in calls:
            use = tool_use(call)
            out += self._start(dict(use, input={}))
            self.blocks[-1]["input"] = use["input"]
            out.append(_event("content_block_delta", {"index": len(self.blocks) - 1, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(use["input"], ensure_ascii=False)}}))
        out += self._close()
        reason, sequence = stop_reason(r, bool(calls))
        self.tail = {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage(r, self.stores),
                     **self._context_management(), "timings": timings(r)}
        out.append(_event("message_delta", {k: v for k, v in self.tail.items() if k != "timings"}))
        out.append(_event("message_stop", {}))
        return self._opening(r.cached_tokens) + out

    def error(self, e: Exception) -> list[Sse]:  # failed before any text: reported as neither read nor written
        return self._opening(0, False) + self._close() + [_event("error", {"error": anthropic_payload(e)[0]["error"]})]

    def _context_management(self) -> dict:
        """The answer's `context_management` field: the edits applied to this request's prompt, as Anthropic
        reports them (`applied_edits`), or nothing when none was."""
        edits = self.call.applied_edits
        return {"context_management": {"applied_edits": edits}} if edits else {}

    def final(self) -> dict:
        t = self.tail
        return {"id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": self.blocks,
                "stop_reason": t["delta"]["stop_reason"], "stop_sequence": t["delta"]["stop_sequence"],
                "usage": t["usage"], **{k: v for k, v in t.items() if k not in ("delta", "usage")}}


def _event(name: str, data: dict) -> Sse:
    return name, dict(type=name, **data)
