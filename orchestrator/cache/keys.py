"""How entries are named in every tier: the salt id of a tenant, and the key of an entry (its salt, kind, length
and a hash of salt and prefix). The names are stable across restarts and machines, so a disk tier reopened, or a
remote tier read by another replica, finds an entry under the key its tokens give."""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence


def salt_id(salt: str) -> str:
    """The id of a cache salt: "" for no salt, else 32 hex digits of its BLAKE2b hash (never the salt itself)."""
    if not salt:
        return ""
    return hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16, person=b"orc-salt").hexdigest()


def disk_key(kind: str, tokens: Sequence[int], sid: str = "") -> str:
    """Key of an entry: "<kind>-<n>-<hash of tokens>" unsalted, "s<salt id>-<kind>-<n>-<hash of salt id and
    tokens>" under salt id `sid`."""
    h = hashlib.blake2b(sid.encode() + struct.pack(f"<{len(tokens)}I", *tokens), digest_size=16).hexdigest()
    return f"s{sid}-{kind}-{len(tokens)}-{h}" if sid else f"{kind}-{len(tokens)}-{h}"


def salt_of_key(key: str) -> str:
    """The salt id an entry key was made under ("" for an unsalted key)."""
    return key[1:33] if key.startswith("s") else ""


def parse_key(key: str) -> tuple[str, str, int] | None:
    """(salt id, kind, n_tokens) of an entry key (`disk_key`'s format), or None if `key` is not one."""
    parts = key.split("-")
    sid = ""
    if parts and parts[0].startswith("s") and len(parts) == 4:
        sid, parts = parts[0][1:], parts[1:]
    if len(parts) != 3 or not parts[1].isdigit() or len(sid) not in (0, 32):
        return None
    return sid, parts[0], int(parts[1])
