"""Authenticated records: keyed BLAKE3 tags (PROTOCOL.md §2.5, THREATS.md). Pure.

A tag proves that a record was written by a holder of the run's key. Keys are
never stored with the checkpoints. From a master key (≥ 32 bytes, identified
by a short *key ID* so keys can rotate) each run gets its own key::

    run_key = BLAKE3-derive_key(context = "ckptstore 2026-11 run key v1",
                                material = master_key || 0x00 || run_id)

and a record's tag is::

    tag = BLAKE3-keyed(run_key, domain(kind) || 0x00 || body_digest)

where ``body_digest`` is the BLAKE3 of the record's canonical bytes *without*
its ``auth`` field and ``domain(kind)`` is ``ckptstore/v1/<kind>`` (run,
attempt, commit, event), so a tag of one kind never verifies as another.
Tags are compared in constant time.
"""

from __future__ import annotations

import enum
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass

import blake3

from ..errors import InvalidInputError

KINDS = ("run", "attempt", "commit", "event", "artifact")  # artifact: a promoted model's provenance.json
DERIVE_CONTEXT = "ckptstore 2026-11 run key v1"
_KEY_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
MIN_KEY_BYTES = 32


class AuthPolicy(str, enum.Enum):
    """``off``: nothing signed or checked (the default, round-1 behaviour).
    ``warn``: records are signed when a key is present; unauthenticated ones
    are used but reported. ``require``: only authenticated records count —
    selection skips the rest with their reason, unauthenticated attempt
    records fence nothing (and stop gc), writers refuse unauthenticated runs."""

    OFF = "off"
    WARN = "warn"
    REQUIRE = "require"


@dataclass(frozen=True)
class AuthTag:
    key_id: str
    tag: str

    def to_json(self) -> dict[str, str]:
        return {"key_id": self.key_id, "tag": self.tag}

    @classmethod
    def parse(cls, value: object) -> AuthTag | None:
        """The tag in a record's ``auth`` field, or None if malformed."""
        if not isinstance(value, dict) or set(value) != {"key_id", "tag"}:
            return None
        kid, tag = value.get("key_id"), value.get("tag")
        if not isinstance(kid, str) or not _KEY_ID.match(kid) or not isinstance(tag, str) or not _HEX64.match(tag):
            return None
        return cls(kid, tag)


def check_key_id(key_id: str) -> str:
    if not isinstance(key_id, str) or not _KEY_ID.match(key_id):
        raise InvalidInputError("a key ID is 1-64 letters, digits, '.', '_' or '-'")
    return key_id


def run_key(master: bytes, run_id: str) -> bytes:
    return blake3.blake3(master + b"\x00" + run_id.encode(), derive_key_context=DERIVE_CONTEXT).digest()


def compute_tag(key: bytes, kind: str, body_digest: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown record kind {kind!r}")
    msg = f"ckptstore/v1/{kind}".encode() + b"\x00" + bytes.fromhex(body_digest)
    return blake3.blake3(msg, key=key).hexdigest()


class Keyring:
    """Master keys by key ID; ``active`` signs, every key verifies (rotation)."""

    def __init__(self, keys: Mapping[str, bytes], active: str | None = None) -> None:
        for kid, k in keys.items():
            check_key_id(kid)
            if not isinstance(k, bytes) or len(k) < MIN_KEY_BYTES:
                raise InvalidInputError(f"key {kid!r} must be at least {MIN_KEY_BYTES} bytes")
        if active is not None and active not in keys:
            raise InvalidInputError(f"active key {active!r} is not in the keyring")
        self._keys = dict(keys)
        self.active = active if active is not None else (next(iter(keys)) if keys else None)
        self._derived: dict[tuple[str, str], bytes] = {}

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    def _run_key(self, key_id: str, run_id: str) -> bytes | None:
        master = self._keys.get(key_id)
        if master is None:
            return None
        k = self._derived.get((key_id, run_id))
        if k is None:
            k = self._derived[(key_id, run_id)] = run_key(master, run_id)
        return k

    def sign(self, kind: str, run_id: str, body_digest: str) -> AuthTag | None:
        if self.active is None:
            return None
        key = self._run_key(self.active, run_id)
        assert key is not None
        return AuthTag(self.active, compute_tag(key, kind, body_digest))

    def check(self, kind: str, run_id: str, body_digest: str, tag: AuthTag | None) -> str | None:
        """None if ``tag`` authenticates the record, else why not."""
        if tag is None:
            return "not authenticated (no tag)"
        key = self._run_key(tag.key_id, run_id)
        if key is None:
            return f"signed with unknown key {tag.key_id!r}"
        if not hmac.compare_digest(compute_tag(key, kind, body_digest), tag.tag):
            return f"bad tag (key {tag.key_id!r})"
        return None

    def __repr__(self) -> str:  # never print key material
        return f"Keyring(key_ids={self.key_ids}, active={self.active!r})"
