"""Object-store specifics: URLs, credentials, errors, and commit races on real servers."""

from __future__ import annotations

import os
import uuid

import pytest

from ckptstore import CheckpointStore, OpenOptions, StoreUnavailableError
from ckptstore.backends.base import Backend
from ckptstore.backends.schemes import backend_from_url as object_store_backend
from ckptstore.cli.commands import main as cli_main
from ckptstore.core.bounded_io import RunIO
from ckptstore.testing.conformance import race_create_round
from tests.backends.test_conformance import ATOMIC_CREATE
from tests.helpers import IDENT, save

backend_kinds = ["seaweedfs", "moto", "fakegcs"]
ROUNDS_READ_BACK = {"seaweedfs": 2, "moto": 50, "fakegcs": 50, "seaweedfs-obstore": 2, "moto-obstore": 50}
# (the raw backend's racing creates are the conformance suite's test_racing_creates_have_one_winner_each_round)


def test_racing_creates_through_the_read_back_always_name_the_stored_writer(backend, backend_kind) -> None:  # type: ignore[no-untyped-def]
    """The protocol's create (retries plus the lost-acknowledgement read-back, ``RunIO.create``)
    under the same concurrency, on every server, moto included: in every round the bytes
    stored are those of a writer that was told it won, and at least one was. A client whose
    first try landed but whose reply was lost retries, meets 412, and reads its own bytes
    back: it is told it won (the raw backend call would say "exists", leaving a round with
    no winner). "At most one winner" is asserted on servers that give it."""
    check_read_back_races(backend, backend_kind)


def check_read_back_races(backend: Backend, backend_kind: str) -> None:
    io = RunIO(backend, "race-run")
    rounds = int(os.environ.get("CKPT_RACE_ROUNDS", ROUNDS_READ_BACK[backend_kind]))
    exclusive = backend_kind.removesuffix("-obstore") in ATOMIC_CREATE
    def create(key: str, data: bytes) -> bool:
        return io.create(key, data, what="commit record")

    violations = [v for r in range(rounds) if (v := race_create_round(backend, create, f"race-io/{r:04d}.json", exclusive=exclusive))]
    assert violations == []


def test_open_by_url_with_storage_options(backend_kind, object_servers) -> None:  # type: ignore[no-untyped-def]
    url, opts = object_servers.url_and_options(backend_kind, f"url-{uuid.uuid4().hex[:8]}")
    st = CheckpointStore.open(url, "run", identity=IDENT, storage_options=opts)
    ref = save(st, 3)
    r = CheckpointStore.open(url, "run", mode="r", storage_options=opts)
    assert r.latest_complete(deep=True).save_id == ref.save_id
    if backend_kind == "fakegcs":
        assert url.startswith("gs://")
        gcs_url = "gcs://" + url[len("gs://") :]
        assert CheckpointStore.open(gcs_url, "run", mode="r", storage_options=opts).latest_complete().step == 3


def test_open_by_url_from_environment(backend_kind, object_servers, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    srv = object_servers.server(backend_kind)
    for k, v in srv.env().items():
        monkeypatch.setenv(k, v)
    url = f"{os.environ['CKPT_TEST_URL']}/env-{uuid.uuid4().hex[:8]}"
    st = CheckpointStore.open(url, "run", identity=IDENT)  # no storage_options: env only
    save(st, 1)
    assert CheckpointStore.open(url, "run", mode="r").latest_complete().step == 1


def test_cli_against_object_store(backend_kind, object_servers, capsys) -> None:  # type: ignore[no-untyped-def]
    url, opts = object_servers.url_and_options(backend_kind, f"cli-{uuid.uuid4().hex[:8]}")
    save(CheckpointStore.open(url, "run", identity=IDENT, storage_options=opts), 5)
    args = []
    for k, v in opts.items():
        if isinstance(v, str):
            args += ["-o", f"{k}={v}"]
    if "client_kwargs" in opts:
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    assert cli_main(["latest", url, "run", *args]) == 0
    assert "step 5" in capsys.readouterr().out


def test_missing_bucket_is_one_clear_error(backend_kind, object_servers) -> None:  # type: ignore[no-untyped-def]
    url, opts = object_servers.url_and_options(backend_kind, "x")
    scheme = url.split("://")[0]
    with pytest.raises(StoreUnavailableError, match="does not exist"):
        CheckpointStore.open(f"{scheme}://no-such-bucket-{uuid.uuid4().hex[:6]}/p", "run", identity=IDENT,
                             storage_options=opts)


def test_unreachable_endpoint_is_one_clear_error(backend_kind, object_servers) -> None:  # type: ignore[no-untyped-def]
    from devservers.servers import free_port

    url, opts = object_servers.url_and_options(backend_kind, "x")
    dead = f"http://127.0.0.1:{free_port()}"
    opts = {**opts, "endpoint_url": dead}
    if backend_kind != "fakegcs":
        opts["config_kwargs"] = {"connect_timeout": 1, "retries": {"max_attempts": 1}}
    else:
        opts["retries"] = 1
    with pytest.raises(StoreUnavailableError, match="cannot reach|does not exist|failed"):
        object_store_backend(url, storage_options=opts)


def test_empty_prefix_after_gc_is_not_a_save(backend_factory) -> None:  # type: ignore[no-untyped-def]
    # version 2: the save prefixes under saves/ that gc empties (version 3 writes pieces/)
    st = CheckpointStore.open(backend_factory(), "run", identity=IDENT, options=OpenOptions(protocol_version=2))
    for s in (1, 2, 3):
        save(st, s)
    st.gc(keep_last=1, grace_seconds=0)
    infos = CheckpointStore.open(backend_factory(), "run", mode="r").list_saves()
    assert [(i.step, i.state.value) for i in infos] == [(3, "committed")]


@pytest.mark.backends("moto", "seaweedfs")
def test_gc_aborts_unfinished_multipart_uploads_after_the_grace_period(backend_factory, backend_kind) -> None:  # type: ignore[no-untyped-def]
    """A writer killed in the middle of a multipart component upload leaves an
    unfinished upload (invisible to listings, still billed); gc aborts it."""
    from ckptstore.backends.s3 import S3Backend

    b = backend_factory()
    assert isinstance(b, S3Backend)
    st = CheckpointStore.open(b, "run", identity=IDENT)
    save(st, 1)
    key = f"{b.root.split('/', 1)[1]}/run/saves/000000000002-00000001-abcdefabcdef/model"
    up = b._call("create_multipart_upload", Bucket=b.bucket, Key=key)  # noqa: SLF001 - what a killed writer leaves
    b._call("upload_part", Bucket=b.bucket, Key=key, UploadId=up["UploadId"], PartNumber=1, Body=b"x" * 1024)  # noqa: SLF001
    if backend_kind != "moto":  # moto reports every upload as initiated in 2010
        young = st.gc(keep_last=1, grace_seconds=3600)
        assert young.temporaries == []  # may still be in flight
    rep = st.gc(keep_last=1, grace_seconds=0)
    assert len(rep.temporaries) == 1 and rep.temporaries[0].startswith(up["UploadId"] + ":")
    assert b.list_incomplete("run/", 1e12) == []
    assert st.latest_complete() is not None
