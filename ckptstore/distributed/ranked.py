"""The single-process PyTorch adapter on many ranks: each rank's own view of a
:class:`DistributedRun`.

    run = open_distributed(url, "run-7", identity=identity)
    ckpt = Checkpointer(RankStore(run), {"model": ddp.module, "optimizer": opt, "sampler": sampler},
                        every_steps=100)
    start = ckpt.resume()          # every rank restores its own state, RNG and data position included
    ...
    ckpt.step_end(step)            # collective: every rank saves at the same steps, all ranks or none

Every rank writes its state under ``rank<r>/`` (``rank1/state.json``,
``rank1/model.safetensors``, ...) in one save that the coordinator publishes
for all ranks or none. Per-rank RNG streams and data positions therefore
resume exactly. Replicated state (a DDP model and optimizer) is written by
every rank — W copies; use the DCP writer to write it once, sharded.

The view quacks like the parts of :class:`CheckpointStore` the adapter uses
(``mode``, ``resumed_from``, ``save``, ``read``, ``iter_read``,
``record_event``). Saves are collective: every rank must save the same
steps in the same order (a preemption signal must reach every rank).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal

from .. import protocol as P
from ..protocol.selection import SaveRef
from .coordinator import DistributedRun, DistributedSave


class _RankSave:
    def __init__(self, inner: DistributedSave, prefix: str) -> None:
        self._inner = inner
        self._prefix = prefix

    def __enter__(self) -> _RankSave:
        self._inner.__enter__()
        return self

    def put(self, name: str, data: Any) -> P.ComponentEntry:
        return self._inner.put(self._prefix + name, data)

    @property
    def ref(self) -> SaveRef | None:
        return self._inner.ref

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._inner.__exit__(exc_type, exc, tb)


class RankStore:
    """One rank's view of a distributed run, for :class:`ckptstore.torch.Checkpointer`."""

    mode: Literal["w"] = "w"

    def __init__(self, run: DistributedRun) -> None:
        self.run = run
        self.prefix = f"rank{run.rank}/"
        self.run_id = run.store.run_id

    @property
    def resumed_from(self) -> SaveRef | None:
        return self.run.resumed_from

    def save(
        self, step: int, *, metadata: Mapping[str, Any] | None = None, expect: Sequence[str] | None = None
    ) -> _RankSave:
        return _RankSave(self.run.save(step, metadata=metadata), self.prefix)

    def read(self, ref: SaveRef, name: str) -> bytes:
        return self.run.store.read(ref, self.prefix + name)

    def iter_read(self, ref: SaveRef, name: str, chunk: int = 8 << 20) -> Iterator[bytes]:
        return self.run.store.iter_read(ref, self.prefix + name, chunk)

    def component(self, ref: SaveRef, name: str) -> P.ComponentEntry:
        return self.run.store.component(ref, self.prefix + name)

    def read_into(self, ref: SaveRef, name: str, out: Any) -> None:
        self.run.store.read_into(ref, self.prefix + name, out)

    def agree_preemption(self, flag: bool) -> bool:
        """The job's agreed preemption flag (collective; :meth:`DistributedRun.agree_preemption`)."""
        return self.run.agree_preemption(flag)

    def alert(self) -> None:
        """A termination signal arrived: give up on silent peers within seconds (:meth:`Channel.alert`)."""
        self.run.channel.alert()

    def abandon(self) -> None:
        """This process is leaving: end every wait for other ranks (:meth:`Channel.abandon`)."""
        self.run.channel.abandon()

    def record_event(self, kind: str, payload: Mapping[str, Any]) -> str:
        """The ledger is the job's: only the coordinator appends to it."""
        if not self.run.is_coordinator:
            return ""
        return self.run.store.record_event(kind, {**dict(payload), "world_size": self.run.world_size})
