"""Faults at the runtime level (tiny model): llama.cpp refusing a restore, corrupt or truncated snapshot files, a
disk filling during spills, a process killed with SIGKILL in the middle of a spill, the model file replaced.

Every request must still equal the cold run, and the cache must stay consistent and within its budgets.
DiskTier-level versions of the file faults are in tests/test_disk.py.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import orchestrator.cache.disk as disk
from orchestrator.cache.radix import CHECKPOINT, KV
from orchestrator.devices import Offload
from orchestrator.engine import Attention
from orchestrator.runtime import Runtime, state_fingerprint
from orchestrator.state import HybridState

from .conftest import assert_same_as_cold, write_then_disk_full

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = {"role": "system", "content": "You are the on-call assistant for a data centre. Be exact and brief. " * 6}


def ask(text: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": text}]


def val_files(d: Path) -> list[Path]:
    return sorted(d.rglob("*.val"))


def assert_disk_consistent(rt: Runtime, d: Path) -> None:
    """Files on disk == what the tier counts, within its budget; the tree matches the tiers."""
    files = val_files(d)
    assert sum(p.stat().st_size for p in files) == rt.cache.tier("disk").bytes <= rt.cache.tier("disk").budget_bytes
    assert len(files) == len(rt.cache.tier("disk"))
    rt.cache.check()


def _replace_ram_bytes(rt: Runtime, kind: str, corrupt) -> int:
    """Replace the RAM bytes of every entry of `kind` with corrupt(bytes); returns how many."""
    c = rt.cache
    with c._lock:
        hot = [m for m in c._meta.values() if m.kind == kind and m.level == 0]
        for m in hot:
            new = corrupt(c.hot.get(m.key).payload)
            c.hot.delete(m.key)
            assert c.hot.put(m.key, (), kind, new)
            m.nbytes = len(new)
    return len(hot)


@pytest.mark.parametrize("corrupt", [lambda b: b[: len(b) // 2], lambda b: bytes([b[0] ^ 0xFF]) + b[1:]],
                         ids=["truncated", "bad-magic"])
def test_llama_cpp_refusing_a_restore_clears_the_sequence_drops_the_entry_and_continues_as_a_miss(
        runtime, caplog, corrupt):
    rt = runtime
    rt.cache.clear()
    assert_same_as_cold(rt, ask("Is rack 12 overheating?"))
    rt.scheduler.drain()
    assert _replace_ram_bytes(rt, CHECKPOINT, corrupt) > 0
    dropped = rt.cache.stats().dropped
    with caplog.at_level(logging.WARNING, logger="orchestrator.scheduler"):
        miss = assert_same_as_cold(rt, ask("Is rack 14 overheating?"))
    assert (miss.result.cached_tokens, miss.result.restore_source) == (0, "none")
    assert any("refused a snapshot restore" in r.getMessage() for r in caplog.records)
    assert rt.cache.stats().dropped > dropped  # the refused entries are gone, not retried forever
    rt.cache.check()
    hit = assert_same_as_cold(rt, ask("Is rack 16 overheating?"))  # the miss stored fresh snapshots
    assert hit.result.cached_tokens == hit.boundaries.system_end


def test_truncated_and_flipped_snapshot_files_are_misses_after_a_restart(start, tmp_path, caplog):
    d = tmp_path / "snap"
    kw = dict(cache_ram_mib=1, cache_disk_dir=d, cache_disk_mib=256)
    rt = start(**kw)
    assert_same_as_cold(rt, ask("List the alerts of the night."))
    assert_same_as_cold(rt, [{"role": "user", "content": "Something unrelated, to push the rest to disk. " * 8}])
    rt.scheduler.drain()
    rt.close()
    files = val_files(d)
    assert len(files) >= 3
    os.truncate(files[0], files[0].stat().st_size // 2)  # truncated (a torn write)
    for p in files[1:]:  # one flipped byte in the payload of every other file
        raw = bytearray(p.read_bytes())
        raw[-7] ^= 0x10
        p.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="orchestrator.cache.disk"):
        rt = start(**kw)
        t = assert_same_as_cold(rt, ask("List the alerts of the night."))
    assert t.result.cached_tokens == 0  # every stored part was corrupt: nothing corrupt reached llama.cpp
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "truncated" in messages and "CRC-32" in messages
    rt.scheduler.drain()
    assert_disk_consistent(rt, d)
    assert not files[0].exists()  # the truncated file is rejected at open; the others when first read
    read = [p for p in files[1:] if not p.exists()]
    assert read and len(val_files(d)) == len(rt.cache.tier("disk"))


def test_disk_filling_during_spills_keeps_serving_from_ram(start, tmp_path, monkeypatch, caplog):
    d = tmp_path / "snap"
    rt = start(cache_ram_mib=4, cache_disk_dir=d, cache_disk_mib=256)
    for q in ("First question, spilled while the disk still has room.", "Another one. " * 30):
        assert_same_as_cold(rt, ask(q))
    rt.scheduler.drain()
    assert rt.cache.stats().spills > 0

    monkeypatch.setattr(disk, "_write_parts", write_then_disk_full)
    with caplog.at_level(logging.WARNING, logger="orchestrator.cache.disk"):
        for q in ("Second question.", "Third question, longer: " + "details " * 40, "Fourth."):
            assert_same_as_cold(rt, ask(q))
    rt.scheduler.drain()
    warnings = [r.getMessage() for r in caplog.records if r.name == "orchestrator.cache.disk"]
    assert len(warnings) == 1 and "disk full" in warnings[0]
    assert rt.cache.tier("disk").disabled and rt.cache.stats().ram_bytes <= 4 << 20
    assert_disk_consistent(rt, d)  # the half-written file was removed
    assert_same_as_cold(rt, ask("Fifth."))
    hit = assert_same_as_cold(rt, ask("Fifth."))
    assert hit.result.cached_tokens > 0  # RAM keeps working


KILLER = """
import os, signal, sys
sys.path.insert(0, {root!r})
import orchestrator.cache.disk as disk
from orchestrator.runtime import Runtime
from tests.conftest import make_config, run_chat

writes = 0
real = disk._write_parts
def dying_write(path, parts):
    global writes
    writes += 1
    if writes == {kill_at}:  # half a snapshot on disk, then the process dies
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "xb") as f:
            f.write(bytes(parts[-1])[: len(parts[-1]) // 2])
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, parts)
disk._write_parts = dying_write

rt = Runtime.start(make_config({model!r}, cache_ram_mib=1, cache_disk_dir={d!r}, cache_disk_mib=4))
system = {{"role": "system", "content": {system!r}}}
for i in range(20):
    run_chat(rt, [system, {{"role": "user", "content": f"question {{i}} " + "more words " * (5 * i)}}])
    rt.scheduler.drain()
print("never killed", writes)
"""


def test_sigkill_in_the_middle_of_a_spill_then_restart_is_consistent_and_within_budget(start, tmp_path,
                                                                                      tiny_model):
    d = tmp_path / "snap"
    script = KILLER.format(root=str(ROOT), kill_at=9, model=str(tiny_model), d=str(d), system=SYSTEM["content"])
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL, proc.stdout.decode() + proc.stderr.decode()
    assert len(val_files(d)) >= 2  # committed spills and the half-written one
    rt = start(cache_ram_mib=1, cache_disk_dir=d, cache_disk_mib=4)
    assert rt.cache.stats().disk_entries > 0  # the committed spills survived
    assert_disk_consistent(rt, d)  # the half-written file was swept; the budget holds
    t = assert_same_as_cold(rt, ask("question 0"))
    assert t.result.cached_tokens in (0, t.boundaries.system_end)
    rt.scheduler.drain()
    assert_disk_consistent(rt, d)


def test_model_file_replaced_in_place_between_runs_empties_the_disk_tier(start, tmp_path, tiny_model):
    model = tmp_path / "model.gguf"
    shutil.copy(tiny_model, model)
    d = tmp_path / "snap"
    kw = dict(cache_ram_mib=1, cache_disk_dir=d, cache_disk_mib=256)
    rt = start(model=model, **kw)
    assert_same_as_cold(rt, ask("What changed?"))
    assert_same_as_cold(rt, [{"role": "user", "content": "Unrelated, to push the rest to disk. " * 8}])
    rt.scheduler.drain()
    assert rt.cache.stats().disk_entries > 0
    rt.close()
    raw = bytearray(model.read_bytes())  # same path, same size, same first and last MiB
    raw[len(raw) // 2 + 3] ^= 0x01
    model.write_bytes(bytes(raw))
    rt = start(model=model, **kw)
    assert rt.cache.stats().disk_entries == 0 and val_files(d) == []
    t = assert_same_as_cold(rt, ask("What changed?"))
    assert t.result.cached_tokens == 0


def test_fingerprint_sees_a_change_in_the_middle_of_the_file_even_with_the_old_mtime(tmp_path, tiny_model):
    model = tmp_path / "model.gguf"
    shutil.copy(tiny_model, model)
    eng = types.SimpleNamespace(n_ctx=1024, n_seq_max=1, attention=Attention(), state=HybridState(split_layout=True),
                                offload=Offload.of([], -1, 8, True), use_extra_bufts=False, min_segment=8,
                                odd_ubatches=False)
    st = model.stat()
    before = state_fingerprint(model, eng)
    assert state_fingerprint(model, eng) == before
    raw = bytearray(model.read_bytes())
    raw[len(raw) * 32 // 64 + 100] ^= 0x01  # inside a sampled 64 KiB block
    model.write_bytes(bytes(raw))
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert state_fingerprint(model, eng) != before
    raw[len(raw) * 32 // 64 + 100] ^= 0x01  # the original bytes, but a new modification time
    model.write_bytes(bytes(raw))
    assert state_fingerprint(model, eng) != before
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert state_fingerprint(model, eng) == before
    assert state_fingerprint(model, types.SimpleNamespace(**{**vars(eng), "n_ctx": 2048})) != before
    assert state_fingerprint(model, types.SimpleNamespace(**{**vars(eng), "use_extra_bufts": True})) != before


def test_a_disk_entry_whose_key_does_not_match_its_content_is_dropped(start, tmp_path):
    """A snapshot stored under another prefix's key (a moved or renamed row) is never restored."""
    d = tmp_path / "snap"
    kw = dict(cache_ram_mib=1, cache_disk_dir=d, cache_disk_mib=256)
    rt = start(**kw)
    assert_same_as_cold(rt, ask("Which disks failed?"))
    assert_same_as_cold(rt, [{"role": "user", "content": "Unrelated, to push the rest to disk. " * 8}])
    rt.scheduler.drain()
    on_disk = [(k, t) for k, tier, t in rt.cache.entries() if tier == "disk" and k == CHECKPOINT]
    assert len(on_disk) >= 2
    tier = rt.cache.tier("disk")
    (_, short), (_, long_) = sorted(on_disk, key=lambda e: len(e[1]))[:2]
    key_short = next(m.key for e, m in rt.cache._meta.items() if rt.cache._tree_of(e).tokens_of(e) == short
                     and m.kind == CHECKPOINT)
    key_long = next(m.key for e, m in rt.cache._meta.items() if rt.cache._tree_of(e).tokens_of(e) == long_
                    and m.kind == CHECKPOINT)
    kind, tokens, payload = tier.get(key_long)
    tier.put(key_short, tokens, kind, payload)  # the long prefix's snapshot under the short prefix's key
    rt.close()
    rt = start(**kw)
    assert key_short not in rt.cache.tier("disk")  # refused at the index rebuild
    t = assert_same_as_cold(rt, ask("Which disks failed?"))
    assert t.result.cached_tokens != len(short)
    assert_disk_consistent(rt, d)
    assert KV in {k for k, _, _ in rt.cache.entries()}
