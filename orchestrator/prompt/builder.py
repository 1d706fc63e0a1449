"""Prompt builder: a validated chat request → prompt text, tokens and snapshot boundaries.

Uses the model's template (GGUF `tokenizer.chat_template`, else templates/qwen3.5.jinja) and the engine's
tokenizer (llama_tokenize with special tokens parsed, no BOS added unless the vocab asks for one and the
template did not write it). Caller strings are escaped before rendering so that only the template's own markup
becomes control tokens (orchestrator/control.py); `/v1/completions` prompts are the caller's own markup and
are tokenized as they are.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .boundaries import Boundaries, BoundaryDetector, detect
from .control import ControlTexts, protected_texts, split_cuts, strip_cuts
from ..engine import Engine
from ..errors import InvalidRequest
from ..output.formats import OutputFormat, detect_format
from ..output.reply import Reply
from .template import ChatTemplate, templates_dir


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt. tokens: n_prompt ids; boundaries: offsets in tokens; text: the rendered text.

    opens_reasoning: the generation prompt ends inside an open <think> block, so generated text starts as
    reasoning (Qwen3.5 with thinking on). reply: the shaper that reads the completion (output/reply.py). render_s, tokenize_s, boundaries_s: where building it took its time
    (the request's time breakdown, with the scheduler's).
    """

    text: str
    tokens: list[int]
    boundaries: Boundaries | None
    opens_reasoning: bool = False
    render_s: float = 0.0  # seconds spent rendering the template (escaping included)
    tokenize_s: float = 0.0  # seconds spent tokenizing the rendered text
    boundaries_s: float = 0.0  # seconds spent finding the boundaries (probe renders and their tokens)
    reply: Reply | None = None  # how the completion of a chat prompt is read (None: a plain-text prompt)


log = logging.getLogger("orchestrator.prompt.builder")

FALLBACK_TEMPLATES = {"gemma3": "gemma3.jinja"}  # GGUF architecture -> templates/ file; default qwen3.5.jinja


def load_template(engine: Engine, override_path=None, max_chars: int | None = None) -> ChatTemplate:
    """The chat template: `override_path`, else the GGUF's, else the project's template for the model's
    architecture (templates/gemma3.jinja for Gemma 3, whose small GGUFs often ship without one; Google's
    published Gemma 3 template), else templates/qwen3.5.jinja. `max_chars`: ChatTemplate's render limit."""
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
    return ChatTemplate(source, bos_token=info.bos_text, eos_token=info.eos_text, max_chars=max_chars)


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

    def _escaped(self, messages, tools, template_kwargs):
        """The request's caller strings escaped (control.py), and messages as the template family expects them."""
        esc = self.controls
        if esc:
            messages, tools = esc.escape_all(messages), esc.escape_all(tools)
            template_kwargs = esc.escape_all(template_kwargs)
        return self.output_format.template_messages(messages), tools, template_kwargs

    def restorable_after(self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict[str, Any],
                         prompt: Prompt) -> Callable[[Sequence[int]], int | None]:
        """A probe for the scheduler's after-generation state: given the generated token ids (with the
        end-of-turn token when generation stopped on one), None where the request that most likely follows does
        not start with `prompt`'s tokens and exactly those ids (the state after them cannot be restored), else
        the fewest tokens it adds after them: its own, with an empty message (Reuse.after_generation stores a
        checkpoint min_segment before the answer's end where that is less than min_segment).

        The likely next request is the conversation with the answer appended (parsed as the server returns it:
        reasoning, content, tool calls) and then the tool results of its calls, or a user message after a text
        answer. Rendered and tokenized like any request. On Qwen3.5 with thinking on, a text answer fails (the
        template drops a turn's reasoning once a newer user message arrives) and a tool call passes (reasoning
        after the last user message is kept), so only the state a tool loop restores is stored (issue 18). On
        Qwen3.5 a tool result adds 14 tokens around its content with thinking on, 16 with it off.
        Never raises: a conversation the template rejects, or an answer that does not parse, is None.
        """
        probe = "\ue000"  # a private-use character: its own token, merging with no neighbour

        def check(generated: Sequence[int]) -> int | None:
            try:
                eog = list(generated[-1:]) if generated and self.engine.is_eog(generated[-1]) else []
                body = list(generated[: len(generated) - len(eog)])
                text = b"".join(self.engine.piece(t) for t in body).decode("utf-8", "replace")
                out = prompt.reply.parse(text)
                answer = prompt.reply.message(out, object_arguments=True)
                if out.tool_calls:
                    probes = [{"role": "tool", "tool_call_id": c["id"], "content": probe} for c in out.tool_calls]
                else:
                    probes = [{"role": "user", "content": probe}]
                msgs, tls, kw = self._escaped(list(messages) + [answer] + probes, tools, template_kwargs)
                text = self.template.render(msgs, tls, add_generation_prompt=True, **kw)
                want = list(prompt.tokens) + list(generated)
                ids = self._ids(text)
                if ids[: len(want)] != want:
                    return None
                # less each probe's tokens and one more: the separators around an empty message may merge
                return max(0, len(ids) - len(want) - len(probes) * (len(self._ids(probe)) + 1))
            except (InvalidRequest, ValueError, KeyError, TypeError):
                return None

        return check

    def chat(self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict[str, Any],
             breakpoints: Sequence[tuple[int, int]] = ()) -> Prompt:
        """Render `messages` with the generation prompt; raises InvalidRequest if the template rejects them.

        `breakpoints`: the caller's cache breakpoints as (message index, characters of its content before it).
        """
        t0 = time.perf_counter()
        raw_tools = tools  # the reply is read against the request's own tools, not their escaped copies
        esc = self.controls
        if esc:  # content is data: see control.py
            by_message: dict[int, list[int]] = {}
            for i, c in breakpoints:
                by_message.setdefault(i, []).append(c)
            moved = {i: iter(esc.escaped_offsets(messages[i].get("content") or "", cs)) for i, cs in by_message.items()}
            breakpoints = [(i, next(moved[i])) for i, _ in breakpoints]
        messages, tools, template_kwargs = self._escaped(messages, tools, template_kwargs)
        text = self.template.render(messages, tools, add_generation_prompt=True, **template_kwargs)
        t1 = time.perf_counter()
        tokens, lengths = self._tokens(text)
        t2 = time.perf_counter()
        bounds = detect(self.detector, messages, tools, text, lengths, template_kwargs, tokens, self._ids,
                        breakpoints)
        text = strip_cuts(text)
        tail = text.rstrip()
        opens = tail.endswith("<think>") and "</think>" not in tail[tail.rfind("<think>"):]
        return Prompt(text=text, tokens=tokens, boundaries=bounds, opens_reasoning=opens, render_s=t1 - t0,
                      tokenize_s=t2 - t1, boundaries_s=time.perf_counter() - t2,
                      reply=Reply(self.output_format, raw_tools, opens))

    def completion(self, text: str) -> Prompt:
        """A plain-text prompt (/v1/completions): no template, no boundaries."""
        t0 = time.perf_counter()
        tokens, _ = self._tokens(text)
        return Prompt(text=text, tokens=tokens, boundaries=None, tokenize_s=time.perf_counter() - t0)

