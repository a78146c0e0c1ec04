"""S3 (and S3-compatible servers) through s3fs.

Records are created with ``PutObject`` and ``If-None-Match: *`` on the s3fs
client's own aiobotocore client (``S3FileSystem.get_s3``): s3fs's
``pipe_file(mode="create")`` maps a 412 to ``FileExistsError`` only when the
server names the condition, and SeaweedFS answers 412 without naming it, which
s3fs would turn into ``OSError(EINVAL)``. So the answer is classified by HTTP
status: 412 means "exists"; 409 ConditionalRequestConflict, 429 and 5xx are
transient; 501/NotImplemented means the server has no conditional writes, and
committing is refused.

Killed component uploads can leave unfinished multipart uploads behind; they
are listed by :meth:`S3Backend.list_incomplete` and aborted by gc.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine, Iterable, Iterator
from typing import Any

from ..errors import InvalidInputError, UnsupportedBackendError
from ..util.redact import redact_text, redact_url
from .base import Buffer, Capabilities, check_depth
from .fsspec_base import PART_SIZE, FsspecBackend, error_code, finish_backend, mtime_of, prepare_options, status_of

#: Parts uploaded at once by one component upload. The caller's thread keeps
#: reading (and hashing) the source while these are on the wire. This module
#: holds at most (PARTS_IN_FLIGHT + 1) parts; the client (aiobotocore: request
#: body, signing) holds copies of its own on top, so a measured put peaks at
#: about 12 parts (~190 MiB with 16 MiB parts, bench/results/obstore_eval.md).
PARTS_IN_FLIGHT = 4


def _parts(chunks: Iterable[Buffer], size: int) -> Iterator[Buffer]:
    """Regroup a chunk stream into parts of exactly ``size`` bytes (the last
    may be shorter); a chunk that is already a whole part is passed through
    without a copy."""
    buf = bytearray()
    for c in chunks:
        mv = memoryview(c).cast("B")
        if not buf and len(mv) == size:
            yield mv
            continue
        while len(mv):
            take = min(size - len(buf), len(mv))
            buf += mv[:take]
            mv = mv[take:]
            if len(buf) == size:
                yield buf  # handed over whole; a new buffer is started
                buf = bytearray()
    if buf:
        yield buf


class S3Backend(FsspecBackend):
    scheme = "s3"
    #: an ETag of a single-request PUT is the MD5 of the object (the record pack relies on it, and checks it)
    capabilities = Capabilities(atomic_create=True, consistent_list=True, list_pages=True, version_is_md5=True)
    endpoint_env = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")

    def _call(self, method: str, **kwargs: Any) -> Any:
        from fsspec.asyn import sync

        return sync(self.fs.loop, lambda: self._acall(method, **kwargs))

    async def _acall(self, method: str, **kwargs: Any) -> Any:
        client = await self.fs.get_s3(self.bucket)
        return await getattr(client, method)(**kwargs)

    def _submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop)

    def put(self, key: str, chunks: Iterable[Buffer]) -> None:
        """Upload a component: one PUT when it fits in a part, else a multipart
        upload with up to :data:`PARTS_IN_FLIGHT` parts in flight while the
        caller's thread reads and hashes the next. If the source or any part
        fails, the upload is aborted and nothing lands."""
        path = self._path(key)
        bucket, _, k = path.partition("/")
        parts = _parts(chunks, PART_SIZE)
        upload_id: str | None = None
        pending: list[tuple[int, concurrent.futures.Future[Any]]] = []
        done: list[dict[str, Any]] = []
        try:
            first = next(parts, b"")
            second = next(parts, None)
            if second is None:
                self._call("put_object", Bucket=bucket, Key=k, Body=bytes(first))
                return
            upload_id = self._call("create_multipart_upload", Bucket=bucket, Key=k)["UploadId"]
            number = 0
            for part in _chain(first, second, parts):
                number += 1
                coro = self._acall("upload_part", Bucket=bucket, Key=k, UploadId=upload_id, PartNumber=number, Body=part)
                pending.append((number, self._submit(coro)))
                while len(pending) >= PARTS_IN_FLIGHT:
                    n, fut = pending.pop(0)
                    done.append({"PartNumber": n, "ETag": fut.result()["ETag"]})
            for n, fut in pending:
                done.append({"PartNumber": n, "ETag": fut.result()["ETag"]})
            pending.clear()
            self._call(
                "complete_multipart_upload", Bucket=bucket, Key=k, UploadId=upload_id, MultipartUpload={"Parts": done}
            )
        except BaseException as exc:
            for _, fut in pending:
                fut.cancel()
            if upload_id is not None:
                try:
                    self._call("abort_multipart_upload", Bucket=bucket, Key=k, UploadId=upload_id)
                except Exception:  # noqa: BLE001 - gc aborts what is left (list_incomplete)
                    pass
            if isinstance(exc, Exception) and not isinstance(exc, (InvalidInputError,)) and _from_client(exc):
                self._raise(exc, "upload", key)
            raise
        finally:
            self._invalidate(path.rsplit("/", 1)[0])

    def _create(self, path: str, data: bytes) -> bool:
        bucket, _, key = path.partition("/")
        try:
            self._call("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
            return True
        except Exception as exc:  # noqa: BLE001
            st = status_of(exc)
            if st == 412:
                return False
            code = error_code(exc)
            if st == 501 or code in ("NotImplemented", "InvalidArgument") and "If-None-Match" in str(exc):
                raise UnsupportedBackendError(
                    f"{self.url}: the server does not support conditional writes (If-None-Match: *); "
                    "ckptstore cannot commit atomically there"
                ) from exc
            self._raise(exc, "conditional create", self._key(path))
            raise

    def list_keys(
        self, prefix: str, *, start_after: str = "", limit: int | None = None, flat: bool = False
    ) -> list[str]:
        """One ``ListObjectsV2`` request per page (``StartAfter``, ``MaxKeys``,
        then the continuation token): the first keys of a long prefix cost one
        request. Directory placeholders (keys ending in '/') are not objects.
        ``flat``: ``Delimiter='/'``, the folders below are neither listed nor walked."""
        pfx = self._bucket_key(prefix)
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": pfx}
        if flat:
            kw["Delimiter"] = "/"
        if start_after:
            kw["StartAfter"] = self._bucket_key(start_after)
        out: list[str] = []
        try:
            while limit is None or len(out) < limit:
                kw["MaxKeys"] = self.list_page if limit is None else max(1, min(self.list_page, limit - len(out)))
                resp = self._call("list_objects_v2", **kw)
                for c in resp.get("Contents", []) or []:
                    name = c.get("Key", "")
                    if name.startswith(pfx) and not name.endswith("/") and not (flat and "/" in name[len(pfx) :]):
                        out.append(self._key(f"{self.bucket}/{name}"))
                token = resp.get("NextContinuationToken")
                if not resp.get("IsTruncated") or not token:
                    break
                kw["ContinuationToken"] = token
        except Exception as exc:  # noqa: BLE001
            self._raise(exc, "list", prefix)
            raise
        if not flat:
            check_depth(self.url, prefix, out)
        return out if limit is None else out[: max(0, limit)]

    def list_incomplete(self, prefix: str, older_than: float) -> list[str]:
        """Unfinished multipart uploads under ``prefix`` started before
        ``older_than``; handles are ``upload_id:key``."""
        root_prefix = f"{self.root}/{prefix}".split("/", 1)[1]
        out: list[str] = []
        try:
            resp = self._call("list_multipart_uploads", Bucket=self.bucket, Prefix=root_prefix)
        except Exception as exc:  # noqa: BLE001
            self._raise(exc, "list multipart uploads", prefix)
            raise
        for up in resp.get("Uploads", []) or []:
            if mtime_of({"LastModified": up.get("Initiated")}) < older_than:
                out.append(f"{up['UploadId']}:{self._key(self.bucket + '/' + up['Key'])}")
        return sorted(out)

    def remove_incomplete(self, handle: str) -> None:
        upload_id, _, key = handle.partition(":")
        if not upload_id or not key:
            raise InvalidInputError(f"{handle!r} is not an unfinished-upload handle")
        path = self._path(key)
        try:
            self._call("abort_multipart_upload", Bucket=self.bucket, Key=path.partition("/")[2], UploadId=upload_id)
        except Exception as exc:  # noqa: BLE001
            if status_of(exc) == 404:
                return
            self._raise(exc, "abort multipart upload", key)


def _chain(first: Buffer, second: Buffer, rest: Iterator[Buffer]) -> Iterator[Buffer]:
    yield first
    yield second
    yield from rest


def _from_client(exc: BaseException) -> bool:
    """An error raised by the S3 client (to be classified), not by the caller's data source."""
    mod = type(exc).__module__
    return mod.startswith(("botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec")) or isinstance(
        exc, (OSError, asyncio.TimeoutError, concurrent.futures.TimeoutError)
    )


def backend_from_url(url: str, storage_options: dict[str, Any]) -> S3Backend:
    """``s3://bucket[/prefix]``. ``storage_options`` go to s3fs unchanged (``key``,
    ``secret``, ``endpoint_url``, ``client_kwargs``, ``config_kwargs`` ...); the
    standard variables apply (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``)."""
    root, opts = prepare_options(url, storage_options)
    try:
        import s3fs
    except ImportError as exc:
        raise InvalidInputError(f"{redact_url(url)}: install ckptstore[s3] to use s3:// URLs ({exc})") from None
    cfg = dict(opts.pop("config_kwargs", {}) or {})
    cfg.setdefault("connect_timeout", 10)
    cfg.setdefault("read_timeout", 120)
    cfg.setdefault("retries", {"max_attempts": 3, "mode": "standard"})
    try:
        fs = s3fs.S3FileSystem(config_kwargs=cfg, **opts)
    except TypeError as exc:
        raise InvalidInputError(f"{redact_url(url)}: bad storage_options: {redact_text(str(exc))}") from None
    backend = finish_backend(S3Backend(fs, root), url, storage_options)
    assert isinstance(backend, S3Backend)
    return backend
