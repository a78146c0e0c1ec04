"""The storage server killed (SIGKILL) and restarted in the middle of a commit.

The wire proxy (``ckptstore.testing.wireproxy``) sits between the writer and
the server, so the kill can be timed against the commit request itself:

* ``request-in-flight``: the commit request's head and half its body reached
  the server, then the server dies; the rest never arrives;
* ``after-server-acted``: the server answered the commit (it created the
  record), the answer is held in the proxy, the server dies, the answer is
  never delivered.

The server comes back on the same port with its data (fake-gcs-server with its
filesystem backend; ``CKPT_RESTART_SEAWEEDFS=1`` adds SeaweedFS, whose restart
takes longer). Outcomes allowed: acknowledged, CommitUnknownError, or a clean
abort. After each: invariant 1 holds raw; at most one commit of the step; the
selection is a complete save no older than the last acknowledged one; a fresh
writer saves again.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from ckptstore import CheckpointStore, CommitUnknownError, SaveAbortedError, StoreUnavailableError
from ckptstore.backends.schemes import backend_from_url
from ckptstore.retry import RetryPolicy
from ckptstore.testing.invariants import assert_invariant_1, commits_of_step
from ckptstore.testing.wireproxy import Fault, Request, WireProxy
from devservers.servers import BUCKET, FakeGcs, SeaweedFS, Server
from tests.helpers import IDENT

NAMES = ("model", "optim")
# retries that outlast the outage (fake-gcs restarts in well under a second)
RETRY = RetryPolicy(attempts=10, base_delay=0.2, max_delay=1.5)


class FakeGcsOnDisk(FakeGcs):
    """fake-gcs-server keeping its objects on disk, so a restart keeps them."""

    def command(self) -> list[str]:
        cmd = super().command()
        cmd[cmd.index("-backend") + 1] = "filesystem"
        return [*cmd, "-filesystem-root", os.path.join(self.data_dir, "objects")]


KINDS = ["fakegcs-disk"] + (["seaweedfs"] if os.environ.get("CKPT_RESTART_SEAWEEDFS") else [])


def blob(step: int, name: str) -> bytes:
    seed = f"<{step}/{name}>".encode()
    return (seed * (20_000 // len(seed) + 1))[:20_000]


def save(store: CheckpointStore, step: int) -> None:
    with store.save(step) as s:
        for n in NAMES:
            s.put(n, blob(step, n))


def is_commit(r: Request) -> bool:
    return r.is_write and r.mentions("/commits/")


@pytest.fixture(params=KINDS)
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, Server]]:
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    kind: str = request.param
    srv: Server = FakeGcsOnDisk() if kind == "fakegcs-disk" else SeaweedFS()
    srv.start()  # a server that cannot start raises ServerStartError: the test fails, loudly
    yield kind, srv
    srv.stop()


def options(kind: str, srv: Server, endpoint: str) -> dict[str, Any]:
    opts: dict[str, Any] = dict(srv.storage_options())  # type: ignore[attr-defined]
    opts["endpoint_url"] = endpoint
    if kind == "fakegcs-disk":
        opts["requests_timeout"] = 3
    else:
        opts["config_kwargs"] = {"connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 1}}
    return opts


@pytest.mark.parametrize("when", ["request-in-flight", "after-server-acted"])
def test_server_killed_and_restarted_mid_commit(
    server: tuple[str, Server], when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kind, srv = server
    if kind == "fakegcs-disk":
        # gcsfs sleeps 1-32 s between its own retries; shorten the sleeps only
        import asyncio

        import gcsfs.retry

        real_sleep = asyncio.sleep

        class _FastAsyncio:
            @staticmethod
            async def sleep(seconds: float) -> None:
                await real_sleep(min(seconds, 0.05))

        monkeypatch.setattr(gcsfs.retry, "asyncio", _FastAsyncio)
    scheme = "gs" if kind == "fakegcs-disk" else "s3"
    url = f"{scheme}://{BUCKET}/restart-{uuid.uuid4().hex[:8]}"
    with WireProxy(srv.endpoint, flavor="gcs" if scheme == "gs" else "s3") as proxy:
        writer = CheckpointStore.open(url, "run", identity=IDENT, storage_options=options(kind, srv, proxy.endpoint),
                                      retry=RETRY)
        save(writer, 1)
        fault = Fault("stall", seconds=1.0) if when == "request-in-flight" else Fault("drop_response", seconds=1.0)
        proxy.add(fault, is_commit, times=1)
        outcome: list[BaseException | None] = []

        def go() -> None:
            try:
                save(writer, 2)
                outcome.append(None)
            except Exception as exc:  # noqa: BLE001 - judged below
                outcome.append(exc)

        t = threading.Thread(target=go, daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        while not proxy.entries(fault.kind):
            assert time.monotonic() < deadline, "the commit request never reached the proxy"
            assert t.is_alive() or not outcome, f"the save ended before its commit: {outcome}"
            time.sleep(0.005)
        entry = proxy.entries(fault.kind)[0]
        if when == "after-server-acted":
            assert entry.upstream_status == 200, "the server had not created the commit"
        srv.stop(grace=0, keep_data=True)  # SIGKILL, mid-commit
        time.sleep(0.5)  # down for a while: the writer's retries meet a refused connection
        srv.restart()
        t.join(timeout=120)
        assert not t.is_alive(), "the save hung after the restart"
    exc = outcome[0]
    allowed = (CommitUnknownError, SaveAbortedError, StoreUnavailableError)
    assert exc is None or isinstance(exc, allowed), f"{when}: {type(exc).__name__}: {exc}"
    direct = backend_from_url(url, storage_options=srv.storage_options())  # type: ignore[attr-defined]
    assert_invariant_1(direct, "run", f"{kind}, killed {when}, outcome {exc!r}")
    commits = commits_of_step(direct, "run", 2)
    assert len(commits) <= 1
    reader = CheckpointStore.open(direct, "run", mode="r")
    latest = reader.latest_complete(deep=True)
    assert latest is not None
    if exc is None:
        assert latest.step == 2, "an acknowledged save is not selected after the restart"
    elif isinstance(exc, (SaveAbortedError, StoreUnavailableError)) and not isinstance(exc, CommitUnknownError):
        assert commits == [] and latest.step == 1, "a clean abort left a commit"
    assert latest.step in (1, 2)
    for n in NAMES:
        assert reader.read(latest, n) == blob(latest.step, n)
    # the store goes on: a new writer resumes from what was selected and saves
    again = CheckpointStore.open(direct, "run", identity=IDENT)
    assert again.resumed_from is not None and again.resumed_from.step == latest.step
    save(again, 3)
    assert CheckpointStore.open(direct, "run", mode="r").latest_complete(deep=True).step == 3  # type: ignore[union-attr]
    print(f"{kind} killed {when}: {'acknowledged' if exc is None else type(exc).__name__}, selected {latest.step}")
