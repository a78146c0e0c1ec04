"""Google Cloud Storage through gcsfs.

Records are created with a single-request (multipart) upload and
``ifGenerationMatch=0`` (gcsfs ``pipe_file(mode="create")``); 412 means
"exists". fake-gcs-server honours the precondition only on this kind of
upload, so records are always sent that way (they are small). Resumable
upload sessions of killed writers cannot be listed through the API and expire
on their own (a week on GCS): :meth:`list_incomplete` has nothing to report.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import InvalidInputError
from ..util.redact import redact_text, redact_url
from .base import check_depth
from .fsspec_base import FsspecBackend, finish_backend, prepare_options, status_of


class GCSBackend(FsspecBackend):
    scheme = "gs"
    endpoint_env = ("STORAGE_EMULATOR_HOST",)

    def list_keys(
        self, prefix: str, *, start_after: str = "", limit: int | None = None, flat: bool = False
    ) -> list[str]:
        """One JSON-API listing request per page (``startOffset``, which is
        inclusive, ``maxResults``, then the page token), names only.
        ``flat``: ``delimiter='/'``, the folders below are neither listed nor walked."""
        pfx = self._bucket_key(prefix)
        params: dict[str, Any] = {"prefix": pfx, "fields": "items(name),nextPageToken"}
        if flat:
            params["delimiter"] = "/"
        skip = self._bucket_key(start_after) if start_after else None
        if skip is not None:
            params["startOffset"] = skip
        out: list[str] = []
        try:
            while limit is None or len(out) < limit:
                want = self.list_page if limit is None else min(self.list_page, limit - len(out) + 1)
                params["maxResults"] = max(1, want)
                page = self.fs.call("GET", "b/{}/o", self.bucket, json_out=True, **params)
                for item in page.get("items", []) or []:
                    name = item.get("name", "") if isinstance(item, dict) else ""
                    if name != skip and name.startswith(pfx) and not name.endswith("/") \
                            and not (flat and "/" in name[len(pfx) :]):
                        out.append(self._key(f"{self.bucket}/{name}"))
                token = page.get("nextPageToken")
                if not token:
                    break
                params["pageToken"] = token
        except Exception as exc:  # noqa: BLE001
            self._raise(exc, "list", prefix)
            raise
        if not flat:
            check_depth(self.url, prefix, out)
        return out if limit is None else out[: max(0, limit)]

    def _create(self, path: str, data: bytes) -> bool:
        try:
            self.fs.pipe_file(path, data, mode="create")
            return True
        except FileExistsError:
            return False
        except Exception as exc:  # noqa: BLE001
            if status_of(exc) == 412:
                return False
            self._raise(exc, "conditional create", self._key(path))
            raise


def backend_from_url(url: str, storage_options: dict[str, Any]) -> GCSBackend:
    """``gs://bucket[/prefix]`` or ``gcs://``. ``storage_options`` go to gcsfs
    unchanged (``token``, ``project``, ``endpoint_url`` ...);
    ``STORAGE_EMULATOR_HOST`` points it at an emulator (then ``token="anon"``
    by default)."""
    root, opts = prepare_options(url, storage_options)
    emulator = "endpoint_url" in opts or bool(os.environ.get("STORAGE_EMULATOR_HOST"))
    try:
        import gcsfs
        from gcsfs.core import GCSFileSystem as PlainGCSFileSystem
    except ImportError as exc:
        raise InvalidInputError(f"{redact_url(url)}: install ckptstore[gcs] to use gs:// URLs ({exc})") from None
    if "endpoint_url" not in opts and os.environ.get("STORAGE_EMULATOR_HOST"):
        opts.setdefault("token", "anon")
    try:
        # Against an emulator use gcsfs's plain filesystem: its "experimental"
        # default (GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT, read once when gcsfs is
        # first imported, possibly by another library) probes every bucket over
        # gRPC, which an emulator does not serve: each open then stalls.
        fs = (PlainGCSFileSystem if emulator else gcsfs.GCSFileSystem)(**opts)
    except TypeError as exc:
        raise InvalidInputError(f"{redact_url(url)}: bad storage_options: {redact_text(str(exc))}") from None
    backend = finish_backend(GCSBackend(fs, root), url, storage_options)
    assert isinstance(backend, GCSBackend)
    return backend
