"""Tenant isolation: `cache_salt` separates snapshots in RAM, on disk, across restarts and in the live sequence."""

from __future__ import annotations

from orchestrator.cache.snapshots import SnapshotCache, disk_key, salt_id
from orchestrator.cache.disk import DiskTier
from orchestrator.cache.radix import CHECKPOINT, KV
from orchestrator.runtime import Runtime
from orchestrator.cache.tiers import RamTier

from .conftest import assert_same_as_cold, make_config

SYSTEM = {"role": "system", "content": "You are the support bot of a bicycle shop. Be brief and friendly. " * 6}


def ask(text: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": text}]


def test_salts_never_share_snapshots_and_the_same_salt_does(fresh_cache):
    rt = fresh_cache
    a1 = assert_same_as_cold(rt, ask("Do you repair brakes?"), cache_salt="tenant-a")
    assert a1.result.cached_tokens == 0
    # Same prompt, another salt: straight after tenant a, so the live sequence holds a's prefix too.
    b1 = assert_same_as_cold(rt, ask("Do you repair brakes?"), cache_salt="tenant-b")
    assert (b1.result.cached_tokens, b1.result.restore_source) == (0, "none")
    unsalted = assert_same_as_cold(rt, ask("Do you repair brakes?"))
    assert unsalted.result.cached_tokens == 0
    a2 = assert_same_as_cold(rt, ask("Do you sell helmets?"), cache_salt="tenant-a")
    assert a2.result.cached_tokens == a2.boundaries.system_end > 0
    b2 = assert_same_as_cold(rt, ask("Do you sell helmets?"), cache_salt="tenant-b")
    assert b2.result.cached_tokens == b2.boundaries.system_end
    shared = assert_same_as_cold(rt, ask("Opening hours?"))
    assert shared.result.cached_tokens == shared.boundaries.system_end  # unsalted requests share as before
    rt.scheduler.drain()
    assert set(rt.cache.salts()) == {"", salt_id("tenant-a"), salt_id("tenant-b")}


def test_cache_salt_over_http(client, runtime):
    runtime.cache.clear()
    body = {"messages": ask("Where is the shop?"), "max_tokens": 4, "temperature": 0}

    def cached(salt):
        r = client.post("/v1/chat/completions", json={**body, "cache_salt": salt} if salt else body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("x") == 0
    assert cached("y") == 0
    assert cached(None) == 0
    assert cached("x") > 0 and cached("y") > 0 and cached(None) > 0


def test_salted_entries_keep_their_salt_on_disk_and_across_restarts(tiny_model, tmp_path):
    kw = dict(cache_ram_mib=1, cache_disk_dir=tmp_path / "snap", cache_disk_mib=512)
    rt = Runtime.start(make_config(tiny_model, **kw))
    try:
        for salt in ("a", "b"):
            assert_same_as_cold(rt, ask("Do you rent bikes? " + "Please tell me the price. " * 20), cache_salt=salt)
        assert_same_as_cold(rt, ask("Spill. " + "Another long question. " * 30), cache_salt="z")
        rt.scheduler.drain()
        assert rt.cache.stats().spills > 0
        # RAM is not written out at close: a's entries, its KV included, must have spilled to disk
        assert {(kind, tier) for kind, tier, _ in rt.cache.entries()} >= {(KV, "disk")}
        keys = rt.cache.tier("disk").keys()
        assert any(k.startswith("s" + salt_id("a")) for k in keys)
        assert any(k.startswith("s" + salt_id("b")) for k in keys)
        assert not any("a" == k or "tenant" in k for k in keys)  # the salt itself is never written
    finally:
        rt.close()
    rt = Runtime.start(make_config(tiny_model, **kw))
    try:
        assert {salt_id("a"), salt_id("b")} <= set(rt.cache.salts()) <= {salt_id(s) for s in "abz"}
        c = assert_same_as_cold(rt, ask("Do you rent bikes? " + "Please tell me the price. " * 20), cache_salt="c")
        assert c.result.cached_tokens == 0
        a = assert_same_as_cold(rt, ask("Do you rent tandems?"), cache_salt="a")
        assert a.result.cached_tokens == a.boundaries.system_end and a.result.restore_source == "disk"
        rt.cache.check()
    finally:
        rt.close()


def test_cache_level_salts_are_separate_trees_with_a_shared_budget(tmp_path):
    fp = bytes(32)
    with DiskTier(tmp_path, 1 << 20, fp) as disk:
        c = SnapshotCache([RamTier(250), disk])
        toks = [1, 2, 3, 4]
        assert c.put(toks, CHECKPOINT, b"r" * 100, salt="a") and c.put(toks, KV, b"k" * 100, salt="a")
        assert c.contains(toks, CHECKPOINT, salt="a")
        assert not c.contains(toks, CHECKPOINT, salt="b") and not c.contains(toks, CHECKPOINT)
        assert c.plan(toks + [5, 6], 6, salt="a").n_tokens == 4
        assert c.plan(toks + [5, 6], 6, salt="b").n_tokens == 0
        assert c.plan(toks + [5, 6], 6, toks).n_tokens == 0  # live KV is no help without a checkpoint of one's own
        assert c.put(toks, CHECKPOINT, b"R" * 100, salt="b")  # the budget is shared: this spills the oldest entry
        assert c.stats().spills == 1 and c.stats().ram_bytes <= 250
        c.check()
        keys = [disk_key(CHECKPOINT, toks, salt_id("a")), disk_key(CHECKPOINT, toks, salt_id("b")),
                disk_key(CHECKPOINT, toks)]
        assert len(set(keys)) == 3
        c.clear()
        assert c.salts() == {} and c.plan(toks + [5, 6], 6, salt="a").n_tokens == 0
        c.check()


def test_an_empty_cache_salt_is_refused_not_silently_shared(client):
    r = client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 1, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
