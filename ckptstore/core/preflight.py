"""Checks made before a store writes anything: can this process write this
run safely, and is the caller's metadata storable."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Literal

from ..backends.base import Backend
from ..errors import InvalidInputError, UnsupportedBackendError
from ..protocol import canonical_json, validate_step


def distributed_world_size() -> int:
    """The size of an initialised default torch.distributed group, or 1.
    Never imports torch: only looks at it if the caller already did."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
    except Exception:  # noqa: BLE001 - a half-initialised torch is not our concern here
        return 1
    return 1


def check_can_write(backend: Backend, requested: dict[str, Any] | None, join_attempt: int | None, single: bool) -> None:
    """Refuse to open for writing what could not be written safely."""
    if requested is None:
        raise InvalidInputError("opening a run for writing needs its identity (identity=...)")
    if not backend.capabilities.atomic_create:
        raise UnsupportedBackendError(
            f"{backend.url}: this backend cannot create objects atomically (create-if-absent); "
            "ckptstore refuses to commit on it rather than risk two writers both publishing"
        )
    world = distributed_world_size()
    if world > 1 and join_attempt is None and not single:
        raise InvalidInputError(
            f"this process is one of {world} ranks of a torch.distributed job: every rank opening the run "
            "would register its own attempt and fence the others. Use "
            "ckptstore.distributed.open_distributed(...) on every rank, or pass "
            "options=OpenOptions(single_writer=True) on the one rank that saves (the DDP 'rank 0 saves' pattern)"
        )


def check_open_args(mode: str, resume_from: object, resume_verify: str) -> Literal["r", "w"]:
    """The open's arguments, checked; the mode."""
    if resume_verify not in ("deep", "cheap"):
        raise InvalidInputError("resume_verify must be 'deep' or 'cheap'")
    if mode not in ("r", "w"):
        raise InvalidInputError(f"mode must be 'r' or 'w', got {mode!r}")
    if resume_from not in ("latest", None) and (type(resume_from) is not int):
        raise InvalidInputError(f"resume_from must be 'latest', None or a step, got {resume_from!r}")
    if isinstance(resume_from, int):
        validate_step(resume_from)
    return "w" if mode == "w" else "r"


def check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    md = dict(metadata or {})
    try:
        canonical_json(md)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"save metadata must be JSON-representable: {exc}") from None
    return md
