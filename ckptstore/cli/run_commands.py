"""The commands about a whole run: ``drill``, ``report``, ``promote``,
``verify-artifact``, ``status``, ``demo``."""

from __future__ import annotations

import argparse

from ..errors import CkptStoreError
from ..options import AuthOptions, OpenOptions
from ..store import CheckpointStore
from ..util.redact import redact_text
from ..util.terminal import sanitize
from .common import budget_from_args, check_output_file, human_bytes, open_store, read_only_backend, require_extra
from .output import emit, esc, parse_options


def cmd_drill(args: argparse.Namespace) -> int:
    require_extra("the recovery drill", "runs", "numpy", "torch", "safetensors")
    from ..ops.drill.drill import DrillConfig, run_drill

    cfg = DrillConfig(
        store=args.store,
        out_dir=args.out,
        steps=args.steps,
        budget_gpu_hours=args.budget_gpu_hours,
        gpu_hours_per_step=args.gpu_hours_per_step,
        mtbi_steps=args.mtbi_steps,
        verbose=args.verbose,
        storage_options=parse_options(args.storage_option),
    )
    return run_drill(cfg)


def cmd_report(args: argparse.Namespace) -> int:
    from ..ops.report import build_record, render_table, render_timeline_svg

    store = open_store(args)
    rec = build_record(store, budget_from_args(args))
    if args.svg:
        with open(args.svg, "w") as f:
            f.write(render_timeline_svg(rec))
    emit(args, rec, render_table(sanitize(rec)))
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    require_extra("promotion", "torch", "torch", "safetensors")
    from ..errors import PromotionRefusedError
    from ..ops.promote import promote, promotion_check
    from ..util.progress import progress

    register = None
    if args.register == "mlflow":
        from ..ops.registry import mlflow_registrar

        register = mlflow_registrar(args.model_name, tracking_uri=args.tracking_uri)
    store = open_store(args)
    check = promotion_check(store, budget=budget_from_args(args), step=args.step, reason=args.reason)
    if not check.promotable:
        obj = {"promoted": False, **check.to_json()}
        text = f"REFUSED: run {esc(store.run_id)} is not promotable:\n" + "\n".join(
            f"  - {esc(r)}" for r in check.reasons)
        emit(args, obj, text)
        return 1
    # the bar's scale: the stored model bytes where they are one component (else an activity line)
    comp = check.ref.components.get("model.safetensors") if check.ref else None
    total = comp.size if comp is not None else 0
    try:
        with progress(f"promote step {check.ref.step if check.ref else '?'}", total, quiet=args.json) as bar:
            result = promote(store, args.to, step=args.step, reason=args.reason, check=check,
                             max_shard_bytes=int(args.max_shard_size * 1e6), register=register,
                             storage_options=parse_options(args.to_option),
                             on_tensor=lambda t: bar.advance(t.nbytes))
    except PromotionRefusedError as exc:  # a race: the run changed between the check and the write
        emit(args, {"promoted": False, "reasons": exc.reasons}, f"REFUSED: {esc(str(exc))}")
        return 1
    lines = [f"promoted run {esc(store.run_id)} step {result.ref.step} (save {esc(result.ref.save_id)}, manifest "
             f"{result.ref.manifest_digest[:16]}…) to {esc(redact_text(result.location))} in {result.seconds:.2f}s"]
    lines += [f"  {esc(n)}  {human_bytes(f['size'])}  blake3 {f['blake3'][:16]}…" for n, f in sorted(result.files.items())]
    lines.append("  provenance.json" + ("  (signed with the run's key)" if result.provenance.get("auth") else ""))
    lines.append("verified: every file re-hashed; the save is complete, verifies and holds exactly these tensors")
    if result.registered:
        lines.append(f"registered: {esc(str(result.registered.get('model')))} version "
                     f"{esc(str(result.registered.get('version')))}")
    emit(args, result.to_json(), "\n".join(lines))
    return 0


def cmd_verify_artifact(args: argparse.Namespace) -> int:
    require_extra("artifact verification", "torch", "torch", "safetensors")
    from .. import keyring_from_env, keyring_from_file
    from ..ops.artifact_check import read_provenance, verify_artifact
    from ..util.progress import progress

    opts = parse_options(args.storage_option)
    store = None
    policy = args.auth_policy or ("warn" if args.auth_key_file else "off")
    keyring = (keyring_from_file(args.auth_key_file) if args.auth_key_file else keyring_from_env()) if policy != "off" else None
    if args.store:
        try:
            run_id = str(read_provenance(args.dir, opts)["run_id"])
        except CkptStoreError as exc:
            emit(args, {"ok": False, "problems": [str(exc)]}, f"ARTIFACT INVALID: {esc(str(exc))}")
            return 1
        store = CheckpointStore.open(read_only_backend(args.store, parse_options(args.store_option)), run_id,
                                     mode="r", options=OpenOptions(auth=AuthOptions(policy, keyring)))
    with progress("verify artifact", 0, quiet=args.json) as bar:
        rep = verify_artifact(args.dir, store=store, keyring=keyring, require_auth=policy == "require",
                              storage_options=opts, on_file=lambda name, n: bar.advance(n, label=name))
    p = rep.provenance or {}
    if rep.ok:
        text = (f"ARTIFACT OK: run {esc(str(p.get('run_id')))} step {p.get('step')} (save {esc(str(p.get('save_id')))})"
                f": {len(p.get('files', {}))} file(s) re-hashed"
                + ("; the store's save is complete, verifies and holds exactly these tensors" if rep.checked_store
                   else " (pass --store URL to check them against the save)")
                + ("; provenance authenticated" if rep.authenticated else ""))
        if rep.confirmed:
            text += "\n  confirmed by the store's records: " + ", ".join(rep.confirmed)
        if rep.unconfirmed:
            text += ("\n  unconfirmed (the provenance's word only" + ("" if rep.checked_store else "; pass --store")
                     + "): " + esc(", ".join(rep.unconfirmed)))
    else:
        text = "ARTIFACT INVALID:\n" + "\n".join(f"  - {esc(x)}" for x in rep.problems)
    emit(args, rep.to_json(), text)
    return 0 if rep.ok else 1


def cmd_status(args: argparse.Namespace) -> int:
    from ..ops.status import parse_age, run_status, status_samples
    from ..util.prometheus import write_textfile

    check_output_file(args.prom, "--prom", ".prom")  # before any store is read: one line, never an OSError
    max_age = parse_age(args.max_age) if args.max_age else None
    budget = budget_from_args(args)
    out, samples, lines, ok = [], [], [], True
    for run in args.runs:
        args.run = run
        st = run_status(open_store(args), max_age=max_age, budget=budget)
        out.append(st.to_json())
        samples += status_samples(st)
        lines.append(esc(st.line()))
        ok = ok and st.ok
    if args.prom:
        write_textfile(args.prom, samples)
    emit(args, out, "\n".join(lines))
    return 0 if ok else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from ..ops.demo import run_demo

    return run_demo(args.store)
