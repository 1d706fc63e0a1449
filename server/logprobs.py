"""Token log-probabilities in OpenAI's two shapes.

Each entry is an `orchestrator.request.TokenLogprob`: the natural log of the softmax of the raw logits at that
step (before the grammar, temperature or truncation samplers), for the sampled token and the most likely ones.
There is one entry per completion token (`usage.completion_tokens`): the end-of-generation token is not one,
tokens of a stop string are.

Chat (`choices[].logprobs`, and per streamed chunk):

    {"content": [{"token": "Hi", "logprob": -0.31, "bytes": [72, 105],
                  "top_logprobs": [{"token": "Hi", "logprob": -0.31, "bytes": [72, 105]}, ...]}, ...],
     "refusal": null}

Completions (legacy):

    {"tokens": ["Hi", ...], "token_logprobs": [-0.31, ...], "top_logprobs": [{"Hi": -0.31, ...}, ...],
     "text_offset": [12, ...]}

where a `top_logprobs` dict holds the k most likely tokens and the sampled one (up to k + 1 entries; tokens
whose texts are equal share a key) and `text_offset` is the character offset of the token in prompt +
completion text.
"""

from __future__ import annotations

from typing import Callable, Sequence

from orchestrator.request import TokenLogprob

Piece = Callable[[int], bytes]  # token id -> its bytes


def _text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def _chat_token(token: int, logprob: float, piece: Piece) -> dict:
    b = piece(token)
    return {"token": _text(b), "logprob": logprob, "bytes": list(b)}


def chat(entries: Sequence[TokenLogprob], piece: Piece) -> dict:
    """`choices[].logprobs` of a chat completion (or chunk) for `entries`."""
    return {"content": [dict(_chat_token(e.token, e.logprob, piece),
                             top_logprobs=[_chat_token(t, lp, piece) for t, lp in e.top]) for e in entries],
            "refusal": None}


class CompletionLogprobs:
    """`choices[].logprobs` of /v1/completions, built in pieces as tokens stream; `text_offset` counts characters
    from the start of the prompt (`prompt_chars` of it come before the completion)."""

    def __init__(self, piece: Piece, prompt_chars: int) -> None:
        self.piece = piece
        self.prompt_chars = prompt_chars
        self._bytes = b""  # the completion tokens' bytes so far

    def block(self, entries: Sequence[TokenLogprob]) -> dict:
        """The logprobs object for the next `entries` (their offsets follow those of earlier blocks)."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            b = self.piece(e.token)
            out["text_offset"].append(self.prompt_chars + len(self._bytes.decode("utf-8", "ignore")))
            self._bytes += b
            out["tokens"].append(_text(b))
            out["token_logprobs"].append(e.logprob)
            top = {_text(self.piece(t)): lp for t, lp in e.top}
            top.setdefault(_text(b), e.logprob)
            out["top_logprobs"].append(top)
        return out
