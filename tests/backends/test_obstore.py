"""S3 through the optional obstore transport (``s3+obstore://``, extra ``obstore``):
the shared conformance suite, the commit semantics under wire faults (409,
412, lost acknowledgements, 5xx), interoperation with ``s3://`` on the same
data, clear errors, and gc of unfinished multipart uploads."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from ckptstore import CheckpointStore, StoreUnavailableError
from ckptstore.backends.base import Backend
from ckptstore.backends.schemes import backend_from_url
from ckptstore.core.bounded_io import RunIO
from ckptstore.errors import ExtraRequiredError, InvalidInputError, TransientError
from ckptstore.retry import RetryPolicy
from ckptstore.testing.wireproxy import Fault, Request, WireProxy
from tests.backends import test_conformance as conformance
from tests.backends.test_object_stores import check_read_back_races
from tests.helpers import IDENT, save

backend_kinds = ["seaweedfs-obstore", "moto-obstore"]
RETRY = RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.05)


class TestObstoreConformance(conformance.TestBackendConformance):
    """The suite with ckptstore's own fixtures, on the obstore kinds (racing creates included)."""


def test_it_is_the_obstore_backend(backend: Backend) -> None:
    from ckptstore.backends.obstore_s3 import ObstoreS3Backend

    assert isinstance(backend, ObstoreS3Backend) and backend.url.startswith("s3+obstore://")


def test_racing_creates_through_the_read_back_always_name_the_stored_writer(backend: Backend, backend_kind: str) -> None:
    check_read_back_races(backend, backend_kind)


def test_saves_interoperate_with_s3fs(backend_kind: str, object_servers: Any) -> None:
    """Same bucket, same keys: a run written through one transport reads and continues through the other."""
    url, opts = object_servers.url_and_options(backend_kind, f"interop-{uuid.uuid4().hex[:8]}")
    plain = "s3://" + url.split("://", 1)[1]
    save(CheckpointStore.open(url, "run", identity=IDENT, storage_options=opts), 1)
    assert CheckpointStore.open(plain, "run", mode="r", storage_options=opts).latest_complete(deep=True).step == 1
    save(CheckpointStore.open(plain, "run", identity=IDENT, storage_options=opts), 2)
    assert CheckpointStore.open(url, "run", mode="r", storage_options=opts).latest_complete(deep=True).step == 2


def test_missing_bucket_and_dead_endpoint_are_one_clear_error(backend_kind: str, object_servers: Any) -> None:
    from devservers.servers import free_port

    _, opts = object_servers.url_and_options(backend_kind, "x")
    with pytest.raises(StoreUnavailableError, match="does not exist"):
        backend_from_url(f"s3+obstore://no-such-bucket-{uuid.uuid4().hex[:6]}/p", storage_options=opts)
    dead = {**opts, "endpoint_url": f"http://127.0.0.1:{free_port()}"}
    with pytest.raises(StoreUnavailableError, match="cannot reach"):
        backend_from_url("s3+obstore://b/p", storage_options=dead)


def test_unknown_option_and_missing_extra_are_named(backend_kind: str, object_servers: Any, monkeypatch: Any) -> None:
    url, opts = object_servers.url_and_options(backend_kind, "x")
    with pytest.raises(InvalidInputError, match="not understood by the obstore transport"):
        backend_from_url(url, storage_options={**opts, "no_such_option": 1})
    monkeypatch.setitem(sys.modules, "obstore.store", None)
    with pytest.raises(ExtraRequiredError, match=r"pip install 'ckptstore\[obstore\]'"):
        backend_from_url(url, storage_options=opts)


def test_gc_aborts_unfinished_multipart_uploads(backend_factory: Any) -> None:
    """obstore cannot list multipart uploads; the backend borrows s3fs (extra ``s3``) for it."""
    from ckptstore.backends.obstore_s3 import ObstoreS3Backend
    from ckptstore.backends.s3 import S3Backend

    b = backend_factory()
    assert isinstance(b, ObstoreS3Backend)
    st = CheckpointStore.open(b, "run", identity=IDENT)
    save(st, 1)
    helper = b._multipart_client()  # noqa: SLF001 - what a killed writer leaves, made with the other client
    assert isinstance(helper, S3Backend)
    key = f"{b.prefix}/run/saves/000000000002-00000001-abcdefabcdef/model"
    up = helper._call("create_multipart_upload", Bucket=b.bucket, Key=key)  # noqa: SLF001
    rep = st.gc(keep_last=1, grace_seconds=0)
    assert len(rep.temporaries) == 1 and rep.temporaries[0].startswith(up["UploadId"] + ":")
    assert b.list_incomplete("run/", 1e12) == []
    assert st.latest_complete() is not None


# ------------------------------------------------------------- wire faults


@pytest.fixture
def wired(backend_kind: str, object_servers: Any) -> Iterator[tuple[WireProxy, Backend, Backend]]:
    """(proxy, backend through the proxy, backend straight to the server) on one fresh prefix."""
    url, opts = object_servers.url_and_options(backend_kind, f"wire-{uuid.uuid4().hex[:8]}")
    srv = object_servers.server(backend_kind.split("-")[0])
    with WireProxy(srv.endpoint) as px:
        via = {**opts, "endpoint_url": px.endpoint, "config_kwargs": {"connect_timeout": 2, "read_timeout": 5}}
        b = backend_from_url(url, storage_options=via)
        direct = backend_from_url(url, storage_options=opts)
        yield px, b, direct
        b.close()
        direct.close()


def puts(name: str) -> Any:
    return lambda r: r.method == "PUT" and r.path.endswith("/" + name)


def test_create_answers_are_classified_by_status(wired: tuple[WireProxy, Backend, Backend]) -> None:
    px, b, direct = wired
    px.add(Fault("status", status=409), puts("a.json"))  # ConditionalRequestConflict: not "exists"
    with pytest.raises(TransientError):
        b.create("a.json", b"mine")
    assert b.create("a.json", b"mine") is True  # the retry goes through
    px.add(Fault("status", status=412), puts("b.json"))
    assert b.create("b.json", b"mine") is False  # "exists", even though nothing is there
    assert not direct.exists("b.json")
    px.add(Fault("status", status=503), puts("c.json"), times=None)
    with pytest.raises(TransientError):
        b.create("c.json", b"mine")
    assert not direct.exists("c.json")


@pytest.mark.parametrize("fault", [Fault("drop_response"), Fault("reset_after"), Fault("status_after", status=503)], ids=str)
def test_lost_acknowledgement_is_settled_by_the_read_back(wired: tuple[WireProxy, Backend, Backend], fault: Fault) -> None:
    """The create landed but its answer was lost: our record is recognised (True);
    when another writer's record is there, a lost answer never becomes success."""
    px, b, direct = wired
    io = RunIO(b, "run", RETRY)
    px.add(fault, puts("ours.json"))
    assert io.create("ours.json", b"ours", what="commit record") is True
    assert direct.get("ours.json") == b"ours"
    assert direct.create("theirs.json", b"theirs") is True
    px.add(fault, puts("theirs.json"))
    assert io.create("theirs.json", b"ours", what="commit record") is False
    assert direct.get("theirs.json") == b"theirs"


def test_persistent_faults_give_up_cleanly(wired: tuple[WireProxy, Backend, Backend]) -> None:
    px, b, direct = wired
    direct.put("obj", [b"x" * 100])

    def is_get(r: Request) -> bool:
        return r.method == "GET"

    px.add(Fault("status", status=503), is_get, times=None)
    with pytest.raises(TransientError):
        b.get_range("obj", 0, 10)
    px.clear()
    px.add(Fault("reset_before"), lambda r: r.method == "PUT", times=None)
    with pytest.raises(TransientError):
        b.put("new", [b"y" * 10])
    assert not direct.exists("new")
