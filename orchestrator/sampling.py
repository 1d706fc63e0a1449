"""llama.cpp's sampler chain over one context's logits (`Sampler`), the grammar sampler the grammar process
runs (`grammar_sampler`, over `candidates` in `TOKEN_DATA` arrays: grammar_child.py), and the log-probabilities
the API reports (`token_logprob`).

Threads: a `Sampler` is used by one thread at a time, the engine thread that decodes its context (the scheduler's
worker); `token_logprob` is a pure function.
"""

from __future__ import annotations

import ctypes
import re
from typing import Sequence

import llama_cpp
import numpy as np

from .errors import EngineError
from .grammar_guard import Grammar, GrammarFailed
from .request import SamplingParams, TokenLogprob


class Sampler:
    """A llama.cpp sampler chain (top-k → top-p → min-p → temperature → dist, or greedy) over the logits of one
    context, after the request's grammar if it has one. Free with close().

    With a grammar, only tokens that fit it keep their logits (the others get -inf before the other samplers,
    llama.cpp's "grammar first"), and an end-of-generation token only where the grammar may end. The grammar
    runs in a child process under a budget (grammar_guard.py: the same candidates as llama.cpp's grammar sampler
    in the chain); its failures raise GrammarFailed (HTTP 400), never reach this process.
    """

    def __init__(self, params: SamplingParams, ctx, vocab=None, grammar: Grammar | None = None) -> None:
        self._ctx = ctx
        self._vocab = vocab
        self._grammar = grammar
        self._chain = None
        # candidates and their token ids, where this chain samples outside llama_sampler_sample (made once)
        self._data: np.ndarray | None = None
        self._ids: np.ndarray | None = None
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        self._chain = chain  # freed by close() from here on
        if params.temperature <= 0:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_k(params.top_k))
            if params.top_p < 1.0:
                llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0.0:
                llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(params.temperature))
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(params.seed & 0xFFFFFFFF))

    def sample(self, idx: int = -1, logits: np.ndarray | None = None) -> int:
        """Sample from the logits of batch index `idx` of the last llama_decode (-1: its last token with logits
        on), with llama_sampler_sample (which also accepts the token into the chain), or from `logits` (float32,
        (n_vocab,): stored ones) through the same steps llama_sampler_sample takes (candidates in token order,
        llama_sampler_apply, llama_sampler_accept: llama-sampling.cpp), so both give the same token; with a
        grammar, over the logits the grammar allows (waiting for its mask unless `ready`). Raises GrammarFailed
        when the grammar allows no token or runs past its budget."""
        if self._grammar is None and logits is None:
            return int(llama_cpp.llama_sampler_sample(self._chain, self._ctx, idx))
        if self._data is None:  # kept: a grammar samples every token this way
            n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
            self._data, self._ids = np.empty(n_vocab, dtype=TOKEN_DATA), np.arange(n_vocab, dtype=np.int32)
        data = self._data
        if logits is None:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, idx), shape=(len(data),))
        data["id"] = self._ids  # the samplers reorder the candidates in place
        data["logit"] = logits
        data["p"] = 0.0
        if self._grammar is not None:
            allowed = self._grammar.mask()
            if not allowed.any():
                raise GrammarFailed("no token fits the request's grammar at this point of the reply (a dead end "
                                    "in the schema: an empty pattern class, or bounds no string meets)")
            data["logit"] = np.where(allowed, data["logit"], np.float32(-np.inf))
        cur = candidates(data)
        llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(cur))
        token = int(cur.data[cur.selected].id)
        llama_cpp.llama_sampler_accept(self._chain, token)
        if self._grammar is None:
            return token
        self._grammar.accept(token)
        if not llama_cpp.llama_vocab_is_eog(self._vocab, token):
            self._grammar.prefetch()  # filtered while the token is decoded
        return token

    def ready(self) -> bool:
        """Whether `sample` can run now without waiting for the grammar process: always without a grammar; with
        one, once it is built and has answered this step's mask (read without waiting: `Grammar.ready`). A caller
        that must not wait (the scheduler's worker) keeps the step's logits meanwhile and samples them later
        with `sample(idx, logits)`: the same token. Raises GrammarFailed as `sample` would."""
        return self._grammar is None or self._grammar.ready()

    def fileno(self) -> int | None:
        """The pipe the grammar's answers arrive on (select it for reading to wait until `ready` may have
        changed); None without a grammar."""
        return None if self._grammar is None else self._grammar.fileno()

    def accept(self, token: int) -> None:
        """Accept a token that was not sampled (a forced one) into the chain: the grammar advances over it."""
        llama_cpp.llama_sampler_accept(self._chain, token)
        if self._grammar is not None:
            self._grammar.accept(token)

    def close(self) -> None:
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
        if self._grammar is not None:
            self._grammar.close()
            self._grammar = None


TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data's layout


def candidates(data: np.ndarray):
    """A llama_token_data_array over `data` (a TOKEN_DATA array, read and written in place by the samplers),
    unsorted, nothing selected."""
    return llama_cpp.llama_token_data_array(data=data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
                                            size=len(data), selected=-1, sorted=False)


def grammar_sampler(vocab, grammar: str, triggers: Sequence[str] = ()):
    """(Called in the grammar process only: grammar_child.py.) llama.cpp's grammar sampler for GBNF `grammar`
    (root rule `root`), lazy when `triggers` are given: a trigger text that is one token of the vocabulary
    triggers on that token, any other on its text (an escaped regular expression). A NULL pointer (falsy) when
    llama.cpp cannot parse the grammar."""
    text = grammar.encode("utf-8")
    if not triggers:
        return llama_cpp.llama_sampler_init_grammar(vocab, text, b"root")
    tokens, patterns = [], []
    for trigger in triggers:
        ids = _tokenize(vocab, trigger)
        if len(ids) == 1:
            tokens.append(ids[0])
        else:
            patterns.append(re.escape(trigger).encode("utf-8"))
    c_patterns = (ctypes.c_char_p * max(1, len(patterns)))(*patterns)
    c_tokens = (llama_cpp.llama_token * max(1, len(tokens)))(*tokens)
    return llama_cpp.llama_sampler_init_grammar_lazy_patterns(vocab, text, b"root", c_patterns, len(patterns),
                                                              c_tokens, len(tokens))


def _tokenize(vocab, text: str) -> list[int]:
    """Token ids of `text` with special-token texts parsed (no BOS)."""
    data = text.encode("utf-8")
    buf = (llama_cpp.llama_token * (len(data) + 16))()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, len(buf), False, True)
    if n < 0:
        raise EngineError(f"llama_tokenize failed ({n}) on {len(data)} bytes")
    return list(buf[:n])


def token_logprob(logits: np.ndarray, token: int, k: int = 0) -> TokenLogprob:
    """`token`'s log-probability under `logits` (raw, shape (n_vocab,)) and the k most likely tokens', from the
    log-softmax computed in float64. Raises ValueError for a token outside the vocabulary."""
    if not 0 <= token < len(logits):
        raise ValueError(f"token {token} is outside the vocabulary of {len(logits)}")
    x = logits.astype(np.float64)
    m = x.max()
    logprobs = x - (m + np.log(np.exp(x - m).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        k = min(k, len(x))
        best = np.argpartition(-logprobs, k - 1)[:k]
        best = best[np.lexsort((best, -logprobs[best]))]  # most likely first, ties by id
        top = tuple((int(i), float(logprobs[i])) for i in best)
    return TokenLogprob(int(token), float(logprobs[token]), top)
