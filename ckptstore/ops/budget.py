"""Interruptions are not free: accounting of steps, GPU-hours and cost.

Pure functions over the run's ledger (attempt records and events), so the
operator record can be rebuilt by a fresh process from the store alone.

Ledger events the accounting reads (written by the Checkpointer / trainer):

* ``start`` / ``resume``  — an attempt began (``resumed_from``)
* ``progress``            — ``{"step": k}``: step ``k`` finished in this attempt
* ``first-step``          — ``{"seconds": s}``: time from process start to the first useful step
* ``save``                — ``{"step", "seconds", "bytes", "save_id"}``: a save committed
* ``preempted``, ``budget-exhausted``, ``finished`` — how an attempt ended

An attempt that ends without ``finished``, ``preempted`` or
``budget-exhausted`` was interrupted (killed). Work it did past the step the
next attempt resumed from is *wasted*: it is paid for and done again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..defaults import BUDGET_GPU_HOURS, GPU_HOURS_PER_STEP, RESTART_GPU_HOURS
from ..errors import InvalidInputError
from ..protocol.records import AttemptRecord

#: The fastest optimizer step the accounting believes by default (seconds): a
#: physical floor, not a measurement. Declare the real one
#: (``Budget.min_step_seconds``, ``report --min-step-seconds``) for a tight bound.
MIN_STEP_SECONDS = 1e-3


@dataclass(frozen=True)
class Budget:
    """A declared compute budget and how steps are priced.

    ``gpu_hours_per_step`` prices one optimizer step (measured from the pilot,
    or declared); ``restart_gpu_hours`` is the accelerator time a restart
    costs before the first useful step (start-up, loading); prices are per
    GPU-hour. ``min_step_seconds`` is the shortest wall-clock time one step
    can take: a progress claim of more steps than the time since its attempt
    registered allows at that pace is not believed (THREATS.md §4.9).
    """

    limit_gpu_hours: float = BUDGET_GPU_HOURS
    gpu_hours_per_step: float = GPU_HOURS_PER_STEP
    restart_gpu_hours: float = RESTART_GPU_HOURS
    price_per_gpu_hour: float = 1.0
    ordinary_price_per_gpu_hour: float = 2.0
    storage_price_per_gb_month: float = 0.02
    transfer_price_per_gb: float = 0.0
    min_step_seconds: float = MIN_STEP_SECONDS

    def __post_init__(self) -> None:
        for k in ("limit_gpu_hours", "gpu_hours_per_step", "min_step_seconds"):
            if getattr(self, k) <= 0:
                raise InvalidInputError(f"budget {k} must be positive")
        for k in ("restart_gpu_hours", "price_per_gpu_hour", "ordinary_price_per_gpu_hour",
                  "storage_price_per_gb_month", "transfer_price_per_gb"):
            if getattr(self, k) < 0:
                raise InvalidInputError(f"budget {k} must be >= 0")

    def to_json(self) -> dict[str, float]:
        return dict(self.__dict__)

    def projected_gpu_hours(self, steps: int, expected_restarts: float = 0.0, waste_fraction: float = 0.0) -> float:
        return steps * self.gpu_hours_per_step * (1 + waste_fraction) + expected_restarts * self.restart_gpu_hours

    def admit(self, steps: int, expected_restarts: float = 0.0, waste_fraction: float = 0.0) -> tuple[bool, float]:
        """Admission: may a request for ``steps`` start? (projected cost within the limit)."""
        proj = self.projected_gpu_hours(steps, expected_restarts, waste_fraction)
        return proj <= self.limit_gpu_hours, proj


@dataclass
class AttemptAccount:
    attempt: int
    resumed_from: int | None
    started_at: float | None
    last_step: int | None = None
    last_progress_at: float | None = None
    executed_steps: int = 0
    wasted_steps: int = 0
    ended: str = "interrupted"  # finished | preempted | budget-exhausted | interrupted | running
    first_step_seconds: float | None = None
    saves: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Accounting:
    attempts: list[AttemptAccount]
    executed_steps: int
    wasted_steps: int
    accepted_steps: int
    restarts: int
    interruptions: int
    spent_gpu_hours: float
    wasted_gpu_hours: float
    budget: Budget

    def to_json(self) -> dict[str, Any]:
        return {
            "attempts": [a.to_json() for a in self.attempts],
            "executed_steps": self.executed_steps,
            "wasted_steps": self.wasted_steps,
            "accepted_steps": self.accepted_steps,
            "restarts": self.restarts,
            "interruptions": self.interruptions,
            "spent_gpu_hours": round(self.spent_gpu_hours, 6),
            "wasted_gpu_hours": round(self.wasted_gpu_hours, 6),
            "budget": self.budget.to_json(),
        }


def account(attempts: Iterable[AttemptRecord], events: Iterable[Mapping[str, Any]], budget: Budget) -> Accounting:
    """Rebuild the accounting from the run's attempt records and ledger events
    (``CheckpointStore.attempts()``, ``CheckpointStore.events()``)."""
    accts: dict[int, AttemptAccount] = {}
    for a in sorted(attempts, key=lambda r: r.number):
        accts[a.number] = AttemptAccount(a.number, a.resumed_from, a.created_at)
    for ev in sorted(events, key=lambda e: float(e.get("at", 0))):
        n = ev.get("attempt")
        if n is None or n not in accts:
            continue
        acc = accts[n]
        kind, p = ev.get("event"), ev.get("payload", {})
        if kind == "progress":
            step = int(p["step"])
            if acc.last_step is None or step > acc.last_step:
                acc.last_step = step
                acc.last_progress_at = float(ev.get("at", 0))
        elif kind == "first-step":
            acc.first_step_seconds = float(p.get("seconds", 0))
        elif kind == "save":
            acc.saves.append(dict(p))
        elif kind in ("finished", "preempted", "budget-exhausted"):
            acc.ended = kind
    ordered = [accts[n] for n in sorted(accts)]
    for i, acc in enumerate(ordered):
        start = -1 if acc.resumed_from is None else int(acc.resumed_from)
        acc.executed_steps = max(0, (acc.last_step if acc.last_step is not None else start) - start)
        if i + 1 < len(ordered):
            nxt = ordered[i + 1].resumed_from
            nxt_start = -1 if nxt is None else int(nxt)
            top = acc.last_step if acc.last_step is not None else start
            acc.wasted_steps = max(0, top - max(nxt_start, start))
        elif acc.ended == "interrupted":
            acc.ended = "running-or-interrupted"
    executed = sum(a.executed_steps for a in ordered)
    wasted = sum(a.wasted_steps for a in ordered)
    restarts = max(0, len(ordered) - 1)
    interruptions = sum(1 for a in ordered[:-1] if a.ended in ("interrupted", "preempted"))
    spent = executed * budget.gpu_hours_per_step + restarts * budget.restart_gpu_hours
    wasted_h = wasted * budget.gpu_hours_per_step + restarts * budget.restart_gpu_hours
    return Accounting(ordered, executed, wasted, executed - wasted, restarts, interruptions, spent, wasted_h, budget)


@dataclass(frozen=True)
class CostComparison:
    ordinary_hours: float
    interruptible_hours: float
    ordinary_cost: float
    interruptible_cost: float

    @property
    def saving_fraction(self) -> float:
        return 0.0 if self.ordinary_cost == 0 else 1 - self.interruptible_cost / self.ordinary_cost

    def to_json(self) -> dict[str, float]:
        return {
            "ordinary_gpu_hours": self.ordinary_hours,
            "interruptible_gpu_hours": self.interruptible_hours,
            "ordinary_cost": round(self.ordinary_cost, 6),
            "interruptible_cost": round(self.interruptible_cost, 6),
            "saving_fraction": round(self.saving_fraction, 6),
        }


def compare_costs(ordinary_hours: float, interruptible_hours: float, ordinary_price: float,
                  interruptible_price: float) -> CostComparison:
    """Price accepted progress: the same unique work on ordinary capacity versus
    the billed hours (including repeated work and restarts) on interruptible
    capacity. The seed's example: 10 h ordinary vs 14 h at half the rate is a
    30 % saving, not 50 %."""
    return CostComparison(ordinary_hours, interruptible_hours, ordinary_hours * ordinary_price,
                          interruptible_hours * interruptible_price)


def young_daly_interval(save_cost: float, mtbi: float) -> float:
    """Young/Daly first-order optimum: sqrt(2 x save cost x mean time between interruptions)
    (both in the same unit, e.g. steps or seconds)."""
    if save_cost < 0 or mtbi <= 0:
        raise InvalidInputError("save cost must be >= 0 and the mean time between interruptions > 0")
    return float((2 * save_cost * mtbi) ** 0.5)
