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
import json
import sys
import time
from collections.abc import Sequence

from ..defaults import BUDGET_GPU_HOURS, DEFAULT_GRACE_SECONDS, GPU_HOURS_PER_STEP, RESTART_GPU_HOURS
from ..errors import ExtraRequiredError
from ..ops.budget import MIN_STEP_SECONDS
from ..store import CheckpointStore, SaveRef
from ..util.redact import redact_text
from ..util.terminal import sanitize
from .output import OneLineParser, emit, esc, parse_options, run_guarded

_parse_options = parse_options
_emit = emit


def _human_bytes(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def _open(args: argparse.Namespace, *, default_policy: str = "off") -> CheckpointStore:
    from ..core.record_auth import load_keyring

    key_file = getattr(args, "auth_key_file", None)
    policy = getattr(args, "auth_policy", None) or ("warn" if key_file and default_policy == "off" else default_policy)
    keyring = load_keyring(key_file=key_file) if policy != "off" else None
    return CheckpointStore.open(
        args.url, args.run, mode="r", storage_options=_parse_options(getattr(args, "storage_option", None)),
        auth_policy=policy, keyring=keyring, local_tier=getattr(args, "local_tier", None),
    )


def cmd_sign(args: argparse.Namespace) -> int:
    store = _open(args, default_policy="warn")
    rep = store.sign()
    obj = {"signed": rep.signed, "already": rep.already, "refused": rep.refused}
    lines = [f"signed {len(rep.signed)} record(s), {len(rep.already)} already authenticated"]
    lines += [f"  not signed: {esc(k)}: {esc(why)}" for k, why in sorted(rep.refused.items())]
    _emit(args, obj, "\n".join(lines))
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    store = _open(args)
    infos = store.list_saves(deep=args.deep, grace_seconds=args.grace)
    rows = [
        [
            "*" if i.selected else "",
            str(i.step),
            str(i.attempt),
            i.state.value,
            _human_bytes(i.bytes),
            str(i.components),
            esc(i.save_id),
            esc(i.detail),
        ]
        for i in infos
    ]
    header = ["", "step", "attempt", "state", "size", "parts", "save_id", "detail"]
    if store.tiered:  # which tier holds each save: local (not yet durable), durable, both
        header.insert(4, "tier")
        for r, i in zip(rows, infos, strict=True):
            r.insert(4, i.ref.tier if i.ref is not None else "-")
    text = _table(rows, header) if rows else "no saves"
    young, stale = store.leftovers(grace_seconds=args.grace)
    if young or stale:
        text += (
            f"\nleft behind by killed writers (temporary files, unfinished uploads): {len(stale)} older than the "
            f"grace period ({args.grace:.0f}s; `gc --apply` removes them), {len(young)} younger (may still be in flight)"
        )
    _emit(args, [i.to_json() for i in infos], text)
    return 0


def cmd_latest(args: argparse.Namespace) -> int:
    store = _open(args)
    sel = store.latest_complete(deep=args.deep, explain=True)
    obj = {
        "latest": sel.latest.to_json(detail=True) if sel.latest else None,
        "check": "deep" if args.deep else "size",
        "skipped": [s.to_json() for s in sel.skipped],
        "more_skipped": sel.more_skipped,
        "notes": list(sel.notes),
    }
    lines = [
        "checked: every byte re-hashed (deep)" if args.deep
        else "checked: records and component sizes only (`--deep` re-hashes every byte, as a resume does)"
    ]
    if sel.latest:
        lines.append(
            f"latest complete: step {sel.latest.step} (attempt {sel.latest.attempt}, save {esc(sel.latest.save_id)}, "
            f"{_human_bytes(sel.latest.total_bytes)})" + (f", tier {sel.latest.tier}" if store.tiered else "")
        )
    else:
        lines.append("no complete save")
    for s in sel.skipped:
        lines.append(f"  skipped step {s.step} attempt {s.attempt}: {s.reason.value}: {esc(s.detail)}")
    if sel.more_skipped:
        lines.append(f"  ... and {sel.more_skipped} older skipped candidate(s)")
    lines += [f"note: {esc(n)}" for n in sel.notes]
    _emit(args, obj, "\n".join(lines))
    return 0 if sel.latest else 1


def cmd_verify(args: argparse.Namespace) -> int:
    store = _open(args)
    if args.step is None:
        ref = store.latest_complete(deep=False)
        if ref is None:
            _emit(args, {"ok": False, "error": "no complete save"}, "no complete save to verify")
            return 1
    else:
        ref = store.get_save(args.step, args.attempt)
    t0 = time.monotonic()
    rep = store.verify(ref, deep=not args.shallow)
    took = time.monotonic() - t0
    obj = {
        "ok": rep.ok,
        "step": ref.step,
        "attempt": ref.attempt,
        "save_id": ref.save_id,
        "deep": rep.deep,
        "seconds": round(took, 3),
        "problems": [{"reason": r.value, "detail": d} for r, d in rep.problems],
    }
    if rep.ok:
        text = (
            f"OK: step {ref.step} (save {esc(ref.save_id)}): {len(ref.components)} component(s), "
            f"{_human_bytes(ref.total_bytes)} {'re-hashed' if rep.deep else 'sizes checked'} in {took:.2f}s"
        )
    else:
        text = f"CORRUPT: step {ref.step} (save {esc(ref.save_id)}):\n" + "\n".join(
            f"  {r.value}: {esc(d)}" for r, d in rep.problems
        )
    _emit(args, obj, text)
    return 0 if rep.ok else 1


def cmd_gc(args: argparse.Namespace) -> int:
    store = _open(args)
    if getattr(args, "tier", "durable") == "local":  # each tier on its own, never across
        rep = store.gc_local(keep_last=args.keep_last, grace_seconds=args.grace, dry_run=not args.apply,
                             deep=not args.shallow)
    else:
        rep = store.gc(keep_last=args.keep_last, grace_seconds=args.grace, dry_run=not args.apply,
                       deep=not args.shallow)
    obj = {
        "dry_run": rep.dry_run,
        "refused": rep.refused,
        "kept": rep.kept,
        "deleted_saves": [{"save_id": s, "reason": r} for s, r in rep.deleted_saves],
        "deleted_objects": [a.key for a in rep.actions],
        "temporaries": rep.temporaries,
    }
    verb = "would delete" if rep.dry_run else "deleted"
    lines = [(f"{verb} {len(rep.deleted_saves)} save(s), {len(rep.actions)} object(s), "
              f"{len(rep.temporaries)} stray temporary file(s); kept {len(rep.kept)}")]
    lines += [f"  {esc(s)}: {esc(r)}" for s, r in rep.deleted_saves]
    obj["ignored"] = rep.ignored
    if rep.ignored:
        lines.append(f"left alone {len(rep.ignored)} key(s) under saves/ that are not ckptstore's (inspect; remove by hand):")
        lines += [f"  {esc(k)}" for k in rep.ignored[:20]]
        if len(rep.ignored) > 20:
            lines.append(f"  ... and {len(rep.ignored) - 20} more")
    if rep.dry_run and rep.actions:
        lines.append("dry run: pass --apply to delete")
    if rep.refused is not None:
        # a refusal is a failed gc, never a silent success: the reason on stdout (and --json), exit 1
        lines = [f"gc refused: deleted nothing: {esc(rep.refused)}"]
    _emit(args, obj, "\n".join(lines))
    return 1 if rep.refused is not None else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    store = _open(args)
    run = store.run_record
    attempts = store.attempts()
    if args.step is not None:
        ref: SaveRef | None = store.get_save(args.step, args.attempt)
    else:
        ref = store.latest_complete()
    obj = {
        "run_id": store.run_id,
        "url": redact_text(store.backend.url),
        "identity": run["identity"],
        "identity_digest": store.identity_digest,
        "lineage": run.get("lineage"),
        "created_at": run.get("created_at"),
        "attempts": [a.to_record() for a in attempts],
        "save": ref.to_json(detail=True) if ref else None,
    }
    lines = [f"run {esc(store.run_id)} at {esc(redact_text(store.backend.url))}", "identity:"]
    lines += [f"  {esc(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(run["identity"].items())]
    if run.get("lineage"):
        lines.append(f"lineage: {json.dumps(run['lineage'], sort_keys=True)}")
    lines.append(f"attempts: {len(attempts)}")
    for a in attempts:
        start = "scratch" if a.resumed_from is None else f"step {a.resumed_from}"
        lines.append(f"  #{a.number} resumed from {start} on {esc(a.host or '?')}")
    if ref:
        lines.append(f"save step {ref.step} attempt {ref.attempt} ({esc(ref.save_id)}), "
                     f"manifest {esc(ref.manifest_digest[:16])}…")
        rows = [[esc(n), _human_bytes(c.size), esc(c.blake3[:16]) + "…"] for n, c in sorted(ref.components.items())]
        lines.append(_table(rows, ["component", "size", "blake3"]))
    else:
        lines.append("no complete save")
    _emit(args, obj, "\n".join(lines))
    return 0


def _require(what: str, extra: str, *modules: str) -> None:
    """One line naming the extra to install, instead of a traceback."""
    import importlib.util

    for m in modules:
        if importlib.util.find_spec(m) is None:
            raise ExtraRequiredError(what, extra, m)


def cmd_drill(args: argparse.Namespace) -> int:
    _require("the recovery drill", "runs", "numpy", "torch", "safetensors")
    from ..ops.drill.drill import DrillConfig, run_drill

    cfg = DrillConfig(
        store=args.store,
        out_dir=args.out,
        steps=args.steps,
        budget_gpu_hours=args.budget_gpu_hours,
        gpu_hours_per_step=args.gpu_hours_per_step,
        mtbi_steps=args.mtbi_steps,
        verbose=args.verbose,
        storage_options=_parse_options(args.storage_option),
    )
    return run_drill(cfg)


def cmd_report(args: argparse.Namespace) -> int:
    from ..ops.budget import Budget
    from ..ops.report import build_record, render_table, render_timeline_svg

    store = _open(args)
    rec = build_record(store, Budget(args.budget_gpu_hours, args.gpu_hours_per_step, args.restart_gpu_hours,
                                     min_step_seconds=args.min_step_seconds))
    if args.svg:
        with open(args.svg, "w") as f:
            f.write(render_timeline_svg(rec))
    _emit(args, rec, render_table(sanitize(rec)))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ..ops.demo import run_demo

    return run_demo(args.store)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="ckptstore",
        description="Crash-consistent training checkpoints. Without a command: a save / crash / resume demonstration.",
    )
    p.add_argument("--debug", action="store_true", help="print the traceback of a failure")
    sub = p.add_subparsers(dest="command")

    def debug_flag(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="print the traceback of a failure")

    def common(sp: argparse.ArgumentParser) -> None:
        debug_flag(sp)
        sp.add_argument("url", help="store URL: a directory, file://, memory://, s3://bucket/prefix, gs://bucket/prefix")
        sp.add_argument("run", help="run ID")
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        sp.add_argument(
            "--storage-option", "-o", action="append", metavar="KEY=VALUE", help="fsspec storage option (repeatable)"
        )
        sp.add_argument(
            "--auth-policy", choices=["off", "warn", "require"], default=None,
            help="authenticated records: off (default), warn, require (keys: --auth-key-file or CKPTSTORE_AUTH_KEYS)",
        )
        sp.add_argument("--auth-key-file", default=None, help='key file {"active": ID, "keys": {ID: HEX}}, mode 600')
        sp.add_argument("--local-tier", default=None, metavar="DIR",
                        help="the run's local tier on this machine: show both tiers (docs/tiers.md)")

    sp = sub.add_parser("ls", help="list every save of a run with its state")
    common(sp)
    sp.add_argument("--deep", action="store_true", help="re-hash every component")
    sp.add_argument("--grace", type=float, default=DEFAULT_GRACE_SECONDS, help="seconds an uncommitted save counts as in progress")
    sp.set_defaults(fn=cmd_ls)

    sp = sub.add_parser("latest", help="the newest complete save, and why newer candidates were skipped")
    common(sp)
    sp.add_argument("--deep", action="store_true", help="re-hash every byte (what a resume checks by default)")
    sp.set_defaults(fn=cmd_latest)

    sp = sub.add_parser("verify", help="re-hash a save (the latest by default); exit 1 on corruption")
    common(sp)
    sp.add_argument("--step", type=int)
    sp.add_argument("--attempt", type=int)
    sp.add_argument("--shallow", action="store_true", help="check sizes only")
    sp.set_defaults(fn=cmd_verify)

    sp = sub.add_parser("gc", help="delete old, superseded and abandoned saves (dry run unless --apply)")
    common(sp)
    sp.add_argument("--keep-last", type=int, default=2)
    sp.add_argument("--grace", type=float, default=DEFAULT_GRACE_SECONDS, help="never delete an uncommitted save younger than this")
    sp.add_argument("--apply", action="store_true", help="really delete")
    sp.add_argument("--shallow", action="store_true", help="check sizes only (default: re-hash before deleting)")
    sp.add_argument("--tier", choices=["durable", "local"], default="durable",
                    help="which tier to collect (with --local-tier); gc never crosses tiers")
    sp.set_defaults(fn=cmd_gc)

    sp = sub.add_parser("inspect", help="a run's identity, attempts and a save's manifest")
    common(sp)
    sp.add_argument("--step", type=int)
    sp.add_argument("--attempt", type=int)
    sp.set_defaults(fn=cmd_inspect)

    sp = sub.add_parser("sign", help="sign a run's existing records (after re-hashing every save) with the configured key")
    common(sp)
    sp.set_defaults(fn=cmd_sign)

    sp = sub.add_parser("demo", help="save / crash / resume on a local directory")
    sp.add_argument("--store", default=None, help="store URL (default: a fresh temporary directory)")
    debug_flag(sp)
    sp.set_defaults(fn=cmd_demo)

    sp = sub.add_parser("drill", help="the recovery drill (the default command)")
    sp.add_argument("--store", default=None, help="store URL (default: a fresh temporary directory)")
    sp.add_argument("--out", default="drill-out", help="where the record, JSON and timeline go")
    sp.add_argument("--steps", type=int, default=120)
    sp.add_argument("--budget-gpu-hours", type=float, default=BUDGET_GPU_HOURS)
    sp.add_argument("--gpu-hours-per-step", type=float, default=GPU_HOURS_PER_STEP)
    sp.add_argument("--mtbi-steps", type=float, default=40.0, help="expected steps between interruptions")
    sp.add_argument("--verbose", action="store_true", help="echo the trainer processes' output")
    sp.add_argument("--storage-option", "-o", action="append", metavar="KEY=VALUE")
    debug_flag(sp)
    sp.set_defaults(fn=cmd_drill)

    sp = sub.add_parser("report", help="the operator record of a run, from the store alone")
    common(sp)
    sp.add_argument("--budget-gpu-hours", type=float, default=BUDGET_GPU_HOURS)
    sp.add_argument("--gpu-hours-per-step", type=float, default=GPU_HOURS_PER_STEP)
    sp.add_argument("--restart-gpu-hours", type=float, default=RESTART_GPU_HOURS)
    sp.add_argument("--min-step-seconds", type=float, default=MIN_STEP_SECONDS,
                    help="the shortest time a step can take: progress claimed faster than this is not believed")
    sp.add_argument("--svg", default=None, help="also write the timeline picture here")
    sp.set_defaults(fn=cmd_report)
    return p




def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["drill", *(["--debug"] if getattr(args, "debug", False) else [])])
    return run_guarded(args)


if __name__ == "__main__":
    sys.exit(main())
