"""Prompts shared by the benchmarks: a realistic agent system prompt and tool schemas of a chosen size."""

from __future__ import annotations

from typing import Callable

_RULES = [
    "Read the relevant files before you answer; cite paths exactly as they appear in the repository.",
    "Prefer the smallest change that fixes the problem, and explain why it is sufficient in one sentence.",
    "When a test fails, reproduce it first, then read the traceback from the bottom frame upwards.",
    "Never run commands that modify files outside the working tree or that need network access.",
    "If a request is ambiguous, state the assumption you make and continue instead of stopping to ask.",
    "Use the search tool before guessing where a symbol is defined; there may be several definitions.",
    "Keep answers short: a summary line, then details only where the user needs them to act.",
    "Format code in fenced blocks with the language named; never paste more than 60 lines at once.",
]


def agent_tools() -> list[dict]:
    """Two realistic tool schemas (OpenAI function format)."""
    return [
        {"type": "function", "function": {
            "name": "search_code",
            "description": "Search the repository for a regular expression and return matching lines with file "
                           "paths and line numbers, most relevant first.",
            "parameters": {"type": "object", "properties": {
                "pattern": {"type": "string", "description": "Python regular expression to search for"},
                "path": {"type": "string", "description": "Directory or file to limit the search to"},
                "max_results": {"type": "integer", "minimum": 1, "maximum": 200, "default": 50}},
                "required": ["pattern"]}}},
        {"type": "function", "function": {
            "name": "run_tests",
            "description": "Run the project's test suite, or a subset of it, and return the summary and the "
                           "output of failing tests.",
            "parameters": {"type": "object", "properties": {
                "selector": {"type": "string", "description": "pytest node id or -k expression"},
                "timeout_s": {"type": "integer", "minimum": 1, "maximum": 3600, "default": 600},
                "verbose": {"type": "boolean", "default": False}}, "required": []}}},
    ]


def agent_system_prompt(tokenize: Callable[[str], list[int]], target_tokens: int) -> str:
    """A system prompt of about `target_tokens` tokens: a role, rules, and a project handbook."""
    parts = ["You are Orchard, an autonomous software engineer working on a Python service that serves "
             "language models. You work in small steps and check your work with the tools you have.\n\nRules:"]
    parts += [f"{i + 1}. {r}" for i, r in enumerate(_RULES)]
    parts.append("\nProject handbook:")
    section = 0
    while len(tokenize("\n".join(parts))) < target_tokens:
        section += 1
        parts.append(
            f"Section {section}. Module {section} owns one concern and exposes a small typed interface. Its "
            f"public functions document units (tokens, bytes, seconds) and the errors they raise; tests for "
            f"module {section} build their inputs from plain lists and assert exact outputs, including the "
            f"order of evictions and the byte counts after every operation.")
    return "\n".join(parts)
