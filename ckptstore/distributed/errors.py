"""Errors of the distributed layer, and their canonical-JSON form.

An error raised on the coordinator travels to every other rank as JSON (type
name, message, and the fields its class needs) and is raised there as the same
class with the same message, so every rank of a job sees one outcome.
"""

from __future__ import annotations

from typing import Any

from .. import errors as E
from .channel import ChannelError, CoordinatorLostError, RanksFailedError


class WorldSizeMismatchError(E.InvalidInputError):
    """The process group does not have the number of ranks the identity, or the
    save being resumed, says; resharding was not asked for."""


class RemoteError(E.CkptStoreError):
    """An error of a type this process cannot rebuild (raised on another rank)."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name


_CLASSES: dict[str, type[E.CkptStoreError]] = {
    c.__name__: c
    for c in (*vars(E).values(), WorldSizeMismatchError, ChannelError, CoordinatorLostError)
    if isinstance(c, type) and issubclass(c, E.CkptStoreError)
}


def error_to_json(exc: BaseException) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, E.IdentityMismatchError):
        out["run_id"] = exc.run_id
        out["fields"] = list(exc.fields)
        out["details"] = {k: [a, b] for k, (a, b) in exc.details.items()}
    elif isinstance(exc, E.SupersededError):
        out["committed"] = exc.committed
    elif isinstance(exc, RanksFailedError):
        out["ranks"] = list(exc.ranks)
    return out


def rank_error_json(rank: int, exc: BaseException) -> dict[str, Any]:
    """``exc`` as JSON, its message naming the rank it happened on (the other ranks raise it)."""
    out = error_to_json(exc)
    out["message"] = f"rank {rank}: {out['message']}"
    return out


def error_from_json(d: dict[str, Any]) -> E.CkptStoreError:
    t, msg = str(d.get("type", "")), str(d.get("message", ""))
    if t == "IdentityMismatchError":
        details = {str(k): (v[0], v[1]) for k, v in dict(d.get("details", {})).items()}
        return E.IdentityMismatchError(str(d.get("run_id", "")), list(d.get("fields", [])), details)
    if t == "SupersededError":
        return E.SupersededError(msg, committed=bool(d.get("committed", False)))
    if t == "RanksFailedError":
        return RanksFailedError(msg, list(d.get("ranks", [])))
    cls = _CLASSES.get(t)
    if cls is None:
        return RemoteError(t, msg)
    return cls(msg)


def may_delete_after(exc: BaseException) -> bool:
    """Whether a failed save's components may be removed: never when the
    commit record may exist (unknown outcome, or committed-but-superseded)."""
    if isinstance(exc, (E.CommitUnknownError, CoordinatorLostError)):
        return False
    return not (isinstance(exc, E.SupersededError) and exc.committed)
