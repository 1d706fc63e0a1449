"""Disk tier of the snapshot cache: snapshot files under one directory, bounded by a byte budget, LRU out first.

Implements the tier protocol (`orchestrator.tiers.Tier`). The RAM tier spills evicted snapshots here (`put`) and
promotes hits back (`get`); at start, the cache's index is rebuilt from `entries()`. Knows keys, tokens and bytes,
nothing of llama.cpp or of the radix tree.

Storage is a `diskcache.Cache` owned by this process (a lock file keeps out a second server). Each snapshot is one
file, written whole before its SQLite row commits, so a process killed mid-write leaves at most an unreferenced file
(swept at the next open) and never a row pointing at half a snapshot. A file torn some other way (power loss, disk
error, an outside writer) fails the length or CRC-32 check and is deleted on read. Nothing is pickled, in either
direction: `_SnapshotDisk` writes only snapshot blobs and integers and refuses to unpickle.

One snapshot file holds one blob (blob.py: header with magic, format version, fingerprint, kind, token count,
payload length and CRC-32, then the token ids and the payload), the same bytes as a value of the remote tier.

LRU order survives restarts: every put and every hit stores a use number, from one counter that only goes up, in a
second diskcache row beside the snapshot (key: the snapshot key as UTF-8 bytes; diskcache keeps str and bytes keys
apart). At open, entries are ordered by it; a snapshot without one counts as least recently used.

Entries of another format version (blob.FORMAT_VERSION) are discarded at open with one log line that says so
(they cost misses, never errors).

A snapshot file's name holds its key: `<16 random hex>.<key as UTF-8, in hex>.<check>.val` under diskcache's two
levels of folders, where check is the CRC-32 (8 hex digits) of the file's 59-byte header (which holds the CRC-32
of the whole blob) and the key's bytes. The name is thus bound to the bytes of that one file: a file served for a
key must carry that key in its name and match the check (else it is rejected and deleted like a corrupt one), so
neither a row of the index pointing at the wrong file nor a file renamed or swapped is ever served under the wrong
key. Files of earlier releases have random names (28 hex digits), as do files of keys too long for a file name
(over 112 UTF-8 bytes; the cache's own keys are at most 88): they are read as before, without this check, and
cannot be re-indexed after losing the index.

The index repairs itself. At open, SQLite's quick_check runs on cache.db. A corrupt one (found so, or raising
SQLite's "database disk image is malformed" or "file is not a database" while loading, or, at run time, from any
operation; or one whose repair was interrupted, which the file cache.db.repairing marks) is moved aside, renamed
cache.db.corrupt-<UTC time> (with its -wal and -shm files), never deleted, and a fresh index is built from the
snapshot files: each file whose header is valid (magic, version, fingerprint, kind, length) and whose name holds a
key that matches the check is taken back under that key (at open in the order the files were written, oldest
first, as least recently used; at run time only the keys the tier held, in their LRU order); the CRC-32 of the
whole blob is checked by `get`, as always. Dropped, and deleted: files whose key cannot be recovered (random
names: serving them under a guessed key could serve the wrong entry), invalid ones, and every file of a key that
two files claim (which is current cannot be told). One warning says what was moved where and how many snapshots
came back. The tier keeps working; nobody needs to repair the folder by hand. A run-time repair happens at most
once per RETRY_S; when one fails, the tier disables itself as for any disk error.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import itertools
import logging
import os
import sqlite3
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Sequence

import diskcache
from diskcache.core import DBNAME, MODE_BINARY, MODE_RAW, UNKNOWN

from ..errors import OrchestratorError
from . import blob
from .blob import FINGERPRINT_BYTES, FORMAT_VERSION, KINDS
from .radix import EntryKind
from .tiers import EntryInfo, Stored, TierStats

__all__ = ["DiskTier", "EntryInfo", "FORMAT_VERSION", "KINDS"]

log = logging.getLogger("orchestrator.cache.disk")

_LOCK_NAME = "orchestrator.lock"
_SUFFIX = ".val"  # diskcache's file suffix
_REPAIRING = "cache.db.repairing"  # exists while a repair builds the fresh index
_NAME_MAX = 255  # bytes of a file name (NAME_MAX of Linux's and macOS's file systems)

# What a failing disk raises: OSError (ENOSPC, EIO, EACCES), SQLite errors ("database or disk is full") and
# diskcache.Timeout (the database stayed locked).
_DISK_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
RETRY_S = 30.0  # seconds the tier takes no writes after a failed one; doubled per failure in a row
RETRY_MAX_S = 600.0


class DiskTier:
    """Snapshots on disk under `directory`, at most `budget_bytes` of files, least recently used out first.
    A `Tier` (orchestrator.cache.tiers) named "disk"; `nbytes` and `bytes` count whole files (header + tokens + payload).

    * `put(key, tokens, kind, payload)` stores a snapshot. The budget is checked before writing: LRU entries are
      evicted until the new one fits; one larger than the whole budget is not stored (False). A failing disk logs
      one warning, counts an error (`errors`, the metric orchestrator_cache_tier_errors_total) and disables the
      tier for a backoff (`disabled`: puts return False for RETRY_S seconds, doubling while writes keep failing,
      at most RETRY_MAX_S; gets and deletes still work); the first put after it tries the disk again, and a
      success re-enables it. Returns False. Never raises for disk trouble.
    * `get(key)` returns `Stored(kind, tokens, payload)` after checking magic, version, fingerprint, lengths and CRC-32,
      and marks the entry used. An entry that fails a check is deleted, logged, and reported as a miss (None).
    * `entries()` lists what is stored, least recently used first, reading only headers and token ids.
    * `on_evict`, if set, is called with each key that `put` evicted to fit its budget, after `put` has released
      the tier's lock (not for deletes, replacements or rejected entries). The RAM tier's index uses it to forget
      snapshots that are gone, so that it stays as small as what the tiers hold.

    Opening validates every header (entries of another fingerprint or format are deleted), sweeps files no row
    refers to, restores the LRU order and evicts until the budget holds, so a smaller budget after a restart
    takes effect at once. A corrupt index is moved aside and rebuilt from the files, at open or when an operation
    meets the corruption (module docstring). One process per directory; raises OrchestratorError if another
    holds it or the directory cannot be used.

    Thread-safe: one lock guards the index and serialises disk I/O.
    """

    name = "disk"
    shared = False

    def __init__(self, directory: Path | str, budget_bytes: int, fingerprint: bytes) -> None:
        if budget_bytes < 0:
            raise ValueError("disk cache budget must be >= 0 bytes")
        if len(fingerprint) != FINGERPRINT_BYTES:
            raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
        self.directory = Path(directory)
        self._budget = budget_bytes
        self._fingerprint = bytes(fingerprint)
        self._lru: OrderedDict[str, int] = OrderedDict()  # key -> nbytes; first = least recently used
        self._bytes = 0
        self._lock = threading.Lock()
        self._disabled = False
        self._retry_at = 0.0  # time.monotonic() from which a disabled tier tries writing again
        self._backoff = RETRY_S
        self._errors = 0
        self._repaired_at = -RETRY_S  # time.monotonic() of the last repair at run time (one per RETRY_S at most)
        self._closed = False
        self._cache: diskcache.Cache | None = None
        self.on_evict: Callable[[str], None] | None = None
        self._hits = self._misses = self._inserts = self._evictions = self._too_large = self._invalid = 0
        self._lock_fd = _lock_directory(self.directory)
        try:
            self._open()
        except _DISK_ERRORS as e:
            self._close_cache()
            self._release()
            raise OrchestratorError(
                f"cannot open the snapshot disk cache at {self.directory}: {e}; fix the directory (permissions, free "
                f"space) or point the disk cache elsewhere") from e
        except BaseException:
            self._close_cache()
            self._release()
            raise

    # -- public API ------------------------------------------------------------------------------------------

    @property
    def budget_bytes(self) -> int:
        """Most file bytes the tier keeps."""
        return self._budget

    @property
    def bytes(self) -> int:
        """File bytes stored now (header + tokens + payload of every snapshot; SQLite's own file not counted)."""
        return self._bytes

    @property
    def disabled(self) -> bool:
        """True after a write failed (full or failing disk), for the backoff: puts return False until then."""
        return self._disabled and time.monotonic() < self._retry_at

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    def contains(self, key: str) -> bool:
        """Whether a snapshot is stored under `key` (without reading or touching it)."""
        return key in self._lru

    def put(self, key: str, tokens: Sequence[int], kind: EntryKind, payload: bytes) -> bool:
        """Store the snapshot of the state after exactly `tokens` under `key`, replacing one stored there.

        `payload` is any bytes-like object; the file holds 59 + 4 * len(tokens) + len(payload) bytes. Returns False,
        storing nothing, if that exceeds the whole budget, if the tier is disabled, or if the disk fails (one
        warning, then the tier disables itself). Raises TypeError for a key that is not a str, ValueError for an
        unknown `kind`, a token id outside [0, 2**32), or a closed tier.
        """
        if not isinstance(key, str):
            raise TypeError(f"snapshot keys are str, got {type(key).__name__}")
        parts = blob.encode(self._fingerprint, kind, tokens, payload)
        nbytes = blob.blob_nbytes(len(tokens), memoryview(payload).nbytes)
        value = _Blob(parts)
        evicted: list[str] = []
        try:
            with self._lock:
                self._check_open()
                if self.disabled:
                    return False
                if nbytes > self._budget:
                    self._too_large += 1
                    return False
                for attempt in range(2):
                    try:
                        if key in self._lru:
                            self._remove(key)
                        while self._bytes + nbytes > self._budget:
                            victim = next(iter(self._lru))
                            self._remove(victim)
                            self._evictions += 1
                            evicted.append(victim)
                        with self._cache.transact():
                            self._cache.set(key, value)
                            self._cache.set(_use_key(key), next(self._uses))
                        break
                    except _DISK_ERRORS as e:
                        if not self._fail(f"writing snapshot {key!r} ({nbytes} bytes)", e) or attempt:
                            return False  # (a repaired index: tried once more)
                self._lru[key] = nbytes
                self._bytes += nbytes
                self._inserts += 1
                if self._disabled:
                    self._disabled, self._backoff = False, RETRY_S
                    log.warning("snapshot disk cache %s takes writes again", self.directory)
                return True
        finally:
            if self.on_evict is not None:
                for victim in evicted:
                    self.on_evict(victim)

    def get(self, key: str) -> Stored | None:
        """`Stored(kind, tokens, payload)` of the snapshot under `key`, or None if absent or invalid.

        Checks magic, version, fingerprint, kind, lengths, the CRC-32 over the whole file and that the file is
        `key`'s (its name) before returning; an entry that fails one, or cannot be read, is deleted and logged
        with the reason. Marks a hit most recently used. Raises ValueError once closed, never for bad data.
        """
        with self._lock:
            self._check_open()
            stored = self._read(key, self._read_whole) if key in self._lru else None
            if stored is None:
                self._misses += 1
                return None
            self._touch(key)
            self._hits += 1
            return stored

    def delete(self, key: str) -> bool:
        """Forget the snapshot under `key`. Returns whether one was stored. Disk errors disable the tier."""
        with self._lock:
            self._check_open()
            if key not in self._lru:
                return False
            self._remove_quietly(key)
            return True

    def entries(self) -> Iterator[EntryInfo]:
        """Every stored snapshot, least recently used first, for rebuilding the RAM index at start.

        Reads each file's header and token ids only (not the payload): the header and the file's name are checked
        (an invalid one is deleted and logged, and skipped), the CRC-32 is left to `get`. Does not change the LRU
        order. Entries put or evicted while iterating may or may not appear.
        """
        with self._lock:
            keys = list(self._lru)
        for key in keys:
            with self._lock:
                self._check_open()
                if key not in self._lru:
                    continue
                got = self._read(key, self._read_listing)
                if got is None:
                    continue
                info = EntryInfo(key, got[0], got[1], self._lru[key])
            yield info

    def keys(self) -> list[str]:
        """Keys stored, least recently used first (for tests and diagnostics)."""
        with self._lock:
            return list(self._lru)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                self.name, entries=len(self._lru), bytes=self._bytes, budget_bytes=self._budget, hits=self._hits,
                misses=self._misses, inserts=self._inserts, evictions=self._evictions,
                rejected_too_large=self._too_large, rejected_invalid=self._invalid, disabled=self.disabled,
                errors=self._errors)

    def close(self) -> None:
        """Close the database and release the directory. Idempotent; other calls raise ValueError afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._close_cache()
            self._release()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals (called with self._lock held) ---------------------------------------------------------------

    def _open(self) -> None:
        """Open the index and load it (`_load`); a corrupt one is repaired (`_repair`)."""
        corrupt = self._index_corruption()
        if corrupt is None:
            try:
                self._cache = self._new_cache()
                self._uses = itertools.count(self._load())
                return
            except _DISK_ERRORS as e:
                if not _is_corruption(e):
                    raise
                corrupt = str(e)
        self._repair(corrupt, None)

    def _new_cache(self) -> diskcache.Cache:
        return diskcache.Cache(
            str(self.directory), disk=_SnapshotDisk, eviction_policy="none", cull_limit=0,
            statistics=0, tag_index=0, disk_min_file_size=0)

    def _close_cache(self) -> None:
        if self._cache is not None:
            with contextlib.suppress(*_DISK_ERRORS):
                self._cache.close()

    def _index_corruption(self) -> str | None:
        """What is wrong with cache.db, by SQLite's quick_check, or None if it is sound or absent. Errors other
        than corruption (cannot open, locked) are left for diskcache to raise."""
        if (self.directory / _REPAIRING).exists():
            return "a repair of it was interrupted"
        path = self.directory / DBNAME
        if not path.exists():
            return None
        try:
            con = sqlite3.connect(str(path), isolation_level=None)
            try:
                rows = con.execute("PRAGMA quick_check").fetchall()
            finally:
                con.close()
        except sqlite3.Error as e:
            return str(e) if _is_corruption(e) else None
        if rows == [("ok",)]:
            return None
        return "quick_check: " + "; ".join(str(r[0]) for r in rows[:3]) + ("; ..." if len(rows) > 3 else "")

    def _repair(self, reason: str, keep: Sequence[str] | None) -> None:
        """Move the corrupt index aside, build a fresh one from the snapshot files, and load it; one warning.

        `keep`: at run time, the keys the tier holds, least recently used first: only their files come back, in
        that order. At open (None): every valid file whose name holds its key, in the order they were written.
        Raises on disk errors (the tier is then left without an index: the caller disables it or fails to open).
        """
        self._close_cache()  # (kept until the fresh one opens: a failed repair leaves a closed one, not None)
        self._lru.clear()
        self._bytes = 0
        marker = self.directory / _REPAIRING  # until the files are indexed: a fresh index that is still empty
        marker.touch()  # must not pass for a sound one (the next open would sweep every file)
        aside = self._set_index_aside()
        self._cache = self._new_cache()
        taken, unnamed, invalid, claimed = self._adopt_files(keep)
        marker.unlink()
        self._uses = itertools.count(self._load())
        dropped = [f"{n} {why}" for n, why in (
            (unnamed, "without their key in the file name (written by an earlier release, or a key too long for one)"),
            (invalid, "invalid or of another model or format" + (", or no longer held" if keep is not None else "")),
            (claimed, "of keys that two files claim"),
            (taken - len(self._lru), "evicted to fit the budget")) if n]
        log.warning("snapshot disk cache %s: its index %s was corrupt (%s); moved it aside to %s and built a fresh one "
                    "from the snapshot files: %d snapshots re-indexed%s", self.directory, DBNAME, reason, aside.name,
                    len(self._lru), "; deleted: " + ", ".join(dropped) if dropped else "")

    def _set_index_aside(self) -> Path:
        """Rename cache.db (and its -wal and -shm files) to cache.db.corrupt-<UTC time>. Returns the new path."""
        base = self.directory / DBNAME
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        for n in itertools.count():
            aside = base.with_name(f"{DBNAME}.corrupt-{stamp}" + (f".{n}" if n else ""))
            if not any(os.path.lexists(f"{aside}{s}") for s in ("", "-wal", "-shm")):
                break
        for suffix in ("", "-wal", "-shm"):
            if os.path.lexists(f"{base}{suffix}"):
                os.replace(f"{base}{suffix}", f"{aside}{suffix}")
        return aside

    def _adopt_files(self, keep: Sequence[str] | None) -> tuple[int, int, int, int]:
        """Index, in the fresh (empty) index, each snapshot file whose header is valid and whose name holds its
        key, with use numbers in `_repair`'s order; delete every other snapshot file.

        Returns (files taken, files without a key, invalid files, files of keys two files claim).
        """
        root = os.path.realpath(self.directory)
        held = None if keep is None else {key: i for i, key in enumerate(keep)}
        found: dict[str, list[tuple[float, str, int]]] = {}  # key -> [(mtime, path relative to root, bytes)]
        unnamed = invalid = 0
        for dirpath, _, names in os.walk(root):
            for name in names:
                if not name.endswith(_SUFFIX):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                try:
                    with open(os.path.join(root, rel), "rb") as f:
                        _, _, _, crc, checked = blob.read_header(f, self._fingerprint)
                        key = _key_in_name(name, checked + struct.pack("<I", crc))
                        size, mtime = f.seek(0, io.SEEK_END), os.fstat(f.fileno()).st_mtime
                except (_Invalid, OSError) as e:
                    log.debug("snapshot file %s not re-indexed: %s", rel, e)
                    invalid += 1
                    self._cache.disk.remove(rel)
                    continue
                if key is None:
                    unnamed += 1
                    self._cache.disk.remove(rel)
                elif held is not None and key not in held:
                    invalid += 1
                    self._cache.disk.remove(rel)
                else:
                    found.setdefault(key, []).append((mtime, rel, size))
        claimed = 0
        for key, files in list(found.items()):
            if len(files) > 1:  # which one is the key's current snapshot cannot be told: neither is served
                claimed += len(files)
                for _, rel, _ in files:
                    self._cache.disk.remove(rel)
                del found[key]
        if held is not None:
            order = sorted(found, key=held.__getitem__)
        else:
            order = sorted(found, key=lambda k: (found[k][0][0], found[k][0][1]))
        with self._cache.transact():
            for use, key in enumerate(order):
                (_, rel, size), = found[key]
                self._cache.set(key, _Adopt(rel, size))
                self._cache.set(_use_key(key), use)
        return len(order), unnamed, invalid, claimed

    def _read(self, key: str, read: Callable[[str, BinaryIO], object]):
        """`read(key, f)` of the file of `key` (which the index holds), or None after rejecting the entry (invalid
        or unreadable: deleted and logged). A corrupt index is repaired first, then the file is read again."""
        for attempt in range(2):
            try:
                with self._open_value(key) as f:
                    return read(key, f)
            except _Invalid as e:
                self._reject(key, str(e))
                return None
            except _DISK_ERRORS as e:
                if _is_corruption(e):
                    if self._fail(f"reading snapshot {key!r}", e) and not attempt and key in self._lru:
                        continue
                    return None
                self._reject(key, f"unreadable ({e})")
                return None
        return None

    def _read_whole(self, key: str, f: BinaryIO) -> Stored:
        stored = blob.read(f, self._fingerprint)
        f.seek(0)
        _check_owner(key, f, f.read(blob.HEADER.size))
        return stored

    def _read_listing(self, key: str, f: BinaryIO) -> tuple[EntryKind, tuple[int, ...]]:
        kind, n_tokens, _, crc, checked = blob.read_header(f, self._fingerprint)
        token_bytes = blob.read_exact(f, 4 * n_tokens, "token ids")
        _check_owner(key, f, checked + struct.pack("<I", crc))
        return kind, blob.tokens_of(token_bytes)

    def _load(self) -> int:
        """Index what the directory holds, oldest use first, and evict to the budget. Returns the next use number.

        Deletes rows that are not valid snapshots of this fingerprint and format, use numbers without a snapshot,
        and snapshot files no row refers to (left by a process killed mid-write).
        """
        sizes: dict[str, int] = {}
        uses: dict[str, int] = {}
        files: set[str] = set()
        other_fingerprint = 0
        other_version: dict[int, int] = {}
        for dkey in list(self._cache):  # rowid order: the order entries were first stored
            if isinstance(dkey, bytes):
                try:
                    use = self._cache.get(dkey)
                except _Invalid:
                    use = None
                if type(use) is int:
                    uses[dkey.decode("utf-8", "surrogatepass")] = use
                else:
                    self._cache.delete(dkey)
                continue
            if not isinstance(dkey, str):  # int or float key: not ours
                self._cache.delete(dkey)
                continue
            try:
                with self._open_value(dkey) as f:
                    _, _, _, crc, checked = blob.read_header(f, self._fingerprint)
                    _check_owner(dkey, f, checked + struct.pack("<I", crc))
                    sizes[dkey] = f.seek(0, io.SEEK_END)
                    if isinstance(f, io.BufferedReader):
                        files.add(os.path.realpath(f.name))
            except _OtherFingerprint:
                other_fingerprint += 1
                self._cache.delete(dkey)
            except _OtherVersion as e:
                other_version[e.version] = other_version.get(e.version, 0) + 1
                self._cache.delete(dkey)
            except (_Invalid, OSError) as e:
                log.warning("snapshot %r in %s rejected at open: %s; deleted", dkey, self.directory, e)
                self._invalid += 1
                self._cache.delete(dkey)
        if other_fingerprint:
            log.warning("%d snapshots in %s were written for another model or state layout (fingerprint "
                        "mismatch); deleted", other_fingerprint, self.directory)
            self._invalid += other_fingerprint
        for version, n in sorted(other_version.items()):
            log.warning("%d snapshots in %s are of format version %d, and this build reads version %d: discarded, "
                        "version changed (they cost misses only)", n, self.directory, version, FORMAT_VERSION)
            self._invalid += n
        for key in uses.keys() - sizes.keys():
            self._cache.delete(_use_key(key))
        self._sweep_unreferenced(files)
        for key in sorted(sizes, key=lambda k: uses.get(k, -1)):  # stable: rowid order among equal uses
            self._lru[key] = sizes[key]
            self._bytes += sizes[key]
        evicted = 0
        while self._bytes > self._budget:
            self._remove(next(iter(self._lru)))
            evicted += 1
        if evicted:
            log.info("snapshot disk cache %s: evicted %d snapshots to fit the budget of %d bytes",
                     self.directory, evicted, self._budget)
        return max(uses.values(), default=-1) + 1

    def _sweep_unreferenced(self, referenced: set[str]) -> None:
        """Delete snapshot files that no row refers to (a write that never committed)."""
        for dirpath, _, names in os.walk(self.directory):
            for name in names:
                path = os.path.realpath(os.path.join(dirpath, name))
                if name.endswith(_SUFFIX) and path not in referenced:
                    log.info("deleting %s: a snapshot file no entry refers to (interrupted write)", path)
                    self._cache.disk.remove(os.path.relpath(path, os.path.realpath(self.directory)))

    def _open_value(self, key: str) -> BinaryIO:
        """The stored value of `key` as a binary file, positioned at 0. Raises _Invalid if absent or not bytes."""
        value = self._cache.get(key, read=True)
        if value is None:
            raise _Invalid("its file is missing")
        if isinstance(value, bytes):  # a blob kept inside SQLite, written by something other than put
            return io.BytesIO(value)
        if not isinstance(value, io.BufferedReader):
            raise _Invalid(f"the stored value is a {type(value).__name__}, not snapshot bytes")
        return value

    def _remove(self, key: str) -> None:
        """Delete `key`'s snapshot and use number from disk, then from the index. Raises on disk errors."""
        with self._cache.transact():
            self._cache.delete(key)
            self._cache.delete(_use_key(key))
        self._bytes -= self._lru.pop(key)

    def _remove_quietly(self, key: str) -> None:
        """`_remove` that never raises: on a disk error the tier is disabled and the key dropped from the index
        (its file then stays on disk, uncounted, until the next open). After a repaired index, tried once more."""
        for attempt in range(2):
            try:
                self._remove(key)
                return
            except _DISK_ERRORS as e:
                if self._fail(f"deleting snapshot {key!r}", e) and not attempt:
                    if key not in self._lru:
                        return
                    continue
                self._bytes -= self._lru.pop(key, 0)
                return

    def _reject(self, key: str, reason: str) -> None:
        log.warning("snapshot %r in %s rejected: %s; deleted", key, self.directory, reason)
        self._invalid += 1
        self._remove_quietly(key)

    def _touch(self, key: str) -> None:
        """Mark `key` most recently used, in the index and (unless disabled) on disk."""
        self._lru.move_to_end(key)
        use = next(self._uses)
        if not self._disabled:
            try:
                self._cache.set(_use_key(key), use)
            except _DISK_ERRORS as e:
                self._fail(f"recording the use of snapshot {key!r}", e)

    def _fail(self, what: str, error: BaseException) -> bool:
        """An operation failed: count it. If the index is corrupt, repair it (at most once per RETRY_S) and return
        True: the tier works on, the caller may try again. Else (or if the repair fails too) warn (once per
        outage), disable the tier for the backoff (doubled when the retry fails too), drop the connection (and any
        half-open transaction; diskcache reconnects on the next use) and return False."""
        self._errors += 1
        if _is_corruption(error) and time.monotonic() - self._repaired_at >= RETRY_S:
            self._repaired_at = time.monotonic()
            keep = list(self._lru)
            try:
                self._repair(f"{what}: {error}", keep)
                return True
            except _DISK_ERRORS as e:
                log.warning("snapshot disk cache %s: repairing its corrupt index failed: %s", self.directory, e)
                error = e
        if not self._disabled:
            self._disabled = True
            hint = " (disk full)" if isinstance(error, OSError) and error.errno == errno.ENOSPC else ""
            log.warning("snapshot disk cache %s disabled after an error %s%s: %s; snapshots stay in RAM only "
                        "for %.0f s, then writes are tried again; free disk space or lower the disk cache budget",
                        self.directory, what, hint, error, self._backoff)
        else:
            log.debug("snapshot disk cache %s: error %s: %s", self.directory, what, error)
            if time.monotonic() >= self._retry_at:  # the retry failed too
                self._backoff = min(self._backoff * 2, RETRY_MAX_S)
        self._retry_at = time.monotonic() + self._backoff
        self._close_cache()
        return False

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"snapshot disk cache {self.directory} is closed")

    def _release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the flock
            self._lock_fd = None


_Invalid, _OtherFingerprint, _OtherVersion = blob.Invalid, blob.OtherFingerprint, blob.OtherVersion


@dataclass(frozen=True)
class _Blob:
    """A snapshot file's bytes in parts (header, token ids, payload), written one after another without joining."""

    parts: tuple[bytes | memoryview, ...]


@dataclass(frozen=True)
class _Adopt:
    """A snapshot file already on disk (`filename`, relative to the directory, of `size` bytes), indexed as it is:
    how a repair re-indexes the files."""

    filename: str
    size: int


def _is_corruption(error: BaseException) -> bool:
    """Whether `error` says the SQLite database is corrupt (SQLITE_CORRUPT, SQLITE_NOTADB), not that the disk or
    the lock failed."""
    if not isinstance(error, sqlite3.DatabaseError):
        return False
    code = getattr(error, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in (11, 26)
    message = str(error)
    return type(error) is sqlite3.DatabaseError and ("malformed" in message or "not a database" in message)


def _keyed_name(key: str, header: bytes | memoryview, random_hex: str) -> str | None:
    """The file name of `key`'s snapshot whose blob starts with `header` (module docstring), or None if it would
    be longer than a file name may be."""
    key_bytes = key.encode("utf-8", "surrogatepass")
    check = zlib.crc32(key_bytes, zlib.crc32(header))
    name = f"{random_hex}.{key_bytes.hex()}.{check:08x}{_SUFFIX}"
    return name if len(name) <= _NAME_MAX else None


def _key_in_name(name: str, header: bytes) -> str | None:
    """The key a snapshot file's `name` holds, checked against the file's 59-byte `header`; None for a random
    name (no key: an earlier release's file, or a key too long). Raises _Invalid if the name holds a key but does
    not match the header (a file renamed, swapped or damaged)."""
    if not name.endswith(_SUFFIX):
        raise _Invalid(f"file name {name!r} is not a snapshot file's")
    fields = name[: -len(_SUFFIX)].split(".")
    if len(fields) == 1:
        return None
    try:
        random_hex, key_hex, check = fields
        key = bytes.fromhex(key_hex).decode("utf-8", "surrogatepass")
        ok = len(check) == 8 and int(check, 16) == zlib.crc32(bytes.fromhex(key_hex), zlib.crc32(header))
    except ValueError:
        ok = False
    if not ok:
        raise _Invalid(f"its file name {name!r} does not match its content (renamed, swapped or damaged)")
    return key


def _check_owner(key: str, f: BinaryIO, header: bytes) -> None:
    """Raise _Invalid unless the snapshot file `f`, whose blob starts with `header`, is `key`'s by its name (a
    file with a random name, of an earlier release, passes; a value held in SQLite has no name)."""
    if not isinstance(f, io.BufferedReader):
        return
    owner = _key_in_name(os.path.basename(f.name), header)
    if owner is not None and owner != key:
        raise _Invalid(f"its file holds another key's snapshot ({owner!r}), not this one's; the index is damaged")


class _SnapshotDisk(diskcache.Disk):
    """diskcache serialisation that never pickles: snapshot blobs go to files, use numbers to SQLite integers.

    Any other value is refused (TypeError); pickled or text values read back are reported invalid, not loaded.
    """

    def filename(self, key=UNKNOWN, value=UNKNOWN):
        """A snapshot file's name holds its key (module docstring); other files get diskcache's random name."""
        if isinstance(key, str) and isinstance(value, _Blob):
            random_hex = os.urandom(10).hex()
            name = _keyed_name(key, value.parts[0], random_hex[4:])
            if name is not None:
                filename = os.path.join(random_hex[:2], random_hex[2:4], name)
                return filename, os.path.join(self._directory, filename)
        return super().filename(key, value)

    def store(self, value, read, key=UNKNOWN):
        if isinstance(value, _Adopt):
            return value.size, MODE_BINARY, value.filename, None
        if isinstance(value, _Blob):
            filename, full_path = self.filename(key, value)
            try:
                size = _write_parts(full_path, value.parts)
            except BaseException:
                self.remove(filename)  # no half-written file left behind
                raise
            return size, MODE_BINARY, filename, None
        if type(value) is int:
            return 0, MODE_RAW, None, value
        raise TypeError(f"the snapshot disk cache stores snapshot blobs and integers only, not {type(value).__name__}")

    def fetch(self, mode, filename, value, read):
        if mode not in (MODE_RAW, MODE_BINARY):
            raise _Invalid(f"diskcache value mode {mode} (pickled or text), not snapshot bytes; not loaded")
        return super().fetch(mode, filename, value, read)

    def get(self, key, raw):
        if not raw:
            raise OrchestratorError(
                f"the snapshot disk cache at {self._directory} holds pickled keys, so something else wrote it; "
                f"give the disk cache a directory of its own")
        return super().get(key, raw)


def _write_parts(path: str, parts: Sequence[bytes | memoryview]) -> int:
    """Write `parts` one after another to a new file at `path`. Returns the bytes written. Raises OSError."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "xb") as f:
        for part in parts:
            f.write(part)
    return sum(memoryview(p).nbytes for p in parts)


def _use_key(key: str) -> bytes:
    """diskcache key of `key`'s use number: its UTF-8 bytes (a bytes key never equals a str key in diskcache)."""
    return key.encode("utf-8", "surrogatepass")


def _lock_directory(directory: Path) -> int:
    """Create `directory` if needed and take an exclusive flock on its lock file. Returns the descriptor.

    Raises OrchestratorError if the directory cannot be used or another process holds it.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise OrchestratorError(
            f"cannot use {directory} for the snapshot disk cache: {e}; fix its permissions or point the disk "
            f"cache elsewhere") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        raise OrchestratorError(
            f"the snapshot disk cache at {directory} is in use by another process (lock {_LOCK_NAME}); stop the "
            f"other server or give this one its own disk cache directory") from e
    return fd
