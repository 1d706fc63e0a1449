"""Command line: `serve` (the OpenAI-compatible server) and `synth-model` (random-weight Qwen3.5 GGUFs).

`python -m orchestrator` runs it (orchestrator/__main__.py), with `serve` from server/__main__.py.

Flags use llama-server's spelling where one exists (--host, --port, --ctx-size, --threads, --batch-size,
--cache-ram, --alias, --chat-template-file, -ngl/--n-gpu-layers, --device, --main-gpu, --no-kv-offload).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Callable

from platformdirs import user_cache_dir

from .cache.policy import POLICIES
from .config import KV_TYPES, Config, default_cache_ram_mib
from .sizing import AGENT_CTX


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _at_least(lo: int):
    def check(text: str) -> int:
        value = int(text)
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {value}")
        return value

    return check


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _redis_url(text: str) -> str:
    from .cache.remote import check_url

    try:
        return check_url(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be between 1 and 65535, got {value}")
    return value


def _api_key(text: str) -> str:
    if not text.strip() or text != text.strip():
        raise argparse.ArgumentTypeError("must be non-empty, without leading or trailing spaces")
    return text


def _existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return path


def _gpu_layers(text: str) -> int:
    """llama-server's -ngl value: a number of layers, or "auto" / "all" (both -1: every layer)."""
    if text in ("auto", "all"):
        return -1
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, 'auto' or 'all', got {value}")
    return value


def _device_list(text: str) -> tuple[str, ...]:
    """llama-server's --device value: comma-separated ggml device names, or "none"."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or ("none" in names and len(names) > 1):
        raise argparse.ArgumentTypeError(f"must be device names separated by commas, or 'none', got {text!r}")
    return names


def _serve_parser(sub) -> None:
    d = Config()
    p = sub.add_parser("serve", help="start the OpenAI-compatible server")
    p.add_argument("-m", "--model", type=Path, help="GGUF file (default: the synthetic qwen3.5-0.8b, random weights)")
    p.add_argument("--host", default=d.host, help=f"bind address (default {d.host})")
    p.add_argument("--port", type=_port, default=d.port, help=f"port (default {d.port})")
    p.add_argument("-c", "--ctx-size", type=_positive, default=d.ctx_size,
                   help="context size per slot in tokens (default: the model's training context, reduced to what "
                        "the slots' KV and states and the compute buffer fit in 80%% of the memory left beside the "
                        "weights, --cache-ram and 1 GiB for the process, and to what --cache-ram holds of one slot; "
                        "the arithmetic is logged at start)")
    p.add_argument("-np", "--parallel", type=_positive, default=None,
                   help=f"slots: requests served at once, each with its own sequence (default {d.parallel}, fewer "
                        f"when memory cannot give each {AGENT_CTX} tokens of context and --ctx-size is not given)")
    p.add_argument("--queue-size", type=_non_negative, default=d.queue_size,
                   help=f"requests that may wait for a slot; more get HTTP 429 (default {d.queue_size})")
    p.add_argument("--timeout", type=_non_negative_float, default=d.timeout, metavar="SECONDS",
                   help=f"most seconds a request may take, queue wait included; 0 = no limit (default {d.timeout:g})")
    p.add_argument("--prefill-chunk", type=_at_least(3), default=d.prefill_chunk, metavar="N",
                   help=f"most prompt tokens per prefill step, between other slots' decode steps (default {d.prefill_chunk})")
    p.add_argument("--prefill-chunk-alone", type=int, default=d.prefill_chunk_alone, metavar="N",
                   help="most prompt tokens per prefill step when no other request is waiting or decoding (other "
                        "prefills wait for the one that finishes first anyway; default 0: --batch-size; larger "
                        "ubatches prefill faster)")
    p.add_argument("--snapshot-min-gap", type=_non_negative, default=d.snapshot_min_gap, metavar="TOKENS",
                   help="leave out message-end snapshots closer than TOKENS to another one (the tools block, the "
                        "system message and the last message always get one): fewer prefill stops on runs of short "
                        f"messages, less reuse when a conversation forks between them (default {d.snapshot_min_gap})")
    p.add_argument("--rs-snapshots", type=_non_negative, default=d.rs_snapshots, metavar="N",
                   help="recurrent-state snapshots per slot kept for rollback (llama.cpp n_rs_seq, hybrid models): "
                        "a prompt's last stop, where within N tokens of its end, is then taken from its final prefill "
                        "call instead of a call of its own, where checked bit-identical at start; N recurrent states more per slot "
                        f"(19 MiB each on Qwen3.5-0.8B) and a slower prefill call; 0 = off (default {d.rs_snapshots})")
    p.add_argument("--spare-checkpoints", type=_non_negative, default=d.spare_checkpoints, metavar="N",
                   help="checkpoint buffers whose memory is faulted in while the server is idle, so that a "
                        "prefill's snapshot saves skip it (out of --cache-ram, at most an eighth of it; 0 = off; "
                        f"default {d.spare_checkpoints})")
    p.add_argument("--decode-batching", choices=["auto", "on", "off"], default=d.decode_batching,
                   help="one llama_decode for all generating slots: auto = only when measured bit-identical to "
                        "decoding alone on this model (default auto)")
    p.add_argument("--speculative", choices=["auto", "off", "ngram", "mtp", "draft"], default=d.speculative,
                   help="speculative decoding with n-gram (prompt lookup) drafts: auto = only in the verification "
                        "widths measured bit-identical to one-token decoding at start (none: off, and the log says "
                        "why), from --model-draft where given; ngram = also where none were (outputs may differ "
                        "from off); mtp = drafts from the model's multi-token-prediction head (a Qwen3.5 GGUF with "
                        "nextn layers), exact widths only; draft = drafts from --model-draft, exact widths only "
                        "(default auto)")
    p.add_argument("-md", "--model-draft", type=Path, default=d.model_draft, metavar="GGUF",
                   help="a smaller model with the same vocabulary that drafts for speculative decoding (e.g. "
                        "Qwen3.5-0.8B for Qwen3.5-9B); its drafts are verified, so answers do not depend on it")
    p.add_argument("--draft-window", type=_positive, default=d.draft_window, metavar="N",
                   help="most prompt tokens the draft model reads of a request, its last ones "
                        f"(default {d.draft_window})")
    p.add_argument("--decode-rows", type=int, choices=[1, 2], default=d.decode_rows,
                   help="rows per one-token decode step: 2 = the token and a rolled-back copy, the kernels of a "
                        "speculative verification, so that verification is exact by construction (answers differ "
                        "from 1; each step computes a second row; default 1)")
    p.add_argument("--decode-kernels", choices=["auto", "default", "reference"], default=d.decode_kernels,
                   help="ggml-cpu kernels of decode steps and verifications: reference = the one-row kernels at "
                        "every width, so speculative verification is exact beyond 7 tokens (prefill keeps the fast "
                        "kernels); auto = reference with -ctk q8_0 where llama-cpp-python allows it (default auto)")
    p.add_argument("-fa", "--flash-attn", choices=["auto", "on", "off"], default=d.flash_attn,
                   help="flash attention: auto = off over F16 (exact prefill splits), on with -ctk/-ctv other than "
                        "f16/f32: -ctk q8_0 is the layout where speculative verification is exact at one row per "
                        "decode step, but prefill is about 3x slower at 12k tokens of context (default auto)")
    p.add_argument("-ctk", "--cache-type-k", choices=["auto", *KV_TYPES], default=d.cache_type_k,
                   help="KV cache type for K (default auto: see --flash-attn)")
    p.add_argument("-ctv", "--cache-type-v", choices=["auto", *KV_TYPES], default=d.cache_type_v,
                   help="KV cache type for V; other than f16/f32 needs flash attention (default auto: f16)")
    p.add_argument("--draft-max", type=_positive, default=d.draft_max, metavar="N",
                   help=f"most drafted tokens per verification (default {d.draft_max})")
    p.add_argument("-b", "--batch-size", type=_positive, default=d.batch_size,
                   help=f"n_batch: most tokens per llama_decode; prefill is chunked to it (default {d.batch_size})")
    p.add_argument("-t", "--threads", type=_positive, default=d.threads, help=f"CPU threads (default {d.threads})")
    p.add_argument("--cache-ram", type=_non_negative, default=None, metavar="MiB",
                   help=f"RAM budget for snapshots in MiB (default: a quarter of available memory, now "
                        f"{default_cache_ram_mib()}); 0 disables the cache")
    p.add_argument("--cache-policy", choices=sorted(POLICIES), default=d.cache_policy,
                   help=f"which snapshot leaves RAM first (default {d.cache_policy}; docs/reuse.md)")
    p.add_argument("--no-cache", action="store_true", help="never reuse or store state (every request cold)")
    p.add_argument("--cache-disk-dir", type=Path, default=Path(user_cache_dir("orchestrator")) / "snapshots",
                   help="disk tier for snapshots evicted from RAM; kept across restarts (default: %(default)s)")
    p.add_argument("--cache-disk", type=_non_negative, default=d.cache_disk_mib, metavar="MiB",
                   help=f"disk tier budget in MiB (default {d.cache_disk_mib}); 0 disables the disk tier")
    p.add_argument("--cache-remote", type=_redis_url, default=os.environ.get("ORCHESTRATOR_CACHE_REMOTE") or None,
                   metavar="URL",
                   help="shared snapshot tier below RAM and disk, in Redis: redis://[user:password@]host:port/db "
                        "(rediss:// for TLS); replicas pointing at the same Redis restore each other's snapshots. "
                        "Redis then holds user data (prompt-derived state): bind it to loopback or use TLS and a "
                        "password (default: $ORCHESTRATOR_CACHE_REMOTE, else none; prefer the environment "
                        "variable for a URL with a password: arguments show in `ps`)")
    p.add_argument("--cache-remote-queue", type=_non_negative, default=d.cache_remote_queue_mib, metavar="MiB",
                   help=f"remote tier write-behind queue in MiB; entries beyond it are dropped and counted "
                        f"(default {d.cache_remote_queue_mib})")
    p.add_argument("--cache-remote-timeout", type=_positive_float, default=d.cache_remote_timeout, metavar="SECONDS",
                   help=f"longest Redis socket operation before the remote tier counts as down and is skipped "
                        f"while it reconnects in the background (default {d.cache_remote_timeout:g})")
    p.add_argument("--replica-name", default=None, metavar="NAME",
                   help="this server's name in the x-orchestrator-replica response header (default: hostname:port)")
    p.add_argument("--checkpoint-interval", type=_non_negative, default=d.checkpoint_interval, metavar="N",
                   help=f"recurrent checkpoint every N tokens inside long messages (default "
                        f"{d.checkpoint_interval}; 0 = only at template boundaries)")
    p.add_argument("-a", "--alias", help="model id reported by the API (default: the file name)")
    p.add_argument("--chat-template-file", type=_existing_file, help="Jinja2 chat template overriding the GGUF's")
    p.add_argument("-n", "--max-tokens", type=_positive, default=d.max_tokens_default,
                   help="completion budget when a request sets none (default: until the context is full, at most "
                        "--max-tokens-limit)")
    p.add_argument("--use-extra-bufts", nargs="?", const="on", choices=("auto", "on", "off"), default=d.use_extra_bufts,
                   help="llama.cpp CPU weight repacking: auto measures it once per model and CPU in a child process "
                        "and keeps it where exact and faster, never on AMX CPUs (default: auto; alone: on)")
    p.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", type=_gpu_layers, default=d.n_gpu_layers, metavar="N",
                   help="layers to offload to the GPU devices: a number, or auto / all (default: all, which is "
                        "none on a CPU-only build; the startup log and /health name the backend and devices)")
    p.add_argument("-dev", "--device", type=_device_list, default=d.devices, metavar="DEV1,DEV2",
                   help="ggml devices to offload to, e.g. Vulkan0 or CUDA0,CUDA1; none = no offload (default: "
                        "every GPU, else the integrated GPUs, as llama.cpp chooses)")
    p.add_argument("-mg", "--main-gpu", type=_non_negative, default=d.main_gpu, metavar="INDEX",
                   help="offload to that one of the devices only (llama-server's -sm none -mg INDEX; default: all)")
    p.add_argument("-nkvo", "--no-kv-offload", action="store_true",
                   help="keep the KV cache and attention on the host while layers are offloaded")
    p.add_argument("--api-key", type=_api_key, default=os.environ.get("ORCHESTRATOR_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health, and enable cache "
                        "administration (default: $ORCHESTRATOR_API_KEY; none = no authentication, no "
                        "administration). Prefer the environment variable: arguments show in `ps`")
    p.add_argument("--admin-key", type=_api_key, default=os.environ.get("ORCHESTRATOR_ADMIN_KEY") or None,
                   help="the operator's key: only it may flush the cache, read /metrics and /v1/cache/stats and see "
                        "/health's queue and cache figures, which tell one tenant what others do; the --api-key "
                        "then serves requests only (default: $ORCHESTRATOR_ADMIN_KEY; none = the --api-key is also "
                        "the operator's)")
    p.add_argument("--max-body-size", type=_positive, default=d.max_body_mib, metavar="MiB",
                   help=f"largest request body accepted, MiB (default {d.max_body_mib}; 413 above)")
    p.add_argument("--max-messages", type=_positive, default=d.max_messages, metavar="N",
                   help=f"most messages in one chat request (default {d.max_messages}; 400 above)")
    p.add_argument("--max-tokens-limit", type=_positive, default=d.max_tokens_limit, metavar="N",
                   help=f"most completion tokens one request generates (default {d.max_tokens_limit}): a request "
                        f"asking for more is served up to it and ends with its route's length reason")
    p.add_argument("--max-prompt-size", type=_positive, default=d.max_prompt_kib, metavar="KiB",
                   help=f"most bytes of text in one prompt (messages, tools, system together), checked before it is "
                        f"rendered; count_tokens too (default {d.max_prompt_kib}; 400 above)")
    p.add_argument("--max-prompt-parts", type=_positive, default=d.max_prompt_parts, metavar="N",
                   help=f"most content parts (blocks, cache breakpoints, tool calls) in one prompt "
                        f"(default {d.max_prompt_parts}; 400 above)")
    p.add_argument("--grammar-budget", type=_positive_float, default=d.grammar_budget, metavar="SECONDS",
                   help=f"structured output: most seconds to build a request's grammar, and llama.cpp's grammar "
                        f"to filter the vocabulary for one token (default {d.grammar_budget}; the request fails "
                        f"with 400 above, the others go on)")
    p.add_argument("--grammar-max-schema", type=_positive, default=d.grammar_max_schema, metavar="N",
                   help=f"most JSON values (properties, enum members...) in one request's schemas "
                        f"(default {d.grammar_max_schema}; 400 above)")
    p.add_argument("--grammar-memory", type=_positive, default=d.grammar_memory_mib, metavar="MiB",
                   help=f"memory a grammar process may allocate beyond the vocabulary (default "
                        f"{d.grammar_memory_mib})")
    p.add_argument("--parse-special-in-content", action="store_true",
                   help="tokenize control-token text inside messages, tool results and tool schemas as control "
                        "tokens, as llama-server does (UNSAFE: anyone who can put text in front of the model can "
                        "forge system, assistant or tool turns; off by default, see docs/security.md)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _config(a: argparse.Namespace) -> Config:
    cfg = Config(model=a.model, host=a.host, port=a.port, ctx_size=a.ctx_size, batch_size=a.batch_size,
                 threads=a.threads, model_alias=a.alias, chat_template=a.chat_template_file,
                 max_tokens_default=a.max_tokens, use_extra_bufts=a.use_extra_bufts,
                 cache_disk_dir=a.cache_disk_dir, cache_disk_mib=a.cache_disk, cache_policy=a.cache_policy,
                 checkpoint_interval=a.checkpoint_interval, parallel=a.parallel or Config.parallel,
                 parallel_auto=a.parallel is None, queue_size=a.queue_size,
                 timeout=a.timeout, prefill_chunk=a.prefill_chunk, prefill_chunk_alone=a.prefill_chunk_alone,
                 snapshot_min_gap=a.snapshot_min_gap, spare_checkpoints=a.spare_checkpoints, rs_snapshots=a.rs_snapshots,
                 decode_batching=a.decode_batching, speculative=a.speculative, draft_max=a.draft_max,
                 model_draft=a.model_draft, draft_window=a.draft_window,
                 decode_rows=a.decode_rows, decode_kernels=a.decode_kernels, flash_attn=a.flash_attn, cache_type_k=a.cache_type_k,
                 cache_type_v=a.cache_type_v,
                 calibration_file=Path(user_cache_dir("orchestrator")) / "calibration.json",
                 api_key=a.api_key, admin_key=a.admin_key, max_body_mib=a.max_body_size, max_messages=a.max_messages,
                 max_tokens_limit=a.max_tokens_limit, max_prompt_kib=a.max_prompt_size,
                 max_prompt_parts=a.max_prompt_parts, grammar_budget=a.grammar_budget,
                 grammar_max_schema=a.grammar_max_schema, grammar_memory_mib=a.grammar_memory,
                 parse_special_in_content=a.parse_special_in_content,
                 cache_remote=a.cache_remote, cache_remote_queue_mib=a.cache_remote_queue,
                 cache_remote_timeout=a.cache_remote_timeout, replica_name=a.replica_name,
                 n_gpu_layers=a.n_gpu_layers, devices=a.device, main_gpu=a.main_gpu, kv_offload=not a.no_kv_offload)
    if a.cache_ram is not None:
        cfg.cache_ram_mib = a.cache_ram
    cfg.cache_enabled = not a.no_cache and cfg.cache_ram_mib > 0
    return cfg


def bind_warning(cfg: Config) -> str | None:
    """The warning to log when the server listens beyond loopback without an API key, else None."""
    if cfg.host in ("127.0.0.1", "localhost", "::1") or cfg.api_key is not None:
        return None
    return (f"listening on {cfg.host} without --api-key: the API has no authentication; anyone who can reach it "
            f"can use it (set ORCHESTRATOR_API_KEY or --api-key)")


def main(serve: Callable[[Config, str], int], argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]); `serve` runs the `serve` subcommand with the
    configuration and the log level, and returns the exit status (server/__main__.py's: the HTTP layer sits above
    this package, so the launchers pass it in)."""
    parser = argparse.ArgumentParser(prog="python -m orchestrator", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    p = sub.add_parser("synth-model", help="write a random-weight Qwen3.5-shaped GGUF (no download needed)")
    from .models.synth import PRESETS  # numpy and gguf load lazily there

    p.add_argument("--preset", choices=sorted(PRESETS), help="required unless --sizes")
    p.add_argument("--out", type=Path, help="output GGUF (default: build once into the user cache and print its path)")
    p.add_argument("--sizes", action="store_true", help="print the preset's sizes (recurrent state per checkpoint, KV "
                   "per token, weights, file) from its shapes, without building; every preset without --preset")
    p.add_argument("--mtp", action="store_true", help="add the multi-token-prediction block published Qwen3.5 models "
                   "ship (llama.cpp's nextn layers, random like the rest): the preset '<preset>-mtp'")
    a = parser.parse_args(argv)
    if a.command == "synth-model" and not a.sizes and a.preset is None:
        parser.error("synth-model: --preset is required (or --sizes)")
    level = getattr(a, "log_level", "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if a.command == "serve":
        return serve(_config(a), a.log_level)
    from .models.synth import SynthError, build_model, ensure_model, sizes_table, with_mtp

    if a.sizes:
        print(sizes_table([a.preset] if a.preset else list(PRESETS)))
        return 0
    try:
        preset = with_mtp(a.preset) if a.mtp else a.preset
    except SynthError as e:
        parser.error(f"synth-model: {e}")
    path = build_model(preset, a.out) if a.out else ensure_model(preset)
    print(path)
    return 0
