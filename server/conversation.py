"""The neutral conversation every chat protocol parses into: OpenAI-style messages, validated and put in the
order the templates render them.

`conversation(raw)` validates each message, binds every tool result to its call (results rendered in call
order), merges the leading system and developer messages into one, and reads the caller's cache breakpoints
(text parts carrying `"prompt_cache_breakpoint": {"mode": "explicit"}`). The Anthropic and Responses protocols
convert their input to this shape first, then rename the paths of any error back to their own fields.
"""

from __future__ import annotations

import json
from typing import Any

from orchestrator.errors import InvalidRequest

from .validate import bad, check_nesting

ROLES = ("system", "developer", "user", "assistant", "tool")
BREAKPOINT = {"mode": "explicit"}  # the mark of a cache breakpoint on a text part


def _content(content: Any, param: str, allow_none: bool) -> str | list | None:
    if content is None:
        if allow_none:
            return None
        raise bad(f"'{param}' is required", param)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"'{param}[{j}]' must be a text part {{\"type\": \"text\", \"text\": \"...\"}} "
                          f"(images are not supported)", f"{param}[{j}]")
        return "".join(p["text"] for p in content)
    raise bad(f"'{param}' must be a string or a list of text parts", param)


def _tool_calls(calls: Any, param: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad(f"'{param}' must be a list", param)
    out = []
    for j, call in enumerate(calls):
        p = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"'{p}.function.name' must be a non-empty string", f"{p}.function.name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError) as e:
                raise bad(f"'{p}.function.arguments' is not valid JSON: {str(e)[:200]}",
                          f"{p}.function.arguments") from e
            check_nesting({f"{p}.function.arguments": args})  # JSON text inside the body: not checked with it
        if not isinstance(args, dict):
            raise bad(f"'{p}.function.arguments' must be a JSON object", f"{p}.function.arguments")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad(f"'{p}.id' must be a string", f"{p}.id")
        # Arguments are rendered as an object: the template writes each parameter in the order given.
        out.append({"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _message(m: Any, i: int) -> dict:
    """One message, validated (tool results are bound to their calls by _messages)."""
    p = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"'{p}' must be an object", p)
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"'{p}.role' must be one of {', '.join(ROLES)}; got {json.dumps(role)[:40]}", f"{p}.role")
    msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
    has_calls = role == "assistant" and m.get("tool_calls")
    msg["content"] = _content(m.get("content"), f"{p}.content", allow_none=bool(has_calls) or role == "assistant")
    if role == "assistant":
        if msg["content"] is None:
            msg["content"] = ""
        if isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        if has_calls:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{p}.tool_calls")
    elif role == "tool":
        call_id = m.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad(f"'{p}.tool_call_id' must be a string", f"{p}.tool_call_id")
        msg["tool_call_id"] = call_id
    if isinstance(m.get("name"), str):
        msg["name"] = m["name"]
    return msg


def _no_call(k: int, call_id: Any, a: int | None, answered: bool = False) -> InvalidRequest:
    p = f"messages[{k}]"
    if a is None:
        why = "the message before it is neither an assistant message with tool calls nor another tool result"
    elif answered:
        why = f"an earlier tool message already answered that call of messages[{a}]"
    else:
        why = f"the assistant message messages[{a}] has no tool call with that id"
    return bad(f"'{p}' is a tool result for the tool call id {json.dumps(call_id)[:80]}, but {why}",
               f"{p}.tool_call_id")


def _bind_results(calls: list[dict], a: int, msgs: list[dict], results: range) -> list[int]:
    """The indices of the tool results `results` (the tool messages right after the assistant message
    messages[a], whose tool calls are `calls`) in the order to render them.

    OpenAI binds a result to its call by tool_call_id, but templates (Qwen3.5's among them) write the results
    by position: so when the calls have unique ids, the results must carry exactly those ids, each once, and
    are put in call order whatever order they came in. A result whose id matches no call (or a call answered
    before) is refused, as is a turn answered in part. Calls without ids (or with repeated ids) cannot be bound
    that way: their results keep their order, each naming a call of the turn or none."""
    ids = [c["id"] for c in calls]
    if None in ids or len(set(ids)) < len(ids):
        open_ids, unnamed = {x for x in ids if x is not None}, ids.count(None)
        for k in results:
            call_id = msgs[k]["tool_call_id"]
            if call_id in open_ids:
                open_ids.discard(call_id)
            elif call_id is None and unnamed:
                unnamed -= 1
            else:
                raise _no_call(k, call_id, a)
        return list(results)
    position = {x: j for j, x in enumerate(ids)}
    by_id: dict[str, int] = {}
    for k in results:
        call_id = msgs[k]["tool_call_id"]
        if call_id not in position or call_id in by_id:
            raise _no_call(k, call_id, a, answered=call_id in by_id)
        by_id[call_id] = k
    if by_id and len(by_id) < len(ids):
        j = next(j for j, x in enumerate(ids) if x not in by_id)
        raise bad(f"the tool call messages[{a}].tool_calls[{j}] (id {json.dumps(ids[j])[:80]}) has no tool result: "
                  f"the tool messages after an assistant message answer each of its calls once (or none of them)",
                  f"messages[{a}].tool_calls[{j}].id")
    return [by_id[x] for x in ids if x in by_id]


def _messages(raw: Any, max_messages: int) -> tuple[list[dict], list[int]]:
    """(validated messages, the index in `raw` of each), with every assistant turn's tool results in the order
    of its tool calls (see _bind_results)."""
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty list", "messages")
    if len(raw) > max_messages:
        raise bad(f"'messages' holds {len(raw)} messages; this server accepts at most {max_messages} "
                  f"(--max-messages)", "messages")
    msgs = [_message(m, i) for i, m in enumerate(raw)]
    order: list[int] = []
    i = 0
    while i < len(msgs):
        m = msgs[i]
        if m["role"] == "tool":
            raise _no_call(i, m["tool_call_id"], None)
        order.append(i)
        j = i + 1
        if m.get("tool_calls"):
            while j < len(msgs) and msgs[j]["role"] == "tool":
                j += 1
            order += _bind_results(m["tool_calls"], i, msgs, range(i + 1, j))
        i = j
    return [msgs[k] for k in order], order


def _merge_system(messages: list[dict], order: list[int], breakpoints: tuple[tuple[int, int], ...]
                  ) -> tuple[list[dict], tuple[tuple[int, int], ...], int | None]:
    """Leading system (and developer) messages merged into one system message, their texts in order and
    separated by a blank line (templates accept one system message, at the start); the caller's breakpoints
    (raw message index, characters) moved to the merged messages. Also returns the raw index of the first
    system message later in the conversation, or None."""
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    where = {raw: k for k, raw in enumerate(order)}
    offset: dict[int, int] = {}
    if n > 1:
        texts, at = [], 0
        for k in range(n):
            offset[order[k]] = at + (2 if texts and messages[k]["content"] else 0)
            if messages[k]["content"]:
                at = offset[order[k]] + len(messages[k]["content"])
                texts.append(messages[k]["content"])
        messages = [{"role": "system", "content": "\n\n".join(texts)}] + messages[n:]
        where = {raw: max(0, k - n + 1) for raw, k in where.items()}
        order = order[:1] + order[n:]
    moved = tuple((where[i], offset.get(i, 0) + c) for i, c in breakpoints)
    late = next((order[k] for k in range(1, len(messages)) if messages[k]["role"] == "system"), None)
    return messages, moved, late


def conversation(raw: Any, max_messages: int
                 ) -> tuple[list[dict], tuple[tuple[int, int], ...], int | None]:
    """OpenAI-style `messages` -> (the messages to render, the caller's cache breakpoints in them, the index in
    `raw` of the first system or developer message after the leading ones, or None).

    Validates every message; puts each assistant turn's tool results in the order of its calls; merges the
    leading system and developer messages into one. Raises InvalidRequest naming the message."""
    messages, order = _messages(raw, max_messages)
    return _merge_system(messages, order, _breakpoints(raw))


def late_system_as_user(messages: list[dict]) -> list[dict]:
    """`messages` (as conversation returns them) with every system message after the first message rendered as
    a user message where it stands, its text unchanged: for templates that refuse or drop a later system
    message (Qwen3.5 raises "System message must be at the beginning"). Where it stands, not merged into the
    system prompt: the text stays in the prompt, and the prompt before it stays the same from turn to turn
    (Claude Code sends its environment as messages[1], after the first user message; moving it to the start
    would put it before the conversation and end every shared prefix there whenever it changes)."""
    return [dict(m, role="user") if k and m["role"] == "system" else m for k, m in enumerate(messages)]


def _breakpoints(raw: list) -> tuple[tuple[int, int], ...]:
    """The caller's cache breakpoints: text parts carrying OpenAI's `"prompt_cache_breakpoint": {"mode":
    "explicit"}` ("marks the exact end of a reusable prompt prefix"), as (message index, characters of the
    message's joined content through that part). Call after _messages validated the parts."""
    out = []
    for i, m in enumerate(raw):
        parts = m.get("content")
        if not isinstance(parts, list):
            continue
        n_chars = 0
        for j, part in enumerate(parts):
            n_chars += len(part["text"])
            mark = part.get("prompt_cache_breakpoint")
            if mark is None:
                continue
            if not isinstance(mark, dict) or mark.get("mode") != "explicit":
                p = f"messages[{i}].content[{j}].prompt_cache_breakpoint"
                raise bad(f"'{p}' must be {{\"mode\": \"explicit\"}}", p)
            out.append((i, n_chars))
    return tuple(out)
