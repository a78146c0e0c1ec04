"""What the commands share: opening the store from the arguments, tables,
human sizes, the flags every command takes."""

from __future__ import annotations

import argparse
import os
from typing import Any
from urllib.parse import urlparse

from ..backends.base import Backend
from ..backends.local import local_backend_options
from ..backends.schemes import backend_from_url
from ..defaults import BUDGET_GPU_HOURS, GPU_HOURS_PER_STEP, RESTART_GPU_HOURS
from ..errors import ExtraRequiredError, InvalidInputError, NotFoundError
from ..ops.budget import MIN_STEP_SECONDS
from ..options import AuthOptions, OpenOptions, TierOptions
from ..store import CheckpointStore
from .output import parse_options


def human_bytes(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def read_only_backend(url: str, storage_options: dict[str, Any] | None) -> Backend:
    """The backend of a store a command only reads. A local directory must
    exist: a read-only command creates nothing (a mistyped path is
    :class:`NotFoundError`, not a new empty store directory)."""
    if "://" not in url or url.startswith("file://"):
        path = urlparse(url).path if url.startswith("file://") else url
        local_backend_options(storage_options)  # a bad option is bad input (exit 2) before "no store there"
        if not os.path.isdir(path):
            raise NotFoundError(f"{path}: no store directory there (a read-only command creates nothing); "
                                "pass the directory the run was saved to")
    return backend_from_url(url, storage_options=storage_options)


def open_store(args: argparse.Namespace, *, default_policy: str = "off") -> CheckpointStore:
    from .. import keyring_from_env, keyring_from_file

    key_file = getattr(args, "auth_key_file", None)
    policy = getattr(args, "auth_policy", None) or ("warn" if key_file and default_policy == "off" else default_policy)
    keyring = (keyring_from_file(key_file) if key_file else keyring_from_env()) if policy != "off" else None
    backend = read_only_backend(args.url, parse_options(getattr(args, "storage_option", None)))
    local = getattr(args, "local_tier", None)
    return CheckpointStore.open(backend, args.run, mode="r", options=OpenOptions(
        auth=AuthOptions(policy, keyring), tiers=TierOptions(local) if local is not None else None))


def check_output_file(path: str | None, flag: str, suffix: str = "") -> None:
    """Refuse, before any work, a file a command is asked to write that it
    could not: its directory missing, not a directory or not writable, the
    path itself a directory, or (``suffix``) the wrong ending. The error
    names the flag, the path and the fix, never a foreign ``OSError``."""
    if path is None:
        return
    if suffix and not path.endswith(suffix):
        raise InvalidInputError(f"{flag} {path}: the file name must end in {suffix}")
    if os.path.isdir(path):
        raise InvalidInputError(f"{flag} {path}: is a directory; name a file in it (e.g. {path.rstrip('/')}/ckptstore{suffix})")
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(d):
        raise InvalidInputError(f"{flag} {path}: the directory {d} does not exist; create it first, or point {flag} "
                                "at a file in an existing directory")
    if not os.path.isdir(d):
        raise InvalidInputError(f"{flag} {path}: {d} is not a directory")
    if not os.access(d, os.W_OK | os.X_OK):
        raise InvalidInputError(f"{flag} {path}: the directory {d} is not writable by this user")


def require_extra(what: str, extra: str, *modules: str) -> None:
    """One line naming the extra to install, instead of a traceback."""
    import importlib.util

    for m in modules:
        if importlib.util.find_spec(m) is None:
            raise ExtraRequiredError(what, extra, m)


def budget_from_args(args: argparse.Namespace) -> Any:
    from ..ops.budget import Budget

    return Budget(args.budget_gpu_hours, args.gpu_hours_per_step, args.restart_gpu_hours,
                  min_step_seconds=args.min_step_seconds)


def debug_flag(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="print the traceback of a failure")


def storage_flags(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.add_argument("--storage-option", "-o", action="append", metavar="KEY=VALUE", help="fsspec storage option (repeatable)")
    sp.add_argument(
        "--auth-policy", choices=["off", "warn", "require"], default=None,
        help="authenticated records: off (default), warn, require (keys: --auth-key-file or CKPTSTORE_AUTH_KEYS)",
    )
    sp.add_argument("--auth-key-file", default=None, help='key file {"active": ID, "keys": {ID: HEX}}, mode 600')
    sp.add_argument("--local-tier", default=None, metavar="DIR",
                    help="the run's local tier on this machine: show both tiers (docs/tiers.md)")


def common_flags(sp: argparse.ArgumentParser) -> None:
    """URL, RUN and the flags every store command takes."""
    debug_flag(sp)
    sp.add_argument("url", help="store URL: a directory, file://, memory://, s3://bucket/prefix, gs://bucket/prefix")
    sp.add_argument("run", help="run ID")
    storage_flags(sp)


def budget_flags(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--budget-gpu-hours", type=float, default=BUDGET_GPU_HOURS)
    sp.add_argument("--gpu-hours-per-step", type=float, default=GPU_HOURS_PER_STEP)
    sp.add_argument("--restart-gpu-hours", type=float, default=RESTART_GPU_HOURS)
    sp.add_argument("--min-step-seconds", type=float, default=MIN_STEP_SECONDS,
                    help="the shortest time a step can take: progress claimed faster than this is not believed")
