"""What the DCP writer and reader share: the plan data, how a target names its
store, and how a ``checkpoint_id`` names a step."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ... import protocol as P
from ...errors import CkptStoreError, InvalidInputError
from ...store import CheckpointStore
from ..coordinator import DistributedRun

METADATA_COMPONENT = "dcp/metadata.json"
DCP_VERSION = "1.0.0"


class PickleRefusedError(CkptStoreError):
    """A checkpoint item is a pickled object and the reader was not allowed to
    unpickle it (``allow_pickle=False``, the default)."""


@dataclass(frozen=True)
class SavePlanData:
    """The save ID the coordinator hands every rank in the global plan."""


    save_id: str


def store_of(target: DistributedRun | CheckpointStore) -> CheckpointStore:
    """The store behind a DCP target (a many-rank run or a single store)."""
    if isinstance(target, DistributedRun):
        return target.store
    if isinstance(target, CheckpointStore):
        return target
    raise InvalidInputError(f"expected a DistributedRun or CheckpointStore, got {type(target).__name__}")


def step_of(checkpoint_id: str | os.PathLike[str] | int | None) -> int | None:
    """The step a DCP ``checkpoint_id`` names: an int, ``"N"`` or ``"step-N"``."""
    if checkpoint_id is None:
        return None
    if isinstance(checkpoint_id, int):
        return P.validate_step(checkpoint_id)
    s = os.fspath(checkpoint_id)
    s = s.removeprefix("step-")
    if not s.isdigit():
        raise InvalidInputError(f"checkpoint_id {checkpoint_id!r} must be a step (an int, 'N' or 'step-N')")
    return P.validate_step(int(s))
