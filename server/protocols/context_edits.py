"""Anthropic's tool-result clearing (`context_management` edit `clear_tool_uses_20250919`), applied to a
conversation as server/conversation.py returns it (OpenAI-style: assistant `tool_calls`, `tool`
messages with a string `content`).

As Anthropic documents it (platform.claude.com/docs/en/build-with-claude/context-editing): once the prompt
passes `trigger` (`{"type": "input_tokens", "value": N}`, default 100,000; or `{"type": "tool_uses", "value": N}`),
the oldest tool results are replaced with a placeholder, all but the `keep` most recent tool uses
(`{"type": "tool_uses", "value": K}`, default 3) and those of `exclude_tools`; `clear_tool_inputs` (true, or a
list of tool names) clears the calls' inputs too; `clear_at_least` (`{"type": "input_tokens", "value": M}`):
an edit that would free fewer than M tokens is not applied. The client keeps its full history and sends it
every turn, so the same edit applies to the same turns again: the prompt changes only where a newly cleared
result stands (the hosted API's cache is invalidated there too, which is what `clear_at_least` is for).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..validate import bad

EDIT = "clear_tool_uses_20250919"
PLACEHOLDER = "[This tool result was cleared to save context.]"
DEFAULT_TRIGGER_TOKENS = 100_000
DEFAULT_KEEP = 3


def _count(raw: Any, q: str, kinds: tuple[str, ...], default: tuple[str, int]) -> tuple[str, int]:
    """{"type": KIND, "value": N} (N a non-negative integer) -> (KIND, N); None -> `default`."""
    if raw is None:
        return default
    value = raw.get("value") if isinstance(raw, dict) else None
    if (not isinstance(raw, dict) or raw.get("type") not in kinds or isinstance(value, bool)
            or not isinstance(value, int) or value < 0):
        shapes = " or ".join(f'{{"type": "{k}", "value": N}}' for k in kinds)
        raise bad(f"'{q}' must be {shapes} with N a non-negative integer", q)
    return raw["type"], value


def _names(raw: Any, q: str) -> frozenset[str]:
    if not isinstance(raw, list) or not all(isinstance(n, str) for n in raw):
        raise bad(f"'{q}' must be a list of tool names", q)
    return frozenset(raw)


@dataclass(frozen=True)
class ClearToolUses:
    """One clear_tool_uses_20250919 edit, validated. trigger: ("input_tokens" | "tool_uses", N); keep: the most
    recent tool uses left as they are; clear_at_least: tokens an applied edit frees at least; exclude: tool
    names never cleared; inputs: True (every cleared call's input), False, or the names whose inputs are."""

    trigger: tuple[str, int] = ("input_tokens", DEFAULT_TRIGGER_TOKENS)
    keep: int = DEFAULT_KEEP
    clear_at_least: int = 0
    exclude: frozenset[str] = frozenset()
    inputs: bool | frozenset[str] = False

    @classmethod
    def parse(cls, edit: dict, q: str) -> ClearToolUses:
        """Raises InvalidRequest naming the field under `q` (the edit's path)."""
        known = {"type", "trigger", "keep", "clear_at_least", "exclude_tools", "clear_tool_inputs"}
        extra = sorted(set(edit) - known)
        if extra:
            raise bad(f"'{q}.{str(extra[0])[:40]}' is not a field of {EDIT}", f"{q}.{extra[0]}")
        trigger = _count(edit.get("trigger"), f"{q}.trigger", ("input_tokens", "tool_uses"),
                         ("input_tokens", DEFAULT_TRIGGER_TOKENS))
        keep = _count(edit.get("keep"), f"{q}.keep", ("tool_uses",), ("tool_uses", DEFAULT_KEEP))
        least = _count(edit.get("clear_at_least"), f"{q}.clear_at_least", ("input_tokens",), ("input_tokens", 0))
        exclude = frozenset() if edit.get("exclude_tools") is None else _names(edit["exclude_tools"],
                                                                                f"{q}.exclude_tools")
        raw_inputs = edit.get("clear_tool_inputs")
        inputs: bool | frozenset[str] = raw_inputs if isinstance(raw_inputs, bool) else False
        if raw_inputs is not None and not isinstance(raw_inputs, bool):
            inputs = _names(raw_inputs, f"{q}.clear_tool_inputs")
        return cls(trigger=trigger, keep=keep[1], clear_at_least=least[1], exclude=exclude, inputs=inputs)

    def triggered(self, n_tokens: int, messages: list[dict]) -> bool:
        """Whether a prompt of `n_tokens` tokens rendered from `messages` passes the trigger."""
        kind, n = self.trigger
        return (n_tokens if kind == "input_tokens" else len(_uses(messages))) > n

    def apply(self, messages: list[dict], breakpoints: tuple[tuple[int, int], ...]
              ) -> tuple[list[dict], tuple[tuple[int, int], ...], int]:
        """(messages with the oldest tool uses cleared, the breakpoints moved to their new offsets, how many uses
        were cleared). `messages` is not changed."""
        uses = [u for u in _uses(messages) if u[2] not in self.exclude]
        cleared = uses[:max(len(uses) - self.keep, 0)]
        out = list(messages)
        results = {}
        for a, j, name, r in cleared:
            if r is not None:
                out[r] = dict(out[r], content=PLACEHOLDER)
                results[r] = len(PLACEHOLDER)
            if self.inputs is True or (self.inputs and name in self.inputs):
                calls = list(out[a]["tool_calls"])
                calls[j] = dict(calls[j], function=dict(calls[j]["function"], arguments={}))
                out[a] = dict(out[a], tool_calls=calls)
        moved = tuple((i, results[i] if i in results else n) for i, n in breakpoints)
        return out, moved, len(cleared)

    def applied(self, n_cleared: int, tokens_freed: int) -> dict:
        """The entry of the answer's `context_management.applied_edits` for an applied edit."""
        return {"type": EDIT, "cleared_tool_uses": n_cleared, "cleared_input_tokens": tokens_freed}


def _uses(messages: list[dict]) -> list[tuple[int, int, str, int | None]]:
    """Every tool use, oldest first: (index of its assistant message, index of the call in it, the tool's name,
    index of its tool result message or None)."""
    result_of: dict[str, int] = {}
    for k, m in enumerate(messages):
        if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
            result_of.setdefault(m["tool_call_id"], k)
    return [(a, j, c["function"]["name"], result_of.get(c.get("id")))
            for a, m in enumerate(messages) if m["role"] == "assistant"
            for j, c in enumerate(m.get("tool_calls") or ())]

