"""Which provenance fields the store can confirm, and what its records say
they are: one home for promotion (which writes them) and
:func:`~.artifact_check.verify_artifact` (which re-derives and compares them;
protocol_spec/THREATS.md §4.9.3).

The fields of a ``ckptstore.artifact/1`` provenance fall in four groups:

* :data:`SELF_FIELDS` — checked against the artifact's own bytes (every file
  re-hashed, the tensor digest re-derived), and with the store against the
  save's model (``files``: the weights by their tensors, the copied config
  files byte for byte; ``tensors``, ``tensors_digest``, ``source_format``);
* :data:`SAVE_FIELDS` — the save: it must be a complete save of the run with
  that save ID and manifest digest;
* :data:`RECORD_FIELDS` — what the run's records determine: rebuilt from the
  store by :func:`record_fields` (the operator record of :mod:`.report`,
  under the budget parameters the provenance records) and compared field by
  field: the identity and its digest, the lineage, the final step, the
  finish's ``eval_*`` metrics, every attempt's resume point / end / steps,
  interruptions, restarts, and the budget figures;
* :data:`OPERATOR_FIELDS` — the promoter's own word (``reason``,
  ``promoted_at``, ``promoted_on``, the ``store`` URL it read, the budget
  parameters it priced steps with): no store record can confirm them; a
  verification report lists them as unconfirmed, with every field it does
  not know.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..errors import CorruptionError, InvalidInputError
from ..store import CheckpointStore
from .budget import Budget

#: checked against the artifact's bytes (and, with the store, against the save's model)
SELF_FIELDS = ("format", "files", "tensors", "tensors_digest", "source_format")
#: the save the artifact came from
SAVE_FIELDS = ("run_id", "save_id", "step", "attempt", "manifest_digest")
#: re-derived from the run's records (:func:`record_fields`)
RECORD_FIELDS = ("final_step", "identity", "identity_digest", "lineage", "eval_metrics", "attempts",
                 "interruptions", "restarts", "budget")
#: the promoter's word: never confirmed by the store
OPERATOR_FIELDS = ("reason", "promoted_at", "promoted_on", "store", "budget.parameters")
#: the keys of each attempt the provenance carries
ATTEMPT_KEYS = ("attempt", "resumed_from", "ended", "last_step", "executed_steps", "wasted_steps")
#: the budget figures the provenance carries (besides its ``parameters``)
BUDGET_KEYS = ("limit_gpu_hours", "spent_gpu_hours", "wasted_gpu_hours", "remaining_gpu_hours", "stopped")


def final_step(rec: Mapping[str, Any]) -> int | None:
    """The run's last step, from the operator record's confirmed finish (None without one)."""
    final = rec.get("final")
    return int(final["steps"]) - 1 if isinstance(final, Mapping) and type(final.get("steps")) is int else None


def record_fields(store: CheckpointStore, rec: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`RECORD_FIELDS` of the run, from its operator record ``rec``
    (:func:`~.report.build_record`); ``budget.parameters`` is the budget the
    record was built with."""
    final = rec.get("final") or {}
    return {
        "final_step": final_step(rec),
        "identity": rec["identity"],
        "identity_digest": store.identity_digest,
        "lineage": rec.get("lineage"),
        "eval_metrics": {k: v for k, v in sorted(final.items()) if k.startswith("eval_")},
        "attempts": [{k: a.get(k) for k in ATTEMPT_KEYS} for a in rec["attempts"]],
        "interruptions": rec["interruptions"],
        "restarts": rec["restarts"],
        "budget": {"limit_gpu_hours": rec["budget"]["limit_gpu_hours"], "spent_gpu_hours": rec["spent_gpu_hours"],
                   "wasted_gpu_hours": rec["wasted_gpu_hours"],
                   "remaining_gpu_hours": rec["budget_remaining_gpu_hours"], "stopped": rec["budget_stopped"],
                   "parameters": dict(rec["budget"])},
    }


def recorded_budget(doc: Mapping[str, Any], where: str) -> Budget:
    """The budget a provenance says its figures were computed with (its
    ``budget.parameters``; the defaults for an artifact that records none).
    A malformed one is :class:`CorruptionError`."""
    b = doc.get("budget")
    params = b.get("parameters") if isinstance(b, Mapping) else None
    if params is None:
        return Budget()
    names = set(Budget.__dataclass_fields__)
    if not isinstance(params, Mapping) or set(params) != names or not all(
            type(v) in (int, float) for v in params.values()):
        raise CorruptionError(f"{where}: budget.parameters is not a budget (the numbers {sorted(names)})")
    try:
        return Budget(**dict(params))  # as recorded: the figures it yields compare type for type
    except InvalidInputError as exc:
        raise CorruptionError(f"{where}: budget.parameters: {exc}") from None


def same(a: Any, b: Any) -> bool:
    """Equal as JSON, types included (``1`` is not ``1.0`` nor ``true``)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def without_parameters(budget: Any) -> Any:
    """A provenance's ``budget`` figures without the parameters (which are the promoter's word)."""
    return {k: v for k, v in budget.items() if k != "parameters"} if isinstance(budget, Mapping) else budget


def shown(v: Any, n: int = 160) -> str:
    """A value for a message: its JSON, cut to ``n`` characters."""
    text = json.dumps(v, sort_keys=True, default=str)
    return text if len(text) <= n else text[: n - 1] + "…"
