"""Prompt builder: a validated chat request → prompt text, tokens and snapshot boundaries.

Uses the model's template (GGUF `tokenizer.chat_template`, else templates/qwen3.5.jinja) and the engine's
tokenizer (llama_tokenize with special tokens parsed, no BOS added unless the vocab asks for one and the
template did not write it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .boundaries import Boundaries, BoundaryDetector, detect
from .engine import Engine
from .template import ChatTemplate, templates_dir


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt. tokens: n_prompt ids; boundaries: offsets in tokens; text: the rendered text.

    opens_reasoning: the generation prompt ends inside an open <think> block, so generated text starts as
    reasoning (Qwen3.5 with thinking on).
    """

    text: str
    tokens: list[int]
    boundaries: Boundaries | None
    opens_reasoning: bool = False

    def snapshot_positions(self) -> list[int]:
        return self.boundaries.positions(len(self.tokens)) if self.boundaries else []


def load_template(engine: Engine, override_path=None) -> ChatTemplate:
    """The chat template: `override_path`, else the GGUF's, else the project's Qwen3.5 template."""
    info = engine.info
    if override_path is not None:
        source = open(override_path, encoding="utf-8").read()
    elif info.chat_template:
        source = info.chat_template
    else:
        source = (templates_dir() / "qwen3.5.jinja").read_text(encoding="utf-8")
    return ChatTemplate(source, bos_token=info.bos_text, eos_token=info.eos_text)


class PromptBuilder:
    """Renders and tokenizes chat and plain-text prompts for one engine."""

    def __init__(self, engine: Engine, template: ChatTemplate) -> None:
        self.engine = engine
        self.template = template
        self.detector = BoundaryDetector(template, engine.info.eot_text)

    def _tokens(self, text: str) -> tuple[list[int], list[int]]:
        eng = self.engine
        tokens = eng.tokenize(text, add_special=False, parse_special=True)
        lengths = [len(eng.piece(t)) for t in tokens]
        bos = eng.info.bos_text
        if eng.info.add_bos and not (bos and text.startswith(bos)):
            tokens.insert(0, eng.bos_id)
            lengths.insert(0, 0)
        return tokens, lengths

    def chat(self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict[str, Any]) -> Prompt:
        """Render `messages` with the generation prompt; raises InvalidRequest if the template rejects them."""
        text = self.template.render(messages, tools, add_generation_prompt=True, **template_kwargs)
        tokens, lengths = self._tokens(text)
        bounds = detect(self.detector, messages, tools, text, lengths, template_kwargs)
        tail = text.rstrip()
        opens = tail.endswith("<think>") and "</think>" not in tail[tail.rfind("<think>"):]
        return Prompt(text=text, tokens=tokens, boundaries=bounds, opens_reasoning=opens)

    def completion(self, text: str) -> Prompt:
        """A plain-text prompt (/v1/completions): no template, no boundaries."""
        tokens, _ = self._tokens(text)
        return Prompt(text=text, tokens=tokens, boundaries=None)

