"""Promotion: from a finished run to a serving artifact linked to its verified manifest.

    from ckptstore.ops.promote import promote
    result = promote(store, "/models/receipts-v4")          # PromotionRefusedError with every reason

:func:`promotion_check` decides, from the operator record
(:func:`~ckptstore.ops.report.build_record`, the store alone), whether a save
may be promoted, and lists *every* reason it may not:

* ``budget-stopped`` — training ended before its last step because the budget was spent;
* ``not finished`` — no attempt completed the run;
* no complete save, or the final save does not verify (every byte re-hashed),
  or it is not the save the finish names;
* ``unconfirmed`` — the finish rests on an unauthenticated claim (no ``planned_steps``);
* ``identity change refused`` — the ledger records an attempt refused for a changed identity
  under this run ID (``identity-refused`` events);
* unauthenticated records under ``auth_policy="require"``;
* a step that is not the run's final one, unless ``step=`` names it and ``reason=`` says why
  (the reason is written into the provenance);
* the save's model weights cannot be read and parsed (read here, verified, as
  :func:`promote` would: a save whose record was rewritten to match damaged
  bytes verifies, yet holds no readable model — THREATS.md §4.14).

:func:`promote` then writes the artifact (:mod:`ckptstore.ops.artifact`),
verifies it against the store, and only then returns (and registers it, when
asked: :mod:`ckptstore.ops.registry`). Nothing is written to the store.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CkptStoreError, CorruptionError, NotFoundError, PromotionRefusedError
from ..protocol.auth import AuthPolicy
from ..protocol.selection import SaveRef
from ..store import CheckpointStore
from ..util.redact import redact_url
from .artifact import DEFAULT_SHARD_BYTES, sink_for, write_artifact
from .artifact_check import ArtifactReport, verify_artifact
from .budget import Budget
from .provenance import final_step, record_fields
from .report import build_record
from .weights import ModelSource, TensorSource, model_source

#: ledger event a trainer records when it refuses to resume under a changed identity
IDENTITY_REFUSED = "identity-refused"
#: the reasons of the operator record that concern only the final step (lifted by ``step=`` + ``reason=``)
_FINAL_ONLY = ("the newest complete save is step", "the final artifact is not linked")


@dataclass
class PromotionCheck:
    """The outcome of :func:`promotion_check`: ``ref`` is the save that would be promoted."""

    run_id: str
    ref: SaveRef | None
    reasons: list[str]
    record: dict[str, Any] | None
    final_step: int | None = None
    #: the model weights of ``ref``, read and parsed by the check (:func:`promote` writes these)
    source: ModelSource | None = field(default=None, repr=False)

    @property
    def promotable(self) -> bool:
        return not self.reasons and self.ref is not None

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "promotable": self.promotable, "reasons": self.reasons,
                "final_step": self.final_step, "save": self.ref.to_json() if self.ref else None}


@dataclass
class Promotion:
    """A published, verified artifact."""

    location: str
    ref: SaveRef
    files: dict[str, dict[str, Any]]
    provenance: dict[str, Any]
    verified: ArtifactReport
    registered: dict[str, Any] | None = None
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"promoted": True, "location": redact_url(self.location), "run_id": self.ref.run_id,
                "step": self.ref.step, "attempt": self.ref.attempt, "save_id": self.ref.save_id,
                "manifest_digest": self.ref.manifest_digest, "files": self.files,
                "verified": self.verified.ok, "registered": self.registered, "seconds": round(self.seconds, 3)}


def promotion_check(
    store: CheckpointStore, *, budget: Budget | None = None, step: int | None = None, reason: str | None = None
) -> PromotionCheck:
    """Every reason the run's save (its final one, or ``step``) may not be promoted; none if it may."""
    reasons: list[str] = []
    try:
        rec = build_record(store, budget, deep=True)
    except CkptStoreError as exc:
        if store.auth_policy is AuthPolicy.REQUIRE:
            return PromotionCheck(store.run_id, None, [f"unauthenticated records under auth_policy=require: {exc}"],
                                  None)
        raise
    last_step = final_step(rec)
    p = rec["promotion"]
    if not p["eligible"]:
        reasons += [r for r in p["reasons"] if step is None or not r.startswith(_FINAL_ONLY)]
    for sk in rec.get("skipped_newer_candidates", []):
        reasons.append(f"a newer save is not complete or does not verify: step {sk.get('step')} attempt "
                       f"{sk.get('attempt')}: {sk.get('reason')}: {str(sk.get('detail', ''))[:200]}")
    for rj in rec.get("rejected_events", []):
        if rj.get("event") == "finished":
            reasons.append(f"the finish claim was not confirmed by the records: {str(rj.get('reason'))[:200]}")
    reasons += _identity_refusals(store)
    if store.auth_policy is AuthPolicy.REQUIRE:
        rejected = [r for r in rec.get("rejected_events", []) if "authenticat" in str(r.get("reason", ""))]
        if rejected:
            reasons.append(f"unauthenticated records under auth_policy=require: {len(rejected)} ledger event(s)")
    ref: SaveRef | None = None
    lc = rec.get("last_valid_checkpoint")
    if step is None:
        if lc is not None:
            ref = store.get_save(int(lc["step"]), int(lc["attempt"]))
    else:
        try:
            ref = store.get_save(step)
        except (NotFoundError, CkptStoreError) as exc:
            reasons.append(f"step {step}: no complete save ({exc})")
        if ref is not None:
            if step != last_step and not (reason and reason.strip()):
                reasons.append(f"step {step} is not the run's final step ({last_step}): say why with a reason "
                               "(it is recorded in the provenance)")
            if lc is None or (ref.step, ref.attempt) != (lc["step"], lc["attempt"]):
                vr = store.verify(ref, deep=True)
                if not vr.ok:
                    reasons.append(f"step {step} does not verify: " + "; ".join(d for _, d in vr.problems))
    source: ModelSource | None = None
    if ref is not None:
        # what promote reads, read now: a refusal with the reason, never a CorruptionError halfway through promote
        try:
            source = model_source(store, ref)
        except CkptStoreError as exc:
            reasons.append(f"step {ref.step}: its model weights cannot be read: {str(exc)[:400]}")
    return PromotionCheck(store.run_id, ref, reasons, rec, last_step, source)


def _identity_refusals(store: CheckpointStore) -> list[str]:
    """Refused identity changes in the ledger. Raw claims are enough here: a
    forged refusal can only make promotion refuse (fail closed)."""
    out = []
    for e in store.events():
        if e.get("event") == IDENTITY_REFUSED:
            fields = e.get("payload", {}).get("fields")
            shown = ", ".join(str(f)[:40] for f in fields[:8]) if isinstance(fields, list) else "?"
            out.append(f"identity change refused in the run's history (attempt at {e.get('at')}: {shown}); "
                       "a changed experiment must be a new run")
    return out


def provenance_of(store: CheckpointStore, check: PromotionCheck, *, reason: str | None = None) -> dict[str, Any]:
    """The provenance fields that come from the run: IDs, identity, eval metrics, attempts, budget line
    (:func:`~.provenance.record_fields`, the fields verification re-derives from the store)."""
    assert check.ref is not None and check.record is not None
    ref = check.ref
    return {
        "run_id": store.run_id,
        "save_id": ref.save_id,
        "step": ref.step,
        "attempt": ref.attempt,
        "manifest_digest": ref.manifest_digest,
        **record_fields(store, check.record),
        "store": redact_url(store.backend.url),
        "reason": reason,
        "promoted_at": round(time.time(), 3),
        "promoted_on": platform.node()[:200],
    }


def promote(
    store: CheckpointStore,
    to: str,
    *,
    step: int | None = None,
    reason: str | None = None,
    budget: Budget | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    storage_options: Mapping[str, Any] | None = None,
    register: Callable[[Promotion], dict[str, Any]] | None = None,
    on_tensor: Callable[[TensorSource], None] | None = None,
    check: PromotionCheck | None = None,
) -> Promotion:
    """Check, write, verify (and register). Raises :class:`PromotionRefusedError`
    with every reason when the run is not promotable (nothing written), and
    :class:`~ckptstore.CorruptionError` when the written artifact does not
    verify against the store, or a local one is not the directory it created
    (left in place, named in the message, for inspection). A local target's
    temporary directory replaced while the artifact is written is
    :class:`~ckptstore.InvalidInputError` and nothing is published
    (:mod:`.artifact_dir`)."""
    t0 = time.monotonic()
    check = check or promotion_check(store, budget=budget, step=step, reason=reason)
    if not check.promotable:
        raise PromotionRefusedError(store.run_id, check.reasons or ["no complete save"])
    assert check.ref is not None
    source = check.source if check.source is not None else model_source(store, check.ref)
    keyring = store.auth.keyring if store.auth_policy is not AuthPolicy.OFF else None
    sink = sink_for(to, storage_options)
    written = write_artifact(source, sink, provenance_of(store, check, reason=reason), run_id=store.run_id,
                     keyring=keyring, max_shard_bytes=max_shard_bytes, on_tensor=on_tensor)
    rep = verify_artifact(written.location, store=store, keyring=keyring,
                          require_auth=store.auth_policy is AuthPolicy.REQUIRE, storage_options=storage_options)
    if not rep.ok:
        raise CorruptionError(f"the artifact written at {redact_url(written.location)} does not verify: "
                              + "; ".join(rep.problems))
    if sink.published_id is not None and rep.directory_id != sink.published_id:
        raise CorruptionError(f"{written.location} is no longer the directory this promotion published (it was "
                              "replaced after the rename): the artifact there was not written by it; remove it and "
                              "promote into a directory only you can write")
    out = Promotion(written.location, check.ref, written.files, written.provenance, rep)
    if register is not None:
        out.registered = register(out)  # only after the artifact verified
    out.seconds = time.monotonic() - t0
    return out
