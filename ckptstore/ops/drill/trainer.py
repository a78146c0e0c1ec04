"""A small, deterministic receipt-classifier training run driven by a Checkpointer.

Used by the recovery drill and by the exact-continuation tests: dropout,
shuffled data through :class:`ResumableSampler`, Adam, a OneCycle LR schedule
and gradient accumulation, so a resume that loses any of that state diverges.

Run as a process (the drill kills it with SIGKILL)::

    python -m ckptstore.ops.drill.trainer --store DIR --run RUN --steps 60 --save-every 10

Lines on stdout (flushed) tell the parent what happened: ``FRESH``,
``RESUMED <step>``, ``STEP <k>``, ``SAVE-BEGIN <k>``, ``COMMITTED <k> <s>``,
``REFUSED <reason>``, ``FINAL <digest>``.
"""

from __future__ import annotations

import time as _time

_T0 = _time.monotonic()  # process start, before torch is imported: for time-to-first-useful-step

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import blake3
import torch
from torch.utils.data import DataLoader, TensorDataset

from ...defaults import BUDGET_GPU_HOURS, GPU_HOURS_PER_STEP, RESTART_GPU_HOURS
from ...errors import CkptStoreError, NotFoundError
from ...identity import RunIdentity, digest_tree
from ...options import OpenOptions, TierOptions
from ...store import CheckpointStore
from ...torch import Checkpointer, ResumableSampler, torch_environment
from ..budget import Budget, account
from ..decision import Action, plan_resume
from ..events import validate_events
from .data import CLASSES, Snapshot, make_snapshot


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 60
    batch_size: int = 32
    accum: int = 2
    lr: float = 0.01
    hidden: int = 64
    dropout: float = 0.1
    save_every: int = 10
    seed: int = 1234
    data_seed: int = 47
    n_samples: int = 4096
    contract: str = "receipt-v4"
    async_save: bool = True
    optimizer_revision: str = "adam-r3"


def setup_determinism(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)


def build(snap: Snapshot, cfg: TrainConfig) -> dict[str, Any]:
    d = snap.features.shape[1]
    model = torch.nn.Sequential(
        torch.nn.Linear(d, cfg.hidden),
        torch.nn.ReLU(),
        torch.nn.Dropout(cfg.dropout),
        torch.nn.Linear(cfg.hidden, len(CLASSES)),
    )
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.steps)
    sampler = ResumableSampler(len(snap.train_idx), seed=cfg.seed)
    tr = snap.train_idx
    ds = TensorDataset(
        torch.from_numpy(snap.features[tr]), torch.from_numpy(snap.labels[tr]), torch.from_numpy(snap.sample_ids[tr])
    )
    # A DataLoader draws its base seed from the *global* torch RNG each time an
    # iterator is created; a resumed process creates one at a different point
    # than the uninterrupted run, which would shift every dropout mask after the
    # resume. Its own generator keeps the global stream untouched.
    loader = DataLoader(
        ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=0, generator=torch.Generator().manual_seed(cfg.seed)
    )
    return {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler, "loader": loader}


def identity_for(snap: Snapshot, cfg: TrainConfig) -> RunIdentity:
    import ckptstore

    code = digest_tree(os.path.dirname(ckptstore.__file__))
    return RunIdentity(
        data_digest=snap.data_digest,
        code_digest=code,
        optimizer_revision=cfg.optimizer_revision,
        feature_contract=snap.feature_contract,
        world_size=1,
        environment=torch_environment(),
        extra={"split_digest": snap.split_digest, "train_config": _config_identity(cfg)},
    )


def _config_identity(cfg: TrainConfig) -> dict[str, Any]:
    d = asdict(cfg)
    for k in ("save_every", "async_save"):  # operational, not part of the experiment
        d.pop(k)
    return d


def state_digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = blake3.blake3()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    sd = opt.state_dict()
    for idx in sorted(sd["state"]):
        for k, v in sorted(sd["state"][idx].items()):
            h.update(f"{idx}.{k}".encode())
            if isinstance(v, torch.Tensor):
                h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(v).encode())
    h.update(json.dumps(sd["param_groups"], sort_keys=True, default=str).encode())
    return h.hexdigest()


def evaluate(model: torch.nn.Module, snap: Snapshot) -> dict[str, float]:
    model.eval()
    with torch.no_grad():
        ev = snap.eval_idx
        x = torch.from_numpy(snap.features[ev])
        y = torch.from_numpy(snap.labels[ev])
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y).item()
        acc = (logits.argmax(1) == y).float().mean().item()
    model.train()
    return {"eval_loss": loss, "eval_accuracy": acc, "eval_count": len(ev), "train_count": len(snap.train_idx)}


class ReplayLog:
    """A running digest of the batch order (sample IDs), saved with the state so
    it continues across restarts: replay evidence for the stage comparison."""

    def __init__(self) -> None:
        self.digest = ""

    def add(self, ids: torch.Tensor) -> None:
        self.digest = blake3.blake3(self.digest.encode() + ids.numpy().tobytes()).hexdigest()

    def state_dict(self) -> dict[str, Any]:
        return {"batch_order": self.digest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.digest = str(state["batch_order"])


def spent_so_far(url: Any, run_id: str, budget: Budget, storage_options: dict[str, Any] | None = None) -> float:
    """GPU-hours already spent by earlier attempts, from the store's ledger."""
    try:
        st = CheckpointStore.open(url, run_id, mode="r", storage_options=storage_options)
    except NotFoundError:
        return 0.0
    attempts = st.attempts()
    # only well-formed events consistent with the records count (a forged or malformed one never stops a run)
    ledger = validate_events(st.events(), attempts, identity=st.run_record.get("identity"),
                             min_step_seconds=budget.min_step_seconds)
    acc = account(attempts, ledger.accepted, budget)
    # a restart about to happen costs its start-up too
    return acc.spent_gpu_hours + (budget.restart_gpu_hours if acc.attempts else 0.0)


class BudgetStop(Exception):
    pass


def _batches(loader: DataLoader[Any]) -> Iterator[Any]:
    while True:
        yield from loader


def say(*parts: Any) -> None:
    print(*parts, flush=True)


def train(
    url: str,
    run_id: str,
    cfg: TrainConfig,
    *,
    sample_log: str | None = None,
    result_path: str | None = None,
    step_sleep: float = 0.0,
    slow_commit: float = 0.0,
    slow_after_component: float = 0.0,
    storage_options: dict[str, Any] | None = None,
    contract_override: str | None = None,
    budget: Budget | None = None,
    progress_every: int = 1,
    slow_mid_component: float = 0.0,
    local_tier: str | None = None,
) -> dict[str, Any]:
    """One attempt of the drill's training job: admit, resume, train to the end
    (or the budget), save the final state, record the result."""
    setup_determinism(cfg.seed)
    snap = make_snapshot(cfg.n_samples, seed=cfg.data_seed, contract=contract_override or cfg.contract)
    objs = build(snap, cfg)
    ident = identity_for(snap, cfg)
    budget = budget or Budget()
    spent_before = _admit(url, run_id, ident, budget, storage_options)
    backend = _backend(url, storage_options, slow_commit, slow_after_component, slow_mid_component)
    tiers = TierOptions(local_tier) if local_tier is not None else None
    store = CheckpointStore.open(backend, run_id, identity=ident, storage_options=storage_options,
                                 options=OpenOptions(tiers=tiers))
    model, opt, sched = objs["model"], objs["optimizer"], objs["scheduler"]
    replay = ReplayLog()
    ckpt = Checkpointer(
        store,
        {"model": model, "optimizer": opt, "scheduler": sched, "sampler": objs["sampler"], "replay": replay},
        every_steps=cfg.save_every,
        async_save=cfg.async_save,
        metadata=lambda step: {"lr": sched.get_last_lr()[0], "batch_order": replay.digest},
    )
    start = ckpt.resume()
    say("FRESH" if start == 0 else f"RESUMED {start - 1}")
    log = open(sample_log, "a") if sample_log else None  # noqa: SIM115
    loop = _Loop(store, ckpt, objs, replay, log, cfg, budget, spent_before, step_sleep, progress_every)
    for step in range(start, cfg.steps):
        loop.step(step, start)
    ckpt.finish(cfg.steps - 1)  # the final artifact is always a complete save
    loop.announce_commits()
    return _finish(store, model, opt, snap, cfg, start, loop.first_step_seconds, result_path)


def _admit(url: str, run_id: str, ident: RunIdentity, budget: Budget, storage_options: dict[str, Any] | None) -> float:
    """The resume decision before anything is registered: a spent budget stops
    (recorded), a changed identity is refused. Returns the GPU-hours spent before."""
    spent_before = spent_so_far(url, run_id, budget, storage_options)
    decision = plan_resume(url, run_id, ident, spent=spent_before, limit=budget.limit_gpu_hours,
                           storage_options=storage_options)
    if decision.action is Action.STOP:
        say(f"STOPPED {decision.reason}")
        try:  # the ledger records the refusal; no attempt is registered for a run that may not start
            CheckpointStore.open(url, run_id, mode="r", storage_options=storage_options).record_event(
                "budget-exhausted", {"at_start": True, "spent_gpu_hours": spent_before,
                                     "limit_gpu_hours": budget.limit_gpu_hours})
        except NotFoundError:
            pass
        raise BudgetStop(decision.reason)
    if decision.action is Action.NEW_RUN_REQUIRED:
        say(f"REFUSED new-run-required: identity changed ({', '.join(decision.mismatched_fields)})")
        raise CkptStoreError(f"identity changed: {decision.mismatched_fields}")
    return spent_before


def _backend(url: str, storage_options: dict[str, Any] | None, slow_commit: float, slow_after_component: float,
             slow_mid_component: float) -> Any:
    """The store URL, or a fault-injecting backend for the drill's kill points."""
    if not (slow_commit or slow_after_component or slow_mid_component):
        return url
    from ...backends.faults import FaultyBackend
    from ...backends.schemes import backend_from_url

    fb = FaultyBackend(backend_from_url(url, storage_options=storage_options))
    if slow_commit:
        fb.slow(None, slow_commit, when=lambda op, key: op == "create" and "/commits/" in key)
    # whole components (protocol versions 1, 2) by name; pieces (version 3, the default) are named by
    # content: a save's pieces are put one by one, so slowing each lands the kill between two of them
    # (after a component) or inside one (mid-component)
    if slow_after_component:
        fb.slow(None, slow_after_component,
                when=lambda op, key: op == "put" and (key.endswith("state.json") or "/pieces/" in key))
    if slow_mid_component:
        fb.slow_stream(slow_mid_component, when=lambda op, key: op == "put" and (
            key.endswith("optimizer.safetensors") or "/pieces/" in key))
    return fb


class _Loop:
    """The training loop's state between steps: one optimizer step at a time."""

    def __init__(self, store: CheckpointStore, ckpt: Checkpointer, objs: dict[str, Any], replay: ReplayLog,
                 log: Any, cfg: TrainConfig, budget: Budget, spent_before: float, step_sleep: float,
                 progress_every: int) -> None:
        self.store, self.ckpt, self.objs, self.replay, self.log = store, ckpt, objs, replay, log
        self.cfg, self.budget, self.spent_before = cfg, budget, spent_before
        self.step_sleep, self.progress_every = step_sleep, progress_every
        self.batches = _batches(objs["loader"])
        self.crit = torch.nn.CrossEntropyLoss()
        self.executed = 0
        self.seen_commits = len(ckpt.saves)
        self.first_step_seconds: float | None = None

    def stop_if_over_budget(self, step: int) -> None:
        b = self.budget
        if self.spent_before + (self.executed + 1) * b.gpu_hours_per_step > b.limit_gpu_hours + 1e-9:
            self.ckpt.close()
            spent = self.spent_before + self.executed * b.gpu_hours_per_step
            self.store.record_event("budget-exhausted", {"step": step - 1, "spent_gpu_hours": spent,
                                                         "limit_gpu_hours": b.limit_gpu_hours})
            say(f"STOPPED budget-exhausted at step {step - 1}: spent {spent:.2f} of {b.limit_gpu_hours:.2f} GPU-h")
            raise BudgetStop("budget-exhausted")

    def optimizer_step(self, step: int) -> None:
        model, opt, sched = self.objs["model"], self.objs["optimizer"], self.objs["scheduler"]
        opt.zero_grad(set_to_none=True)
        for micro in range(self.cfg.accum):
            x, y, ids = next(self.batches)
            self.replay.add(ids)
            if self.log:
                self.log.write(f"{step} {micro} {','.join(map(str, ids.tolist()))}\n")
            loss = self.crit(model(x), y) / self.cfg.accum
            loss.backward()
        opt.step()
        sched.step()
        if self.log:
            self.log.flush()
        if self.step_sleep:
            time.sleep(self.step_sleep)
        self.executed += 1

    def record_progress(self, step: int, start: int) -> None:
        if self.first_step_seconds is None:
            self.first_step_seconds = time.monotonic() - _T0
            self.store.record_event("first-step", {"step": step, "seconds": round(self.first_step_seconds, 4)})
        if self.progress_every and (step + 1 - start) % self.progress_every == 0:
            self.store.record_event("progress", {"step": step})
        say(f"STEP {step}")

    def announce_commits(self) -> None:
        while self.seen_commits < len(self.ckpt.saves):
            s = self.ckpt.saves[self.seen_commits]
            say(f"COMMITTED {s['step']} {s['seconds']}")
            self.seen_commits += 1

    def step(self, step: int, start: int) -> None:
        self.stop_if_over_budget(step)
        self.optimizer_step(step)
        self.record_progress(step, start)
        if self.ckpt.due(step) and not self.ckpt.preempted:
            say(f"SAVE-BEGIN {step}")
        self.ckpt.step_end(step)
        self.announce_commits()


def _finish(store: CheckpointStore, model: torch.nn.Module, opt: torch.optim.Optimizer, snap: Snapshot,
            cfg: TrainConfig, start: int, first_step_seconds: float | None, result_path: str | None) -> dict[str, Any]:
    """The result: final digest, evaluation, the final save's IDs; recorded as ``finished``."""
    digest = state_digest(model, opt)
    result = {
        "final_digest": digest,
        "steps": cfg.steps,
        "resumed_from": start - 1 if start else None,
        "first_step_seconds": first_step_seconds,
        **evaluate(model, snap),
        "data_digest": snap.data_digest,
        "split_digest": snap.split_digest,
    }
    final_ref = store.latest_complete(deep=True)
    result["final_save_id"] = final_ref.save_id if final_ref else None
    result["final_manifest_digest"] = final_ref.manifest_digest if final_ref else None
    store.record_event("finished", {k: v for k, v in result.items()})
    if result_path:
        with open(result_path, "w") as f:
            json.dump(result, f, indent=2, sort_keys=True)
    say(f"FINAL {digest}")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--sync", action="store_true", help="synchronous saves")
    ap.add_argument("--sample-log")
    ap.add_argument("--result")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--slow-commit", type=float, default=0.0, help="test hook: delay every commit create")
    ap.add_argument("--slow-after-component", type=float, default=0.0, help="test hook: delay the state.json put")
    ap.add_argument("--contract", default=None, help="override the feature contract (identity change)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--budget-gpu-hours", type=float, default=BUDGET_GPU_HOURS)
    ap.add_argument("--gpu-hours-per-step", type=float, default=GPU_HOURS_PER_STEP)
    ap.add_argument("--restart-gpu-hours", type=float, default=RESTART_GPU_HOURS)
    ap.add_argument("--progress-every", type=int, default=1)
    ap.add_argument("--slow-mid-component", type=float, default=0.0, help="test hook: stall inside a component write")
    ap.add_argument("--local-tier", default=None, help="a local directory as the fast tier (docs/tiers.md)")
    ap.add_argument("--storage-options-fd", type=int, default=None,
                    help="read the storage options (JSON) from this inherited descriptor; "
                         "they never go on the command line, where ps shows them")
    a = ap.parse_args(argv)
    storage_options = None
    if a.storage_options_fd is not None:
        from .proc import read_options_fd

        storage_options = read_options_fd(a.storage_options_fd)
    cfg = TrainConfig(steps=a.steps, save_every=a.save_every, async_save=not a.sync, seed=a.seed)
    try:
        train(
            a.store,
            a.run,
            cfg,
            sample_log=a.sample_log,
            result_path=a.result,
            step_sleep=a.step_sleep,
            slow_commit=a.slow_commit,
            slow_after_component=a.slow_after_component,
            contract_override=a.contract,
            budget=Budget(a.budget_gpu_hours, a.gpu_hours_per_step, a.restart_gpu_hours),
            progress_every=a.progress_every,
            slow_mid_component=a.slow_mid_component,
            storage_options=storage_options,
            local_tier=a.local_tier,
        )
    except BudgetStop:
        return 4
    except CkptStoreError as exc:
        say(f"REFUSED {type(exc).__name__}: {exc}")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
