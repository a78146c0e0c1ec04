"""The shared base of object-store backends over an fsspec filesystem.

Everything but the conditional create is the same on S3 and GCS: components
are ordinary uploads (multipart above the block size) under the save's unique
prefix, reads are ranged, listing filters out "directory" placeholders
(SeaweedFS keeps listing a prefix as a directory after its last object was
deleted), and client errors are classified by **HTTP status** into the
ckptstore hierarchy. A subclass supplies :meth:`FsspecBackend._create` (the
store's own conditional write) and its URL factory: :mod:`.s3`, :mod:`.gcs`.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any
from urllib.parse import urlparse

from ..errors import InvalidInputError, NotFoundError, StoreUnavailableError
from ..errors import TransientError as TransientError
from ..util.redact import redact_text, redact_url
from .base import Backend, Buffer, Capabilities, ObjectInfo, byte_limits, check_depth, check_key

_TRANSIENT_NAMES = (
    "ConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "EndpointConnectionError",
    "ClientConnectorError",
    "ServerDisconnectedError",
    "ClientOSError",
    "TimeoutError",
    "ProxyError",
    "ResponseStreamingError",
)

PART_SIZE = 16 * 1024 * 1024
#: Keys asked for per listing request by ``list_keys`` (S3 and GCS serve at most 1,000).
LIST_PAGE = 1000


def status_of(exc: BaseException) -> int | None:
    """The HTTP status behind an s3fs/gcsfs/botocore error, wherever it hides."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 6:
        resp = getattr(e, "response", None)
        if isinstance(resp, dict):
            st = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(st, int):
                return st
        code = getattr(e, "code", None)
        if isinstance(code, int) and 100 <= code < 600:
            return code
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def error_code(exc: BaseException) -> str:
    e: BaseException | None = exc
    for _ in range(6):
        if e is None:
            break
        resp = getattr(e, "response", None)
        if isinstance(resp, dict) and isinstance(resp.get("Error"), dict):
            return str(resp["Error"].get("Code", ""))
        e = e.__cause__ or e.__context__
    return ""


def is_transient(exc: BaseException) -> bool:
    st = status_of(exc)
    if st is not None and (st >= 500 or st in (408, 429)):
        return True
    if error_code(exc) in ("ConditionalRequestConflict", "SlowDown", "RequestTimeout", "InternalError"):
        return True
    e: BaseException | None = exc
    for _ in range(6):
        if e is None:
            break
        if type(e).__name__ in _TRANSIENT_NAMES or isinstance(e, (asyncio.TimeoutError, ConnectionError, TimeoutError)):
            return True
        e = e.__cause__ or e.__context__
    return False


class FsspecBackend(Backend):
    """A bucket prefix on an object store, through an fsspec filesystem."""

    capabilities = Capabilities(atomic_create=True, consistent_list=True, list_pages=True)
    read_concurrency = 8
    scheme = ""
    #: keys per listing request of ``list_keys`` (tests lower it to exercise paging)
    list_page = LIST_PAGE
    #: environment variables the client reads its endpoint from
    endpoint_env: tuple[str, ...] = ()

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root.strip("/")
        if not self.root:
            raise InvalidInputError("object-store URL needs a bucket (s3://bucket/prefix)")
        self.bucket = self.root.split("/", 1)[0]
        self.url = f"{self.scheme}://{self.root}"

    # -- helpers ---------------------------------------------------------
    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def _key(self, path: str) -> str:
        path = path.lstrip("/")
        if path.startswith(self.root + "/"):
            return path[len(self.root) + 1 :]
        return path

    def _raise(self, exc: BaseException, what: str, key: str) -> None:
        """Translate a client error into the ckptstore hierarchy (always raises)."""
        where = f"{self.url}/{key}"
        if isinstance(exc, FileNotFoundError) or status_of(exc) == 404:
            code = error_code(exc)
            if code == "NoSuchBucket" or "bucket" in str(exc).lower():
                raise StoreUnavailableError(
                    f"{self.url}: bucket {self.bucket!r} does not exist (or is not visible with these credentials)"
                ) from exc
            raise NotFoundError(f"{where}: no such object") from exc
        if is_transient(exc):
            raise TransientError(f"{where}: {what} failed transiently: {redact_text(str(exc))}") from exc
        st = status_of(exc)
        if isinstance(exc, PermissionError) or st in (401, 403) or "Forbidden" in str(exc):
            raise StoreUnavailableError(
                f"{self.url}: access denied during {what} of {key!r}; check the credentials "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or the GCS token) and the bucket's permissions"
            ) from exc
        raise StoreUnavailableError(f"{where}: {what} failed: {type(exc).__name__}: {redact_text(str(exc))}") from exc

    def _invalidate(self, path: str | None = None) -> None:
        try:
            self.fs.invalidate_cache(path)
        except Exception:  # noqa: BLE001
            pass

    # -- interface -------------------------------------------------------
    def get(self, key: str) -> bytes:
        try:
            return bytes(self.fs.cat_file(self._path(key)))
        except Exception as exc:  # noqa: BLE001
            self._raise(exc, "read", key)
            raise

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        try:
            data = bytes(self.fs.cat_file(self._path(key), start=start, end=end))
        except Exception as exc:  # noqa: BLE001
            if status_of(exc) == 416 or "not satisfiable" in str(exc):
                return b""  # the object exists and ends before ``start`` (e.g. an empty one)
            self._raise(exc, "ranged read", key)
            raise
        return data[: end - start]

    def get_many(self, keys: Sequence[str], max_bytes: int | Sequence[int]) -> list[bytes | None]:
        """Ranged reads sent concurrently (fsspec ``cat_ranges``, in batches),
        each bounded by its own limit."""
        if not keys:
            return []
        limits = byte_limits(keys, max_bytes)
        try:
            got = self.fs.cat_ranges([self._path(k) for k in keys], [0] * len(keys), limits, on_error="return")
        except Exception as exc:  # noqa: BLE001
            self._raise(exc, "read", keys[0])
            raise
        out: list[bytes | None] = []
        for k, limit, r in zip(keys, limits, got, strict=True):
            if isinstance(r, BaseException):
                if isinstance(r, FileNotFoundError) or status_of(r) == 404 and error_code(r) != "NoSuchBucket":
                    out.append(None)
                    continue
                if status_of(r) == 416 or "not satisfiable" in str(r):
                    out.append(b"")  # an empty object
                    continue
                self._raise(r, "read", k)
            out.append(bytes(r)[:limit])
        return out

    def put(self, key: str, chunks: Iterable[Buffer]) -> None:
        path = self._path(key)
        f = None

        def discard() -> None:
            if f is not None and not f.closed:
                try:
                    f.discard()
                except Exception:  # noqa: BLE001
                    pass
                # fsspec files flush on close/__del__: mark closed so nothing lands
                f.closed = True

        try:
            try:
                f = self.fs.open(path, "wb", block_size=PART_SIZE)
            except Exception as exc:  # noqa: BLE001
                self._raise(exc, "upload", key)
            it = iter(chunks)
            while True:
                try:
                    c = next(it)
                except StopIteration:
                    break
                except BaseException:
                    discard()  # the source failed: nothing must land
                    raise
                try:
                    f.write(c)  # type: ignore[union-attr]
                except Exception as exc:  # noqa: BLE001
                    discard()
                    self._raise(exc, "upload", key)
            try:
                f.close()  # type: ignore[union-attr]
            except Exception as exc:  # noqa: BLE001
                discard()
                self._raise(exc, "upload", key)
        except BaseException:
            discard()
            raise
        finally:
            self._invalidate(path.rsplit("/", 1)[0])

    def create(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        try:
            return self._create(path, bytes(data))
        finally:
            self._invalidate(path.rsplit("/", 1)[0])

    def _create(self, path: str, data: bytes) -> bool:
        """The store's own create-if-absent: True if created, False if the
        object existed (HTTP 412); other failures through :meth:`_raise`."""
        raise NotImplementedError

    def list(self, prefix: str, *, flat: bool = False) -> list[ObjectInfo]:
        # list the deepest "directory" of the prefix (flat: one delimiter listing of it), then
        # filter by the full prefix
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = f"{self.root}/{base}" if base else self.root
        self._invalidate(top)
        try:
            if flat:
                found = {i["name"]: i for i in self.fs.ls(top, detail=True) if i.get("type") != "directory"}
            else:
                found = self.fs.find(top, detail=True)
        except FileNotFoundError:
            return []
        except Exception as exc:  # noqa: BLE001
            self._raise(exc, "list", prefix)
            raise
        out = []
        for path, info in found.items():
            if info.get("type") == "directory" or path.endswith("/"):
                continue
            key = self._key(path)
            if not key.startswith(prefix):
                continue
            out.append(ObjectInfo(key, int(info.get("size") or 0), mtime_of(info), version_of(info)))
        if flat:
            out = [o for o in out if "/" not in o.key[len(prefix) :]]
        else:
            check_depth(self.url, prefix, (o.key for o in out))
        out.sort(key=lambda o: o.key)
        return out

    def _bucket_key(self, key: str) -> str:
        """``key`` (a key, a prefix or '') as the object name inside the bucket."""
        return f"{self.root}/{key}".partition("/")[2]

    def size(self, key: str) -> int:
        path = self._path(key)
        self._invalidate(path)
        try:
            info = self.fs.info(path)
        except Exception as exc:  # noqa: BLE001
            self._raise(exc, "stat", key)
            raise
        if info.get("type") == "directory":
            raise NotFoundError(f"{self.url}/{key}: no such object")
        return int(info["size"])

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001
            if status_of(exc) == 404:
                return
            self._raise(exc, "delete", key)
        finally:
            self._invalidate(path.rsplit("/", 1)[0])

    def check_bucket(self) -> None:
        """Fail early and clearly when the bucket is missing or unreachable."""
        try:
            ok = self.fs.exists(self.bucket)
        except Exception as exc:  # noqa: BLE001
            if is_transient(exc):
                raise StoreUnavailableError(
                    f"{self.url}: cannot reach the endpoint ({type(exc).__name__}: {redact_text(str(exc))}); check the endpoint URL "
                    "(AWS_ENDPOINT_URL / STORAGE_EMULATOR_HOST or storage_options) and the network"
                ) from exc
            self._raise(exc, "bucket check", "")
            raise
        if not ok:
            raise StoreUnavailableError(
                f"{self.url}: bucket {self.bucket!r} does not exist or is not accessible; create it first "
                "or check the credentials"
            )

    def close(self) -> None:
        pass


def version_of(info: Mapping[str, Any]) -> str:
    """The content version a listing entry carries ("" if none): GCS's generation, else the ETag."""
    for k in ("generation", "ETag", "etag", "md5Hash"):
        v = info.get(k)
        if v not in (None, ""):
            return str(v)
    return ""


def mtime_of(info: Mapping[str, Any]) -> float:
    for k in ("LastModified", "updated", "mtime", "timeCreated"):
        v = info.get(k)
        if v is None:
            continue
        if isinstance(v, datetime):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
        try:
            return datetime.fromisoformat(str(v).replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
    return 0.0


def probe_endpoint(url: str, endpoint_env: tuple[str, ...], opts: Mapping[str, Any]) -> None:
    """Fail fast (seconds, not the clients' minutes of retries) when an explicitly
    configured endpoint does not accept connections."""
    endpoint = opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
    if not endpoint:
        endpoint = next((os.environ[e] for e in endpoint_env if os.environ.get(e)), None)
    if not endpoint:
        return
    parsed = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    host = parsed.hostname
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    if not host:
        raise InvalidInputError(f"{url}: malformed endpoint {endpoint!r}")
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as exc:
        raise StoreUnavailableError(
            f"{redact_url(url)}: cannot reach the endpoint {redact_url(endpoint)} ({exc.strerror or exc}); check the endpoint URL "
            "(storage_options endpoint_url, AWS_ENDPOINT_URL or STORAGE_EMULATOR_HOST) and that the server runs"
        ) from None


def prepare_options(url: str, storage_options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(``bucket/prefix``, options with ckptstore's defaults: no instance or
    listing caches, whose staleness would break read-after-write checks)."""
    parsed = urlparse(url)
    if not parsed.netloc:
        raise InvalidInputError(f"{url}: missing bucket name ({parsed.scheme}://bucket/prefix)")
    opts = dict(storage_options)
    opts.setdefault("skip_instance_cache", True)
    opts.setdefault("use_listings_cache", False)
    return (parsed.netloc + parsed.path).strip("/"), opts


def finish_backend(backend: FsspecBackend, url: str, storage_options: Mapping[str, Any]) -> FsspecBackend:
    """Probe the endpoint and the bucket so a misconfiguration fails in seconds, clearly."""
    probe_endpoint(url, backend.endpoint_env, storage_options)
    backend.check_bucket()
    return backend
