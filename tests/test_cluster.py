"""Two replicas of the tiny model behind the SMG router and one Redis, all real processes on loopback, started
by examples/cluster.py's `Cluster`: agents stay on their replica under `cache_aware`; a round-robin router moves
them and the remote tier restores them; a killed replica's agents go on from the remote tier on the other one;
every answer checked equals a cold run (cache_prompt false) on the replica that served it.

Bounded in time (each start and wait has a limit); no timing assertions.
"""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest

from .conftest import cluster_example

NEAR = 8  # "through the end of the previous turn": at most this many tokens short of the previous prompt's end

C = cluster_example()


@pytest.fixture()
def cluster(tiny_model, tmp_path):
    c = C.Cluster(tiny_model, workdir=tmp_path)
    yield c
    c.close()


def settle_writes(url: str, timeout_s: float = 60) -> None:
    """Wait until the replica at `url` wrote (or dropped) every entry it stored to Redis: its write-behind queue
    is empty, so a kill loses nothing."""
    def counter(text: str, name: str) -> float:
        m = re.search(rf'^{name}(?:{{tier="remote"}})? (\S+)$', text, re.M)
        return float(m.group(1)) if m else 0.0

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=5).text
        done = counter(text, "orchestrator_cache_tier_writes_total") + \
            counter(text, "orchestrator_cache_tier_dropped_writes_total")
        if done >= counter(text, "orchestrator_cache_inserts_total"):
            return
        time.sleep(0.1)
    raise AssertionError("the replica's writes to Redis did not settle")


def assert_cold_equal(client: httpx.Client, url: str, rec: dict, fleet) -> None:
    cold = C.ask(client, url, rec["messages"], fleet.tools, fleet.max_tokens, use_cache=False)
    assert cold["cached_tokens"] == 0
    assert rec["text"] == cold["text"], f"agent {rec['agent']} turn {rec['turn']}: cached answer differs from cold"


def by_agent(records: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in records:
        out.setdefault(r["agent"], []).append(r)
    return out


def test_cache_aware_keeps_agents_in_place_and_a_killed_replicas_agents_go_on_from_redis(cluster):
    cluster.start("cache_aware", remote=True)
    fleet = C.Fleet(agents=4, tools_tokens=600)
    with httpx.Client(timeout=300) as client:
        records = [r for t in range(3) for r in fleet.turn(client, cluster.router_url, t)]
        for agent, turns in by_agent(records).items():
            assert {r["replica"] for r in turns} == {turns[0]["replica"]}, f"agent {agent} moved"
            for prev, cur in zip(turns, turns[1:]):
                assert prev["prompt_tokens"] - NEAR <= cur["cached_tokens"] < cur["prompt_tokens"], cur
                assert cur["tier"] in ("live", "ram")
        # Kill the replica that serves the agents (cache_aware put them all on the one holding the tools block).
        victim = records[-1]["replica"]
        i = int(victim.rsplit("-", 1)[1]) - 1
        survivor = cluster.replica_url(1 - i)
        settle_writes(cluster.replica_url(i))
        cluster.stop(victim, signal.SIGKILL)
        last = {a: turns[-1] for a, turns in by_agent(records).items()}
        after = fleet.turn(client, cluster.router_url, 3)
        for rec in after:
            assert rec["replica"] != victim and rec["tier"] == "remote", rec
            assert last[rec["agent"]]["prompt_tokens"] - NEAR <= rec["cached_tokens"], rec
            assert_cold_equal(client, survivor, rec, fleet)


def test_round_robin_moves_agents_and_the_remote_tier_restores_them_on_the_other_replica(cluster):
    cluster.start("round_robin", remote=True)
    fleet = C.Fleet(agents=3, tools_tokens=300)
    with httpx.Client(timeout=300) as client:
        first = fleet.turn(client, cluster.router_url, 0)
        for i in range(2):
            settle_writes(cluster.replica_url(i))
        second = fleet.turn(client, cluster.router_url, 1)
        where = {r["agent"]: r["replica"] for r in first}
        moved = [r for r in second if r["replica"] != where[r["agent"]]]
        assert moved, "round-robin kept every agent in place; the test needs one that moves"
        urls = {f"replica-{i + 1}": cluster.replica_url(i) for i in range(2)}
        prompt = {r["agent"]: r["prompt_tokens"] for r in first}
        for rec in moved:
            assert rec["tier"] == "remote" and prompt[rec["agent"]] - NEAR <= rec["cached_tokens"], rec
            assert_cold_equal(client, urls[rec["replica"]], rec, fleet)
