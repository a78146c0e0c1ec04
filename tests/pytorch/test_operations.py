"""Operations: retention, preemption exit status, corrupt-resume fallback, CUDA copy ordering,
ResumableSampler with workers, the global-RNG pitfall."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore, InvalidInputError, SaveState
from ckptstore import protocol as P
from ckptstore.backends.memory import MemoryBackend
from ckptstore.torch import (
    EX_TEMPFAIL,
    Checkpointer,
    ResumableSampler,
    RngPitfallWarning,
    read_state,
)
from tests.helpers import IDENT, tiny_model
from tests.incremental.common import stored_at


def step(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
    o.zero_grad()
    m(torch.randn(5, 4)).pow(2).mean().backward()
    o.step()


def committed_steps(st: CheckpointStore) -> list[int]:
    return [i.step for i in st.list_saves() if i.state is SaveState.COMMITTED]


# ------------------------------------------------------------------ retention


def test_keep_last_runs_after_each_commit() -> None:
    b = MemoryBackend()
    st = CheckpointStore.open(b, "r", identity=IDENT)
    m, o = tiny_model()
    ck = Checkpointer(st, {"model": m, "optimizer": o}, every_steps=1, keep_last=2, handle_signals=False)
    for s in range(6):
        step(m, o)
        ck.step_end(s)
        ck.wait()
        assert committed_steps(st) == [s, s - 1][: min(s + 1, 2)]
    ck.close()
    assert ck.retention_errors == []


def test_a_retention_failure_never_fails_the_save_or_training() -> None:
    from ckptstore import StoreUnavailableError
    from ckptstore.backends.faults import FaultyBackend

    fb = FaultyBackend(MemoryBackend())
    fb.fail(None, StoreUnavailableError("delete refused"), persistent=True, when=lambda op, k: op == "delete")
    st = CheckpointStore.open(fb, "r", identity=IDENT)
    m, o = tiny_model()
    ck = Checkpointer(st, {"model": m, "optimizer": o}, every_steps=1, keep_last=1, handle_signals=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(3):
            step(m, o)
            ck.step_end(s)
        ck.close()
    assert sum("retention after a save failed" in str(w.message) for w in caught) == 2
    assert committed_steps(st) == [2, 1, 0]  # nothing deleted, every save committed
    assert len(ck.retention_errors) == 2 and "delete refused" in ck.retention_errors[0]
    assert len([e for e in st.events() if e["event"] == "retention-failed"]) == 2


def test_keep_every_keeps_milestones_beside_the_newest() -> None:
    st = CheckpointStore.open(MemoryBackend(), "r", identity=IDENT)
    m, _ = tiny_model()
    with pytest.raises(InvalidInputError):
        Checkpointer(st, {"model": m}, keep_last=0, handle_signals=False)
    ck = Checkpointer(st, {"model": m}, keep_last=1, keep_every=20, handle_signals=False, async_save=False)
    for step in (10, 20, 30, 40, 50):
        ck.save(step)
    ck.close()
    assert committed_steps(st) == [50, 40, 20]  # the newest, and every multiple of 20


# ------------------------------------------------------------------ preemption


def test_preemption_saves_and_exits_with_tempfail() -> None:
    st = CheckpointStore.open(MemoryBackend(), "r", identity=IDENT)
    m, o = tiny_model()
    ck = Checkpointer(st, {"model": m, "optimizer": o}, every_steps=100, handle_signals=False)
    step(m, o)
    ck.step_end(0)
    ck.request_preemption()
    step(m, o)
    with pytest.raises(SystemExit) as ei:
        ck.step_end(1)
    assert ei.value.code == EX_TEMPFAIL == 75
    ref = st.latest_complete(deep=True)
    assert ref is not None and ref.step == 1
    assert [e["payload"]["step"] for e in st.events() if e["event"] == "preempted"] == [1]
    ck2 = Checkpointer(CheckpointStore.open(MemoryBackend(), "r", identity=IDENT), {"model": m},
                       handle_signals=False, preempt_exit_code=0)
    ck2.request_preemption()
    with pytest.raises(SystemExit) as ei:
        ck2.step_end(0)
    assert ei.value.code == 0
    with pytest.raises(InvalidInputError):
        Checkpointer(st, {"model": m}, handle_signals=False, preempt_exit_code=300)


# ------------------------------------------------------------------ corrupt resume point


def test_cheap_verified_resume_falls_back_from_a_corrupt_newest_save() -> None:
    b = MemoryBackend()
    m, o = tiny_model()
    ck = Checkpointer(CheckpointStore.open(b, "r", identity=IDENT), {"model": m, "optimizer": o},
                      async_save=False, handle_signals=False)
    step(m, o)
    ck.save(0)
    at0 = [p.detach().clone() for p in m.parameters()]
    step(m, o)
    bad = ck.save(1)
    ck.close()
    assert bad is not None
    key, at = stored_at("r", bad, "model.safetensors", -1)  # its file; on version 3 the piece of its last byte
    raw = bytearray(b.get(key))
    raw[at] ^= 0x01  # same size: a cheap check cannot see it
    b.put(key, [bytes(raw)])

    st = CheckpointStore.open(b, "r", identity=IDENT, resume_verify="cheap")
    assert st.resumed_from is not None and st.resumed_from.step == 1
    m2, o2 = tiny_model()
    ck2 = Checkpointer(st, {"model": m2, "optimizer": o2}, async_save=False, handle_signals=False)
    with pytest.warns(RuntimeWarning, match="step 1 is corrupt; resuming from step 0"):
        assert ck2.resume() == 1
    assert all(torch.equal(a, p) for a, p in zip(at0, m2.parameters(), strict=True))
    assert ck2.store is st and st.attempt is not None and st.attempt.resumed_from == 0
    ev = [e for e in ck2.store.events() if e["event"] == "resume-fallback"]
    assert len(ev) == 1 and ev[0]["payload"]["from_step"] == 1 and ev[0]["payload"]["to_step"] == 0
    assert "BLAKE3" in ev[0]["payload"]["reasons"][0]
    # the corrupt save left the run's history; the continuation commits step 1 again
    step(m2, o2)
    ck2.save(1)
    ck2.close()
    reader = CheckpointStore.open(b, "r", mode="r")
    latest = reader.latest_complete(deep=True)
    assert latest is not None and latest.step == 1 and latest.attempt == ck2.store.attempt.number
    states = {(i.step, i.attempt): i.state for i in reader.list_saves()}
    assert states[(1, bad.attempt)] is SaveState.SUPERSEDED


# ------------------------------------------------------------------ CUDA copy ordering


class FakeStreams:
    """Records the stream operations of a snapshot, in order."""

    def __init__(self, log: list[tuple[str, ...]]) -> None:
        self.log = log

    class Stream:
        def __init__(self, name: str, log: list[tuple[str, ...]]) -> None:
            self.name, self.log = name, log

        def wait_stream(self, other: FakeStreams.Stream) -> None:
            self.log.append(("wait", self.name, other.name))

        def record_event(self) -> Any:
            self.log.append(("record", self.name))
            log = self.log

            class Event:
                def synchronize(self) -> None:
                    log.append(("sync",))

            return Event()

    def current(self) -> FakeStreams.Stream:
        return self.Stream("train", self.log)

    def new(self) -> FakeStreams.Stream:
        return self.Stream("copy", self.log)

    @contextlib.contextmanager
    def use(self, stream: FakeStreams.Stream) -> Iterator[None]:
        self.log.append(("enter", stream.name))
        yield
        self.log.append(("exit", stream.name))


def test_snapshot_stream_ordering_with_a_fake_stream() -> None:
    log: list[tuple[str, ...]] = []
    st = CheckpointStore.open(MemoryBackend(), "r", identity=IDENT)
    m, o = tiny_model()
    ck = Checkpointer(st, {"model": m}, every_steps=1, handle_signals=False, streams=FakeStreams(log))
    real_copy = ck._buffers.copy
    real_save = st.save

    def copy(entry: str, key: str, t: torch.Tensor) -> torch.Tensor:
        log.append(("copy", key))
        return real_copy(entry, key, t)

    def save(*a: Any, **kw: Any) -> Any:
        log.append(("write",))
        return real_save(*a, **kw)

    ck._buffers.copy = copy  # type: ignore[method-assign]
    st.save = save  # type: ignore[method-assign]
    step(m, o)
    ck.step_end(0)
    ck.wait()
    ck.close()
    kinds = [e[0] for e in log]
    assert log[0] == ("wait", "copy", "train")  # the copy stream waits for the step just queued
    assert log[1] == ("enter", "copy")  # copies are issued on the copy stream
    copies = [i for i, k in enumerate(kinds) if k == "copy"]
    assert {"weight", "bias"} <= {log[i][1] for i in copies}  # model tensors (and the RNG states)
    assert all(1 < i < kinds.index("exit") for i in copies)
    i_exit = kinds.index("exit")
    assert log[i_exit + 1] == ("wait", "train", "copy")  # later training kernels wait for the copies
    assert log[i_exit + 2] == ("record", "copy")
    assert kinds.index("sync") < kinds.index("write")  # the writer waits for the copies before writing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
def test_async_save_right_after_step_captures_the_update_on_gpu() -> None:
    st = CheckpointStore.open(MemoryBackend(), "r", identity=IDENT)
    torch.manual_seed(0)
    m = torch.nn.Linear(2048, 2048).cuda()
    o = torch.optim.SGD(m.parameters(), lr=1.0)
    ck = Checkpointer(st, {"model": m}, every_steps=1, handle_signals=False)
    for s in range(3):
        o.zero_grad()
        m(torch.randn(512, 2048, device="cuda")).square().mean().backward()
        o.step()  # queued, not finished
        ck.step_end(s)  # async snapshot right away
        expect = m.weight.detach().cpu().clone()  # what the step produced
        with torch.no_grad():
            m.weight.mul_(-3.0)  # the next in-place update, queued behind the copy
        ck.wait()
        ref = st.latest_complete()
        assert ref is not None
        saved = read_state(st, ref)["model"]["weight"]
        assert torch.equal(saved, expect)
        with torch.no_grad():
            m.weight.div_(-3.0)
    ck.close()


# ------------------------------------------------------------------ ResumableSampler with workers


def test_resumable_sampler_with_workers_never_rewinds_a_live_iterator() -> None:
    s = ResumableSampler(40, seed=1)
    dl: Any = torch.utils.data.DataLoader(list(range(40)), batch_size=4, sampler=s, num_workers=2)  # type: ignore[arg-type]
    it = iter(dl)
    seen: list[int] = []
    for _ in range(3):
        b = next(it)
        seen += b.tolist()
        s.advance(len(b))  # what the loop consumed; the workers prefetched more
    state = s.state_dict()
    assert (state["epoch"], state["offset"]) == (0, 12)
    s.set_position(0, 12)  # the old docstring's advice: harmless now
    rest = [x for b in it for x in b.tolist()]
    assert sorted(seen + rest) == list(range(40))  # no sample twice, none lost
    s.advance(len(rest))
    assert (s.epoch, s.offset) == (0, 40)
    s2 = ResumableSampler(40, seed=1)
    s2.load_state_dict(state)
    assert list(s2) == rest
    # the next epoch after the end-of-epoch position
    assert list(iter(s))[:5] == s.order(1)[:5]
    with pytest.raises(InvalidInputError, match="passes the end of the epoch"):
        ResumableSampler(10).advance(11)


# ------------------------------------------------------------------ global-RNG pitfall


@pytest.mark.parametrize("draw_before_iter", [False, True])
def test_loader_without_generator_after_resume(draw_before_iter: bool) -> None:
    def loader(s: ResumableSampler) -> Any:
        return torch.utils.data.DataLoader(list(range(16)), batch_size=4, sampler=s)  # type: ignore[arg-type]  # no generator=

    b = MemoryBackend()
    torch.manual_seed(0)
    s = ResumableSampler(16, seed=2)
    it = iter(loader(s))
    next(it)
    ck = Checkpointer(CheckpointStore.open(b, "r", identity=IDENT), {"sampler": s}, async_save=False,
                      handle_signals=False)
    ck.save(0)
    ck.close()
    uninterrupted = (next(it).tolist(), torch.rand(3))  # next batch, then "dropout"

    torch.manual_seed(123)  # a fresh process
    s2 = ResumableSampler(16, seed=2)
    ck2 = Checkpointer(CheckpointStore.open(b, "r", identity=IDENT), {"sampler": s2}, handle_signals=False)
    ck2.resume()
    if draw_before_iter:
        torch.rand(1)  # user code using the global RNG before the first batch: cannot be undone
        with pytest.warns(RngPitfallWarning, match="global torch RNG was used"):
            batch = next(iter(loader(s2))).tolist()
        assert s2.rng_after_resume == "diverged"
        return
    batch = next(iter(loader(s2))).tolist()  # the iterator draws a base seed from the global RNG ...
    assert s2.rng_after_resume == "undone"  # ... which the sampler undid
    dropout = torch.rand(3)
    assert batch == uninterrupted[0] and torch.equal(dropout, uninterrupted[1])
    ck2.close()


# ------------------------------------------------------------------ ResumableLoader position


@pytest.mark.parametrize("drop_last", [False, True])
def test_resumable_loader_position_mid_epoch_and_at_the_end(drop_last: bool) -> None:
    from ckptstore.torch import ResumableLoader

    data = list(range(10))

    def mk() -> ResumableLoader:
        return ResumableLoader(data, batch_size=4, seed=5, drop_last=drop_last)

    ref = mk()
    epochs = [[b.tolist() for b in ref] for _ in range(3)]
    per_epoch = 2 if drop_last else 3
    assert all(len(e) == per_epoch for e in epochs)
    for cut in range(per_epoch + 1):  # 0 .. all batches of epoch 0 consumed
        a = mk()
        it = iter(a)
        got = [next(it).tolist() for _ in range(cut)]
        state = a.state_dict()
        assert (state["epoch"], state["batches"]) == (0, cut)
        b = mk()
        b.load_state_dict(state)
        rest = [x.tolist() for x in b] if cut < per_epoch else []
        later = [[x.tolist() for x in b] for _ in range(2)]
        flat = got + rest + [x for e in later for x in e]
        assert flat[: 3 * per_epoch] == [x for e in epochs for x in e]


# ------------------------------------------------------------------ torchdata work-around


@pytest.mark.parametrize("with_fix", [False, True])
def test_stateful_dataloader_zero_workers_epoch_boundary_after_resume(with_fix: bool) -> None:
    """torchdata 0.11 alone draws another permutation at the first epoch boundary
    after a resume (0 workers, generator=); the Checkpointer's work-around fixes it.
    If the first case starts passing, torchdata fixed it and the work-around can go."""
    from torchdata.stateful_dataloader import StatefulDataLoader  # type: ignore[import-untyped]

    def mk() -> Any:
        return StatefulDataLoader(list(range(10)), batch_size=3, shuffle=True,
                                  generator=torch.Generator().manual_seed(1))

    ref = [[b.tolist() for b in dl] for dl in [mk()] for _ in range(3)]
    b = MemoryBackend()
    dl = mk()
    it = iter(dl)
    got = [next(it).tolist() for _ in range(2)]
    ck = Checkpointer(CheckpointStore.open(b, "r", identity=IDENT), {"loader": dl}, async_save=False,
                      handle_signals=False)
    ck.save(0)
    ck.close()
    dl2 = mk()
    st = CheckpointStore.open(b, "r", identity=IDENT)
    if with_fix:
        Checkpointer(st, {"loader": dl2}, handle_signals=False).resume()
    else:
        from ckptstore.torch import read_state

        assert st.resumed_from is not None
        dl2.load_state_dict(read_state(st, st.resumed_from)["loader"])  # torchdata's own resume
    rest = [[x.tolist() for x in dl2] for _ in range(2)]
    resumed = [got + rest[0], rest[1]]
    assert (resumed == ref[:2]) is with_fix


# ------------------------------------------------------------------ more than one save in flight


def test_two_saves_in_flight_commit_in_order_with_bounded_buffers() -> None:
    """max_inflight=2: a due save does not wait while one is being written;
    a third waits for the oldest; the newer save, although its writes finish
    first, commits after the older one; at most two buffer sets exist."""
    from ckptstore.backends.faults import FaultyBackend

    slow_first = FaultyBackend(MemoryBackend()).slow(
        None, 0.6, when=lambda op, key: op == "put" and ("/saves/000000000001-" in key and "model" in key
                                                         or "/pieces/000000000001-" in key)  # version 3: every piece
    )
    st = CheckpointStore.open(slow_first, "r", identity=IDENT)
    m, o = tiny_model()
    ck = Checkpointer(st, {"model": m, "optimizer": o}, handle_signals=False, max_inflight=2)
    step(m, o)
    ck.save(1)
    step(m, o)
    t0 = time.perf_counter()
    ck.save(2)  # a free slot: does not wait for save 1 (slowed by 0.6 s per model put)
    assert time.perf_counter() - t0 < 0.4
    assert ck._queue is not None and len(ck._queue) == 2
    step(m, o)
    ck.save(3)  # no free slot: waits for save 1
    assert len(ck._queue) <= 2
    ck.close()
    creates = [t.key for t in slow_first.trace if t.op == "create" and "/commits/" in t.key]
    steps = [sa[0] for k in creates if (sa := P.LATEST_LAYOUT.parse_commit_name(k.rsplit("/", 1)[-1]))]
    assert steps == sorted(steps) == [1, 2, 3]
    assert len(ck._queue.idle) == 2  # two sets were made, both back after close
    assert committed_steps(CheckpointStore.open(slow_first, "r", mode="r"))[:3] == [3, 2, 1]


def test_max_inflight_must_be_positive() -> None:
    st = CheckpointStore.open(MemoryBackend(), "r", identity=IDENT)
    m, o = tiny_model()
    for bad in (0, -1, 1.5):
        with pytest.raises(InvalidInputError, match="max_inflight"):
            Checkpointer(st, {"model": m}, handle_signals=False, max_inflight=bad)  # type: ignore[arg-type]
