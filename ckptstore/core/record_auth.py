"""Authenticated records in use: where keys come from, sealing the records a
store writes, and judging the records it reads (the tag format is in
:mod:`ckptstore.protocol.auth`; the threat model in ``protocol_spec/THREATS.md``).

Keys are never stored with the checkpoints. They come from, in order: a
:class:`Keyring` passed in, a callable (a key service), a key file
(``{"active": ID, "keys": {ID: HEX}}``; refused if it is a link, not owned
by this user, or readable by others), or
the ``CKPTSTORE_AUTH_KEYS`` environment variable (``ID:HEX[,ID:HEX...]``, the
first one signs).

Records written before a key existed can be signed afterwards
(``ckptstore sign``): the tag then lives in a *sidecar* object
``<run>/auth/<record key relative to the run>``, created exclusively, which a
reader consults only for a record that carries no tag of its own. A walk that
listed the sidecars (``list_saves`` and gc list ``auth/commits/`` once) reads
only those the listing shows, and each of those only once while the listing
shows it with the same size and time (:class:`RecordAuth` keeps them decoded):
listing a run twice under ``warn`` or ``require`` reads no sidecar the second
time (THREATS.md §4.14).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
import threading
import warnings
from collections.abc import Mapping
from typing import TypeVar

from ..backends.base import ObjectInfo
from ..errors import InvalidInputError
from ..protocol import canonical_json, decode_json
from ..protocol.auth import MIN_KEY_BYTES, AuthPolicy, AuthTag, Keyring, check_key_id
from ..protocol.records import Signable
from .bounded_io import RunIO

ENV_KEYS = "CKPTSTORE_AUTH_KEYS"
AUTH_DIR = "auth"
MAX_SIDECAR = 4096
#: Sidecars one store keeps decoded (each a few hundred bytes), by key.
SIDECAR_CACHE_ENTRIES = 1 << 16
#: A decoded sidecar: the body digest it vouches for and its tag (None: unreadable, vouches for nothing).
_Sidecar = tuple[str, AuthTag] | None
R = TypeVar("R", bound=Signable)


class UnauthenticatedWarning(UserWarning):
    """Under ``auth_policy="warn"``: a record is used although it is not authenticated."""


def _parse_hex_key(kid: str, text: str) -> bytes:
    try:
        return bytes.fromhex(text.strip())
    except ValueError:
        raise InvalidInputError(f"key {kid!r} is not hexadecimal (the value is not shown)") from None


def keyring_from_env(var: str = ENV_KEYS) -> Keyring | None:
    """The :class:`~ckptstore.Keyring` in the environment variable ``var``
    (``CKPTSTORE_AUTH_KEYS``: ``ID:HEX[,ID:HEX...]``, the first key signs), or
    None when it is unset or empty (public as ``ckptstore.keyring_from_env``)."""
    spec = os.environ.get(var, "").strip()
    if not spec:
        return None
    keys: dict[str, bytes] = {}
    for i, part in enumerate(spec.split(","), 1):
        kid, sep, hexkey = part.partition(":")
        if not sep:
            raise InvalidInputError(f"{var} must be ID:HEX[,ID:HEX...] (the key itself is not shown)")
        try:
            key = _parse_hex_key(f"#{i}", hexkey)
        except InvalidInputError:
            raise InvalidInputError(f"{var}: key #{i} is not hexadecimal (the key is not shown)") from None
        if len(key) < MIN_KEY_BYTES:  # checked here so no message quotes an ID that may be a misplaced key
            raise InvalidInputError(f"{var}: key #{i} must be at least {MIN_KEY_BYTES} bytes (the key is not shown)")
        try:
            keys[check_key_id(kid.strip())] = key
        except InvalidInputError:
            raise InvalidInputError(f"{var}: the ID of key #{i} is not 1-64 letters, digits, '.', '_' or '-' "
                                    "(the ID is not shown)") from None
    return Keyring(keys, next(iter(keys)))


#: Largest key file read; a bigger one is refused, never cut short.
MAX_KEY_FILE = 1 << 16


def _read_key_file(p: str) -> bytes:
    """The bytes of a key file: opened without following a link at its last
    component, and accepted only if it is a regular file owned by this user
    and readable by nobody else (THREATS.md §2.2, §4.10). Errors name the
    file and the cause, never its content."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InvalidInputError(
                f"key file {p}: is a symbolic link; key files are opened without following links "
                "(point --auth-key-file or keyring_from_file() at the file itself)"
            ) from None
        raise InvalidInputError(f"key file {p}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInputError(f"key file {p}: not a regular file")
        if st.st_uid != os.geteuid():
            raise InvalidInputError(
                f"key file {p}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); "
                "a key file must belong to the user who runs ckptstore (chown it, or use your own copy)"
            )
        if st.st_mode & 0o077:
            raise InvalidInputError(f"key file {p}: must be a regular file readable by its owner only (chmod 600)")
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_KEY_FILE:
            chunk = os.read(fd, MAX_KEY_FILE + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise InvalidInputError(f"key file {p}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if size > MAX_KEY_FILE:
        raise InvalidInputError(f"key file {p}: larger than {MAX_KEY_FILE} bytes; not a key file")
    return b"".join(chunks)


def keyring_from_file(path: str | os.PathLike[str]) -> Keyring:
    """The :class:`~ckptstore.Keyring` in a key file ``{"active": ID, "keys": {ID: HEX}}``
    (public as ``ckptstore.keyring_from_file``; the same loader as the CLI's
    ``--auth-key-file``). ``active`` signs (default: the first key); every key
    verifies. Each key is at least 32 bytes, written as hex.

    Refused (:class:`~ckptstore.InvalidInputError` naming the file and the
    cause, never any of its content): a symbolic link (the last component is
    opened without following it), anything but a regular file, a file owned
    by another user or readable or writable by group or others (``chmod 600``),
    one over 64 KiB, malformed JSON or keys, an ``active`` that names no key."""
    p = os.fspath(path)
    data = _read_key_file(p)
    try:
        doc = decode_json(data, where=p, max_bytes=MAX_KEY_FILE)
    except Exception:  # noqa: BLE001 - never echo key material
        raise InvalidInputError(f"key file {p}: not valid JSON") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), dict) or not doc["keys"]:
        raise InvalidInputError(f'key file {p}: expected {{"active": ID, "keys": {{ID: HEX}}}}')
    keys: dict[str, bytes] = {}
    for i, (k, v) in enumerate(doc["keys"].items(), 1):
        # a key ID and a key swapped by mistake must not put the key into a message: name entries by position
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidInputError(f"key file {p}: entry #{i} of \"keys\" must map an ID to a hex string")
        try:
            key = _parse_hex_key(f"#{i}", v)
            keys[check_key_id(k)] = key
        except InvalidInputError:
            raise InvalidInputError(
                f"key file {p}: entry #{i} of \"keys\" is not ID: HEX (an ID is 1-64 letters, digits, '.', '_', '-'; "
                "the entry is not shown)"
            ) from None
        if len(key) < MIN_KEY_BYTES:
            raise InvalidInputError(f"key file {p}: key #{i} must be at least {MIN_KEY_BYTES} bytes (the key is not shown)")
    active = doc.get("active")
    if active is not None and (not isinstance(active, str) or active not in keys):
        raise InvalidInputError(f'key file {p}: "active" does not name one of its key IDs (the value is not shown)')
    try:
        return Keyring(keys, active)
    except InvalidInputError as exc:
        raise InvalidInputError(f"key file {p}: {exc}") from None


def sidecar_key(record_key: str) -> str:
    run_id, _, rest = record_key.partition("/")
    return f"{run_id}/{AUTH_DIR}/{rest}"


def sidecars_prefix(run_id: str, folder: str) -> str:
    """Where the sidecars of the records under ``<run>/<folder>/`` live."""
    return f"{run_id}/{AUTH_DIR}/{folder}/"


class RecordAuth:
    """One store's authentication policy and keys."""

    def __init__(self, policy: AuthPolicy | str = AuthPolicy.OFF, keyring: Keyring | None = None) -> None:
        try:
            self.policy = AuthPolicy(policy)
        except ValueError:
            raise InvalidInputError(f"auth_policy must be one of off, warn, require; got {policy!r}") from None
        if self.policy is not AuthPolicy.OFF and keyring is None:
            keyring = keyring_from_env()
        if self.policy is AuthPolicy.REQUIRE and (keyring is None or not keyring.key_ids):
            raise InvalidInputError(
                f'auth_policy="require" needs a key: pass keyring=..., or set {ENV_KEYS}=ID:HEX (never stored with the checkpoints)'
            )
        self.keyring = keyring
        self._lock = threading.Lock()
        #: sidecar key -> ((size, time) its listing showed when it was read, what it holds)
        self._sidecars: dict[str, tuple[tuple[int, float], _Sidecar]] = {}

    def __getstate__(self) -> dict[str, object]:
        # picklable as before (plug-ins hand the policy to other processes): without the lock and the cache
        state = dict(self.__dict__)
        state.pop("_lock", None)
        state["_sidecars"] = {}
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def seal(self, rec: R, run_id: str) -> R:
        """The record with its tag, when a signing key is configured."""
        if self.policy is AuthPolicy.OFF or self.keyring is None:
            return rec
        tag = self.keyring.sign(rec.kind, run_id, rec.unsigned_digest())
        return dataclasses.replace(rec, auth=tag) if tag is not None else rec  # type: ignore[type-var]

    def problem(
        self, rec: Signable, run_id: str, io: RunIO | None = None, key: str | None = None,
        sidecars: Mapping[str, ObjectInfo] | None = None,
    ) -> str | None:
        """None if the record is authentic (or the policy is off), else why not.
        A record without a tag of its own is looked up in its sidecar;
        ``sidecars``: a listing of the sidecars' folder taken by the caller: a
        sidecar it does not show is not read, one it shows is read only when
        not cached under the same listing entry."""
        if self.policy is AuthPolicy.OFF:
            return None
        if self.keyring is None:
            return "no key configured to check it"
        tag = rec.auth
        if tag is None and io is not None and key is not None:
            tag = self._sidecar(io, key, rec.body_digest, sidecars)
        return self.keyring.check(rec.kind, run_id, rec.body_digest, tag)

    def judge(
        self, rec: Signable, run_id: str, io: RunIO | None = None, key: str | None = None,
        sidecars: Mapping[str, ObjectInfo] | None = None,
    ) -> str | None:
        """:meth:`problem`, with ``warn``'s warning: returns a reason only when
        the policy requires the record to be refused."""
        why = self.problem(rec, run_id, io, key, sidecars)
        if why is None:
            return None
        if self.policy is AuthPolicy.WARN:
            warnings.warn(f"{key or rec.kind}: used although {why}", UnauthenticatedWarning, stacklevel=3)
            return None
        return why

    def _sidecar(
        self, io: RunIO, key: str, body_digest: str, listed: Mapping[str, ObjectInfo] | None,
    ) -> AuthTag | None:
        skey = sidecar_key(key)
        if listed is None:
            held = self._read_sidecar(io, skey, key)[0]
        else:
            info = listed.get(skey)
            if info is None:
                return None  # not there when the caller listed: nothing to read
            seen = (info.size, info.mtime)
            with self._lock:
                hit = self._sidecars.get(skey)
            if hit is not None and hit[0] == seen:
                held = hit[1]
            else:
                held, size = self._read_sidecar(io, skey, key)
                if size == info.size:  # unchanged since the listing: valid while the listing shows this entry
                    with self._lock:
                        self._sidecars.pop(skey, None)
                        self._sidecars[skey] = (seen, held)
                        while len(self._sidecars) > SIDECAR_CACHE_ENTRIES:
                            self._sidecars.pop(next(iter(self._sidecars)))
        return held[1] if held is not None and held[0] == body_digest else None

    @staticmethod
    def _read_sidecar(io: RunIO, skey: str, key: str) -> tuple[_Sidecar, int | None]:
        """What a sidecar holds (one bounded read) and its size (None: not read)."""
        try:
            data = io.get_bounded(skey, MAX_SIDECAR)
        except Exception:  # noqa: BLE001 - an unreadable or missing sidecar authenticates nothing
            return None, None
        try:
            doc = decode_json(data, where=key, max_bytes=MAX_SIDECAR)
            if not isinstance(doc, dict) or not isinstance(doc.get("body_digest"), str):
                return None, len(data)
            tag = AuthTag.parse(doc.get("auth"))
        except Exception:  # noqa: BLE001 - a malformed sidecar authenticates nothing
            return None, len(data)
        return ((doc["body_digest"], tag) if tag is not None else None), len(data)

    def sign_existing(self, io: RunIO, key: str, rec: Signable) -> bool:
        """Write the sidecar tag of an existing record; False if it has one."""
        if self.keyring is None or self.keyring.active is None:
            raise InvalidInputError(f"signing needs a key: set {ENV_KEYS}=ID:HEX or pass a key file")
        tag = self.keyring.sign(rec.kind, io.run_id, rec.body_digest)
        assert tag is not None
        doc = {"protocol_version": io.layout.version, "kind": "auth", "record": key, "body_digest": rec.body_digest,
               "auth": tag.to_json()}
        return io.create(sidecar_key(key), canonical_json(doc), what="auth sidecar")
