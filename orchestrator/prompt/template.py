"""Chat templates: render a model's Jinja2 template the way Hugging Face transformers does.

The template comes from the GGUF (`tokenizer.chat_template`) or from the project's templates/ folder.
Rendering follows transformers' `apply_chat_template`: a sandboxed Jinja2 environment with trim_blocks and
lstrip_blocks, `raise_exception`, `strftime_now`, and a `tojson` that does not HTML-escape (Jinja2's built-in
one turns `<` into `\\u003c`, which would change the prompt's tokens).
"""

from __future__ import annotations

import json
import re
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .control import CUT
from ..errors import InvalidRequest



def templates_dir() -> Path:
    """The project's templates/ folder: beside the package in a source checkout (editable install), else where
    pyproject's data-files put it (<prefix>/share/orchestrator/templates)."""
    source = Path(__file__).resolve().parents[2] / "templates"
    return source if source.is_dir() else Path(sys.prefix) / "share" / "orchestrator" / "templates"


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False,
            ensure_ascii: bool = False) -> str:
    text = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    # A CUT (control.py) marks where caller text must not join into a control token: keep it a character even
    # in ASCII-only JSON, where it would otherwise become the six characters \ufdd0 of the prompt.
    return _ASCII_CUT.sub(lambda m: m.group(1) + CUT, text) if ensure_ascii and "\\ufdd0" in text else text


_ASCII_CUT = re.compile(r"(?<!\\)((?:\\\\)*)\\ufdd0")  # an escape, not an escaped backslash before "ufdd0"


class _TemplateRaised(Exception):
    """Raised by a template's own raise_exception()."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


class ChatTemplate:
    """A compiled chat template.

    `source` is the Jinja2 text; `bos_token` / `eos_token` are the texts the template may reference.
    `max_chars`: the most characters one render may produce (None: no limit): a render is stopped as soon as it
    passes them, so a template that repeats the caller's text (a tool once per message, say) costs at most that
    much time and memory, whatever the request's own size. Raises ValueError if the source does not compile.
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", max_chars: int | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template does not compile: {e}") from e
        self.source = source
        self.max_chars = max_chars
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_file(cls, path: Path, **kw: str) -> "ChatTemplate":
        return cls(Path(path).read_text(encoding="utf-8"), **kw)

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        """Render `messages` (OpenAI-style dicts, tool-call arguments already parsed to objects) to prompt text.

        `kwargs` are the request's chat_template_kwargs (e.g. enable_thinking). Raises InvalidRequest when the
        template rejects the conversation (its raise_exception), or its text passes `max_chars`, so the caller
        answers HTTP 400.
        """
        try:
            pieces = self._template.generate(
                messages=messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
            if self.max_chars is None:
                return "".join(pieces)
            out, n = [], 0
            for piece in pieces:
                n += len(piece)
                if n > self.max_chars:
                    raise InvalidRequest(f"the conversation renders to more than {self.max_chars} characters; this "
                                         f"server renders at most that much (twice --max-prompt-size)",
                                         param="messages")
                out.append(piece)
            return "".join(out)
        except _TemplateRaised as e:
            raise InvalidRequest(f"the chat template rejected the conversation: {e}", param="messages") from e
        except (jinja2.TemplateError, TypeError, AttributeError, KeyError, ValueError) as e:
            raise InvalidRequest(f"the chat template could not render the conversation: {e}",
                                 param="messages") from e
