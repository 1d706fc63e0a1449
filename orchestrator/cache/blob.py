"""The snapshot blob: one entry as bytes, the same in every tier that keeps entries outside this process (a file of
the disk tier, a string of the remote tier), so both check what they read the same way.

Little-endian throughout (`nbytes` = 59 + 4 * n_tokens + payload bytes):

    offset    size  field
         0       8  magic b"ORCSNAP\\0"
         8       2  format version, u16 (FORMAT_VERSION)
        10      32  fingerprint of model and state layout (refused if not the reader's own)
        42       1  kind, u8: 0 "kv" (the attention KV of the prefix; the whole state where it is KV only or
                    cannot be split), 1 "checkpoint" (the recurrent state after the prefix), 2 "logits" (the
                    float32 logits after the prefix's last token, where a prompt ended)
        43       4  n_tokens, u32
        47       8  payload length in bytes, u64
        55       4  CRC-32 of bytes [0, 55) + token ids + payload, u32
        59  4 * n   token ids of the prefix the snapshot holds, u32 each
    59 + 4n    len  payload: the sequence-state bytes, opaque here

Format versions: 1 named the kinds "full" and "recurrent"; 2 (this one) has the same bytes under the names "kv"
and "checkpoint". A blob of another version or fingerprint is refused (`OtherVersion`, `OtherFingerprint`), one
that fails a length or CRC check is `Invalid`: the tiers delete it and report a miss.
"""

from __future__ import annotations

import io
import struct
import zlib
from typing import BinaryIO, Sequence

import numpy as np

from .radix import EntryKind
from .tiers import Stored

MAGIC = b"ORCSNAP\0"
FORMAT_VERSION = 2
FINGERPRINT_BYTES = 32
KINDS = (EntryKind.KV, EntryKind.CHECKPOINT, EntryKind.LOGITS)  # index = the kind byte (new kinds go last)

HEADER = struct.Struct("<8sH32sBIQI")  # magic, version, fingerprint, kind, n_tokens, payload bytes, crc32
_CHECKED = HEADER.size - 4  # header bytes covered by the checksum: all but the checksum itself
_TOKEN = np.dtype("<u4")


class Invalid(Exception):
    """Stored bytes are not a valid snapshot for this reader; the message says why."""


class OtherFingerprint(Invalid):
    """A valid header, but for another model or state layout."""


class OtherVersion(Invalid):
    """A blob of another format version."""

    def __init__(self, version: int) -> None:
        super().__init__(f"format version {version}, this build reads version {FORMAT_VERSION}")
        self.version = version


def encode(fingerprint: bytes, kind: EntryKind, tokens: Sequence[int], payload) -> tuple[bytes, bytes, object]:
    """The blob of one entry in three parts (header, token ids, payload: written one after another, never joined
    here). `payload` is any bytes-like object. Raises ValueError for an unknown kind or a token id outside
    [0, 2**32)."""
    if kind not in KINDS:
        raise ValueError(f"snapshot kind must be one of {[str(k) for k in KINDS]}, got {kind!r}")
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() > 0xFFFFFFFF)):
        raise ValueError("tokens must be a flat sequence of token ids in [0, 2**32)")
    token_bytes = ids.astype(_TOKEN).tobytes()
    checked = HEADER.pack(MAGIC, FORMAT_VERSION, fingerprint, KINDS.index(kind), ids.size,
                          memoryview(payload).nbytes, 0)[:_CHECKED]
    crc = zlib.crc32(payload, zlib.crc32(token_bytes, zlib.crc32(checked)))
    return checked + struct.pack("<I", crc), token_bytes, payload


def blob_nbytes(n_tokens: int, payload_nbytes: int) -> int:
    """Bytes of the blob of an entry of `n_tokens` tokens and `payload_nbytes` payload bytes."""
    return HEADER.size + 4 * n_tokens + payload_nbytes


def read_header(f: BinaryIO, fingerprint: bytes) -> tuple[EntryKind, int, int, int, bytes]:
    """Read and check a header at the start of `f`, including that `f` has exactly the length it announces.

    Returns (kind, n_tokens, payload bytes, crc32, the checksummed header bytes). Leaves `f` at the token ids.
    Raises OtherVersion, OtherFingerprint or Invalid with the reason.
    """
    raw = f.read(HEADER.size)
    if len(raw) < HEADER.size:
        raise Invalid(f"truncated header ({len(raw)} of {HEADER.size} bytes)")
    magic, version, fp, kind, n_tokens, payload_nbytes, crc = HEADER.unpack(raw)
    if magic != MAGIC:
        raise Invalid(f"bad magic {magic!r}, not a snapshot")
    if version != FORMAT_VERSION:
        raise OtherVersion(version)
    if fp != fingerprint:
        raise OtherFingerprint("written for another model or state layout (fingerprint mismatch)")
    if kind >= len(KINDS):
        raise Invalid(f"unknown kind byte {kind}")
    expected = blob_nbytes(n_tokens, payload_nbytes)
    size = f.seek(0, io.SEEK_END)
    f.seek(HEADER.size)
    if size != expected:
        raise Invalid(f"{size} bytes, but the header announces {expected} (truncated or torn write)")
    return KINDS[kind], n_tokens, payload_nbytes, crc, raw[:_CHECKED]


def read_exact(f: BinaryIO, nbytes: int, what: str) -> bytes:
    """`nbytes` bytes from `f`; raises Invalid naming `what` if fewer are there."""
    data = f.read(nbytes)
    if len(data) != nbytes:
        raise Invalid(f"{what} truncated ({len(data)} of {nbytes} bytes)")
    return data


def read(f: BinaryIO, fingerprint: bytes) -> Stored:
    """The whole entry in `f`, every check made (header, lengths, CRC-32). Raises Invalid (or a subclass)."""
    kind, n_tokens, payload_nbytes, crc, checked = read_header(f, fingerprint)
    token_bytes = read_exact(f, 4 * n_tokens, "token ids")
    payload = read_exact(f, payload_nbytes, "payload")
    if zlib.crc32(payload, zlib.crc32(token_bytes, zlib.crc32(checked))) != crc:
        raise Invalid("CRC-32 mismatch: the blob is corrupt")
    return Stored(kind, tokens_of(token_bytes), payload)


def tokens_of(token_bytes: bytes) -> tuple[int, ...]:
    """Token ids from their stored bytes."""
    return tuple(np.frombuffer(token_bytes, dtype=_TOKEN).tolist())
