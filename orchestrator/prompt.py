"""Prompt builder: a validated chat request → prompt text, tokens and snapshot boundaries.

Uses the model's template (GGUF `tokenizer.chat_template`, else templates/qwen3.5.jinja) and the engine's
tokenizer (llama_tokenize with special tokens parsed, no BOS added unless the vocab asks for one and the
template did not write it). Caller strings are escaped before rendering so that only the template's own markup
becomes control tokens (orchestrator/control.py); `/v1/completions` prompts are the caller's own markup and
are tokenized as they are.
"""

from __future__ import annotations

import logging

from dataclasses import dataclass
from typing import Any, Sequence

from .boundaries import Boundaries, BoundaryDetector, detect
from .control import ControlTexts, protected_texts, split_cuts, strip_cuts
from .engine import Engine
from .formats import OutputFormat, detect_format
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


log = logging.getLogger("orchestrator.prompt")

FALLBACK_TEMPLATES = {"gemma3": "gemma3.jinja"}  # GGUF architecture -> templates/ file; default qwen3.5.jinja


def load_template(engine: Engine, override_path=None) -> ChatTemplate:
    """The chat template: `override_path`, else the GGUF's, else the project's template for the model's
    architecture (templates/gemma3.jinja for Gemma 3, whose small GGUFs often ship without one; Google's
    published Gemma 3 template), else templates/qwen3.5.jinja."""
    info = engine.info
    if override_path is not None:
        source = open(override_path, encoding="utf-8").read()
    elif info.chat_template:
        source = info.chat_template
    else:
        name = FALLBACK_TEMPLATES.get(info.architecture, "qwen3.5.jinja")
        log.warning("%s has no chat template; using templates/%s (--chat-template-file overrides it)",
                    info.path.name, name)
        source = (templates_dir() / name).read_text(encoding="utf-8")
    return ChatTemplate(source, bos_token=info.bos_text, eos_token=info.eos_text)


class PromptBuilder:
    """Renders and tokenizes chat and plain-text prompts for one engine. `output_format`: how replies to its
    chat prompts are parsed (reasoning, tool calls), detected from the template's family.

    parse_special_in_content: tokenize caller strings with special tokens parsed, as llama-server does (control
    texts in content become control tokens: --parse-special-in-content, off by default; see control.py).
    """

    def __init__(self, engine: Engine, template: ChatTemplate, parse_special_in_content: bool = False) -> None:
        self.engine = engine
        self.template = template
        self.output_format: OutputFormat = detect_format(template.source)
        self.detector = BoundaryDetector(template)
        specials = engine.special_tokens()
        texts = protected_texts(((text, control) for _, text, control in specials), template.source)
        # ids that only the template's markup may produce (whatever the flag says: tests and logs use them)
        self.protected_ids = frozenset(tok for tok, text, _ in specials if text in texts)
        self.controls = ControlTexts(frozenset() if parse_special_in_content else texts)
        if parse_special_in_content:
            log.warning("--parse-special-in-content: control-token text inside messages, tool results and tool "
                        "schemas becomes control tokens; callers can forge turns and tool calls")

    def _encode(self, text: str) -> tuple[list[int], bool]:
        """(token ids of `text`, whether a BOS was inserted: the vocab asks for one and the template did not
        write it). `text` may hold CUTs (control.py): each piece between them is tokenized on its own."""
        eng = self.engine
        tokens = [t for piece in split_cuts(text) if piece
                  for t in eng.tokenize(piece, add_special=False, parse_special=True)]
        bos = eng.info.bos_text
        if eng.info.add_bos and not (bos and text.startswith(bos)):
            return [eng.bos_id] + tokens, True
        return tokens, False

    def _ids(self, text: str) -> list[int]:
        return self._encode(text)[0]

    def _tokens(self, text: str) -> tuple[list[int], list[int]]:
        """(token ids, byte length of each token's text in `text`: 0 for an inserted BOS)."""
        tokens, inserted = self._encode(text)
        lengths = [len(self.engine.piece(t)) for t in tokens]
        if inserted:
            lengths[0] = 0
        return tokens, lengths

    def chat(self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict[str, Any],
             breakpoints: Sequence[tuple[int, int]] = ()) -> Prompt:
        """Render `messages` with the generation prompt; raises InvalidRequest if the template rejects them.

        `breakpoints`: the caller's cache breakpoints as (message index, characters of its content before it).
        """
        esc = self.controls
        if esc:  # content is data: see control.py
            breakpoints = [(i, esc.escaped_offset(messages[i].get("content") or "", c)) for i, c in breakpoints]
            messages, tools = esc.escape_all(messages), esc.escape_all(tools)
            template_kwargs = esc.escape_all(template_kwargs)
        messages = self.output_format.template_messages(messages)
        text = self.template.render(messages, tools, add_generation_prompt=True, **template_kwargs)
        tokens, lengths = self._tokens(text)
        bounds = detect(self.detector, messages, tools, text, lengths, template_kwargs, tokens, self._ids,
                        breakpoints)
        text = strip_cuts(text)
        tail = text.rstrip()
        opens = tail.endswith("<think>") and "</think>" not in tail[tail.rfind("<think>"):]
        return Prompt(text=text, tokens=tokens, boundaries=bounds, opens_reasoning=opens)

    def completion(self, text: str) -> Prompt:
        """A plain-text prompt (/v1/completions): no template, no boundaries."""
        tokens, _ = self._tokens(text)
        return Prompt(text=text, tokens=tokens, boundaries=None)

