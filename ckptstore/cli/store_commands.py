"""The commands that read and maintain one run's saves: ``ls``, ``latest``,
``verify``, ``gc``, ``inspect``, ``sign``."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ..store import CheckpointStore, SaveRef
from ..util.redact import redact_text
from .common import human_bytes, open_store, table
from .output import emit, esc


def cmd_sign(args: argparse.Namespace) -> int:
    store = open_store(args, default_policy="warn")
    rep = store.sign()
    obj = {"signed": rep.signed, "already": rep.already, "refused": rep.refused}
    lines = [f"signed {len(rep.signed)} record(s), {len(rep.already)} already authenticated"]
    lines += [f"  not signed: {esc(k)}: {esc(why)}" for k, why in sorted(rep.refused.items())]
    emit(args, obj, "\n".join(lines))
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    store = open_store(args)
    infos = store.list_saves(deep=args.deep, grace_seconds=args.grace)
    rows = [
        [
            "*" if i.selected else "",
            str(i.step),
            str(i.attempt),
            i.state.value,
            human_bytes(i.bytes),
            str(i.components),
            esc(i.save_id),
            esc(i.detail),
        ]
        for i in infos
    ]
    header = ["", "step", "attempt", "state", "size", "parts", "save_id", "detail"]
    if any(i.bytes_written is not None and i.bytes_written != i.bytes_referenced for i in infos):
        # version 3 (pieces): what each save wrote against what it names
        header[4:5] = ["written", "referenced"]
        for row, i in zip(rows, infos, strict=True):
            written = i.bytes_written if i.bytes_written is not None else i.bytes
            row[4:5] = [human_bytes(written), human_bytes(i.bytes_referenced or i.bytes)]
    if store.tiered:  # which tier holds each save: local (not yet durable), durable, both
        header.insert(4, "tier")
        for r, i in zip(rows, infos, strict=True):
            r.insert(4, i.ref.tier if i.ref is not None else "-")
    text = table(rows, header) if rows else "no saves"
    young, stale = store.leftovers(grace_seconds=args.grace)
    if young or stale:
        text += (
            f"\nleft behind by killed writers (temporary files, unfinished uploads): {len(stale)} older than the "
            f"grace period ({args.grace:.0f}s; `gc --apply` removes them), {len(young)} younger (may still be in flight)"
        )
    emit(args, [i.to_json() for i in infos], text)
    return 0


def cmd_latest(args: argparse.Namespace) -> int:
    store = open_store(args)
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
            f"{human_bytes(sel.latest.total_bytes)})" + (f", tier {sel.latest.tier}" if store.tiered else "")
        )
    else:
        lines.append("no complete save")
    for s in sel.skipped:
        lines.append(f"  skipped step {s.step} attempt {s.attempt}: {s.reason.value}: {esc(s.detail)}")
    if sel.more_skipped:
        lines.append(f"  ... and {sel.more_skipped} older skipped candidate(s)")
    lines += [f"note: {esc(n)}" for n in sel.notes]
    emit(args, obj, "\n".join(lines))
    return 0 if sel.latest else 1


def cmd_verify(args: argparse.Namespace) -> int:
    store = open_store(args)
    if args.step is None:
        ref = store.latest_complete(deep=False)
        if ref is None:
            emit(args, {"ok": False, "error": "no complete save"}, "no complete save to verify")
            return 1
    else:
        ref = store.get_save(args.step, args.attempt)
    t0 = time.monotonic()
    rep = _verify_with_progress(store, ref, deep=not args.shallow, quiet=args.json)
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
            f"{human_bytes(ref.total_bytes)} {'re-hashed' if rep.deep else 'sizes checked'} in {took:.2f}s"
        )
    else:
        text = f"CORRUPT: step {ref.step} (save {esc(ref.save_id)}):\n" + "\n".join(
            f"  {r.value}: {esc(d)}" for r, d in rep.problems
        )
    emit(args, obj, text)
    return 0 if rep.ok else 1


def _verify_with_progress(store: CheckpointStore, ref: SaveRef, *, deep: bool, quiet: bool) -> Any:
    """``store.verify``; on a terminal a deep check streams each component
    (verified as read) under a progress bar first, then checks the record."""
    from ..errors import CorruptionError
    from ..util.progress import progress

    with progress(f"verify step {ref.step}", ref.total_bytes, quiet=quiet) as bar:
        if not (deep and bar.enabled):
            return store.verify(ref, deep=deep)
        try:
            for name in sorted(ref.components):
                for chunk in store.iter_read(ref, name):
                    bar.advance(len(chunk))
        except CorruptionError:
            return store.verify(ref, deep=True)  # the authoritative report names every problem
        return store.verify(ref, deep=False)


def cmd_gc(args: argparse.Namespace) -> int:
    from ..util.progress import progress

    store = open_store(args)
    with progress("gc --apply: deleting", 0, quiet=args.json or not args.apply):
        if getattr(args, "tier", "durable") == "local":  # each tier on its own, never across
            rep = store.gc_local(keep_last=args.keep_last, grace_seconds=args.grace, dry_run=not args.apply,
                                 deep=not args.shallow)
        else:
            rep = store.gc(keep_last=args.keep_last, grace_seconds=args.grace, dry_run=not args.apply,
                           deep=not args.shallow)
    obj: dict[str, object] = {
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
    obj["pieces"] = {"freed": rep.pieces_freed, "bytes_freed": rep.piece_bytes_freed, "marked": rep.pieces_marked,
                     "young": rep.pieces_young, "intents_expired": rep.intents_expired, "refused": rep.pieces_refused,
                     "deferred": rep.pieces_deferred,
                     "intent_bytes_read": rep.intent_bytes_read, "sweep_rounds": rep.sweep_rounds}
    if rep.pieces_freed or rep.pieces_marked or rep.pieces_young or rep.pieces_refused:
        lines.append(f"pieces: {verb} {rep.pieces_freed} ({human_bytes(rep.piece_bytes_freed)}); kept "
                     f"{rep.pieces_marked} named by kept commits or live intents, {rep.pieces_young} younger than "
                     f"the grace period; {len(rep.intents_expired)} expired intent(s) removed")
        if rep.pieces_deferred:
            lines.append(f"  only pieces of committed saves swept: {esc(rep.pieces_deferred)}")
        if rep.pieces_refused:
            lines.append(f"  no piece swept: {esc(rep.pieces_refused)}")
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
    emit(args, obj, "\n".join(lines))
    return 1 if rep.refused is not None else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    store = open_store(args)
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
        rows = [[esc(n), human_bytes(c.size), esc(c.blake3[:16]) + "…"] for n, c in sorted(ref.components.items())]
        lines.append(table(rows, ["component", "size", "blake3"]))
    else:
        lines.append("no complete save")
    emit(args, obj, "\n".join(lines))
    return 0
