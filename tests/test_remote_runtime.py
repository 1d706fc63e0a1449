"""Two runtimes of the tiny model that share nothing but a real Redis (--cache-remote): what one stores the other
restores, with outputs equal to cold runs (greedy tokens and first-step logits); salts apart; corrupt blobs and a
Redis killed mid-run cost misses, never a failed request; reuse resumes after Redis restarts.
"""

from __future__ import annotations

import time

import httpx
import numpy as np

from orchestrator.request import Job, SamplingParams
from server.metrics import Metrics

from .conftest import LiveServer, assert_same_as_cold, run_chat
from .redis_server import redis_server  # noqa: F401 - the fixture

TOOLS = [{"type": "function", "function": {
    "name": "search_code", "description": "Search the repository for a regular expression; returns matching lines.",
    "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
                   "required": ["pattern"]}}}]
SYSTEM = {"role": "system", "content": "You are a careful coding assistant. Cite paths; keep answers short. " * 8}


def ask(text: str, system: dict = SYSTEM) -> list[dict]:
    return [system, {"role": "user", "content": text}]


def wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached within the bound")
        time.sleep(0.05)


def settle(rt) -> None:
    """Let the runtime store its after-generation snapshot and write everything behind to Redis."""
    assert rt.scheduler.drain(60)
    assert rt.cache.tier("remote").flush(30)


def remote_stats(rt):
    return rt.cache.stats().tiers[-1]


def test_a_snapshot_one_runtime_stores_is_restored_by_a_second_sharing_only_redis(start, redis_server):  # noqa: F811
    a, b = start(cache_remote=redis_server.url), start(cache_remote=redis_server.url)
    prompt = a.prompts.chat([{"role": "user", "content": "Count from one to ten."}], None, {})
    first = a.scheduler.run(Job(prompt.tokens, prompt.boundaries, max_tokens=12,
                                sampling=SamplingParams(temperature=0.0)))
    settle(a)
    # Turn 2 extends turn 1's prompt and exactly its generated tokens, and goes to the other replica.
    extended = prompt.tokens + first.completion_tokens + a.engine.tokenize("\nMore text follows here.")
    warm = b.scheduler.run(Job(extended, max_tokens=4, want_logits=True))
    cold = b.scheduler.run(Job(extended, max_tokens=4, use_cache=False, want_logits=True))
    assert (warm.restore_source, warm.cached_tokens) == ("remote", len(prompt.tokens) + len(first.completion_tokens))
    assert warm.completion_tokens == cold.completion_tokens
    assert np.array_equal(warm.first_logits, cold.first_logits)
    assert remote_stats(b).hits == 2  # the checkpoint and the KV entry
    b.cache.check()


def test_another_agent_restores_the_shared_tools_and_system_prefix_from_the_other_runtime(start, redis_server):  # noqa: F811
    a, b = start(cache_remote=redis_server.url), start(cache_remote=redis_server.url)
    run_chat(a, ask("Where is the eviction policy?"), TOOLS)
    settle(a)
    # No KV entry of A prefixes B's prompt: the KV of A's request is listed at the checkpoints it covers.
    other = assert_same_as_cold(b, ask("How are snapshots keyed?"), TOOLS)
    assert other.result.restore_source == "remote"
    assert other.result.cached_tokens == other.boundaries.system_end > 0
    again = assert_same_as_cold(b, ask("And how are they evicted?"), TOOLS)
    assert again.result.restore_source in ("live", "ram")  # promoted: the next one is local
    assert again.result.cached_tokens == again.boundaries.system_end
    b.scheduler.drain(60)
    b.cache.check()


def test_salts_never_read_each_others_snapshots_through_redis(start, redis_server):  # noqa: F811
    a, b = start(cache_remote=redis_server.url), start(cache_remote=redis_server.url)
    run_chat(a, ask("Do you repair brakes?"), cache_salt="tenant-a")
    settle(a)
    other = assert_same_as_cold(b, ask("Do you sell helmets?"), cache_salt="tenant-b")
    assert (other.result.cached_tokens, other.result.restore_source) == (0, "none")
    unsalted = assert_same_as_cold(b, ask("Do you sell gloves?"))
    assert unsalted.result.cached_tokens == 0
    same = assert_same_as_cold(b, ask("Do you sell bells?"), cache_salt="tenant-a")
    assert same.result.restore_source == "remote" and same.result.cached_tokens == same.boundaries.system_end


def test_a_corrupt_blob_in_redis_is_a_miss_deleted_and_the_output_equals_the_cold_run(start, redis_server):  # noqa: F811
    a, b = start(cache_remote=redis_server.url), start(cache_remote=redis_server.url)
    run_chat(a, ask("What does the scheduler do?"))
    settle(a)
    raw = redis_server.client()
    blobs = raw.keys("*:e:*")
    assert blobs
    for name in blobs:  # one byte of every payload flipped
        at = raw.strlen(name) - 1
        raw.setrange(name, at, bytes([raw.getrange(name, at, at)[0] ^ 0xFF]))
    t = assert_same_as_cold(b, ask("What does the cache do?"))
    assert t.result.cached_tokens == 0 and t.result.restore_source == "none"
    assert remote_stats(b).rejected_invalid >= 1
    spoiled_left = [n for n in blobs if raw.exists(n)]
    assert len(spoiled_left) < len(blobs)  # what B read was deleted
    b.cache.check()


def test_redis_killed_mid_run_then_restarted_no_request_fails_and_reuse_resumes(start, redis_server):  # noqa: F811
    a = start(cache_remote=redis_server.url, cache_remote_timeout=0.5)
    b = start(cache_remote=redis_server.url, cache_remote_timeout=0.5)
    run_chat(a, ask("First question before the outage."))
    settle(a)
    redis_server.kill()
    during = assert_same_as_cold(b, ask("A question during the outage."))  # the probe fails: a miss, no error
    assert during.result.restore_source == "none"
    local = assert_same_as_cold(a, ask("Another question during the outage."))
    assert local.result.restore_source in ("live", "ram") and local.result.cached_tokens > 0
    assert remote_stats(b).errors >= 1 and remote_stats(b).disabled
    metrics = Metrics(b.cache_stats).render().decode()
    assert 'orchestrator_cache_tier_up{tier="remote"} 0.0' in metrics
    assert 'orchestrator_cache_tier_errors_total{tier="remote"}' in metrics
    redis_server.start()  # empty again: reuse resumes with what is written from now on
    wait_until(lambda: a.cache.tier("remote").up and b.cache.tier("remote").up)
    system = {"role": "system", "content": "A new system prompt after the restart, which B never saw. " * 8}
    run_chat(a, ask("First question after the restart.", system))
    settle(a)
    after = assert_same_as_cold(b, ask("Second question after the restart.", system))
    assert after.result.restore_source == "remote" and after.result.cached_tokens == after.boundaries.system_end
    assert 'orchestrator_cache_tier_up{tier="remote"} 1.0' in Metrics(b.cache_stats).render().decode()


def test_fetch_only_when_the_transfer_is_faster_than_the_measured_prefill(start, redis_server):  # noqa: F811
    a, b = start(cache_remote=redis_server.url), start(cache_remote=redis_server.url)
    run_chat(a, ask("Which module calls llama.cpp?"))
    settle(a)
    rate = b.scheduler.reuse.prefill
    assert rate.tokens_per_s > 0  # measured at start, refined since
    rate.tokens_per_s = 1e15  # as if recomputing were nearly free: nothing is worth fetching
    skipped = assert_same_as_cold(b, ask("Which module parses replies?"))
    assert (skipped.result.restore_source, skipped.result.cached_tokens) == ("none", 0)
    assert b.cache.stats().shared_skipped >= 1
    b.cache.clear()
    rate.tokens_per_s = 1e-3  # as if recomputing took forever
    fetched = assert_same_as_cold(b, ask("Which module tokenizes prompts?"))
    assert fetched.result.restore_source == "remote" and fetched.result.cached_tokens > 0


def test_responses_name_the_replica_and_the_restore_tier(start, redis_server):  # noqa: F811
    a = start(cache_remote=redis_server.url, replica_name="replica-a")
    b = start(cache_remote=redis_server.url, replica_name="replica-b")
    srv_a, srv_b = LiveServer(a), LiveServer(b)
    try:
        body = {"messages": ask("Hello there, which tools do you have?"), "max_tokens": 2, "temperature": 0}
        with httpx.Client(timeout=120) as client:
            r = client.post(srv_a.url + "/v1/chat/completions", json=body)
            assert r.headers["x-orchestrator-replica"] == "replica-a"
            assert r.headers["x-orchestrator-cache-tier"] == "none"
            settle(a)
            body["messages"] = ask("Hello there, what can you do?")
            r = client.post(srv_b.url + "/v1/chat/completions", json=body)
            assert (r.headers["x-orchestrator-replica"], r.headers["x-orchestrator-cache-tier"]) == \
                ("replica-b", "remote")
            assert r.json()["timings"]["cache_source"] == "remote"
            assert client.get(srv_b.url + "/health").headers["x-orchestrator-replica"] == "replica-b"
            assert client.get(srv_b.url + "/v1/models/none").headers["x-orchestrator-replica"] == "replica-b"
    finally:
        srv_a.stop()
        srv_b.stop()
