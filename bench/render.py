"""Render chat requests exactly as orchestrator's server does, and tokenize them, without loading the weights.

The prompt text is what `server.protocols.openai_chat.parse_chat` + `orchestrator.template.ChatTemplate` produce from the
GGUF's own chat template (the same code path as `POST /v1/chat/completions`); tokens are llama.cpp's
(`llama_tokenize`, special tokens parsed, BOS only where the vocabulary asks for one and the text lacks it),
from a vocab-only load of the same GGUF. These token ids are the oracle's input and the prompt that
llama-cpp-python's server receives as text.
"""

from __future__ import annotations

import contextlib
import os
from functools import lru_cache
from pathlib import Path

import llama_cpp

from orchestrator.prompt.template import ChatTemplate
from server.protocols.openai_chat import parse_chat


class Renderer:
    """Prompt text and token ids of a chat body for one GGUF (vocab only; a few MB of RAM, no compute)."""

    def __init__(self, model: Path) -> None:
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
            self.llm = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
        meta = self.llm.metadata
        vocab = self.llm._model.vocab  # noqa: SLF001 - llama-cpp-python keeps the vocab pointer here

        def text(tok: int) -> str:
            return self.llm.detokenize([tok], special=True).decode("utf-8", "replace") if tok >= 0 else ""

        self.bos_text = text(llama_cpp.llama_vocab_bos(vocab))
        eos_text = text(llama_cpp.llama_vocab_eos(vocab))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        self.template = ChatTemplate(meta["tokenizer.chat_template"], bos_token=self.bos_text, eos_token=eos_text)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of plain text (no BOS, special tokens parsed)."""
        return self._tok(text)

    @lru_cache(maxsize=4096)
    def _tok(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def text(self, body: dict) -> str:
        """The prompt text of a chat body (generation prompt included), as the server renders it."""
        req = parse_chat({**body, "max_tokens": 1})
        return self.template.render(req.messages, req.tools, add_generation_prompt=True, **req.template_kwargs)

    def tokens(self, body: dict) -> list[int]:
        """Prompt token ids of a chat body, as the server computes them."""
        text = self.text(body)
        toks = list(self._tok(text))
        if self.add_bos and not (self.bos_text and text.startswith(self.bos_text)):
            toks.insert(0, self.llm.token_bos())
        return toks
