"""Remote tier: snapshot entries in Redis, shared by every replica that points at the same Redis database.

A shared `Tier` (tiers.py) below RAM and disk: what one replica stored, any other restores, after a failover, a
rebalance or a local eviction. Knows keys, tokens and bytes; nothing of llama.cpp or the radix tree.

What Redis holds (`ns` = "orc:<blob format version>:<fingerprint hex>": the model file, llama.cpp version and
context layout, so one database serves several models without a wrong restore):

    <ns>:e:<entry key>                  string: the entry's blob (blob.py: the disk tier's header, token ids,
                                        CRC-32 and payload; checked on every read)
    <ns>:d:<salt id or ->:<chain hex>   hash, the directory of one block of BLOCK_TOKENS tokens: a field per
                                        entry that restores a position inside the block, "<entry key>" (or
                                        "<key at p> <entry key>" for a KV entry listed at a checkpoint
                                        position p it covers) -> the blob's bytes

Entry keys are the cache's own (keys.py: salt id, kind, length and a hash of salt id and prefix), so nothing of
one `cache_salt` is found, or readable, under another: the salt is part of every name and every hash.

How a replica finds what others stored, in one round trip. The directory names chain the prompt's blocks:

    c_0 = H(salt id)        c_(i+1) = H(c_i || tokens[i*B : (i+1)*B])        (B = BLOCK_TOKENS, H = BLAKE2b-128)

An entry of n tokens is listed under c_(n // B). A KV entry is also listed at the positions p of the
checkpoints on its path (`covers`, given by the cache): KV is prefix-closed, and on a hybrid model a restore of
p needs a checkpoint at p and KV *covering* p, which is usually a deeper entry on another branch (the end of an
earlier request). For a request, the cache asks `probe` for entries deeper than what it restores locally and at
most as deep as it may restore: the replica derives the chain of its prompt in one pass, reads the directories
of those blocks in one pipeline, and keeps the listings whose key at p is the key of its own prefix of that
length (a prompt that shares the block's start but not the rest lists entries this check refuses). The cache
indexes what is kept and fetches (`get`) the parts of the deepest plan, only when the transfer is faster than
recomputing the tokens it saves (`transfer_s`; reuse.py decides).

Write-behind: `put` queues the entry and returns at once; one writer thread sends each as one MULTI (blob and
directory field). The queue holds at most `queue_bytes`; an entry that does not fit is dropped and counted
(`TierStats.dropped`), as is every write while Redis is unreachable. A directory that grows past
DIRECTORY_FIELDS fields is emptied to its newest entry (stale fields of entries Redis evicted go with it).

Faults: an error or a timeout (`timeout_s` per socket operation) of Redis makes the tier *down*: one warning,
the error counted (`TierStats.errors`, /metrics), every call a miss at once (no waiting on the request path),
and the writer thread reconnects with exponential backoff (BACKOFF_S) in the background; a warning again only
after it was back. A full Redis (maxmemory without eviction: "OOM command not allowed") refuses writes: counted
and warned once, reads go on. A blob that fails its checks is a miss, deleted, counted (`rejected_invalid`).

Bandwidth and round-trip time are measured at connect (PING, and a 4 MiB SET and GET of a scratch key) and on
every transfer since (a moving average), so `transfer_s` is measured, not assumed.

Redis sees user data: blob payloads are the model's state after the prompt's tokens (from which the prompt can
be partly recovered), token ids of every prefix, and hashes of them. Bind Redis to loopback or a private
network, require a password (`redis://:password@host:port/db`) or an ACL user, and use TLS (`rediss://`) off
the host; docs/scale-out.md has the settings.
"""

from __future__ import annotations

import collections
import hashlib
import io
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from . import blob
from .keys import disk_key, parse_key, salt_of_key
from .radix import EntryKind
from .tiers import EntryInfo, Listed, Stored, TierStats

log = logging.getLogger("orchestrator.remote")

BLOCK_TOKENS = 64  # tokens per directory block
DIRECTORY_FIELDS = 256  # a directory with more fields is emptied to its newest one
MAX_VALUE_BYTES = 512 * 2**20  # the largest Redis string
BACKOFF_S = (0.25, 8.0)  # first and longest wait between reconnection attempts, seconds
PROBE_BYTES = 4 * 2**20  # scratch value measuring the bandwidth at connect
_AVERAGE = 0.5  # weight of a new bandwidth measurement in the moving average


def redacted(url: str) -> str:
    """`url` without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def check_url(url: str) -> str:
    """`url` if it names a Redis server (redis://, rediss:// or unix://); raises ValueError saying what is
    expected otherwise."""
    scheme = urlsplit(url).scheme
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"--cache-remote takes redis://[user:password@]host:port/db (rediss:// for TLS), got "
                         f"{redacted(url)!r}")
    return url


class _Link:
    """A Redis client and the health of the connection to it: up or down, errors counted, the measured round
    trip and bandwidth. Thread-safe (redis-py's connection pool is).

    `call` runs one operation: while down it returns its default at once; a connection error or timeout makes
    the link down (one warning per outage); `revive` (the writer thread, with backoff) brings it back.
    """

    def __init__(self, url: str, timeout_s: float) -> None:
        self.label = redacted(url)
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._lock = threading.Lock()
        self.up = False
        self.errors = 0
        self.rtt_s: float | None = None  # measured round trip, seconds
        self.bandwidth: float | None = None  # measured transfer rate, bytes per second
        self._down_since = time.monotonic()  # start of the current outage (or of the first connection attempt)
        self._warned_refused: set[str] = set()

    def call(self, what: str, fn: Callable[[redis.Redis], object], default=None):
        """fn(client), or `default` when down or when the call fails (the failure counted and logged)."""
        if not self.up:
            return default
        try:
            return fn(self.client)
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, OSError) as e:
            self._down(what, e)
        except redis.RedisError as e:  # refused by the server (full, read-only replica, wrong type): a miss
            with self._lock:
                self.errors += 1
                first = type(e).__name__ + str(e)[:20] not in self._warned_refused
                self._warned_refused.add(type(e).__name__ + str(e)[:20])
            if first:
                hint = (" (Redis is full: set maxmemory-policy allkeys-lru, or raise maxmemory)"
                        if "OOM" in str(e) else "")
                log.warning("remote snapshot tier %s refused %s: %s%s; treated as a miss", self.label, what, e, hint)
        return default

    def _down(self, what: str, error: BaseException) -> None:
        with self._lock:
            self.errors += 1
            was_up, self.up = self.up, False
            if was_up:
                self._down_since = time.monotonic()
        if was_up:
            log.warning("remote snapshot tier %s failed (%s: %s: %s): serving from the local tiers only; "
                        "reconnecting in the background", self.label, what, type(error).__name__, error)
        self.client.connection_pool.disconnect()

    def revive(self) -> bool:
        """Try to connect and measure round trip and bandwidth; whether the link is up now."""
        try:
            self._measure()
        except (redis.RedisError, OSError) as e:
            with self._lock:
                self.errors += 1
            log.debug("remote snapshot tier %s still unreachable: %s", self.label, e)
            self.client.connection_pool.disconnect()
            return False
        with self._lock:
            self.up = True
            outage = time.monotonic() - self._down_since if self.errors else None
        log.info("remote snapshot tier %s up%s: round trip %.2f ms, %.0f MiB/s", self.label,
                 f" again after {outage:.1f} s" if outage is not None else "", self.rtt_s * 1e3,
                 self.bandwidth / 2**20)
        return True

    def _measure(self) -> None:
        r = self.client
        pings = []
        for _ in range(3):
            t0 = time.perf_counter()
            r.ping()
            pings.append(time.perf_counter() - t0)
        self.rtt_s = sorted(pings)[1]
        key = f"orc:scratch:{os.urandom(8).hex()}"
        data = os.urandom(PROBE_BYTES)
        try:
            t0 = time.perf_counter()
            r.set(key, data, px=60_000)
            t1 = time.perf_counter()
            got = r.get(key)
            t2 = time.perf_counter()
        finally:
            r.delete(key)
        if got != data:
            raise redis.RedisError("the scratch value read back differs from the one written")
        self.bandwidth = None
        self.observe(len(data), t1 - t0)
        self.observe(len(data), t2 - t1)

    def observe(self, nbytes: int, seconds: float) -> None:
        """Fold one transfer of `nbytes` taking `seconds` (one round trip included) into the bandwidth."""
        if nbytes < 2**16 or self.rtt_s is None:
            return
        rate = nbytes / max(seconds - self.rtt_s, 1e-6)
        with self._lock:
            self.bandwidth = rate if self.bandwidth is None else (1 - _AVERAGE) * self.bandwidth + _AVERAGE * rate

    def transfer_s(self, nbytes: int) -> float:
        """Seconds to read `nbytes` now: round trip + bytes / bandwidth; infinite while down or unmeasured."""
        if not self.up or self.bandwidth is None or self.rtt_s is None:
            return math.inf
        return self.rtt_s + nbytes / self.bandwidth

    def close(self) -> None:
        self.up = False
        self.client.close()


@dataclass
class _Write:
    key: str
    tokens: tuple[int, ...]
    kind: EntryKind
    payload: bytes
    nbytes: int
    covers: tuple[int, ...]


class RemoteTier:
    """Snapshot entries in the Redis database at `url`, shared with other replicas (see the module docstring).

    A shared `Tier` named "remote": `shared` is True, `put` is write-behind, `entries()` lists nothing (its
    entries are found per request by `probe`), and `bytes`, `budget_bytes` and `len()` are 0 (Redis's
    maxmemory is its budget; `INFO memory` shows its use).

    fingerprint: 32 bytes naming the model and state layout (runtime.state_fingerprint); blobs of another are
    never read. queue_bytes: most bytes waiting to be written. timeout_s: limit of each socket operation.
    Raises ValueError for a URL that is not redis://, rediss:// or unix://, or a bad fingerprint. Never raises
    for Redis trouble: an unreachable Redis at start is a tier that is down and reconnects.
    """

    name = "remote"
    shared = True

    def __init__(self, url: str, fingerprint: bytes, queue_bytes: int = 256 * 2**20, timeout_s: float = 2.0) -> None:
        if len(fingerprint) != blob.FINGERPRINT_BYTES:
            raise ValueError(f"fingerprint must be {blob.FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
        if queue_bytes < 0 or not timeout_s > 0:
            raise ValueError("queue_bytes must be >= 0 and timeout_s > 0")
        self._fingerprint = bytes(fingerprint)
        self._ns = f"orc:{blob.FORMAT_VERSION}:{self._fingerprint.hex()}"
        self._link = _Link(check_url(url), timeout_s)
        self._queue_limit = queue_bytes
        self._queue: collections.deque[_Write] = collections.deque()
        self._queued_bytes = 0
        self._pending: dict[str, int] = {}  # key -> writes queued or in flight
        self._listed: dict[str, list[tuple[str, str]]] = {}  # entry key -> (directory, field): listings that
        #                                                       recent probes found (deleted with the entry)
        self._cond = threading.Condition()
        self._closed = False
        self.on_evict: Callable[[str], None] | None = None  # Redis evicts silently: never called
        self._hits = self._misses = self._inserts = self._too_large = self._invalid = self._dropped = 0
        if not self._link.revive():
            log.warning("remote snapshot tier %s unreachable at start: serving from the local tiers only; "
                        "reconnecting in the background", self._link.label)
        self._writer = threading.Thread(target=self._write_loop, name="orchestrator-remote-writer", daemon=True)
        self._writer.start()

    # -- the tier protocol --------------------------------------------------------------------------------------

    @property
    def budget_bytes(self) -> int:
        return 0

    @property
    def bytes(self) -> int:
        return 0

    def __len__(self) -> int:
        return 0

    @property
    def up(self) -> bool:
        """Whether Redis answered the last call (False while reconnecting)."""
        return self._link.up

    def put(self, key: str, tokens: Sequence[int], kind: EntryKind, payload: bytes,
            covers: Sequence[int] = ()) -> bool:
        """Queue the entry for writing (write-behind; True) or drop it (False, counted): the queue is full, Redis
        is down, or the blob exceeds Redis's 512 MiB strings. Never blocks on Redis. `covers` (KV entries): the
        positions < len(tokens) of the checkpoints on its path, where it is listed too."""
        nbytes = blob.blob_nbytes(len(tokens), memoryview(payload).nbytes)
        with self._cond:
            if self._closed:
                return False
            if nbytes > MAX_VALUE_BYTES:
                self._too_large += 1
                return False
            if not self._link.up or self._queued_bytes + nbytes > self._queue_limit:
                self._dropped += 1
                return False
            kind = EntryKind(kind)
            at = tuple(p for p in covers if 0 < p < len(tokens)) if kind.prefix_closed else ()
            self._queue.append(_Write(key, tuple(tokens), kind, payload, nbytes, at))
            self._queued_bytes += nbytes
            self._pending[key] = self._pending.get(key, 0) + 1
            self._cond.notify_all()
            return True

    def get(self, key: str) -> Stored | None:
        """The entry under `key`, every check of blob.py made, or None (absent, Redis down or failing, invalid:
        then it is deleted). Measures the fetch (transfer and checks) for `transfer_s`."""
        t0 = time.perf_counter()
        data = self._link.call("get", lambda r: r.get(self._entry(key)))
        if data is None:
            self._misses += 1
            self._unlist(key)  # listed but gone (Redis evicted it): forget the stale listings
            return None
        try:
            stored = blob.read(io.BytesIO(data), self._fingerprint)
        except blob.Invalid as e:
            self._invalid += 1
            log.warning("remote snapshot %s rejected: %s; deleted", key, e)
            self.delete(key)
            self._misses += 1
            return None
        self._link.observe(len(data), time.perf_counter() - t0)  # what a fetch costs: transfer and checks
        self._hits += 1
        return stored

    def contains(self, key: str) -> bool:
        """Whether `key` is queued for writing or stored in Redis (one round trip; False while down)."""
        with self._cond:
            if key in self._pending:
                return True
        return bool(self._link.call("exists", lambda r: r.exists(self._entry(key)), default=0))

    def delete(self, key: str) -> bool:
        """Delete the entry and its directory listings (those a probe found). Whether Redis held it."""
        listings = self._listed.pop(key, [])

        def op(r: redis.Redis):
            pipe = r.pipeline(transaction=False)
            pipe.delete(self._entry(key))
            for directory, field in listings:
                pipe.hdel(directory, field)
            return pipe.execute()[0]

        return bool(self._link.call("delete", op, default=0))

    def _unlist(self, key: str) -> None:
        listings = self._listed.pop(key, [])
        if listings:
            def op(r: redis.Redis):
                pipe = r.pipeline(transaction=False)
                for directory, field in listings:
                    pipe.hdel(directory, field)
                return pipe.execute()

            self._link.call("unlist", op)

    def entries(self) -> Iterator[EntryInfo]:
        """Nothing: a shared tier is not listed (other replicas write to it); `probe` finds entries per request."""
        return iter(())

    def stats(self) -> TierStats:
        """Counters since start (no call to Redis): hits, misses, writes made (`inserts`), writes dropped,
        errors, invalid blobs deleted; `disabled` while Redis is unreachable."""
        return TierStats(self.name, entries=0, bytes=0, budget_bytes=0, hits=self._hits, misses=self._misses,
                         inserts=self._inserts, rejected_too_large=self._too_large,
                         rejected_invalid=self._invalid, disabled=not self._link.up, errors=self._link.errors,
                         dropped=self._dropped)

    def close(self) -> None:
        """Write what is queued (up to 10 s), stop the writer and close the connections. Idempotent."""
        self.flush(10.0)
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._writer.join(timeout=15)
        self._link.close()

    # -- the shared tier's own members ---------------------------------------------------------------------------

    def probe(self, tokens: Sequence[int], lo: int, hi: int, sid: str) -> list[Listed]:
        """Entries of salt id `sid` that restore tokens[:n] for lo < n <= hi, as their directories list them (one
        pipelined round trip), each checked here against `tokens`; the smallest transfer first among listings of
        the same key. [] while down or on failure. The entries may have been evicted since they were listed:
        `get` then misses and forgets the listing."""
        hi = min(hi, len(tokens))
        if hi <= lo or not self._link.up:
            return []
        first, last = lo // BLOCK_TOKENS, hi // BLOCK_TOKENS
        chain = chain_hashes(tokens, last, sid)
        names = [self._directory(sid, chain[b]) for b in range(first, last + 1)]

        def op(r: redis.Redis):
            pipe = r.pipeline(transaction=False)
            for name in names:
                pipe.hgetall(name)
            return pipe.execute()

        replies = self._link.call("probe", op)
        found: list[Listed] = []
        for name, reply in zip(names, replies or ()):
            for field, value in reply.items():
                listed = _parse_listing(field, value)
                if listed is None:
                    continue
                key, source, nbytes = listed
                parsed = parse_key(key)
                if parsed is None or parsed[0] != sid or not lo < parsed[2] <= hi:
                    continue
                kind, n = EntryKind(parsed[1]), parsed[2]
                if key != disk_key(kind, tokens[:n], sid):
                    continue
                found.append(Listed(key, kind, n, nbytes, source))
                self._listed.setdefault(source, []).append((name, field.decode()))
        while len(self._listed) > 4 * DIRECTORY_FIELDS:  # bounded: the listings of recent probes only
            del self._listed[next(iter(self._listed))]
        found.sort(key=lambda e: (e.key, e.nbytes))
        return found

    def transfer_s(self, nbytes: int) -> float:
        """Measured seconds to read `nbytes` from Redis now (infinite while down or before a measurement)."""
        return self._link.transfer_s(nbytes)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write was made or dropped. False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout_s)

    # -- internals -----------------------------------------------------------------------------------------------

    def _entry(self, key: str) -> str:
        return f"{self._ns}:e:{key}"

    def _directory(self, sid: str, chain: bytes) -> str:
        return f"{self._ns}:d:{sid or '-'}:{chain.hex()}"

    def _write_loop(self) -> None:
        backoff = BACKOFF_S[0]
        while True:
            with self._cond:
                while not self._closed and not self._queue and self._link.up:
                    self._cond.wait(BACKOFF_S[0])  # wakes up to notice a link that went down meanwhile
                if self._closed and (not self._queue or not self._link.up):
                    self._drop_queue()
                    return
                item = self._queue.popleft() if self._link.up and self._queue else None
            if item is None:  # down: drop what waits, then try to reconnect after the backoff
                with self._cond:
                    self._drop_queue()
                    self._cond.wait(backoff)
                    if self._closed:
                        return
                if self._link.revive():
                    backoff = BACKOFF_S[0]
                else:
                    backoff = min(2 * backoff, BACKOFF_S[1])
                continue
            try:
                self._write(item)
            finally:
                with self._cond:
                    self._queued_bytes -= item.nbytes
                    self._done(item.key)

    def _write(self, item: _Write) -> None:
        """One entry: its blob and its listings (at its own length and at each covered position) in one MULTI;
        a directory grown past DIRECTORY_FIELDS is emptied to this entry's listings."""
        sid = salt_of_key(item.key)
        n = len(item.tokens)
        chain = chain_hashes(item.tokens, n // BLOCK_TOKENS, sid)
        listings: dict[str, dict[str, int]] = {}  # directory -> {field: blob bytes}
        for p in (n, *item.covers):
            field = item.key if p == n else f"{disk_key(item.kind, item.tokens[:p], sid)} {item.key}"
            listings.setdefault(self._directory(sid, chain[p // BLOCK_TOKENS]), {})[field] = item.nbytes
        value = b"".join(bytes(p) for p in blob.encode(self._fingerprint, item.kind, item.tokens, item.payload))

        def op(r: redis.Redis):
            pipe = r.pipeline(transaction=True)
            pipe.set(self._entry(item.key), value)
            for directory, fields in listings.items():
                pipe.hset(directory, mapping=fields)
                pipe.hlen(directory)
            return pipe.execute()

        t0 = time.perf_counter()
        replies = self._link.call("write", op)
        if replies is None:
            with self._cond:
                self._dropped += 1
            return
        self._link.observe(len(value), time.perf_counter() - t0)
        with self._cond:
            self._inserts += 1
        full = [d for d, size in zip(listings, replies[2::2]) if size > DIRECTORY_FIELDS]
        if full:
            def reset(r: redis.Redis):
                pipe = r.pipeline(transaction=True)
                for directory in full:
                    pipe.delete(directory)
                    pipe.hset(directory, mapping=listings[directory])
                return pipe.execute()

            self._link.call("directory reset", reset)

    def _drop_queue(self) -> None:
        """Drop every queued write (Redis is down or the tier closes); called with the condition held."""
        while self._queue:
            item = self._queue.popleft()
            self._queued_bytes -= item.nbytes
            self._dropped += 1
            self._done(item.key)

    def _done(self, key: str) -> None:
        left = self._pending.get(key, 0) - 1
        if left > 0:
            self._pending[key] = left
        else:
            self._pending.pop(key, None)
        self._cond.notify_all()


def chain_hashes(tokens: Sequence[int], last_block: int, sid: str) -> list[bytes]:
    """c_0 .. c_last_block of `tokens` under salt id `sid` (the module docstring): c_i names the directory of
    entries whose prefix ends in block i. Blocks past the end of `tokens` are not needed (ValueError)."""
    if last_block * BLOCK_TOKENS > len(tokens):
        raise ValueError(f"block {last_block} starts past the {len(tokens)} tokens")
    data = np.asarray(tokens[: last_block * BLOCK_TOKENS], dtype="<u4").tobytes()
    chain = [hashlib.blake2b(sid.encode(), digest_size=16, person=b"orc-chain").digest()]
    step = 4 * BLOCK_TOKENS
    for i in range(last_block):
        chain.append(hashlib.blake2b(chain[-1] + data[i * step:(i + 1) * step], digest_size=16).digest())
    return chain


def _parse_listing(field: bytes, value: bytes) -> tuple[str, str, int] | None:
    """(key at its position, key of the blob, blob bytes) of one directory field, or None if malformed."""
    try:
        keys = field.decode().split(" ")
        if len(keys) not in (1, 2):
            return None
        return keys[0], keys[-1], int(value)
    except (ValueError, UnicodeDecodeError):
        return None
