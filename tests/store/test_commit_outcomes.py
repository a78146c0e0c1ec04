"""Lost acknowledgements, unknown outcomes, retries and non-atomic backends."""

from __future__ import annotations

import pytest

from ckptstore import (
    CheckpointStore,
    CommitUnknownError,
    OpenOptions,
    SaveAbortedError,
    StoreUnavailableError,
    UnsupportedBackendError,
)
from ckptstore.backends.base import Capabilities
from ckptstore.backends.faults import FaultyBackend, transient
from ckptstore.backends.memory import MemoryBackend
from ckptstore.retry import RetryPolicy
from tests.helpers import IDENT, save

FAST = RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.005)
# counts version 2's operations: the next put after a save is a whole component (version 3 lists pieces first)
V2 = OpenOptions(protocol_version=2)


def is_commit(op: str, key: str) -> bool:
    return op == "create" and "/commits/" in key


def test_lost_ack_on_commit_commits_exactly_once(backend) -> None:  # type: ignore[no-untyped-def]
    fb = FaultyBackend(backend)
    st = CheckpointStore.open(fb, "run", identity=IDENT, retry=FAST)
    fb.lose_ack(when=is_commit)
    ref = save(st, 1)
    creates = [t for t in fb.trace if t.op == "create" and "/commits/" in t.key]
    assert [t.outcome for t in creates] == ["created, ACK LOST", "exists"], fb.format_trace()
    r = CheckpointStore.open(backend, "run", mode="r")
    assert r.latest_complete(deep=True).save_id == ref.save_id
    assert len(backend.list("run/commits/")) == 1


def test_unsettled_commit_is_reported_unknown(backend) -> None:  # type: ignore[no-untyped-def]
    fb = FaultyBackend(backend)
    st = CheckpointStore.open(fb, "run", identity=IDENT, retry=FAST)
    fb.fail(None, transient(), persistent=True, when=is_commit)
    with pytest.raises(CommitUnknownError, match="not acknowledged"):
        save(st, 1)
    assert CheckpointStore.open(backend, "run", mode="r").latest_complete() is None


def test_transient_put_is_retried(backend) -> None:  # type: ignore[no-untyped-def]
    fb = FaultyBackend(backend)
    st = CheckpointStore.open(fb, "run", identity=IDENT, retry=FAST)
    fb.fail(None, transient(), when=lambda op, key: op == "put")
    ref = save(st, 1)
    assert sum(1 for t in fb.trace if t.outcome.startswith("FAIL")) == 1
    assert CheckpointStore.open(backend, "run", mode="r").latest_complete(deep=True).save_id == ref.save_id


def test_persistent_io_error_aborts_and_keeps_previous(backend) -> None:  # type: ignore[no-untyped-def]
    fb = FaultyBackend(backend)
    st = CheckpointStore.open(fb, "run", identity=IDENT, retry=FAST)
    good = save(st, 1)
    fb.fail(None, StoreUnavailableError("no space left on device"), persistent=True, when=lambda op, k: op == "put")
    with pytest.raises(StoreUnavailableError):
        save(st, 2)
    assert CheckpointStore.open(backend, "run", mode="r").latest_complete(deep=True).save_id == good.save_id


def test_bit_flip_in_flight_is_caught_before_commit_or_at_read(backend) -> None:  # type: ignore[no-untyped-def]
    fb = FaultyBackend(backend)
    st = CheckpointStore.open(fb, "run", identity=IDENT, retry=FAST, options=V2)
    good = save(st, 1)
    fb.flip_in_flight(fb.count + 1, offset=17)  # next put: the model component
    save(st, 2)  # same size: the cheap inventory cannot see it ...
    r = CheckpointStore.open(backend, "run", mode="r")
    sel = r.latest_complete(deep=True, explain=True)  # ... the deep check does
    assert sel.latest.save_id == good.save_id
    assert sel.skipped[0].reason.value == "hash-mismatch"


class NoCAS(MemoryBackend):
    capabilities = Capabilities(atomic_create=False)


def test_backend_without_atomic_create_refuses_to_write() -> None:
    with pytest.raises(UnsupportedBackendError, match="atomically"):
        CheckpointStore.open(NoCAS(), "run", identity=IDENT)


def test_exception_in_block_publishes_nothing(backend) -> None:  # type: ignore[no-untyped-def]
    st = CheckpointStore.open(backend, "run", identity=IDENT)
    with pytest.raises(ZeroDivisionError):
        with st.save(1) as s:
            s.put("a", b"x")
            1 / 0  # noqa: B018
    assert st.latest_complete() is None
    assert backend.list("run/saves/") == []  # aborted components removed
    with pytest.raises(SaveAbortedError):
        with st.save(2):
            pass


def test_commit_that_landed_but_reported_a_hard_failure_is_unknown_and_keeps_its_bytes() -> None:
    """A create that fails definitely *after* the record landed (e.g. the
    directory fsync) must not be reported as a plain failure, nor clean up."""
    from ckptstore import CommitUnknownError
    from ckptstore.backends.memory import MemoryBackend
    from ckptstore.errors import StoreUnavailableError

    class LandsThenFails(MemoryBackend):
        def create(self, key: str, data: bytes) -> bool:
            created = super().create(key, data)
            if "/commits/" in key:
                raise StoreUnavailableError("injected: fsync of the directory failed")
            return created

    b = LandsThenFails()
    st = CheckpointStore.open(b, "run", identity={"data_digest": "d"})
    with pytest.raises(CommitUnknownError, match="landed"):
        with st.save(1) as s:
            s.put("model", b"weights")
    ref = CheckpointStore.open(b, "run", mode="r").latest_complete(deep=True)
    assert ref is not None and ref.step == 1  # published after all, bytes intact
