"""Disk tier: round trips, exact LRU order, byte budget recounted from the files, restarts, corruption, full disk,
killed writers. Small fake snapshots (bytes whose length is the cost); no model."""

from __future__ import annotations

import logging
import os
import random
import signal
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
