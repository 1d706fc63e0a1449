"""Disk tier: round trips, exact LRU order, byte budget recounted from the files, restarts, corruption, full disk,
killed writers. Small fake snapshots (bytes whose length is the cost); no model."""

from __future__ import annotations

import logging
import os
import random
import signal
import sqlite3
import struct
import subprocess
import sys
import textwrap
import time
import threading
import zlib
from collections import OrderedDict
from pathlib import Path

import diskcache
import pytest

import orchestrator.cache.disk as disk
from orchestrator.cache.disk import DiskTier, EntryInfo
from orchestrator.errors import OrchestratorError

from .conftest import write_then_disk_full

FP = bytes(range(32))
OTHER_FP = bytes(range(1, 33))
HEADER = 59  # header bytes of one snapshot file
ROOT = Path(__file__).resolve().parents[1]


def nbytes(tokens, payload) -> int:
    return HEADER + 4 * len(tokens) + len(payload)


def val_files(d: Path) -> list[Path]:
    return sorted(d.rglob("*.val"))


def recount(tier: DiskTier, d: Path) -> None:
    """Count stored bytes and entries from the files themselves and compare with the tier and its budget."""
    files = val_files(d)
    total = sum(p.stat().st_size for p in files)
    assert total == tier.bytes, "tier's byte count differs from the files on disk"
    assert total <= tier.budget_bytes, "byte budget exceeded"
    assert len(files) == len(tier) == len(tier.keys())


def only_file(d: Path) -> Path:
    (p,) = val_files(d)
    return p


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "orchestrator.cache.disk" and r.levelno == logging.WARNING]


def test_round_trip_kind_tokens_payload(tmp_path):
    full = ("kv", (0, 1, 2**32 - 1, 151_643), os.urandom(5000))
    rec = ("checkpoint", tuple(range(300)), b"\x00" * 7)
    with DiskTier(tmp_path, 1 << 20, FP) as t:
        assert t.put("a", full[1], full[0], full[2])
        assert t.put("b", list(rec[1]), rec[0], bytearray(rec[2]))  # any sequence, any bytes-like payload
        assert t.put("empty", [], "kv", b"")
        assert t.get("a") == full
        got = t.get("b")
        assert got == rec and type(got[2]) is bytes
        assert t.get("empty") == ("kv", (), b"")
        assert t.get("missing") is None
        assert "a" in t and "missing" not in t and len(t) == 3
        assert t.bytes == nbytes(full[1], full[2]) + nbytes(rec[1], rec[2]) + HEADER
        recount(t, tmp_path)
    with DiskTier(tmp_path, 1 << 20, FP) as t:
        assert t.get("a") == full and t.get("b") == rec


def test_file_layout_is_the_documented_one(tmp_path):
    tokens, payload = [5, 70000], b"payload!"
    with DiskTier(tmp_path, 1 << 20, FP) as t:
        t.put("k", tokens, "checkpoint", payload)
    raw = only_file(tmp_path).read_bytes()
    magic, version, fp, kind, n, plen, crc = struct.unpack_from("<8sH32sBIQI", raw)
    assert (magic, version, fp, kind, n, plen) == (b"ORCSNAP\0", 2, FP, 1, 2, len(payload))
    assert raw[HEADER:HEADER + 8] == struct.pack("<2I", *tokens)
    assert raw[HEADER + 8:] == payload
    assert crc == zlib.crc32(raw[:HEADER - 4] + raw[HEADER:])
    random_hex, key_hex, check, suffix = only_file(tmp_path).name.split(".")  # the name holds the key
    assert len(random_hex) == 16 and bytes.fromhex(key_hex) == b"k" and suffix == "val"
    assert int(check, 16) == zlib.crc32(b"k", zlib.crc32(raw[:HEADER]))


def test_lru_order_exact(tmp_path):
    size = nbytes([1], b"x" * 41)  # 104 bytes; three fit in 330
    with DiskTier(tmp_path, 330, FP) as t:
        for k in "abc":
            assert t.put(k, [1], "kv", b"x" * 41)
        assert t.get("a") is not None  # order now b, c, a
        assert t.keys() == ["b", "c", "a"]
        assert t.put("d", [1], "kv", b"x" * 41)
        assert t.keys() == ["c", "a", "d"] and "b" not in t
        assert t.put("a", [2], "kv", b"y" * 41)  # replacing makes it most recent, evicts nothing
        assert t.keys() == ["c", "d", "a"] and t.get("a") == ("kv", (2,), b"y" * 41)
        assert t.put("e", [1], "kv", b"x" * (41 + size))  # needs two slots: c and d go
        assert t.keys() == ["a", "e"]
        assert t.stats().evictions == 3
        recount(t, tmp_path)


def test_random_ops_match_a_model_and_never_exceed_the_budget(tmp_path):
    rng = random.Random(3)
    budget = 2000
    model: OrderedDict[str, tuple[str, tuple[int, ...], bytes]] = OrderedDict()
    with DiskTier(tmp_path, budget, FP) as t:
        for step in range(250):
            key = f"k{rng.randrange(20)}"
            op = rng.random()
            if op < 0.55:
                toks = tuple(rng.randrange(1000) for _ in range(rng.randrange(0, 20)))
                payload = rng.randbytes(rng.randrange(0, 900))
                kind = rng.choice(["kv", "checkpoint"])
                size = nbytes(toks, payload)
                stored = t.put(key, toks, kind, payload)
                assert stored == (size <= budget)
                if stored:
                    model.pop(key, None)
                    while sum(nbytes(v[1], v[2]) for v in model.values()) + size > budget:
                        model.popitem(last=False)
                    model[key] = (kind, toks, payload)
            elif op < 0.9:
                got = t.get(key)
                assert got == model.get(key)
                if got is not None:
                    model.move_to_end(key)
            else:
                assert t.delete(key) == (model.pop(key, None) is not None)
            assert t.keys() == list(model), f"LRU order differs at step {step}"
            recount(t, tmp_path)


def test_threads_sharing_a_tier_keep_the_budget_and_the_data(tmp_path):
    budget = 3000
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(60):
                key = f"k{rng.randrange(12)}"
                if rng.random() < 0.5:
                    t.put(key, [len(key)], "kv", key.encode() * rng.randrange(1, 60))
                else:
                    got = t.get(key)  # whatever is there must be intact and belong to this key
                    assert got is None or (got[1] == (len(key),) and set(got[2].split(key.encode())) == {b""})
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with DiskTier(tmp_path, budget, FP) as t:
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        recount(t, tmp_path)


def test_entry_larger_than_budget_is_refused_and_evicts_nothing(tmp_path):
    with DiskTier(tmp_path, 500, FP) as t:
        assert t.put("small", [1], "kv", b"s" * 10)
        assert not t.put("big", [1, 2], "kv", b"b" * (500 - HEADER - 8 + 1))
        assert "big" not in t and t.keys() == ["small"]
        assert t.stats().rejected_too_large == 1
        assert t.put("exact", [1, 2], "kv", b"b" * (500 - HEADER - 8))  # exactly the budget fits
        assert t.keys() == ["exact"] and t.bytes == 500
        recount(t, tmp_path)
    with DiskTier(tmp_path / "zero", 0, FP) as t:
        assert not t.put("a", [], "kv", b"")


def test_smaller_budget_after_reopen_shrinks_lru_first(tmp_path):
    payload = b"p" * 100
    size = nbytes([1, 2], payload)
    with DiskTier(tmp_path, 10 * size, FP) as t:
        for k in "abcde":
            t.put(k, [1, 2], "kv", payload)
        t.get("a")
        t.get("c")  # LRU order: b, d, e, a, c
    with DiskTier(tmp_path, 2 * size + 1, FP) as t:
        assert t.keys() == ["a", "c"]
        recount(t, tmp_path)
    with DiskTier(tmp_path, 10 * size, FP) as t:  # what was evicted is gone for good
        assert t.keys() == ["a", "c"]
        recount(t, tmp_path)


def test_entries_after_reopen_list_what_is_stored_in_lru_order(tmp_path):
    stored = {
        "a": ("kv", (1, 2, 3), b"A" * 30),
        "b": ("checkpoint", (1, 2), b"B" * 20),
        "c": ("kv", tuple(range(1000, 1100)), b"C" * 10),
    }
    with DiskTier(tmp_path, 10_000, FP) as t:
        for k, (kind, toks, payload) in stored.items():
            t.put(k, toks, kind, payload)
        t.get("a")  # order: b, c, a
    with DiskTier(tmp_path, 10_000, FP) as t:
        want = [EntryInfo(k, stored[k][0], stored[k][1], nbytes(stored[k][1], stored[k][2])) for k in "bca"]
        assert list(t.entries()) == want
        assert list(t.entries()) == want  # listing does not touch the order
        t.get("b")  # order: c, a, b
    size = nbytes(stored["c"][1], stored["c"][2])
    with DiskTier(tmp_path, t.bytes - size + 1, FP) as t:  # room for all but one: c, least recent, goes
        assert [e.key for e in t.entries()] == ["a", "b"]
        recount(t, tmp_path)


def test_other_fingerprint_entries_are_deleted_not_returned(tmp_path, caplog):
    with DiskTier(tmp_path, 10_000, FP) as t:
        t.put("a", [1], "kv", b"a")
        t.put("b", [2], "checkpoint", b"b")
    with caplog.at_level(logging.WARNING, logger="orchestrator.cache.disk"):
        with DiskTier(tmp_path, 10_000, OTHER_FP) as t:
            assert len(t) == 0 and list(t.entries()) == [] and t.get("a") is None
            assert t.bytes == 0 and val_files(tmp_path) == []
    assert any("fingerprint" in m for m in warnings_of(caplog))
    with DiskTier(tmp_path, 10_000, FP) as t:  # deleted, not hidden
        assert len(t) == 0


def test_entries_of_an_older_format_version_are_discarded_with_one_clear_line(tmp_path, caplog):
    with DiskTier(tmp_path, 10_000, FP) as t:
        for i in range(3):
            t.put(f"rec-{i}", [i], "checkpoint", b"r")
    for p in val_files(tmp_path):
        _rewrite_header(p, version=1)  # as written by the previous release
    with caplog.at_level(logging.WARNING, logger="orchestrator.cache.disk"):
        with DiskTier(tmp_path, 10_000, FP) as t:
            assert len(t) == 0 and t.bytes == 0 and val_files(tmp_path) == []
            assert t.stats().rejected_invalid == 3
    (line,) = warnings_of(caplog)
    assert "3 snapshots" in line and "format version 1" in line and "discarded, version changed" in line


def _corrupt_and_expect_miss(tmp_path, caplog, corrupt, reason: str) -> None:
    """Store a victim and a bystander; `corrupt(path)` the victim's file under the open tier; get must miss."""
    with DiskTier(tmp_path, 100_000, FP) as t:
        t.put("victim", [1, 2, 3], "kv", b"payload" * 10)
        victim = only_file(tmp_path)
        t.put("bystander", [4], "checkpoint", b"ok")
        corrupt(victim)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="orchestrator.cache.disk"):
            assert t.get("victim") is None
        msgs = warnings_of(caplog)
        assert len(msgs) == 1 and "victim" in msgs[0] and reason in msgs[0], msgs
        assert "victim" not in t and not victim.exists()
        assert t.get("bystander") == ("checkpoint", (4,), b"ok")
        recount(t, tmp_path)
        t.delete("bystander")


def _flip(offset: int):
    def corrupt(p: Path) -> None:
        raw = bytearray(p.read_bytes())
        raw[offset] ^= 0x01
        p.write_bytes(bytes(raw))
    return corrupt


def test_truncated_value_is_a_miss_and_deleted(tmp_path, caplog):
    def truncate(p: Path) -> None:
        os.truncate(p, p.stat().st_size - 1)
    _corrupt_and_expect_miss(tmp_path, caplog, truncate, "truncated")


def test_flipped_payload_byte_is_a_miss_and_deleted(tmp_path, caplog):
    _corrupt_and_expect_miss(tmp_path, caplog, _flip(-1), "CRC")


def test_every_flipped_header_or_token_byte_is_a_miss(tmp_path, caplog):
    # Kind 0 -> 1 and the token ids are caught only by the CRC, which covers the header too.
    for offset in range(HEADER + 12):
        _corrupt_and_expect_miss(tmp_path, caplog, _flip(offset), "")


def _rewrite_header(p: Path, **fields) -> None:
    """Rewrite the header with `fields` changed and a CRC that matches, so only the field check can catch it."""
    raw = p.read_bytes()
    names = ("magic", "version", "fingerprint", "kind", "n_tokens", "payload_nbytes", "crc")
    values = dict(zip(names, struct.unpack_from("<8sH32sBIQI", raw)))
    values.update(fields)
    head = struct.pack("<8sH32sBIQ", *[values[n] for n in names[:-1]])
    crc = zlib.crc32(raw[HEADER:], zlib.crc32(head))
    p.write_bytes(head + struct.pack("<I", crc) + raw[HEADER:])


def test_wrong_magic_or_version_is_a_miss_even_with_a_valid_crc(tmp_path, caplog):
    _corrupt_and_expect_miss(tmp_path, caplog, lambda p: _rewrite_header(p, magic=b"ORCSNAP\1"), "magic")
    _corrupt_and_expect_miss(tmp_path, caplog, lambda p: _rewrite_header(p, version=3), "version")
    _corrupt_and_expect_miss(tmp_path, caplog, lambda p: _rewrite_header(p, kind=7), "kind")


def test_invalid_entries_are_dropped_at_reopen(tmp_path, caplog):
    with DiskTier(tmp_path, 100_000, FP) as t:
        t.put("short", [1], "kv", b"x" * 50)
        short = only_file(tmp_path)
        t.put("good", [2], "kv", b"y" * 50)
    os.truncate(short, 30)  # even the header is incomplete
    with caplog.at_level(logging.WARNING, logger="orchestrator.cache.disk"):
        with DiskTier(tmp_path, 100_000, FP) as t:
            assert [e.key for e in t.entries()] == ["good"]
            assert t.get("short") is None and t.get("good") == ("kv", (2,), b"y" * 50)
            recount(t, tmp_path)
    assert any("short" in m and "truncated" in m for m in warnings_of(caplog))


def test_truncated_blob_from_a_killed_writer_is_rejected(tmp_path, caplog):
    with DiskTier(tmp_path, 100_000, FP) as t:
        t.put("old", [1], "kv", b"o" * 100)
        t.put("torn", [1, 2], "kv", b"t" * 100)
    blob = next(p.read_bytes() for p in val_files(tmp_path) if p.read_bytes().endswith(b"t" * 100))
    with diskcache.Cache(str(tmp_path)) as dc:  # a writer died after committing half a value
        dc.set("torn", blob[: len(blob) // 2])
    with caplog.at_level(logging.WARNING, logger="orchestrator.cache.disk"):
        with DiskTier(tmp_path, 100_000, FP) as t:
            assert t.keys() == ["old"] and t.get("torn") is None
            assert t.get("old") == ("kv", (1,), b"o" * 100)
            recount(t, tmp_path)
    assert any("torn" in m for m in warnings_of(caplog))


def test_process_killed_mid_write_leaves_a_consistent_cache(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        import orchestrator.cache.disk as disk
        t = disk.DiskTier({str(tmp_path)!r}, 1 << 20, {FP!r})
        assert t.put("old", [1], "kv", b"o" * 1000)
        def dying_write(path, parts):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "xb") as f:
                f.write(parts[0])
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        disk._write_parts = dying_write
        t.put("new", [2], "kv", b"n" * 1000)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert len(val_files(tmp_path)) == 2  # the committed one and the half-written one
    with DiskTier(tmp_path, 1 << 20, FP) as t:  # the dead process's lock is gone with it
        assert t.keys() == ["old"] and t.get("old") == ("kv", (1,), b"o" * 1000)
        recount(t, tmp_path)  # the half-written file was swept


def test_full_disk_warns_once_returns_false_and_keeps_serving_reads(tmp_path, caplog, monkeypatch):
    with DiskTier(tmp_path, 100_000, FP) as t:
        t.put("old", [1], "kv", b"o" * 100)

        monkeypatch.setattr(disk, "_write_parts", write_then_disk_full)
        with caplog.at_level(logging.WARNING, logger="orchestrator.cache.disk"):
            assert t.put("new", [2], "kv", b"n" * 100) is False
            assert t.disabled
            assert t.put("newer", [3], "kv", b"n" * 100) is False
            assert t.get("old") == ("kv", (1,), b"o" * 100)
        msgs = warnings_of(caplog)
        assert len(msgs) == 1 and "disk full" in msgs[0], msgs
        assert t.keys() == ["old"]
        recount(t, tmp_path)  # the partial file was removed
        monkeypatch.undo()
        assert t.put("later", [4], "kv", b"l") is False  # stays off for the backoff
        assert t.stats().errors == 1 and t.stats().disabled
        now = time.monotonic()
        monkeypatch.setattr(disk.time, "monotonic", lambda: now + disk.RETRY_S + 1)
        assert not t.disabled and t.put("later", [4], "kv", b"l")  # re-enabled: the disk works again
        assert t.keys() == ["old", "later"] and not t.stats().disabled
        monkeypatch.undo()
    with DiskTier(tmp_path, 100_000, FP) as t:
        assert not t.disabled and t.put("latest", [5], "kv", b"l")


def test_a_disk_that_keeps_failing_backs_off_longer_and_counts_every_error(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(disk.time, "monotonic", lambda: clock[0])
    with DiskTier(tmp_path, 100_000, FP) as t:
        monkeypatch.setattr(disk, "_write_parts", write_then_disk_full)
        assert t.put("a", [1], "kv", b"a") is False and t.disabled
        clock[0] += disk.RETRY_S + 1  # the retry fails too: twice the wait
        assert not t.disabled and t.put("b", [2], "kv", b"b") is False
        clock[0] += disk.RETRY_S + 1
        assert t.disabled
        clock[0] += disk.RETRY_S
        assert not t.disabled
        assert t.stats().errors == 2 and t.keys() == []


def test_pickled_values_are_never_loaded(tmp_path):
    canary = tmp_path / "unpickled"

    class Boom:
        def __reduce__(self):
            return (os.mkdir, (str(canary),))

    with DiskTier(tmp_path / "c", 100_000, FP) as t:
        t.put("good", [1], "kv", b"g")
    with diskcache.Cache(str(tmp_path / "c")) as dc:
        dc.set("evil", Boom())
        dc.set("text", "not bytes")
    with DiskTier(tmp_path / "c", 100_000, FP) as t:
        assert t.keys() == ["good"] and t.get("evil") is None
        with pytest.raises(TypeError):
            t._cache.set("x", Boom())  # the tier's own diskcache refuses to pickle
    assert not canary.exists()


def test_one_process_per_directory(tmp_path):
    t = DiskTier(tmp_path, 1000, FP)
    with pytest.raises(OrchestratorError, match="in use by another process"):
        DiskTier(tmp_path, 1000, FP)
    t.close()
    t.close()
    with pytest.raises(ValueError):
        t.get("a")
    DiskTier(tmp_path, 1000, FP).close()


def test_misuse_raises(tmp_path):
    with pytest.raises(ValueError):
        DiskTier(tmp_path, 1000, b"short")
    with pytest.raises(ValueError):
        DiskTier(tmp_path, -1, FP)
    with DiskTier(tmp_path, 1000, FP) as t:
        with pytest.raises(ValueError):
            t.put("k", [1], "full", b"")  # format version 1's name
        with pytest.raises(ValueError):
            t.put("k", [-1], "kv", b"")
        with pytest.raises(ValueError):
            t.put("k", [2**32], "kv", b"")
        with pytest.raises(TypeError):
            t.put(3, [1], "kv", b"")
        assert len(t) == 0


# -- a corrupt index (cache.db) repairs itself ------------------------------------------------------------------


def _corrupt_index(d: Path, where: str) -> bytes:
    """Overwrite part of the closed tier's cache.db (SQLite's header, or pages in the middle). Returns the bytes."""
    db = d / "cache.db"
    assert not (d / "cache.db-wal").exists() or (d / "cache.db-wal").stat().st_size == 0
    raw = bytearray(db.read_bytes())
    if where == "header":
        raw[:100] = b"\xa5" * 100
    else:  # every page after the first: the tables and their indexes
        assert len(raw) >= 3 * 4096, len(raw)
        start, end = 4096 + 512, len(raw) - 512
        raw[start:end] = random.Random(5).randbytes(end - start)
    db.write_bytes(bytes(raw))
    return bytes(raw)


def _moved_aside(d: Path) -> list[Path]:
    return sorted(p for p in d.glob("cache.db.corrupt-*") if not p.name.endswith(("-wal", "-shm")))


@pytest.mark.parametrize("where", ["header", "middle"])
def test_a_corrupt_index_is_moved_aside_and_the_entries_come_back(tmp_path, caplog, where):
    rng = random.Random(7)
    stored = {f"k{i}": (("kv", "checkpoint", "logits")[i % 3], tuple(rng.randrange(2**32) for _ in range(i * 7)),
                        rng.randbytes(rng.randrange(0, 3000))) for i in range(40)}
    stored["s" + "a" * 32 + "-kv-3-" + "b" * 32] = ("kv", (1, 2, 3), b"salted")  # a key as long as real ones
    stored["ключ"] = ("kv", (9,), b"utf-8 key")
    with DiskTier(tmp_path, 1 << 22, FP) as t:
        for key, (kind, toks, payload) in stored.items():
            assert t.put(key, toks, kind, payload)
        t.put("torn", [5, 6], "kv", b"T" * 500)
        torn = next(p for p in val_files(tmp_path) if p.read_bytes().endswith(b"T" * 500))
        t.put("short", [7], "kv", b"S" * 500)
        short = next(p for p in val_files(tmp_path) if p.read_bytes().endswith(b"S" * 500))
        t.get("k0")
        t.get("k1")
    _flip(-1)(torn)  # files corrupted at the same time: one in its payload (CRC), one truncated
    os.truncate(short, 100)
    corrupt = _corrupt_index(tmp_path, where)
    with caplog.at_level(logging.WARNING, logger="orchestrator.cache.disk"):
        with DiskTier(tmp_path, 1 << 22, FP) as t:
            assert not t.disabled and not t.stats().disabled
            assert "short" not in t
            assert set(t.keys()) - {"torn"} == set(stored)
            for key, want in stored.items():
                assert t.get(key) == want, key  # byte-identical, under its own key
            assert t.get("torn") is None and "torn" not in t  # CRC mismatch: never served
            assert t.get("short") is None
            recount(t, tmp_path)
            assert t.put("new", [1, 2], "checkpoint", b"new") and t.get("new") == ("checkpoint", (1, 2), b"new")
            recount(t, tmp_path)
    (aside,) = _moved_aside(tmp_path)
    assert aside.read_bytes() == corrupt  # moved, not deleted
    msgs = warnings_of(caplog)
    assert any("moved" in m and aside.name in m and f"{len(stored) + 1} snapshots re-indexed" in m for m in msgs), msgs
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="orchestrator.cache.disk"):
        with DiskTier(tmp_path, 1 << 22, FP) as t:  # the fresh index is a normal one
            assert set(t.keys()) == set(stored) | {"new"}
            assert t.get("k5") == stored["k5"]
            recount(t, tmp_path)
    assert warnings_of(caplog) == [] and len(_moved_aside(tmp_path)) == 1


def test_a_repaired_index_keeps_the_budget(tmp_path):
    payload = b"p" * 100
    size = nbytes([1], payload)
    with DiskTier(tmp_path, 10 * size, FP) as t:
        for i in range(10):
            t.put(f"k{i}", [1], "kv", payload)
    _corrupt_index(tmp_path, "header")
    with DiskTier(tmp_path, 4 * size, FP) as t:
        assert len(t) == 4 and t.bytes == 4 * size
        recount(t, tmp_path)


def test_entries_whose_key_is_not_in_their_file_are_not_reindexed(tmp_path, caplog, monkeypatch):
    """Files written before keys were kept with them (random names) and keys too long for a file name: their
    key cannot be recovered from the file, so a repair drops them; the tier works on."""
    long_key = "x" * 300
    with monkeypatch.context() as m:
        m.setattr(disk._SnapshotDisk, "filename", diskcache.Disk.filename)  # as the previous release named files
        with DiskTier(tmp_path, 1 << 20, FP) as t:
            t.put("old", [1], "kv", b"o" * 50)
    with DiskTier(tmp_path, 1 << 20, FP) as t:
        assert t.get("old") == ("kv", (1,), b"o" * 50)  # read as before
        assert t.put(long_key, [2], "kv", b"l" * 50) and t.get(long_key) == ("kv", (2,), b"l" * 50)
        assert t.put("named", [3], "kv", b"n" * 50)
    _corrupt_index(tmp_path, "header")
    with caplog.at_level(logging.WARNING, logger="orchestrator.cache.disk"):
        with DiskTier(tmp_path, 1 << 20, FP) as t:
            assert not t.disabled and t.keys() == ["named"]
            assert t.get("old") is None and t.get(long_key) is None
            assert t.get("named") == ("kv", (3,), b"n" * 50)
            assert t.put("later", [4], "kv", b"x") and t.get("later") == ("kv", (4,), b"x")
            recount(t, tmp_path)
    assert any("1 snapshots re-indexed" in m and "2 without their key" in m for m in warnings_of(caplog))


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_name("swap.tmp")
    os.replace(a, tmp)
    os.replace(b, a)
    os.replace(tmp, b)


def test_a_file_holding_another_keys_snapshot_is_never_served(tmp_path, caplog):
    with DiskTier(tmp_path, 1 << 20, FP) as t:
        t.put("a", [1, 2], "kv", b"A" * 40)
        (fa,) = val_files(tmp_path)
        t.put("b", [1, 2], "kv", b"B" * 40)
        (fb,) = set(val_files(tmp_path)) - {fa}
        _swap(fa, fb)  # both files valid blobs, each where the other key's file should be
        with caplog.at_level(logging.WARNING, logger="orchestrator.cache.disk"):
            assert t.get("a") is None and t.get("b") is None
        msgs = warnings_of(caplog)
        assert len(msgs) == 2 and all("does not match its content" in m for m in msgs), msgs
        assert len(t) == 0
        recount(t, tmp_path)
        t.put("e", [4], "kv", b"E" * 40)
        (fe,) = val_files(tmp_path)
        t.put("f", [4], "kv", b"F" * 40)
        con = sqlite3.connect(str(tmp_path / "cache.db"))  # the index's row of e points at f's (intact) file
        with con:
            con.execute("UPDATE Cache SET filename = (SELECT filename FROM Cache WHERE key = 'f') WHERE key = 'e'")
        con.close()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="orchestrator.cache.disk"):
            assert t.get("e") is None
        (msg,) = warnings_of(caplog)
        assert "another key's snapshot ('f')" in msg, msg
        t.delete("f")
        fe.unlink()
        t.put("c", [3], "kv", b"C" * 40)
        (fc,) = val_files(tmp_path)
        t.put("d", [3], "kv", b"D" * 40)
        (fd,) = set(val_files(tmp_path)) - {fc}
    _swap(fc, fd)
    _corrupt_index(tmp_path, "header")
    with DiskTier(tmp_path, 1 << 20, FP) as t:  # a repair does not take them back either
        assert len(t) == 0 and t.get("c") is None and t.get("d") is None
        recount(t, tmp_path)


def test_two_files_claiming_one_key_are_both_dropped_at_a_repair(tmp_path):
    with DiskTier(tmp_path, 1 << 20, FP) as t:
        t.put("dup", [1], "kv", b"new")
        t.put("other", [2], "kv", b"o")
    (f,) = [p for p in val_files(tmp_path) if p.read_bytes().endswith(b"new")]
    copy = f.with_name("0123456789abcdef" + f.name[16:])
    copy.write_bytes(f.read_bytes())  # a stale copy of the key's snapshot (a delete that failed): which is current?
    _corrupt_index(tmp_path, "header")
    with DiskTier(tmp_path, 1 << 20, FP) as t:
        assert t.keys() == ["other"] and t.get("dup") is None
        recount(t, tmp_path)


def test_an_index_found_corrupt_at_run_time_is_repaired_without_a_restart(tmp_path, caplog):
    with DiskTier(tmp_path, 1 << 20, FP) as t:
        for k in "abc":
            t.put(k, [ord(k)], "kv", k.encode() * 100)
        t.get("a")  # order: b, c, a
        t._cache.close()  # the connection goes (as after any error); the file gets corrupted under the server
        corrupt = _corrupt_index(tmp_path, "header")
        with caplog.at_level(logging.WARNING, logger="orchestrator.cache.disk"):
            assert t.get("b") == ("kv", (ord("b"),), b"b" * 100)  # repaired, then read
        assert not t.disabled and t.keys() == ["c", "a", "b"]
        assert any("moved" in m for m in warnings_of(caplog))
        (aside,) = _moved_aside(tmp_path)
        assert aside.read_bytes() == corrupt
        assert t.put("d", [4], "kv", b"d") and t.get("d") == ("kv", (4,), b"d")
        recount(t, tmp_path)
    with DiskTier(tmp_path, 1 << 20, FP) as t:
        assert t.keys() == ["c", "a", "b", "d"]


def test_a_repair_that_was_interrupted_is_done_again_at_the_next_open(tmp_path, monkeypatch):
    with DiskTier(tmp_path, 1 << 20, FP) as t:
        for k in "ab":
            t.put(k, [1], "kv", k.encode())
    _corrupt_index(tmp_path, "header")

    def dies(self, keep):
        raise OSError("killed while re-indexing")

    with monkeypatch.context() as m:
        m.setattr(DiskTier, "_adopt_files", dies)
        with pytest.raises(OrchestratorError, match="killed while re-indexing"):
            DiskTier(tmp_path, 1 << 20, FP)
    assert (tmp_path / "cache.db").exists()  # a fresh, sound, empty index: not to be taken for the truth
    with DiskTier(tmp_path, 1 << 20, FP) as t:
        assert sorted(t.keys()) == ["a", "b"] and t.get("b") == ("kv", (1,), b"b")
        recount(t, tmp_path)
    assert len(_moved_aside(tmp_path)) == 2 and not (tmp_path / "cache.db.repairing").exists()


def test_a_server_stopped_with_sigterm_writes_its_ram_snapshots_to_the_disk_tier(tiny_model, tmp_path):
    """uvicorn ends on SIGTERM by raising the signal again; with the default handler the process died before
    Runtime.close, so the RAM tier's snapshots (the newest: what a session restores next) never reached the disk,
    and W6's restart restored 69.5% of the previous request instead of all but its last tokens."""
    import httpx

    from tests.conftest import serve_process

    disk = tmp_path / "disk"
    proc, url = serve_process(tiny_model, tmp_path / "log", "-c", "4096", "-np", "1", "--cache-ram", "64",
                              "--cache-disk-dir", str(disk))
    try:
        body = {"messages": [{"role": "system", "content": "You answer briefly. " * 20},
                             {"role": "user", "content": "Hello there."}], "max_tokens": 2}
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=300).status_code == 200
        assert httpx.get(url + "/v1/cache/stats", timeout=30).json()["disk_entries"] == 0  # all in RAM
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    finally:
        proc.kill()
    log = (tmp_path / "log").read_text()
    assert "snapshots from RAM to the disk tier at shutdown" in log
    assert len([p for p in disk.iterdir() if p.is_dir()]) >= 2  # entries' files, beside the index
