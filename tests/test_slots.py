"""Parallel slots: concurrent conversations, batched decoding, cancellation, queue limits and timeouts.

Concurrent runs must give every request the output of its cold run (greedy tokens and first-step logits) and
the cached_tokens of a sequential run. `tiny-q4` (Q4_K_M) is batch-invariant, so its decode steps share one
llama_decode; `tiny` (F16) is not, so its slots decode one at a time; both are tested.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import numpy as np
import pytest

from orchestrator.calibration import check_batch_invariance
from orchestrator.errors import QueueFull, RequestCancelled, RequestTimeout
from orchestrator.cache.radix import CHECKPOINT, KV
from orchestrator.request import Event, Job, SamplingParams
from orchestrator.runtime import Runtime
from orchestrator.reuse import spaced_stops
from orchestrator.models.synth import ensure_model

from .conftest import LiveServer

SYSTEM = "You are a release engineer. Answer in one short paragraph and cite the file you used."
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
QUESTIONS = ["Which tests cover the disk tier?", "Where is n_batch enforced?",
             "How are snapshots named on disk?", "What does the radix tree store per node?"]


@pytest.fixture(scope="module")
def q4_model():
    return ensure_model("tiny-q4")


@pytest.fixture()
def start(start):
    """conftest's `start` with the defaults of these tests: 4 slots, 4,096 tokens each; the model is required."""
    def _start(model, **kw):
        kw.setdefault("parallel", 4)
        kw.setdefault("ctx_size", 4096)
        return start(model, **kw)

    return _start


def chat_job(rt: Runtime, messages, use_cache=True, max_tokens=8) -> Job:
    prompt = rt.prompts.chat(messages, TOOLS, {})
    return Job(prompt.tokens, prompt.boundaries, max_tokens=max_tokens,
               sampling=SamplingParams(temperature=0.0), use_cache=use_cache, want_logits=True)


def submit_all(rt: Runtime, jobs: list[Job]) -> list[tuple[object, str]]:
    """Submit every job at once (in order) and wait: [(result, streamed text)]."""
    done = [threading.Event() for _ in jobs]
    results: list = [None] * len(jobs)
    texts = [""] * len(jobs)

    def sink_for(i):
        def sink(ev: Event) -> None:
            if ev.kind == "text":
                texts[i] += ev.text
            else:
                results[i] = ev.result if ev.kind == "done" else ev.error
                done[i].set()
        return sink

    for i, job in enumerate(jobs):
        rt.scheduler.submit(job, sink_for(i))
    for d in done:
        assert d.wait(300)
    return list(zip(results, texts))


def conversations(turn_outputs: list[list[str]]) -> list[list[dict]]:
    """Message lists for the next turn of each conversation, given the assistant texts so far."""
    convs = []
    for i, q in enumerate(QUESTIONS):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        for k, answer in enumerate(turn_outputs[i]):
            msgs += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": f"Follow-up {k}: and the tests for that?"}]
        convs.append(msgs)
    return convs


@pytest.mark.parametrize("preset,kernels,batched", [("tiny-q4", "auto", True), ("tiny", "auto", True),
                                                    ("tiny", "default", False)])
def test_concurrent_conversations_equal_cold_and_sequential_runs(start, preset, kernels, batched):
    """F16 decode steps batch exactly with the defaults' reference decode kernels (tinyBLAS gated out of them),
    not with ggml-cpu's default kernels, which take tinyBLAS for two or more rows: both ways, concurrent
    conversations answer as sequential and cold runs."""
    model = ensure_model(preset)
    seq_rt = start(model, decode_kernels=kernels)
    assert bool(seq_rt.scheduler.batch_widths) is batched  # measured at start (calibration.exact_batch_widths)
    # Sequential oracle: each turn of each conversation, one at a time, on a fresh cache; and cold runs.
    outputs: list[list[str]] = [[] for _ in QUESTIONS]
    sequential, cold = [], []
    for _turn in range(2):
        convs = conversations(outputs)
        for i, msgs in enumerate(convs):
            r = seq_rt.scheduler.run(chat_job(seq_rt, msgs))
            c = seq_rt.scheduler.run(chat_job(seq_rt, msgs, use_cache=False))
            assert r.completion_tokens == c.completion_tokens
            sequential.append(r)
            cold.append(c)
            outputs[i].append(r.text)
        seq_rt.scheduler.drain()
    assert [r.cached_tokens for r in sequential[1:4]] == [sequential[1].cached_tokens] * 3 > [0] * 3

    # Concurrent: every conversation's turn submitted at once on a fresh runtime.
    rt = start(model, decode_kernels=kernels)
    outputs = [[] for _ in QUESTIONS]
    got = []
    for _turn in range(2):
        jobs = [chat_job(rt, msgs) for msgs in conversations(outputs)]
        for i, (r, streamed) in enumerate(submit_all(rt, jobs)):
            assert streamed == r.text  # no event of another request in this stream
            outputs[i].append(r.text)
            got.append(r)
        rt.scheduler.drain()
    assert len({r.slot for r in got}) > 1  # they did run side by side
    for r, s, c in zip(got, sequential, cold):
        assert r.completion_tokens == c.completion_tokens
        assert np.array_equal(r.first_logits, c.first_logits)
        assert r.cached_tokens == s.cached_tokens


def test_requests_sharing_a_prefix_wait_for_it_instead_of_prefilling_it_again(start, q4_model):
    rt = start(q4_model)
    msgs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    jobs = [chat_job(rt, m) for m in msgs]
    stops = spaced_stops(jobs[0].boundaries, len(jobs[0].prompt_tokens), rt.config.snapshot_min_gap)
    shared = max(b for b in stops if jobs[1].prompt_tokens[:b] == jobs[0].prompt_tokens[:b])
    results = submit_all(rt, jobs)
    assert [r.cached_tokens for r, _ in results] == [0, shared, shared, shared]


def test_batch_invariance_is_measured_on_the_model(start, q4_model, tiny_model):
    """F16 weights take llamafile's tinyBLAS for two or more rows under the default kernels, so batching changes
    their logits; the defaults' reference decode kernels gate it out (kernels.reference_matmuls)."""
    assert check_batch_invariance(start(q4_model).engine) is True
    assert check_batch_invariance(start(tiny_model).engine) is True
    assert check_batch_invariance(start(tiny_model, decode_kernels="default").engine) is False


class CancelAfter(threading.Event):
    """A cancel flag that turns itself on after `n` checks (the scheduler checks once per step)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    def is_set(self) -> bool:
        self.left -= 1
        return self.left < 0 or super().is_set()


def test_cancel_during_prefill_keeps_its_checkpoints_and_stores_no_end_state(start, q4_model):
    rt = start(q4_model, parallel=1, batch_size=64)
    words = " ".join(f"w{i}" for i in range(250))
    msgs = [{"role": "system", "content": SYSTEM + words}, {"role": "user", "content": "Summarise. " + words}]
    job = chat_job(rt, msgs)
    done, box = threading.Event(), []
    rt.scheduler.submit(job, lambda ev: (box.append(ev), done.set()) if ev.kind != "text" else None,
                        CancelAfter(6))
    assert done.wait(300)
    assert isinstance(box[0].error, RequestCancelled)
    rt.scheduler.drain()
    n = len(job.prompt_tokens)
    stored = {(len(tokens), kind) for kind, _tier, tokens in rt.cache.entries()}
    assert stored and all(k == CHECKPOINT for _, k in stored)  # checkpoints only: no KV, nothing at the end
    assert max(p for p, _ in stored) < n
    deepest = max(p for p, _ in stored)
    again = rt.scheduler.run(job)
    cold = rt.scheduler.run(chat_job(rt, msgs, use_cache=False))
    assert again.cached_tokens == deepest
    assert again.completion_tokens == cold.completion_tokens
    assert np.array_equal(again.first_logits, cold.first_logits)
    rt.scheduler.drain()
    # a whole run stores the KV where its branch ends (after its generated tokens)
    assert any(kind == KV and len(tokens) >= n for kind, _tier, tokens in rt.cache.entries())


class Gate:
    """A sink that holds the worker thread at the job's first text event until released: the slot stays busy."""

    def __init__(self) -> None:
        self.reached, self.release, self.done = threading.Event(), threading.Event(), threading.Event()

    def __call__(self, ev: Event) -> None:
        if ev.kind == "text" and not self.reached.is_set():
            self.reached.set()
            assert self.release.wait(120)
        elif ev.kind != "text":
            self.done.set()


def hold_the_only_slot(rt: Runtime) -> Gate:
    gate = Gate()
    rt.scheduler.submit(Job(rt.engine.tokenize("hold the slot " * 8), max_tokens=64), gate)
    assert gate.reached.wait(120)
    return gate


def test_queue_limit_and_timeout_at_the_scheduler(start, tiny_model):
    rt = start(tiny_model, parallel=1, queue_size=1)
    gate = hold_the_only_slot(rt)
    waited, box = threading.Event(), []
    rt.scheduler.submit(Job(rt.engine.tokenize("queued " * 8), max_tokens=2, timeout_s=0.05),
                        lambda ev: (box.append(ev), waited.set()) if ev.kind != "text" else None)
    with pytest.raises(QueueFull) as e:
        rt.scheduler.submit(Job(rt.engine.tokenize("refused " * 8), max_tokens=2), lambda ev: None)
    assert e.value.status == 429 and e.value.retry_after >= 1
    time.sleep(0.1)
    gate.release.set()
    assert waited.wait(60) and isinstance(box[0].error, RequestTimeout)
    assert gate.done.wait(60)
    assert rt.scheduler.run(Job(rt.engine.tokenize("served " * 8), max_tokens=2)).prompt_tokens > 0


def wait_until(check, timeout=60.0) -> None:
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.05)


@pytest.fixture()
def served(start, q4_model):
    servers = []

    def _serve(**kw):
        rt = start(q4_model, **kw)
        events: list[Event] = []
        submit = rt.scheduler.submit

        def recording_submit(job, sink, cancel=None):
            def both(ev):
                if ev.kind != "text":
                    events.append(ev)
                sink(ev)
            return submit(job, both, cancel)

        rt.scheduler.submit = recording_submit
        srv = LiveServer(rt)
        servers.append(srv)
        return rt, srv, events

    yield _serve
    for srv in servers:
        srv.stop()


def test_queue_full_answers_429_with_retry_after(served):
    rt, srv, _ = served(parallel=1, queue_size=1)
    gate = hold_the_only_slot(rt)
    body = {"model": "m", "prompt": "one two three four", "max_tokens": 2, "temperature": 0}
    queued: list[httpx.Response] = []
    t = threading.Thread(target=lambda: queued.append(httpx.post(srv.url + "/v1/completions", json=body, timeout=120)))
    t.start()
    wait_until(lambda: httpx.get(srv.url + "/health").json()["queue_length"] == 1)
    refused = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full"
    gate.release.set()
    t.join(120)
    assert queued[0].status_code == 200


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_slot(served, stream):
    rt, srv, events = served(parallel=1)
    max_tokens = 3000  # far more than the client waits for
    body = {"model": "m", "prompt": "count slowly: one two three", "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}
    if stream:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    wait_until(lambda: rt.scheduler.slots_busy == 0 and events)
    assert events[0].kind == "done" and len(events[0].result.completion_tokens) < max_tokens
    assert httpx.get(srv.url + "/health").json()["slots_busy"] == 0
    after = httpx.post(srv.url + "/v1/completions", json=dict(body, max_tokens=2, stream=False), timeout=60)
    assert after.status_code == 200


def test_load_16_clients_20_requests_each_loses_nothing_and_mixes_nothing(served):
    rt, srv, _ = served(parallel=4, queue_size=64)
    prompts = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{q} (variant {v})"}]
               for q in QUESTIONS for v in range(5)]

    def body(msgs, stream, cache=True):
        return {"model": "m", "messages": msgs, "tools": TOOLS, "max_tokens": 4, "temperature": 0,
                "stream": stream, "cache_prompt": cache}

    def ask(client: httpx.Client, msgs, stream: bool) -> str:
        if not stream:
            r = client.post("/v1/chat/completions", json=body(msgs, False))
            assert r.status_code == 200, r.text
            m = r.json()["choices"][0]["message"]
            return (m.get("reasoning_content") or "") + "|" + (m.get("content") or "")
        parts = {"reasoning_content": "", "content": ""}
        with client.stream("POST", "/v1/chat/completions", json=body(msgs, True)) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    for k in parts:
                        parts[k] += delta.get(k) or ""
        return parts["reasoning_content"] + "|" + parts["content"]

    with httpx.Client(base_url=srv.url, timeout=300) as c:
        expected = []
        for msgs in prompts:
            r = c.post("/v1/chat/completions", json=body(msgs, False, cache=False)).json()["choices"][0]["message"]
            expected.append((r.get("reasoning_content") or "") + "|" + (r.get("content") or ""))
    failures: list[str] = []
    answered = [0] * 16

    def client_loop(k: int) -> None:
        with httpx.Client(base_url=srv.url, timeout=300) as c:
            for j in range(20):
                i = (k * 7 + j * 3) % len(prompts)
                try:
                    got = ask(c, prompts[i], stream=(j % 2 == 1))
                except Exception as e:  # noqa: BLE001 - collected and reported below
                    failures.append(f"client {k} request {j}: {e!r}")
                    continue
                if got != expected[i]:
                    failures.append(f"client {k} request {j}: prompt {i} answered {got!r}, cold {expected[i]!r}")
                answered[k] += 1

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    assert not failures, failures[:5]
    assert answered == [20] * 16
