"""Shared fixtures: the tiny synthetic Qwen3.5 (random weights, real vocabulary and template), an in-process
runtime, and a live server on a free loopback port.

ORCHESTRATOR_TEST_MODEL=path runs the model-level tests against another GGUF (e.g. a real Qwen3.5).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib.util
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn

from orchestrator.config import Config
from orchestrator.request import Event, Job, Result, SamplingParams
from orchestrator.runtime import Runtime
from orchestrator.speculative.policy import VerifyCosts
from server.app import create_app


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    env = os.environ.get("ORCHESTRATOR_TEST_MODEL")
    if env:
        return Path(env)
    from orchestrator.models.synth import ensure_model

    return ensure_model("tiny")


@pytest.fixture(scope="session")
def ending_model() -> Path:
    """A model whose answers end as a real model's do (</think>, then <|im_end|>, after tens of tokens): the
    `tiny-ends` synthetic preset (orchestrator.models.synth, module doc "Ending answers"), or
    ORCHESTRATOR_TEST_MODEL (a real model ends its answers)."""
    env = os.environ.get("ORCHESTRATOR_TEST_MODEL")
    if env:
        return Path(env)
    from orchestrator.models.synth import ensure_model

    return ensure_model("tiny-ends")


class FreeCosts(VerifyCosts):
    """Verification costs for the tests of what speculation computes (not of when it pays: tests/test_drafts.py):
    every width and rollback as cheap as a decode step, so every available draft is verified whatever the
    acceptance and the machine's timings, and rejections and their rollbacks happen in every case."""

    def ratio(self, width: int) -> float:
        return 1.0

    def rewind_ratio(self) -> float:
        return 0.0

    def draft_ratio(self) -> float:
        return 0.0


def spy_verify_many(monkeypatch, engine) -> list[tuple[list[int], bool]]:
    """Record each `engine.verify_many` call, then make it: (tokens per sequence, `every`) per call, in order."""
    calls, verify_many = [], engine.verify_many

    def spied(items, every=True):
        calls.append(([len(tokens) for _, tokens, _ in items], every))
        return verify_many(items, every)

    monkeypatch.setattr(engine, "verify_many", spied)
    return calls


def verify_every_draft(rt: Runtime) -> Runtime:
    """`rt` with FreeCosts in its scheduler's speculation (read by each request at its first step)."""
    rt.scheduler.speculation.costs = FreeCosts()
    return rt


def speculation_pair(tmp_path_factory, model: Path, speculative: str, parallel: int, **on_kw):
    """Yields (on, off): runtimes of `model` with two-row decode steps under ggml-cpu's default kernels (every
    width 2..7 exact: the tiled matmul takes 8+ rows; the defaults' reference kernels are tests/
    test_attention_layouts.py's), `speculative` (and `on_kw`) with every draft verified (FreeCosts) and speculation
    off, `parallel` slots; one calibration file, so that the second start reads what the first measured. A module
    fixture's body."""
    cal = tmp_path_factory.mktemp("cal") / "calibration.json"
    kw = dict(ctx_size=2048, parallel=parallel, decode_rows=2, calibration_file=cal, decode_batching="off",
              decode_kernels="default")
    on = verify_every_draft(Runtime.start(make_config(model, speculative=speculative, **kw, **on_kw)))
    off = Runtime.start(make_config(model, speculative="off", **kw))
    yield on, off
    on.close()
    off.close()


# a prompt the random tiny models answer in loops (their own answer gets drafted), and the sampling cases
# speculation must leave unchanged
LOOP = "<|im_start|>user\n" + "alpha beta gamma delta " * 30 + "<|im_end|>\n<|im_start|>assistant\n"
SPECULATION_CASES = {
    "greedy": dict(sampling=SamplingParams(temperature=0.0)),
    "seeded": dict(sampling=SamplingParams(temperature=0.15, top_k=20, seed=7)),
    "logprobs": dict(sampling=SamplingParams(temperature=0.0), logprobs=2),
    "stop": dict(sampling=SamplingParams(temperature=0.0), stop=("a",)),
    "cold": dict(sampling=SamplingParams(temperature=0.0), use_cache=False),
    "n2": dict(sampling=SamplingParams(temperature=0.15, top_k=20, seed=3), n=2),
}


def same_answers(on: Runtime, off: Runtime, job: Job) -> tuple[list[Result], list[Result]]:
    """Both runtimes' results for `job`, asserted equal: tokens, text, finish, logprobs, first-step logits."""
    a, b = on.scheduler.run_choices(job), off.scheduler.run_choices(job)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.completion_tokens, x.text, x.finish_reason, x.logprobs) == \
            (y.completion_tokens, y.text, y.finish_reason, y.logprobs)
        assert np.array_equal(x.first_logits, y.first_logits)
    return a, b


def every_width(n_slots: int, batched: bool = True) -> tuple[int, ...]:
    """Scheduler batch_widths for "all generating slots in one decode step" (batched) or "each alone"."""
    return tuple(range(2, n_slots + 1)) if batched else ()


def make_config(model: Path, **kw) -> Config:
    # speculative "off": no verification-width probe at every start; tests/test_speculative_models.py and
    # test_attention_layouts.py start with it on.
    # use_extra_bufts "off": no repacking probe at every start; tests/test_repacking.py tests "auto", and
    # test_correctness.py serves tiny-q4 repacked too. flash_attn "off": the default layout (flash attention off
    # over F16) named outright; tests/test_attention_layouts.py tests "auto" and serves the VERIFYING layout.
    base = dict(model=model, ctx_size=16384, batch_size=256, threads=2, cache_ram_mib=2048, checkpoint_interval=0,
                parallel=1, speculative="off", use_extra_bufts="off", flash_attn="off")
    base.update(kw)
    return Config(**base)


@pytest.fixture()
def start(tiny_model):
    """start(model=None, **config) -> a Runtime (default: the tiny model), closed after the test."""
    runtimes = []

    def _start(model=None, **kw):
        rt = Runtime.start(make_config(model or tiny_model, **kw))
        runtimes.append(rt)
        return rt

    yield _start
    for rt in runtimes:
        rt.close()


@pytest.fixture(scope="module")
def runtime(tiny_model):
    rt = Runtime.start(make_config(tiny_model))
    yield rt
    rt.close()


@pytest.fixture()
def fresh_cache(runtime):
    """The module's runtime with an empty cache (after earlier after-generation snapshots landed); drained and
    recounted (`SnapshotCache.check`) after the test."""
    runtime.scheduler.drain()
    runtime.cache.clear()
    yield runtime
    runtime.scheduler.drain()
    runtime.cache.check()


@dataclass
class Turn:
    """One chat request run in-process: the prompt's tokens and boundaries, and the result."""

    tokens: list[int]
    boundaries: object
    result: Result


def run_chat(rt: Runtime, messages, tools=None, use_cache=True, max_tokens=8, cache_salt="",
             **template_kwargs) -> Turn:
    prompt = rt.prompts.chat(messages, tools, template_kwargs)
    job = Job(prompt_tokens=prompt.tokens, boundaries=prompt.boundaries, max_tokens=max_tokens,
              sampling=SamplingParams(temperature=0.0), use_cache=use_cache, want_logits=True,
              cache_salt=cache_salt)
    return Turn(prompt.tokens, prompt.boundaries, rt.scheduler.run(job))


def assert_same_as_cold(rt: Runtime, messages, tools=None, max_tokens=8, cache_salt="", **template_kwargs) -> Turn:
    """Run with the cache, then cold (cache off), and assert identical greedy tokens and first-step logits."""
    warm = run_chat(rt, messages, tools, True, max_tokens, cache_salt, **template_kwargs)
    rt.scheduler.drain()  # the warm run's after-generation work lands first (else the cold run would preempt it)
    cold = run_chat(rt, messages, tools, False, max_tokens, **template_kwargs)
    assert cold.result.cached_tokens == 0
    assert warm.result.completion_tokens == cold.result.completion_tokens
    assert np.array_equal(warm.result.first_logits, cold.result.first_logits), (
        f"first-step logits differ: max |Δ| = {np.abs(warm.result.first_logits - cold.result.first_logits).max()}")
    return warm


def write_then_disk_full(path, parts) -> None:
    """A stand-in for orchestrator.disk._write_parts on a disk that fills up mid-write: the first part lands, then
    ENOSPC."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "xb") as f:
        f.write(parts[0])
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_example():
    """examples/cluster.py as a module (Cluster, run_fleet, redis_binary, ...), loaded once."""
    mod = sys.modules.get("cluster_example")
    if mod is None:
        path = Path(__file__).resolve().parent.parent / "examples" / "cluster.py"
        spec = importlib.util.spec_from_file_location("cluster_example", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    return mod


class LiveServer:
    """uvicorn serving create_app(runtime) in a thread on 127.0.0.1:<free port>; `wrap` (an ASGI middleware
    factory, e.g. a request recorder) goes around the app."""

    def __init__(self, rt: Runtime, wrap=None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = create_app(rt) if wrap is None else wrap(create_app(rt))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@contextlib.contextmanager
def serving(model: Path, **config):
    """A Runtime of `model` with `config` (make_config's overrides) served by a LiveServer: yields (rt, srv)."""
    rt = Runtime.start(make_config(model, **config))
    srv = LiveServer(rt)
    try:
        yield rt, srv
    finally:
        srv.stop()
        rt.close()


@pytest.fixture(scope="module")
def live_server(runtime):
    srv = LiveServer(runtime)
    yield srv
    srv.stop()


@pytest.fixture()
def client(live_server):
    with httpx.Client(base_url=live_server.url, timeout=300) as c:
        yield c


def scripted(runtime, monkeypatch, text: str, finish_reason: str | None = None) -> None:
    """Make the model 'say' `text` (the random-weight model never writes a tool call, nor ends a turn): the server
    parses it as it would the real output. finish_reason: the result's, e.g. "stop" for a turn the model ended
    (default: the real run's)."""
    submit = runtime.scheduler.submit

    def fake(job, sink, *args):
        sent = []

        def wrap(ev: Event) -> None:
            if ev.kind == "text" or (ev.kind == "done" and not sent):
                if not sent:
                    sent.append(True)
                    sink(Event("text", text=text))
                if ev.kind == "text":
                    return
            if ev.kind == "done":
                ev = Event("done", result=dataclasses.replace(ev.result, text=text,
                                                              finish_reason=finish_reason or ev.result.finish_reason))
            sink(ev)

        return submit(job, wrap, *args)

    monkeypatch.setattr(runtime.scheduler, "submit", fake)


AGENTS_DIR = Path(__file__).parent / "agents"


@pytest.fixture(scope="session")
def agent_bin() -> Path:
    """The bin folder of the agent CLIs at the versions tests/agents/package-lock.json pins (Claude Code, Codex,
    pi), installed on first use with `npm ci` (about 35 s and 1 GB; Node.js 20 and npm from the machine)."""
    stamp = AGENTS_DIR / "node_modules" / ".installed-lock"
    lock = (AGENTS_DIR / "package-lock.json").read_bytes()
    if not stamp.exists() or stamp.read_bytes() != lock:
        import subprocess

        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=AGENTS_DIR, check=True,
                       timeout=600)
        stamp.write_bytes(lock)
    return AGENTS_DIR / "node_modules" / ".bin"


def serve_process(model: Path, log_path: Path, *flags: str, env: dict | None = None,
                  start_s: float = 600.0) -> tuple[subprocess.Popen, str]:
    """`python -m orchestrator serve --model MODEL --port <free> FLAGS` as a child process logging to
    `log_path`, once /health answers 200: (process, base URL). Fails the test with the log's tail if it exits
    or has not answered within `start_s` seconds (a first start calibrates: minutes on a loaded machine)."""
    port = free_port()
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "serve", "--model", str(model),
                             "--port", str(port), *flags], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + start_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start:\n{Path(log_path).read_text()[-3000:]}")
        time.sleep(0.3)
