"""The ``ckptstore`` command line.

Human tables by default, ``--json`` for machines. Every failure is one line on
stderr and a non-zero exit code (2 for bad input, 1 for a failed check,
unavailable storage or an unexpected error), never a traceback unless
``--debug`` asks for one.

Hostile storage (protocol_spec/THREATS.md): every string that comes from the
store is escaped before it reaches the terminal (:mod:`ckptstore.util.terminal`),
and every message is redacted (:mod:`ckptstore.util.redact`): passwords in URLs and
the values of ``-o`` storage options are never printed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from ..defaults import BUDGET_GPU_HOURS, DEFAULT_GRACE_SECONDS, GPU_HOURS_PER_STEP
from .common import budget_flags, common_flags, debug_flag, storage_flags
from .output import OneLineParser, run_guarded
from .run_commands import cmd_demo, cmd_drill, cmd_promote, cmd_report, cmd_status, cmd_verify_artifact
from .store_commands import cmd_gc, cmd_inspect, cmd_latest, cmd_ls, cmd_sign, cmd_verify


def _add_inspection_commands(sub: Any) -> None:
    """ls, latest, verify, inspect: reading a run's saves."""
    sp = sub.add_parser("ls", help="list every save of a run with its state")
    common_flags(sp)
    sp.add_argument("--deep", action="store_true", help="re-hash every component")
    sp.add_argument("--grace", type=float, default=DEFAULT_GRACE_SECONDS, help="seconds an uncommitted save counts as in progress")
    sp.set_defaults(fn=cmd_ls)

    sp = sub.add_parser("latest", help="the newest complete save, and why newer candidates were skipped")
    common_flags(sp)
    sp.add_argument("--deep", action="store_true", help="re-hash every byte (what a resume checks by default)")
    sp.set_defaults(fn=cmd_latest)

    sp = sub.add_parser("verify", help="re-hash a save (the latest by default); exit 1 on corruption")
    common_flags(sp)
    sp.add_argument("--step", type=int)
    sp.add_argument("--attempt", type=int)
    sp.add_argument("--shallow", action="store_true", help="check sizes only")
    sp.set_defaults(fn=cmd_verify)

    sp = sub.add_parser("inspect", help="a run's identity, attempts and a save's manifest")
    common_flags(sp)
    sp.add_argument("--step", type=int)
    sp.add_argument("--attempt", type=int)
    sp.set_defaults(fn=cmd_inspect)


def _add_maintenance_commands(sub: Any) -> None:
    """gc and sign: commands that write to the store."""
    sp = sub.add_parser("gc", help="delete old, superseded and abandoned saves (dry run unless --apply)")
    common_flags(sp)
    sp.add_argument("--keep-last", type=int, default=2)
    sp.add_argument("--grace", type=float, default=DEFAULT_GRACE_SECONDS, help="never delete an uncommitted save younger than this")
    sp.add_argument("--apply", action="store_true", help="really delete")
    sp.add_argument("--shallow", action="store_true", help="check sizes only (default: re-hash before deleting)")
    sp.add_argument("--tier", choices=["durable", "local"], default="durable",
                    help="which tier to collect (with --local-tier); gc never crosses tiers")
    sp.set_defaults(fn=cmd_gc)

    sp = sub.add_parser("sign", help="sign a run's existing records (after re-hashing every save) with the configured key")
    common_flags(sp)
    sp.set_defaults(fn=cmd_sign)


def _add_run_commands(sub: Any) -> None:
    """demo, drill, report, status: whole runs."""
    sp = sub.add_parser("demo", help="save / crash / resume on a local directory")
    sp.add_argument("--store", default=None, help="store URL (default: a fresh temporary directory)")
    debug_flag(sp)
    sp.set_defaults(fn=cmd_demo)

    sp = sub.add_parser("drill", help="the recovery drill (the default command)")
    sp.add_argument("--store", default=None, help="store URL (default: a fresh temporary directory)")
    sp.add_argument("--out", default="drill-out", help="where the record, JSON, timeline and promoted artifact go")
    sp.add_argument("--steps", type=int, default=120)
    sp.add_argument("--budget-gpu-hours", type=float, default=BUDGET_GPU_HOURS)
    sp.add_argument("--gpu-hours-per-step", type=float, default=GPU_HOURS_PER_STEP)
    sp.add_argument("--mtbi-steps", type=float, default=40.0, help="expected steps between interruptions")
    sp.add_argument("--verbose", action="store_true", help="echo the trainer processes' output")
    sp.add_argument("--storage-option", "-o", action="append", metavar="KEY=VALUE")
    debug_flag(sp)
    sp.set_defaults(fn=cmd_drill)

    sp = sub.add_parser("report", help="the operator record of a run, from the store alone")
    common_flags(sp)
    budget_flags(sp)
    sp.add_argument("--svg", default=None, help="also write the timeline picture here")
    sp.set_defaults(fn=cmd_report)

    sp = sub.add_parser("status", help="one line per run; exit 1 when stale, without a complete save or over budget")
    debug_flag(sp)
    sp.add_argument("url", help="store URL")
    sp.add_argument("runs", nargs="+", metavar="RUN", help="run ID(s)")
    storage_flags(sp)
    budget_flags(sp)
    sp.add_argument("--max-age", default=None, help="alert when the newest complete save is older (90s, 30m, 2h, 1d)")
    sp.add_argument("--prom", default=None, metavar="FILE.prom", help="also write the metrics here (textfile collector)")
    sp.set_defaults(fn=cmd_status)


def _add_promotion_commands(sub: Any) -> None:
    """promote and verify-artifact."""
    sp = sub.add_parser("promote", help="write a finished run's model as a verified serving artifact (or say why not)")
    common_flags(sp)
    budget_flags(sp)
    sp.add_argument("--to", required=True, help="artifact directory (must not exist), or s3:// / gs:// prefix (empty)")
    sp.add_argument("--step", type=int, default=None, help="promote this step instead of the final one (needs --reason)")
    sp.add_argument("--reason", default=None, help="why a step other than the final one (kept in the provenance)")
    sp.add_argument("--max-shard-size", type=float, default=5000.0, metavar="MB",
                    help="shard the weights above this size (default 5000 MB, as Hugging Face)")
    sp.add_argument("--to-option", action="append", metavar="KEY=VALUE", help="storage option of the --to URL")
    sp.add_argument("--register", choices=["mlflow"], default=None,
                    help="after verification, create a model version (needs the 'registry' extra)")
    sp.add_argument("--model-name", default=None, help="registered model name (--register)")
    sp.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: MLFLOW_TRACKING_URI)")
    sp.set_defaults(fn=cmd_promote)

    sp = sub.add_parser("verify-artifact", help="re-hash a promoted artifact; with --store check its save; exit 1 otherwise")
    debug_flag(sp)
    sp.add_argument("dir", help="artifact directory or URL")
    sp.add_argument("--store", default=None, help="store URL of the run the provenance names")
    sp.add_argument("--store-option", action="append", metavar="KEY=VALUE", help="storage option of --store")
    storage_flags(sp)
    sp.set_defaults(fn=cmd_verify_artifact)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="ckptstore",
        description="Crash-consistent training checkpoints. Without a command: a save / crash / resume demonstration.",
    )
    p.add_argument("--debug", action="store_true", help="print the traceback of a failure")
    sub = p.add_subparsers(dest="command")
    _add_inspection_commands(sub)
    _add_maintenance_commands(sub)
    _add_run_commands(sub)
    _add_promotion_commands(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["drill", *(["--debug"] if getattr(args, "debug", False) else [])])
    return run_guarded(args)


if __name__ == "__main__":
    sys.exit(main())
