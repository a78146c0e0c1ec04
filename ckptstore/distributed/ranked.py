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

The view implements the Checkpointer's typed contract,
:class:`ckptstore.torch.contract.CheckpointerStore` (checked by ``mypy --strict``
below, as :class:`CheckpointStore` is). Saves are collective: every rank must
save the same steps in the same order (a preemption signal must reach every rank).

Decided once, by the coordinator, for all ranks:

* retention (``Checkpointer(..., keep_last=...)``): after each commit the
  coordinator runs ``gc`` on the job's one store, which holds every rank's
  part of every save; the other ranks delete nothing;
* the corrupt-resume-point fallback (:meth:`RankStore.read_resume_point`):
  every rank reads back its own part of the resume point, the outcomes are
  gathered by the coordinator, and if any rank's part is corrupt every rank
  moves to the same older save, which the coordinator registers (a new
  attempt, recorded as ``resume-fallback``) and the others join.

A run opened with ``reshard=True`` that changed the world size is refused
here, on every rank alike: each rank's state is its own and cannot be
resharded; the DCP reader (:mod:`ckptstore.distributed.dcp.writer`) reshards.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from .. import GcReport
from .. import protocol as P
from ..errors import CkptStoreError, CorruptionError
from ..protocol.selection import SaveRef
from ..store import DEFAULT_GRACE_SECONDS, CheckpointStore
from ..torch.contract import CheckpointerStore
from .coordinator import DistributedRun, DistributedSave
from .errors import WorldSizeMismatchError, error_from_json, error_to_json, rank_error_json

T = TypeVar("T")

#: the most older saves the fallback tries before giving up (each costs every rank one read)
MAX_FALLBACK_TRIES = 20


class _RankSave:
    def __init__(self, inner: DistributedSave, prefix: str) -> None:
        self._inner = inner
        self._prefix = prefix

    def __enter__(self) -> _RankSave:
        self._inner.__enter__()
        return self

    def put(self, name: str, data: Any) -> P.ComponentEntry:
        return self._inner.put(self._prefix + name, data)

    def put_many(self, items: Sequence[tuple[str, Any]]) -> dict[str, P.ComponentEntry]:
        got = self._inner.put_many([(self._prefix + name, data) for name, data in items])
        return {name: got[self._prefix + name] for name, _ in items}

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
        if run.resharded is not None:
            rs = run.resharded
            raise WorldSizeMismatchError(
                f"run {run.store.run_id!r} was opened with reshard=True: its save"
                f"{'' if rs.get('resumed_from') is None else ' of step ' + str(rs['resumed_from'])} was written by "
                f"{rs.get('from_world_size')} ranks, this job has {rs.get('to_world_size')}. RankStore (the "
                "Checkpointer on many ranks) keeps each rank's own state and cannot reshard it: load the save with "
                "the DCP reader (ckptstore.distributed.dcp.writer, which reshards), or resume with "
                f"{rs.get('from_world_size')} ranks, or start a new run ID (lineage=store.lineage_of(ref))"
            )
        self.run = run
        self.prefix = f"rank{run.rank}/"
        self.run_id = run.store.run_id

    @property
    def resumed_from(self) -> SaveRef | None:
        return self.run.resumed_from

    @property
    def attempt(self) -> P.AttemptRecord | None:
        """The job's attempt, which every rank joined (after a collective
        fallback: the one the coordinator registered for it)."""
        return self.run.store.attempt

    def events(self) -> list[dict[str, Any]]:
        """The job's ledger (one for all ranks, appended to by the coordinator), oldest first;
        every rank may read it (the Checkpointer's metrics do)."""
        return self.run.store.events()

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

    def read_range(self, ref: SaveRef, name: str, start: int, end: int) -> bytes:
        return self.run.store.read_range(ref, self.prefix + name, start, end)

    @property
    def tiered(self) -> bool:
        """Whether the job was opened with a ``local_tier`` (``docs/tiers.md`` "Many ranks")."""
        return self.run.store.tiered

    def make_durable(self, timeout: float | None = None) -> bool:
        """Collective (a preemption, the end of training): every rank queues its
        part of the newest local save and waits up to ``timeout`` seconds for it
        to be uploaded; the coordinator waits for the durable commit. Every rank
        returns the coordinator's answer: True when that save is committed in the
        durable tier (False too when the coordinator cannot be heard)."""
        run = self.run
        mine = run.store.make_durable(timeout)
        ch = run.channel
        tag = ch.next()
        try:
            out = ch.exchange_from_coordinator(tag, "durable", {"durable": mine} if run.is_coordinator else None,
                                               timeout=(timeout or 0.0) + ch.timeout)
        except CkptStoreError:
            return False
        return out.get("durable") is True

    def agree_preemption(self, flag: bool) -> bool:
        """The job's agreed preemption flag (collective; :meth:`DistributedRun.agree_preemption`)."""
        return self.run.agree_preemption(flag)

    def alert(self) -> None:
        """A termination signal arrived: give up on silent peers within seconds (:meth:`Channel.alert`)."""
        self.run.channel.alert()

    def abandon(self) -> bool:
        """This process is leaving: end every wait for other ranks (:meth:`Channel.abandon`).
        True: this store's saves wait for other ranks (the Checkpointer's contract)."""
        self.run.channel.abandon()
        return True

    def record_event(self, kind: str, payload: Mapping[str, Any]) -> str:
        """The ledger is the job's: only the coordinator appends to it."""
        if not self.run.is_coordinator:
            return ""
        return self.run.store.record_event(kind, {**dict(payload), "world_size": self.run.world_size})

    # ------------------------------------------------------------ decided by the coordinator
    def gc(
        self,
        *,
        keep_last: int = 2,
        keep_every: int | None = None,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        dry_run: bool = False,
        deep: bool = True,
        incremental: bool = False,
    ) -> GcReport | None:
        """Retention for the whole job: the coordinator runs
        :meth:`CheckpointStore.gc` (every rank's part of every save is in its one
        store, so one pass covers all ranks, with gc's rules: the newest complete
        save and in-flight saves are kept); on the other ranks it deletes
        nothing and returns None. Not collective (no rank waits for it)."""
        if not self.run.is_coordinator:
            return None
        return self.run.store.gc(
            keep_last=keep_last, keep_every=keep_every, grace_seconds=grace_seconds, dry_run=dry_run, deep=deep,
            incremental=incremental,
        )

    def read_resume_point(
        self, ref: SaveRef, read: Callable[[SaveRef], T], check: Callable[[T, SaveRef], None] | None = None
    ) -> tuple[T, SaveRef]:
        """Collective: read this rank's part of the resume point with ``read``;
        if any rank finds its part corrupt (:class:`CorruptionError`), every
        rank falls back to the same older complete save that every rank reads
        back intact. The coordinator registers it (a new attempt that the
        others join, ``resume-fallback`` recorded with every rank's reasons).
        ``check`` (e.g. "does the save fit the live objects") runs on the read
        state; its error, like any other error than corruption on any rank, is
        raised on every rank (never a reason to fall back)."""
        run, ch = self.run, self.run.channel
        failures: list[str] = []
        older: list[SaveRef] | None = None
        cand = ref
        for tries in range(MAX_FALLBACK_TRIES + 1):
            result: list[T] = []
            own: Exception | None = None
            try:
                result.append(read(cand))
                mine: dict[str, Any] = {"ok": True}
            except CorruptionError as exc:
                mine = {"ok": False, "corrupt": f"rank {run.rank}: step {cand.step} ({cand.save_id}): {exc}"}
            except Exception as exc:  # noqa: BLE001 - told to every rank, raised everywhere
                own = exc
                mine = {"ok": False, "error": rank_error_json(run.rank, exc)}
            if result and check is not None:
                try:
                    check(result[0], cand)
                except Exception as exc:  # noqa: BLE001 - a misfit is no corruption: raised everywhere
                    own = exc
                    mine = {"ok": False, "error": rank_error_json(run.rank, exc)}
            tag = ch.next()
            ch.post(tag, "verified", mine)
            if ch.is_coordinator:
                decision = self._decide(tag, cand, ref, failures, older, last=tries == MAX_FALLBACK_TRIES)
                if decision.get("next") is not None:
                    older = decision.pop("_older")
                ch.post(tag, "decision", {k: v for k, v in decision.items() if not k.startswith("_")})
            else:
                decision = ch.receive(tag, "decision", timeout=run.save_timeout + ch.timeout)
            if "error" in decision:
                if own is not None:
                    raise own  # this rank's own error, its real type (the others raise the one reported)
                raise error_from_json(decision["error"])
            if decision.get("next") is not None:
                cand = self._ref(decision["next"])
                continue
            if cand is not ref:
                self._join_fallback(cand, int(decision["attempt"]), list(decision.get("failures", [])))
            return result[0], cand
        raise CorruptionError(f"run {self.run_id!r}: the fallback did not settle")  # pragma: no cover

    def _decide(
        self, tag: str, cand: SaveRef, ref: SaveRef, failures: list[str], older: list[SaveRef] | None, *, last: bool
    ) -> dict[str, Any]:
        """Coordinator: gather every rank's outcome for ``cand``; say what all do next."""
        run, ch, store = self.run, self.run.channel, self.run.store
        try:
            got = ch.gather(tag, "verified", timeout=run.save_timeout)
            errors = [g["error"] for _, g in sorted(got.items()) if "error" in g]
            if errors:
                return {"error": errors[0]}
            corrupt = [str(g["corrupt"]) for _, g in sorted(got.items()) if "corrupt" in g]
            if not corrupt:
                if cand is ref:
                    return {"ok": True}
                store.fall_back(cand, failures)
                assert store.attempt is not None
                return {"ok": True, "attempt": store.attempt.number, "failures": failures[:20]}
            failures.extend(corrupt)
            if older is None:
                older = store.fallback_candidates(ref)
            older = [o for o in older if (o.step, o.attempt) < (cand.step, cand.attempt)]
            if not older or last:
                raise CorruptionError(_summary(
                    f"run {self.run_id!r}: no complete save could be read back intact on every rank"
                    f"{' (' + str(MAX_FALLBACK_TRIES) + ' older saves tried)' if older else ''}", failures))
            nxt = older[0]
            return {"next": _ref_to_json(nxt), "_older": older}
        except Exception as exc:  # noqa: BLE001 - every rank raises the same
            return {"error": error_to_json(exc)}

    def _ref(self, d: Mapping[str, Any]) -> SaveRef:
        ref = self.run.store.get_save(int(d["step"]), int(d["attempt"]))
        if ref.manifest_digest != d["manifest_digest"] or ref.save_id != d["save_id"]:
            raise CorruptionError(
                f"run {self.run_id!r}: the commit of step {d['step']} read here differs from the coordinator's"
            )
        return ref

    def _join_fallback(self, to: SaveRef, attempt: int, failures: list[str]) -> None:
        """Every rank: resume from ``to`` in the attempt the coordinator registered."""
        run = self.run
        if not run.is_coordinator:
            old = run.store
            try:
                o = old.options
                o = o if o.tiers is None else replace(o, tiers=replace(o.tiers, peers=None))
                new = CheckpointStore(old.backend, old.run_id, o, identity=old.identity, mode="w", join_attempt=attempt)
            except CkptStoreError as exc:
                raise CkptStoreError(
                    f"rank {run.rank}: cannot join the fallback attempt {attempt} of run {old.run_id!r}: {exc}"
                ) from exc
            new.resumed_from = self._ref_in(new, to)
            run.store = new
        warnings.warn(_summary(
            f"rank {run.rank}: resume point is corrupt on some rank; every rank resumes from step {to.step} "
            f"instead (attempt {attempt} registered)", failures), RuntimeWarning, stacklevel=5)

    @staticmethod
    def _ref_in(store: CheckpointStore, to: SaveRef) -> SaveRef:
        ref = store.get_save(to.step, to.attempt)
        if ref.manifest_digest != to.manifest_digest:
            raise CorruptionError(f"run {store.run_id!r}: the commit of step {to.step} changed while falling back")
        return ref


def _ref_to_json(ref: SaveRef) -> dict[str, Any]:
    return {"step": ref.step, "attempt": ref.attempt, "save_id": ref.save_id, "manifest_digest": ref.manifest_digest}


def _summary(head: str, items: Sequence[str], limit: int = 8) -> str:
    shown = "; ".join(items[:limit]) + (f"; ... ({len(items) - limit} more)" if len(items) > limit else "")
    return f"{head}: {shown}" if items else head


if TYPE_CHECKING:  # mypy --strict checks that both stores keep the Checkpointer's contract
    _RANK_STORE: type[CheckpointerStore] = RankStore
    _ONE_STORE: type[CheckpointerStore] = CheckpointStore
