"""S3 (and S3-compatible servers) through obstore, Rust's ``object_store``:
``s3+obstore://bucket/prefix``, extra ``obstore``.

An optional transport for the same storage as ``s3://`` (same bucket, same
keys: a store written through one reads through the other). **Not the
default**; ``s3://`` stays on s3fs. Measured on loopback SeaweedFS and moto
(``./dev bench obstore_eval``, ``bench/results/obstore_eval.md``, 256 MiB,
medians of 5) it took 0.82-0.90x s3fs's time to put, 0.39-0.61x to get in one
GET, 0.72-0.96x in 8 MiB ranges, 0.45-0.54x the latency of a 1 KB create,
0.2-0.3x of a 1 KB get, 0.2-0.6x for a listing of 1,000 keys, with 0.4-0.6x
the client CPU. It is not the default because it is not better in every
dimension nor complete alone: it cannot list or abort the unfinished multipart
uploads a killed writer leaves behind (obstore exposes no such call), so
:meth:`ObstoreS3Backend.list_incomplete` borrows the s3fs client for that when
the ``s3`` extra is installed and finds nothing otherwise; errors are
classified from the status in obstore's message text (its typed errors merge
409 and 412), which a later obstore may word differently; a ranged read is
copied out of obstore's buffer (a little more peak memory than s3fs). Against
GCS it is not offered: fake-gcs-server does not serve the XML API that
``object_store`` uses, so its conditional create could not be checked here.

Records are created with ``PutObject`` and ``If-None-Match: *`` (obstore
``put(mode="create")``, always a single request). obstore raises
``AlreadyExistsError`` both for 412 (the object exists) and for 409 (AWS's
ConditionalRequestConflict: another conditional write to the key is in
flight), so the answer is classified by the **HTTP status** in the message:
412 means "exists", 409, 429, 5xx, timeouts and broken connections are
transient (obstore's own retries run first, below ours), 501 or
``NotSupportedError`` mean the server cannot commit atomically and committing
is refused. A create whose reply was lost surfaces as a transient error or,
after obstore's own retry, as "exists"; either way the read-back of the
lost-acknowledgement protocol (:meth:`ckptstore.core.bounded_io.RunIO.create`) settles it.

Components are a single PUT up to one 16 MiB part, else a multipart upload
(16 MiB parts, 4 in flight); if the source fails obstore aborts the upload.
"""

from __future__ import annotations

import builtins
import itertools
import os
import re
import time
import uuid
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from ..errors import (
    ExtraRequiredError,
    InvalidInputError,
    NotFoundError,
    StoreUnavailableError,
    TransientError,
    UnsupportedBackendError,
)
from ..util.redact import redact_text, redact_url
from .base import Backend, Buffer, Capabilities, ObjectInfo, check_depth, check_key
from .fsspec_base import PART_SIZE, probe_endpoint

#: Parts uploaded at once by one component upload (as :mod:`.s3`).
PARTS_IN_FLIGHT = 4
ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
_STATUS = re.compile(r"status code: (\d{3})")
_NO_BUCKET = "<Code>NoSuchBucket</Code>"
_TRANSIENT_TEXT = ("error sending request", "timed out", "timeout", "connection", "broken pipe", "error decoding response body",
                   "incomplete", "reset by peer")


def status_of(exc: BaseException) -> int | None:
    """The HTTP status obstore reports in the error's message, if any."""
    m = _STATUS.search(str(exc))
    return int(m.group(1)) if m else None


def _short(exc: BaseException) -> str:
    """The first line of obstore's message (the rest is a Rust debug dump), redacted."""
    return redact_text(str(exc).split("\n", 1)[0][:400])


class ObstoreS3Backend(Backend):
    """A bucket prefix on S3 through an ``obstore.store.S3Store``."""

    capabilities = Capabilities(atomic_create=True, consistent_list=True)
    read_concurrency = 8

    def __init__(self, store: Any, bucket: str, prefix: str, *, fallback_options: dict[str, Any] | None = None) -> None:
        self.store = store
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3+obstore://{bucket}/{self.prefix}".rstrip("/")
        self._fallback_options = fallback_options
        self._s3fs: Backend | None = None

    # -- helpers ---------------------------------------------------------
    def _path(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _key(self, path: str) -> str:
        return path[len(self.prefix) + 1 :] if self.prefix else path

    def _raise(self, exc: BaseException, what: str, key: str) -> None:
        """Translate an obstore error into the ckptstore hierarchy (always raises)."""
        import obstore.exceptions as oe

        where = f"{self.url}/{key}"
        text = str(exc)
        st = status_of(exc)
        if _NO_BUCKET in text:
            raise StoreUnavailableError(
                f"{self.url}: bucket {self.bucket!r} does not exist (or is not visible with these credentials)"
            ) from exc
        if isinstance(exc, FileNotFoundError) or st == 404:
            raise NotFoundError(f"{where}: no such object") from exc
        if isinstance(exc, (oe.PermissionDeniedError, oe.UnauthenticatedError)) or st in (401, 403):
            raise StoreUnavailableError(
                f"{self.url}: access denied during {what} of {key!r}; check the credentials "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) and the bucket's permissions"
            ) from exc
        if is_transient(exc):
            raise TransientError(f"{where}: {what} failed transiently: {_short(exc)}") from exc
        raise StoreUnavailableError(f"{where}: {what} failed: {type(exc).__name__}: {_short(exc)}") from exc

    # -- interface -------------------------------------------------------
    def get(self, key: str) -> bytes:
        import obstore

        try:
            return bytes(obstore.get(self.store, self._path(key)).bytes())
        except Exception as exc:  # noqa: BLE001
            self._raise(exc, "read", key)
            raise

    def get_range(self, key: str, start: int, end: int) -> bytes:
        import obstore

        if end <= start:
            return b""
        try:
            data = obstore.get_range(self.store, self._path(key), start=start, end=end)
        except Exception as exc:  # noqa: BLE001
            if status_of(exc) == 416:
                return b""  # the object exists and ends before ``start`` (e.g. an empty one)
            self._raise(exc, "ranged read", key)
            raise
        return bytes(memoryview(data)[: end - start])

    def put(self, key: str, chunks: Iterable[Buffer]) -> None:
        """Upload a component: one PUT when it fits in a part, else a multipart
        upload (obstore cuts the chunks into parts) with up to
        :data:`PARTS_IN_FLIGHT` parts in flight. An error of the source
        propagates unchanged and nothing lands (obstore aborts the upload)."""
        import obstore

        path = self._path(key)
        failed: list[BaseException] = []

        def source() -> Iterator[Buffer]:
            try:
                for c in chunks:
                    mv = memoryview(c)
                    yield mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
            except BaseException as exc:
                failed.append(exc)  # the caller's data source failed, not the store
                raise

        # hold chunks (views, no copy) until they exceed one part: a small object is one PUT
        it = source()
        held: list[Buffer] = []
        total = 0
        for c in it:
            held.append(c)
            total += memoryview(c).nbytes
            if total > PART_SIZE:
                break
        try:
            if total <= PART_SIZE:
                obstore.put(self.store, path, b"".join(held), use_multipart=False)
            else:
                obstore.put(self.store, path, itertools.chain(held, it), chunk_size=PART_SIZE,
                            max_concurrency=PARTS_IN_FLIGHT, use_multipart=True)
        except Exception as exc:  # noqa: BLE001
            if failed:  # the source's own error, unchanged (obstore has aborted the upload)
                if exc is failed[0]:
                    raise
                raise failed[0] from exc
            self._raise(exc, "upload", key)

    def create(self, key: str, data: bytes) -> bool:
        import obstore
        import obstore.exceptions as oe

        path = self._path(key)
        try:
            obstore.put(self.store, path, bytes(data), mode="create", use_multipart=False)
            return True
        except (oe.AlreadyExistsError, oe.PreconditionError) as exc:
            st = status_of(exc)
            if st == 409:  # ConditionalRequestConflict: a concurrent conditional write, not "exists"
                raise TransientError(f"{self.url}/{key}: conditional create conflicted, retry: {_short(exc)}") from exc
            return False
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, oe.NotSupportedError) or status_of(exc) == 501 or "NotImplemented" in str(exc):
                raise UnsupportedBackendError(
                    f"{self.url}: the server does not support conditional writes (If-None-Match: *); "
                    "ckptstore cannot commit atomically there"
                ) from exc
            self._raise(exc, "conditional create", key)
            raise

    def list(self, prefix: str, *, flat: bool = False) -> list[ObjectInfo]:
        import obstore

        # list the deepest "directory" of the prefix (obstore lists whole path segments; flat:
        # one delimiter listing of it), then filter
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = "/".join(p for p in (self.prefix, base) if p)
        out = []
        try:
            if flat:
                batches: Iterable[Any] = [obstore.list_with_delimiter(self.store, prefix=top or None)["objects"]]
            else:
                batches = obstore.list(self.store, prefix=top or None)
            for batch in batches:
                for meta in batch:
                    path = meta["path"]
                    if path.endswith("/"):
                        continue  # a directory placeholder (SeaweedFS)
                    key = self._key(path)
                    if key.startswith(prefix):
                        out.append(ObjectInfo(key, int(meta["size"]), meta["last_modified"].timestamp(),
                                              str(meta.get("e_tag") or "")))
        except Exception as exc:  # noqa: BLE001
            self._raise(exc, "list", prefix)
            raise
        if flat:
            out = [o for o in out if "/" not in o.key[len(prefix) :]]
        else:
            check_depth(self.url, prefix, (o.key for o in out))
        out.sort(key=lambda o: o.key)
        return out

    def size(self, key: str) -> int:
        import obstore

        try:
            return int(obstore.head(self.store, self._path(key))["size"])
        except Exception as exc:  # noqa: BLE001
            self._raise(exc, "stat", key)
            raise

    def delete(self, key: str) -> None:
        import obstore

        try:
            obstore.delete(self.store, self._path(key))
        except FileNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001
            self._raise(exc, "delete", key)

    # -- unfinished multipart uploads: not in obstore's API ---------------
    def _multipart_client(self) -> Backend | None:
        """An s3fs backend on the same location, for the calls obstore lacks
        (None when the ``s3`` extra is not installed)."""
        if self._s3fs is None and self._fallback_options is not None:
            try:
                import s3fs  # noqa: F401
            except ImportError:
                self._fallback_options = None
                return None
            from .s3 import backend_from_url as s3fs_backend

            self._s3fs = s3fs_backend(f"s3://{self.bucket}/{self.prefix}", dict(self._fallback_options))
        return self._s3fs

    def list_incomplete(self, prefix: str, older_than: float) -> builtins.list[str]:
        """Unfinished multipart uploads, listed through s3fs when the ``s3``
        extra is installed; without it [] (obstore cannot list them: configure
        the bucket's lifecycle rule to abort incomplete uploads)."""
        client = self._multipart_client()
        return client.list_incomplete(prefix, older_than) if client is not None else []

    def remove_incomplete(self, handle: str) -> None:
        client = self._multipart_client()
        if client is None:
            raise UnsupportedBackendError(f"{self.url}: aborting multipart uploads needs the s3 extra (pip install 'ckptstore[s3]')")
        client.remove_incomplete(handle)

    def check_bucket(self, tries: int = 3) -> None:
        """Fail early and clearly when the bucket is missing or unreachable (a
        GET of an absent key; a transient failure is tried again, ``tries`` in all)."""
        import obstore

        probe = f"{self.prefix}/.ckptstore-probe-{uuid.uuid4().hex[:8]}".lstrip("/")
        for i in range(tries):
            try:
                obstore.get(self.store, probe)
                return
            except FileNotFoundError as exc:
                if _NO_BUCKET in str(exc):
                    self._raise(exc, "bucket check", "")
                return
            except Exception as exc:  # noqa: BLE001
                if not is_transient(exc):
                    self._raise(exc, "bucket check", "")
                if i == tries - 1:
                    raise StoreUnavailableError(
                        f"{self.url}: cannot reach the endpoint ({_short(exc)}); check the endpoint URL "
                        "(AWS_ENDPOINT_URL or storage_options endpoint_url) and the network"
                    ) from exc
                time.sleep(0.1 * 3**i)

    def close(self) -> None:
        if self._s3fs is not None:
            self._s3fs.close()


def is_transient(exc: BaseException) -> bool:
    st = status_of(exc)
    if st is not None:
        return st >= 500 or st in (408, 409, 429)
    text = str(exc).split("\n", 1)[0].lower()
    return isinstance(exc, (TimeoutError, ConnectionError)) or any(t in text for t in _TRANSIENT_TEXT)


# ---------------------------------------------------------------- factory

#: s3fs-style storage options understood here (so one options dict serves both transports)
_KNOWN = {"key", "secret", "token", "endpoint_url", "client_kwargs", "config_kwargs", "anon", "obstore",
          "skip_instance_cache", "use_listings_cache"}


def _config(opts: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(S3 config, client options, retry config) from s3fs-style options."""
    unknown = sorted(set(opts) - _KNOWN)
    if unknown:
        raise InvalidInputError(f"storage option(s) {unknown} not understood by the obstore transport; known: {sorted(_KNOWN)}")
    client_kwargs = dict(opts.get("client_kwargs") or {})
    cfg: dict[str, Any] = {}
    for ours, theirs in (("key", "access_key_id"), ("secret", "secret_access_key"), ("token", "token")):
        if opts.get(ours):
            cfg[theirs] = opts[ours]
    endpoint = opts.get("endpoint_url") or client_kwargs.get("endpoint_url")
    if not endpoint:
        endpoint = next((os.environ[e] for e in ENDPOINT_ENV if os.environ.get(e)), None)
    if endpoint:
        cfg["endpoint"] = endpoint
    region = client_kwargs.get("region_name") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    cfg["region"] = region or "us-east-1"
    if str(opts.get("anon", "")).lower() in ("1", "true", "yes"):
        cfg["skip_signature"] = True
    cfg.update(opts.get("obstore") or {})  # obstore's own S3Config keys, verbatim
    kw = dict(opts.get("config_kwargs") or {})
    client: dict[str, Any] = {
        "connect_timeout": f"{int(kw.get('connect_timeout', 10))}s",
        "timeout": f"{int(kw.get('read_timeout', 120))}s",
        "allow_http": bool(endpoint and urlparse(endpoint).scheme == "http"),
    }
    attempts = int((kw.get("retries") or {}).get("max_attempts", 3))
    retry = {"max_retries": max(0, attempts - 1), "retry_timeout": timedelta(seconds=60)}
    return cfg, client, retry


def backend_from_url(url: str, storage_options: dict[str, Any]) -> ObstoreS3Backend:
    """``s3+obstore://bucket[/prefix]``. ``storage_options`` as for ``s3://``
    (``key``, ``secret``, ``token``, ``endpoint_url``, ``client_kwargs.region_name``,
    ``config_kwargs`` timeouts and retries, ``anon``), plus ``obstore``: a dict
    of obstore ``S3Config`` keys passed verbatim. The standard variables apply."""
    try:
        from obstore.store import S3Store
    except ImportError as exc:
        raise ExtraRequiredError(f"{redact_url(url)}", "obstore", "obstore") from exc
    parsed = urlparse(url)
    if not parsed.netloc:
        raise InvalidInputError(f"{redact_url(url)}: missing bucket name (s3+obstore://bucket/prefix)")
    cfg, client, retry = _config(storage_options)
    try:
        store = S3Store(parsed.netloc, config=cfg, client_options=client, retry_config=retry)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - obstore raises its own errors for bad configuration
        raise InvalidInputError(f"{redact_url(url)}: bad storage_options: {_short(exc)}") from None
    fallback = {k: v for k, v in storage_options.items() if k != "obstore"}
    backend = ObstoreS3Backend(store, parsed.netloc, parsed.path, fallback_options=fallback)
    probe_endpoint(url, ENDPOINT_ENV, storage_options)
    backend.check_bucket()
    return backend
