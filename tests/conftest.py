"""Backend fixtures shared by every suite.

``backend_kind`` is parametrized over every backend the run covers: memory and
local always; the object-store servers (SeaweedFS, moto, fake-gcs-server) are
added by ``tests/servers.py`` (session-scoped, started here, stopped after).
Set ``CKPT_BACKENDS=memory,local`` to narrow a local run; CI runs them all.
"""

from __future__ import annotations

import os
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, settings

# Before anything imports gcsfs (the plug-in tests' frameworks may): against the
# GCS emulator gcsfs's experimental default would probe buckets over gRPC.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

#: Where the processes the suite starts keep their bytecode when the environment forbids writing it
#: next to the sources (``PYTHONDONTWRITEBYTECODE``, as the machine the suite is timed on does): without
#: it every rank worker, trainer, CLI child and xdist worker compiles ckptstore and the test modules
#: again (~0.7 s CPU each, hundreds of processes a run). A prefix outside the tree keeps the tree as clean;
#: a pyc file stays validated against its source's mtime and size, as everywhere.
PYCACHE_PREFIX = os.environ.get("PYTHONPYCACHEPREFIX") or os.path.join(
    tempfile.gettempdir(), f"ckptstore-pycache-{os.getuid()}")
if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTHONPYCACHEPREFIX"):
    os.environ.pop("PYTHONDONTWRITEBYTECODE")
    os.environ["PYTHONPYCACHEPREFIX"] = PYCACHE_PREFIX

# Hypothesis profiles: "default" is the bounded profile of the normal suite;
# "deep" runs >= 100,000 state-machine steps (pytest --hypothesis-profile=deep).
# A failing example prints its rule sequence and a @reproduce_failure blob;
# --hypothesis-seed=N replays a run.
settings.register_profile(
    "default", max_examples=25, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck),
    print_blob=True,
)
settings.register_profile(
    "deep", max_examples=2500, stateful_step_count=60, deadline=None, suppress_health_check=list(HealthCheck),
    print_blob=True,
)
settings.load_profile(os.environ.get("CKPT_HYPOTHESIS_PROFILE", "default"))

from ckptstore.backends.base import Backend
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.memory import MemoryBackend, clear_memory_registry
from tests.helpers import THREADS_BEFORE_TEST

ALL_KINDS = ["memory", "local", "seaweedfs", "moto", "fakegcs"]
EXTERNAL_KINDS = ["external-s3", "external-gcs"]
OBJECT_KINDS = {"seaweedfs", "moto", "fakegcs"}
#: S3 through the optional obstore transport (``s3+obstore://``) on the same servers: run only
#: where a module, class or marker names them, or when CKPT_BACKENDS does
OPT_IN_KINDS = ["seaweedfs-obstore", "moto-obstore"]


def selected_kinds() -> list[str]:
    env = os.environ.get("CKPT_BACKENDS")
    if not env:
        return ALL_KINDS
    kinds = [k.strip() for k in env.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ALL_KINDS + EXTERNAL_KINDS + OPT_IN_KINDS]
    if bad:
        raise pytest.UsageError(f"CKPT_BACKENDS names unknown backends {bad}; known: {ALL_KINDS + OPT_IN_KINDS}")
    return kinds


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend_kind" in metafunc.fixturenames:
        kinds = selected_kinds()
        marker = metafunc.definition.get_closest_marker("backends")
        only = (
            marker.args if marker is not None
            else getattr(metafunc.cls, "backend_kinds", None) or getattr(metafunc.module, "backend_kinds", None)
        )
        if only is not None:
            if not os.environ.get("CKPT_BACKENDS"):
                kinds = kinds + OPT_IN_KINDS
            kinds = [k for k in kinds if k in only]
        metafunc.parametrize("backend_kind", kinds, scope="function")


@pytest.fixture(autouse=True)
def _threads_before_the_test() -> None:
    THREADS_BEFORE_TEST.clear()
    THREADS_BEFORE_TEST.update(threading.enumerate())


@pytest.fixture(autouse=True)
def _clear_memory_registry() -> Iterator[None]:
    clear_memory_registry()
    yield
    clear_memory_registry()


@pytest.fixture
def backend_factory(backend_kind: str, tmp_path, request) -> Iterator[Callable[[], Backend]]:  # type: ignore[no-untyped-def]
    """A callable returning a *new* backend object on this test's fresh location
    (memory: the same instance, since memory is per instance)."""
    made: list[Backend] = []
    if backend_kind == "memory":
        mem = MemoryBackend("test")

        def factory() -> Backend:
            return mem

    elif backend_kind == "local":

        def factory() -> Backend:
            b = LocalBackend(tmp_path / "store")
            return b

    else:
        servers = request.getfixturevalue("object_servers")
        prefix = f"t-{uuid.uuid4().hex[:12]}"

        def factory() -> Backend:
            b = servers.backend(backend_kind, prefix)
            made.append(b)
            return b

    yield factory
    for b in made:
        b.close()


@pytest.fixture
def backend(backend_factory: Callable[[], Backend]) -> Backend:
    return backend_factory()


def _attached_servers() -> dict[str, int]:
    """``CKPT_TEST_SERVERS``: ``{"moto": port, ...}`` of servers already running on 127.0.0.1."""
    import json

    return {str(k): int(v) for k, v in json.loads(os.environ.get("CKPT_TEST_SERVERS") or "{}").items()}


class ObjectServers:
    """Session-wide servers, started on first use, stopped at session end.

    A server that cannot start fails every test that needs it, with its log —
    never a skip. ``external-s3`` / ``external-gcs`` use an endpoint named by
    ``CKPT_EXTERNAL_S3_URL`` / ``CKPT_EXTERNAL_GCS_URL`` (``s3://bucket/prefix``)
    and the clients' standard environment variables (``AWS_ENDPOINT_URL``,
    ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``; ``STORAGE_EMULATOR_HOST``
    or Google credentials), so MinIO, Ceph or the real clouds plug in.
    """

    def __init__(self) -> None:
        self.servers: dict[str, object] = {}
        self.failures: dict[str, str] = {}
        self._s3_session: object | None = None

    def server(self, kind: str):  # type: ignore[no-untyped-def]
        from devservers.servers import SERVERS, ServerStartError

        kind = kind.removesuffix("-obstore")  # the same server under the other S3 client

        if kind in self.failures:
            pytest.fail(f"{kind} server failed to start earlier:\n{self.failures[kind]}", pytrace=False)
        if kind not in self.servers and kind in _attached_servers():
            # a server a parent process started and owns (tests/mutations/run.py starts one set for its
            # many pytest runs): used on its port, never started, stopped or restarted here (pid 0)
            srv = SERVERS[kind]()
            srv.port = _attached_servers()[kind]
            self.servers[kind] = srv
        if kind not in self.servers:
            try:
                self.servers[kind] = SERVERS[kind]().start()
            except ServerStartError as exc:
                self.failures[kind] = str(exc)
                pytest.fail(f"{kind} server failed to start:\n{exc}", pytrace=False)
        return self.servers[kind]

    def url_and_options(self, kind: str, prefix: str) -> tuple[str, dict]:  # type: ignore[type-arg]
        from devservers.servers import BUCKET

        if kind == "external-s3":
            return os.environ["CKPT_EXTERNAL_S3_URL"].rstrip("/") + "/" + prefix, {}
        if kind == "external-gcs":
            return os.environ["CKPT_EXTERNAL_GCS_URL"].rstrip("/") + "/" + prefix, {}
        srv = self.server(kind)
        scheme = "gs" if kind == "fakegcs" else "s3+obstore" if kind.endswith("-obstore") else "s3"
        return f"{scheme}://{BUCKET}/{prefix}", srv.storage_options()  # type: ignore[attr-defined]

    def backend(self, kind: str, prefix: str) -> Backend:
        from ckptstore.backends.schemes import backend_from_url as object_store_backend

        url, opts = self.url_and_options(kind, prefix)
        if kind in ("seaweedfs", "moto"):
            # One aiobotocore session for the in-process S3 backends of the run
            # (s3fs's documented ``session`` option): each backend still builds
            # its own client, connections and bucket check, but botocore parses
            # the S3 service model once, not for every backend the tests make
            # (~0.1-0.2 s each). Subprocesses and URL-opened stores are unchanged.
            if self._s3_session is None:
                import aiobotocore.session

                self._s3_session = aiobotocore.session.AioSession()
            opts = {**opts, "session": self._s3_session}
        return object_store_backend(url, storage_options=opts)

    def stop(self) -> None:
        for srv in self.servers.values():
            srv.stop()  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def object_servers() -> Iterator[ObjectServers]:
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    servers = ObjectServers()
    yield servers
    servers.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Module size is printed, never enforced: a line cap split modules by line count and made
    import cycles (issue 19). A module over 450 lines is named so a reader can ask whether it
    still has one job."""
    from pathlib import Path

    pkg = Path(__file__).resolve().parents[1] / "ckptstore"
    big = {str(p.relative_to(pkg)): n for p in pkg.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    if big:
        terminalreporter.write_line(f"note: modules over 450 lines (does each still have one job?): {big}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``./dev test``: ``--dist loadfile --no-loadscope-reorder``) a test file is one
    unit of work, handed out in collection order as a worker frees up. The files that take longest go
    first (seconds per file from a full run, tests/module_seconds.json; a file not listed goes after
    them, in its usual order), so the run does not end waiting on a long file started last, while
    the other worker idles. Only the order of files changes: within a file, tests keep their order."""
    if not hasattr(config, "workerinput"):
        return  # not an xdist worker: the usual order
    import json
    from pathlib import Path

    here = Path(__file__).parent
    seconds: dict[str, float] = json.loads((here / "module_seconds.json").read_text())
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::", 1)[0], i)

    def weight(item: pytest.Item) -> tuple[float, int]:
        path = item.nodeid.split("::", 1)[0]
        return -seconds.get(path.removeprefix("tests/"), 0.0), first[path]

    items.sort(key=weight)  # stable: a file's tests stay in their order
