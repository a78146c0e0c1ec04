"""Selection that does not grow with history (PROTOCOL.md §4.4): on S3 (moto)
and GCS (fake-gcs-server), ``latest_complete()`` — plain and with
``explain`` — and ``get_save(step)`` make the same number of HTTP requests
over 50 saves as over 2,500, counted on the wire by a proxy in front of the
server. A version-1 run, whose commit names sort oldest first, still pays one
listing request per 1,000 commits (what version 2 removes).

The histories are written through the public API on a memory backend, then
copied object for object into the bucket (much faster than 2,500 saves over
HTTP), except the bytes of saves older than the newest ten: selection never
reaches them, and leaving them out halves the upload.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ckptstore import CheckpointStore
from ckptstore.backends.fsspec_base import FsspecBackend
from ckptstore.backends.memory import MemoryBackend
from ckptstore.backends.schemes import backend_from_url
from ckptstore.testing.wireproxy import WireProxy
from tests.helpers import IDENT, RawAccess

backend_kinds = ["moto", "fakegcs"]

SMALL, LARGE = 50, 2500
LARGE_V1 = 1001  # two listing pages of commit names
KEPT_BYTES = 10


def history(h: int, version: int) -> dict[str, bytes]:
    mem = MemoryBackend()
    st = CheckpointStore.open(mem, "run", identity=IDENT, protocol_version=version)
    for step in range(h):
        with st.save(step) as s:
            s.put("model", b"w" * 16)
    raw = RawAccess(mem)
    newest = {st.get_save(step).save_id for step in range(max(0, h - KEPT_BYTES), h)}
    return {
        o.key: raw.get(o.key) or b"" for o in mem.list("")
        if "/saves/" not in o.key or o.key.split("/")[2] in newest
    }


@pytest.fixture(scope="module")
def histories() -> dict[tuple[int, int], dict[str, bytes]]:
    return {(h, v): history(h, v) for h, v in ((SMALL, 2), (LARGE, 2), (SMALL, 1), (LARGE_V1, 1))}


@pytest.fixture
def bucket(backend_kind: str, object_servers: Any) -> Iterator[Callable[[dict[str, bytes]], tuple[str, dict[str, Any], WireProxy]]]:
    """Upload a history under a fresh prefix; (url, storage options through a counting proxy, the proxy)."""
    server = object_servers.server(backend_kind)
    proxies: list[WireProxy] = []

    def make(objects: dict[str, bytes]) -> tuple[str, dict[str, Any], WireProxy]:
        url, opts = object_servers.url_and_options(backend_kind, f"hist-{uuid.uuid4().hex[:8]}")
        direct = backend_from_url(url, storage_options=opts)
        assert isinstance(direct, FsspecBackend)
        direct.fs.pipe({f"{direct.root}/{k}": v for k, v in objects.items()})
        direct.fs.invalidate_cache()
        proxy = WireProxy(server.endpoint, flavor="gcs" if backend_kind == "fakegcs" else "s3").start()
        proxies.append(proxy)
        return url, {**opts, "endpoint_url": proxy.endpoint}, proxy

    yield make
    for p in proxies:
        p.stop()


def requests_of(url: str, opts: dict[str, Any], proxy: WireProxy, call: Callable[[CheckpointStore], object]) -> int:
    st = CheckpointStore.open(url, "run", mode="r", storage_options=opts)
    before = len(proxy.entries())
    call(st)
    n = len(proxy.entries()) - before
    st.close()
    return n


CALLS: dict[str, Callable[[CheckpointStore], object]] = {
    "latest_complete": lambda st: st.latest_complete(),
    "latest_complete(deep)": lambda st: st.latest_complete(deep=True),
    "latest_complete(explain)": lambda st: st.latest_complete(explain=True),
    "get_save(middle)": lambda st: st.get_save(SMALL // 2),
}


@pytest.mark.slow
def test_selection_requests_do_not_grow_with_history(histories: Any, bucket: Any) -> None:
    small, large = bucket(histories[(SMALL, 2)]), bucket(histories[(LARGE, 2)])
    for name, call in CALLS.items():
        a, b = requests_of(*small, call), requests_of(*large, call)
        assert a == b, f"{name}: {a} requests over {SMALL} saves, {b} over {LARGE}"
        assert b <= 6, f"{name}: {b} requests"
    ref = CheckpointStore.open(large[0], "run", mode="r", storage_options=large[1]).latest_complete()
    assert ref is not None and ref.step == LARGE - 1


@pytest.mark.slow
def test_a_version_1_run_still_lists_its_whole_history(histories: Any, bucket: Any) -> None:
    small, large = bucket(histories[(SMALL, 1)]), bucket(histories[(LARGE_V1, 1)])
    a = requests_of(*small, CALLS["latest_complete"])
    b = requests_of(*large, CALLS["latest_complete"])
    assert b == a + 1, (a, b)  # 1,001 commit names: two listing pages instead of one
    ref = CheckpointStore.open(large[0], "run", mode="r", storage_options=large[1]).latest_complete()
    assert ref is not None and ref.step == LARGE_V1 - 1
