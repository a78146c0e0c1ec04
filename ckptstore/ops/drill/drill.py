"""``ckptstore drill``: the recovery drill, end to end, with real killed processes.

1. Envelope and admission: frozen data snapshot, split, code digest, optimizer
   revision, feature contract, GPU-hour budget; the projected cost is admitted
   or refused before anything runs.
2. Pilot: measured step time and save-and-publish time; the checkpoint interval
   from Young/Daly with a declared mean time between interruptions.
3. A clean reference run.
4. The interrupted run, killed with SIGKILL just before a checkpoint, while a
   component's bytes are being written, after only some components, and
   before the commit; every restart is a fresh process that must resume from
   the newest complete save, with the same optimizer state bytes as the clean
   run at that step.
4b. Two tiers (:mod:`.tiered`): a local directory in front of the store; the
   local disk wiped mid-run, a local copy corrupted; the interval per tier.
5. The same store path under a changed feature contract: refused.
6. A budget breach after repeated interruptions: the job stops with an
   incomplete, unpromotable artifact.
7. Verification against the clean run (cohort counts, metrics within a
   tolerance declared up front, final digest), and replay evidence: per-stage
   digests that name the earliest changed stage of a deliberately perturbed run.
8. The operator record, rebuilt by a fresh read of the store: table, JSON, SVG.
9. Promotion: the recovered run is promoted (weights-only safetensors and
   ``provenance.json``) and the artifact verified against the store, its
   tensors equal to the final save's model; the budget-stopped run's
   promotion is refused, with its reasons in the record.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...defaults import BUDGET_GPU_HOURS, GPU_HOURS_PER_STEP, RESTART_GPU_HOURS
from ...store import CheckpointStore
from ...util.progress import Progress, progress
from ...util.redact import redact_text, redact_url
from ...util.terminal import escape_lines, sanitize
from ..budget import Budget, account, young_daly_interval
from ..events import validate_events
from ..promote import promote, promotion_check
from ..report import build_record, render_table, render_timeline_svg
from .proc import ProcResult, run_trainer, trainer_cmd
from .tiered import run_tiered

TOLERANCE = {"eval_accuracy": 0.01, "eval_loss": 0.01}  # declared before any run


@dataclass
class DrillConfig:
    store: str | None = None
    out_dir: str = "drill-out"
    steps: int = 120
    budget_gpu_hours: float = BUDGET_GPU_HOURS
    gpu_hours_per_step: float = GPU_HOURS_PER_STEP
    restart_gpu_hours: float = RESTART_GPU_HOURS
    mtbi_steps: float = 40.0
    step_sleep: float = 0.02
    verbose: bool = False
    storage_options: dict[str, Any] = field(default_factory=dict)


class Drill:
    def __init__(self, cfg: DrillConfig, log: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self._log = log or _terminal_log
        self.log = self._log_around_bar
        self.bar: Progress | None = None
        self.url = cfg.store or tempfile.mkdtemp(prefix="ckptstore-drill-")
        self.out = Path(cfg.out_dir)
        self.checks: list[tuple[str, bool, str]] = []
        self.t0 = time.monotonic()
        self.budget = Budget(cfg.budget_gpu_hours, cfg.gpu_hours_per_step, cfg.restart_gpu_hours)

    # -------------------------------------------------------------- helpers
    def _args(self, *extra: str, steps: int | None = None, interval: int | None = None,
              budget: float | None = None) -> list[str]:
        return [
            "--steps", str(steps or self.cfg.steps),
            "--save-every", str(interval or self.interval),
            "--step-sleep", str(self.cfg.step_sleep),
            "--budget-gpu-hours", str(budget or self.cfg.budget_gpu_hours),
            "--gpu-hours-per-step", str(self.cfg.gpu_hours_per_step),
            "--restart-gpu-hours", str(self.cfg.restart_gpu_hours),
            *extra,
        ]

    def run(self, run_id: str, *extra: str, kill_on: str | None = None, delay: float = 0.0, **kw: Any) -> ProcResult:
        return run_trainer(trainer_cmd(self.url, run_id, *self._args(*extra, **kw)), kill_on=kill_on, delay=delay,
                           echo=self.cfg.verbose, storage_options=self.cfg.storage_options or None)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append((name, ok, detail))
        self.log(f"    [{'ok' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}")
        return ok

    def stage(self, title: str) -> None:
        self.log(f"\n[{time.monotonic() - self.t0:6.1f}s] {title}")
        if self.bar is not None:
            self.bar.advance(1, label=f"drill: {title.split(':')[0][:30]}")

    def _log_around_bar(self, text: str) -> None:
        if self.bar is not None:
            self.bar.clear()
        self._log(text)
        if self.bar is not None and self.bar.enabled:
            self.bar.advance(0)

    def reader(self, run_id: str) -> CheckpointStore:
        return CheckpointStore.open(self.url, run_id, mode="r", storage_options=self.cfg.storage_options or None)

    # -------------------------------------------------------------- stages
    def envelope(self) -> None:
        from ...identity import digest_tree
        from .data import make_snapshot

        self.stage("1. run envelope and admission")
        snap = make_snapshot()
        import ckptstore

        code = digest_tree(os.path.dirname(ckptstore.__file__))
        self.log(f"    store            {redact_url(self.url)}")
        self.log(f"    data snapshot    {snap.data_digest}  ({len(snap.labels)} receipts, "
                 f"{len(snap.train_idx)} train / {len(snap.eval_idx)} eval, split {snap.split_digest})")
        self.log(f"    feature contract {snap.feature_contract} ({snap.features.shape[1]} features)")
        self.log(f"    code digest      {code[:40]}…")
        self.log("    optimizer        adam-r3 (Adam + OneCycle LR, dropout, 2-step gradient accumulation)")
        self.log(f"    budget           {self.budget.limit_gpu_hours} GPU-h; a step is priced "
                 f"{self.budget.gpu_hours_per_step} GPU-h, a restart {self.budget.restart_gpu_hours} GPU-h")
        ok, proj = self.budget.admit(self.cfg.steps, expected_restarts=4, waste_fraction=0.1)
        self.check("admission", ok, f"projected {proj:.2f} GPU-h for {self.cfg.steps} steps with 4 restarts "
                                    f"and 10 % rework, limit {self.budget.limit_gpu_hours}")
        if not ok:
            raise SystemExit("admission refused: the projected cost exceeds the budget")

    def pilot(self) -> None:
        self.stage("2. pilot: throughput and save cost -> checkpoint interval")
        r = self.run("pilot", steps=12, interval=4)
        st = self.reader("pilot")
        ev = st.events()
        prog = [e for e in ev if e["event"] == "progress"]
        saves = [e["payload"]["seconds"] for e in ev if e["event"] == "save"]
        step_s = (prog[-1]["at"] - prog[0]["at"]) / max(1, len(prog) - 1)
        save_s = sorted(saves)[len(saves) // 2] if saves else 0.0
        save_steps = save_s / max(step_s, 1e-9)
        raw = young_daly_interval(save_steps, self.cfg.mtbi_steps)
        self.interval = max(5, min(self.cfg.steps // 4, round(raw)))
        self.step_seconds = step_s
        self.log(f"    pilot: {len(prog)} steps, {step_s * 1000:.1f} ms/step; save-and-publish median "
                 f"{save_s * 1000:.1f} ms ({save_steps:.2f} step-equivalents) over {len(saves)} saves")
        self.log(f"    Young/Daly: sqrt(2 x {save_steps:.2f} x {self.cfg.mtbi_steps:.0f} steps MTBI) = {raw:.1f} "
                 f"-> every {self.interval} steps (clamped to [5, steps/4])")
        self.check("pilot ran", r.returncode == 0 and len(saves) >= 2)

    def clean(self) -> None:
        self.stage("3. clean reference run")
        r = self.run("receipts-clean", "--result", str(self.out / "clean-result.json"))
        self.clean_result = json.loads((self.out / "clean-result.json").read_text())
        self.check("clean run finished", r.returncode == 0,
                   f"eval accuracy {self.clean_result['eval_accuracy']:.4f}, final digest "
                   f"{self.clean_result['final_digest'][:16]}…")

    def _optimizer_digest(self, run_id: str, step: int) -> str | None:
        try:
            ref = self.reader(run_id).get_save(step)
        except Exception:  # noqa: BLE001
            return None
        if "optimizer.safetensors" not in ref.components:
            return None
        return self.reader(run_id).content_digest(ref, "optimizer.safetensors")  # the bytes, whatever the layout

    def _restart_check(self, label: str, r: ProcResult, expect_step: int) -> None:
        resumed = r.first("RESUMED")
        got = int(resumed.split()[1]) if resumed else None
        ok = got == expect_step
        ours = self._optimizer_digest("receipts", expect_step)
        clean = self._optimizer_digest("receipts-clean", expect_step)
        self.check(f"{label}: fresh process resumed from the newest complete save", ok,
                   f"RESUMED {got}, expected {expect_step}")
        if not ok:
            for ln in [x for x in r.lines if x.startswith(("STDERR", "REFUSED", "STOPPED"))][-12:]:
                self.log(f"      {ln}")
        self.check(f"{label}: optimizer state bytes equal the clean run's at step {expect_step}",
                   ours is not None and ours == clean)

    def interrupted(self) -> None:
        self.stage("4. the interrupted run: four kills at awkward points, each restart in a fresh process")
        k = self.interval
        cases = [
            # synchronous saves: the step-(k-1) save is committed before "STEP k" is printed,
            # so the kill lands just before the next checkpoint however loaded the machine is
            ("just before a checkpoint", ["--sync"], f"STEP {2 * k - 2}", 0.0, k - 1),
            ("while a component's bytes are being written", ["--sync", "--slow-mid-component", "3"],
             f"SAVE-BEGIN {3 * k - 1}", 1.0, 2 * k - 1),
            ("after only some components were written", ["--sync", "--slow-after-component", "3"],
             f"SAVE-BEGIN {3 * k - 1}", 1.0, 2 * k - 1),
            ("after all components, before the commit", ["--sync", "--slow-commit", "3"],
             f"SAVE-BEGIN {4 * k - 1}", 1.0, 3 * k - 1),
        ]
        # the first case starts a fresh run; each later one restarts it and is killed again
        first = True
        expected_resume = None
        for label, extra, trigger, delay, resume_after in cases:
            r = self.run("receipts", *extra, kill_on=trigger, delay=delay)
            if not first:
                self._restart_check(f"restart before '{label}'", r, expected_resume)  # type: ignore[arg-type]
            first = False
            self.check(f"killed {label}", r.killed, f"SIGKILL at '{trigger}' +{delay:.0f}s")
            sel = self.reader("receipts").latest_complete(deep=True, explain=True)
            skipped = ", ".join(f"step {s.step}: {s.reason.value}" for s in sel.skipped) or "none"
            self.check("  newest complete save survives, partial newer ones skipped",
                       sel.latest is not None and sel.latest.step == resume_after,
                       f"latest step {sel.latest.step if sel.latest else None}; skipped: {skipped}")
            expected_resume = resume_after
        r = self.run("receipts", "--result", str(self.out / "recovered-result.json"))
        self._restart_check("final restart", r, expected_resume)  # type: ignore[arg-type]
        self.check("interrupted run finished", r.returncode == 0)
        self.recovered = json.loads((self.out / "recovered-result.json").read_text())

    def identity_change(self) -> None:
        self.stage("5. same store path, changed feature contract")
        before = len(self.reader("receipts").attempts())
        r = self.run("receipts", "--contract", "receipt-v5")
        refused = r.first("REFUSED")
        after = len(self.reader("receipts").attempts())
        self.check("resume under the old run ID refused", r.returncode == 3 and refused is not None,
                   refused or "not refused")
        self.check("nothing was written to the old run", before == after)

    def budget_breach(self) -> None:
        self.stage("6. budget breach after repeated interruptions")
        limit = round(self.cfg.steps * self.cfg.gpu_hours_per_step * 0.8, 2)
        k = self.interval
        kills = [f"STEP {k + 3}", f"STEP {2 * k + 3}", f"STEP {3 * k + 3}"]
        for trig in kills:
            self.run("receipts-budget", kill_on=trig, budget=limit)
        r = self.run("receipts-budget", budget=limit)
        stopped = r.first("STOPPED")
        self.check("the job stops when the budget is spent", r.returncode == 4 and stopped is not None,
                   stopped or f"exit {r.returncode}")
        r2 = self.run("receipts-budget", budget=limit)
        self.check("a further restart is refused before it starts", r2.returncode == 4,
                   r2.first("STOPPED") or "")
        rec = build_record(self.reader("receipts-budget"), Budget(limit, self.cfg.gpu_hours_per_step,
                                                                   self.cfg.restart_gpu_hours))
        self.check("the budget-stopped artifact is not promotable", not rec["promotion"]["eligible"],
                   "; ".join(rec["promotion"]["reasons"]))
        self.budget_record = rec

    def stage_digests(self, run_id: str) -> list[tuple[str, str]]:
        st = self.reader(run_id)
        ident = st.identity
        stages = [("data", ident["data_digest"]), ("split", ident.get("split_digest", "")),
                  ("features", ident["feature_contract"])]
        history = sorted((i for i in st.list_saves() if i.state.value == "committed"), key=lambda i: i.step)
        for i in history:
            ref = i.ref
            assert ref is not None
            stages.append((f"batch-order@{i.step}", str(ref.metadata.get("batch_order"))))
            stages.append((f"parameters@{i.step}", st.content_digest(ref, "model.safetensors")))
        return stages

    @staticmethod
    def earliest_difference(a: list[tuple[str, str]], b: list[tuple[str, str]]) -> str | None:
        bd = dict(b)
        for name, dig in a:
            if name in bd and bd[name] != dig:
                return name
        return None

    def verify(self) -> None:
        self.stage("7. verification against the clean run, and replay evidence")
        c, r = self.clean_result, self.recovered
        self.check("cohort counts equal", (c["train_count"], c["eval_count"]) == (r["train_count"], r["eval_count"]),
                   f"train {r['train_count']}, eval {r['eval_count']}")
        for m, tol in TOLERANCE.items():
            self.check(f"{m} within the declared tolerance {tol}", abs(c[m] - r[m]) <= tol,
                       f"clean {c[m]:.6f}, recovered {r[m]:.6f}")
        self.bit_equal = c["final_digest"] == r["final_digest"]
        self.log(f"    final digest (reported separately from metric agreement): "
                 f"{'bit-identical' if self.bit_equal else 'DIFFERENT'} ({r['final_digest'][:16]}…)")
        clean_stages = self.stage_digests("receipts-clean")
        rec_stages = self.stage_digests("receipts")
        diff = self.earliest_difference(clean_stages, rec_stages)
        self.check("replay evidence: recovered run matches the clean run at every stage", diff is None,
                   f"{len(clean_stages)} stages compared" if diff is None else f"first divergence at {diff}")
        self.run("receipts-perturbed", "--seed", "999", steps=2 * self.interval)
        pert = self.stage_digests("receipts-perturbed")
        diff = self.earliest_difference(clean_stages, pert)
        self.check("replay evidence names the earliest changed stage of a perturbed run (sampler seed changed)",
                   diff is not None and diff.startswith("batch-order"), f"earliest changed stage: {diff}")
        self.perturbed_stage = diff

    def report(self) -> dict[str, Any]:
        self.stage("8. operator record (rebuilt from the store by a fresh read)")
        rec = build_record(self.reader("receipts"), self.budget)
        rec["drill"] = {
            "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in self.checks],
            "interval_steps": self.interval,
            "bit_identical_to_clean": self.bit_equal,
            "metric_tolerance": TOLERANCE,
            "clean": self.clean_result,
            "recovered": self.recovered,
            "perturbed_earliest_changed_stage": self.perturbed_stage,
            "budget_breach": {k: self.budget_record[k] for k in ("spent_gpu_hours", "budget_stopped", "promotion",
                                                                  "interruptions", "wasted_steps")},
            "elapsed_s": round(time.monotonic() - self.t0, 1),
            "tiers": self.tiers,
        }
        clean = self.reader("receipts-clean")
        clean_attempts = clean.attempts()
        clean_events = validate_events(clean.events(), clean_attempts, identity=clean.run_record.get("identity"))
        clean_acc = account(clean_attempts, clean_events.accepted, self.budget)
        rec["drill"]["clean_spent_gpu_hours"] = clean_acc.spent_gpu_hours
        (self.out / "record.json").write_text(json.dumps(rec, indent=2, sort_keys=True, default=str))
        (self.out / "timeline.svg").write_text(render_timeline_svg(rec))
        (self.out / "budget-record.json").write_text(json.dumps(self.budget_record, indent=2, sort_keys=True))
        (self.out / "budget-timeline.svg").write_text(render_timeline_svg(self.budget_record))
        table = render_table(sanitize(rec))
        (self.out / "record.txt").write_text(table + "\n")
        self.log(table)
        self.log(f"    elapsed spend: clean run {clean_acc.spent_gpu_hours:.2f} GPU-h, "
                 f"interrupted run {rec['spent_gpu_hours']:.2f} GPU-h")
        return rec

    def promotion(self, rec: dict[str, Any]) -> None:
        self.stage("9. promotion: the recovered run to a serving artifact; the budget-stopped run refused")
        import shutil

        import torch
        from safetensors.torch import load_file

        from ...torch import read_state
        from ..artifact import PROVENANCE
        from ..artifact_check import verify_artifact

        dest = self.out / "artifact-receipts"
        if (dest / PROVENANCE).exists():
            shutil.rmtree(dest)  # a previous drill's artifact in the drill's own output folder
        store = self.reader("receipts")
        result = promote(store, str(dest), budget=self.budget)
        self.check("the recovered run was promoted and its artifact verifies against the store", result.verified.ok,
                   f"{len(result.files)} weight file(s) + provenance.json at {dest}")
        saved = read_state(store, result.ref)["model"]
        loaded = load_file(str(dest / "model.safetensors")) if (dest / "model.safetensors").exists() else {}
        same = set(loaded) == set(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)
        self.check("safetensors loads exactly the final save's model tensors", same, f"{len(loaded)} tensors")
        tampered = self.out / "artifact-tampered"
        if tampered.exists():
            shutil.rmtree(tampered)
        shutil.copytree(dest, tampered)
        with open(tampered / "model.safetensors", "r+b") as f:
            f.seek(-1, 2)
            last = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([last[0] ^ 1]))
        bad = verify_artifact(str(tampered))
        shutil.rmtree(tampered)
        self.check("a tampered artifact is refused", not bad.ok, "; ".join(bad.problems)[:160])
        limit = self.budget_record["budget"]["limit_gpu_hours"]
        refused = promotion_check(self.reader("receipts-budget"),
                                  budget=Budget(limit, self.cfg.gpu_hours_per_step, self.cfg.restart_gpu_hours))
        self.check("the budget-stopped run's promotion is refused", not refused.promotable,
                   "; ".join(refused.reasons)[:200])
        rec["drill"]["promotion"] = {"artifact": str(dest), **result.to_json()}
        rec["drill"]["budget_breach"]["promotion_refused"] = {"refused": not refused.promotable,
                                                               "reasons": refused.reasons}
        self.budget_record["promotion_attempt"] = rec["drill"]["budget_breach"]["promotion_refused"]
        (self.out / "record.json").write_text(json.dumps(rec, indent=2, sort_keys=True, default=str))
        (self.out / "budget-record.json").write_text(json.dumps(self.budget_record, indent=2, sort_keys=True))

    def run_all(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        with progress("drill", 9, use_rich=False) as bar:
            self.bar = bar
            try:
                return self._run_stages()
            finally:
                self.bar = None

    def _run_stages(self) -> int:
        self.envelope()
        self.pilot()
        self.clean()
        self.interrupted()
        self.tiers = run_tiered(self, self.cfg.mtbi_steps, self.step_seconds)
        self.identity_change()
        self.budget_breach()
        self.verify()
        rec = self.report()
        self.promotion(rec)
        failed = [n for n, ok, _ in self.checks if not ok]
        self.log(f"\ndrill {'PASSED' if not failed else 'FAILED'}: {len(self.checks) - len(failed)}/"
                 f"{len(self.checks)} checks in {time.monotonic() - self.t0:.0f} s; "
                 f"promotion eligible: {rec['promotion']['eligible']}")
        self.log(f"record: {self.out / 'record.json'}, {self.out / 'record.txt'}, timeline: {self.out / 'timeline.svg'}")
        self.log(f"again from the store alone: ckptstore report {redact_url(self.url)} receipts")
        return 0 if not failed else 1


def _terminal_log(text: str) -> None:
    """The drill's console: store-derived text (child processes' refusals, skip
    details) is escaped and redacted before it reaches the terminal."""
    print(redact_text(escape_lines(text)), flush=True)


def run_drill(cfg: DrillConfig) -> int:
    if cfg.steps < 40 or math.isnan(cfg.steps):
        from ...errors import InvalidInputError

        raise InvalidInputError("the drill needs at least 40 steps")
    return Drill(cfg).run_all()
