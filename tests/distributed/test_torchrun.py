"""Real ``torchrun`` jobs, as users launch them (issue 25).

``python -m torch.distributed.run`` with c10d rendezvous on 127.0.0.1, gloo,
``--max-restarts`` and ``--monitor-interval=1``; the worker
(tests/workers/torchrun_worker.py) trains a tiny DDP model with the Checkpointer's
defaults (asynchronous saves, signal handling on) and a ResumableLoader per
rank. The test SIGKILLs a worker at seeded points — between steps, inside a
save (components written, inventory not sent), and on the coordinator just
before it publishes — lets torchrun restart the workers, and compares every
rank's final model and optimizer bytes with an uninterrupted run. Under
torchrun's default store (the agent's TCPStore, which outlives worker
restarts) and with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, with one agent
and with two (``--nnodes=2`` on one box).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore
from tests.workers.dist_launch import ROOT, free_port

pytestmark = pytest.mark.backends("local")

WORKER = str(Path(__file__).parents[1] / "workers" / "torchrun_worker.py")
STEPS = 16
SAVE_STEPS = [s for s in range(STEPS - 1) if (s + 1) % 3 == 0]  # every_steps=3
#: generous: a survivor must leave within seconds of its peer's death, not at torchrun's 30 s SIGKILL
SURVIVOR_BOUND = 20.0
JOB_TIMEOUT = 240.0


@dataclass
class Job:
    out: Path
    rcs: list[int]
    events: list[dict[str, Any]]
    kills: list[dict[str, Any]] = field(default_factory=list)

    def of(self, ev: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["ev"] == ev]

    def explain(self) -> str:
        logs = "\n".join(p.read_text()[-3000:] for p in sorted(self.out.glob("agent*.log")))
        return f"rcs={self.rcs} kills={self.kills}\nevents={self.events[-30:]}\n{logs}"


def read_events(out: Path) -> list[dict[str, Any]]:
    p = out / "events.jsonl"
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip().endswith("}")]


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for the agent to reap it counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def launch(
    out: Path, *, agents: int = 1, share_store: bool = True, faults: list[dict[str, Any]] | None = None,
    preempt_at: int | None = None, max_restarts: int = 5, tiers: dict[str, Any] | None = None,
) -> Job:
    """Run one torchrun job (``agents`` agents of 2/agents workers each) to its end, killing as the faults say."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {"out": str(out), "url": str(out.parent / "store"), "steps": STEPS, "faults": faults or [],
            "preempt_at": preempt_at, "tiers": tiers}
    (out / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    port = free_port()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={agents}", f"--nproc-per-node={2 // agents}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=job-{port}",
        f"--max-restarts={max_restarts}", "--monitor-interval=1", WORKER, str(out / "spec.json"),
    ]
    procs = []
    for a in range(agents):
        log = open(out / f"agent{a}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), log))
    job = Job(out, [], [])
    deadline = time.monotonic() + JOB_TIMEOUT
    pending: list[dict[str, Any]] = []  # kills whose survivor and resumption are being watched
    sent_term = False
    try:
        while any(p.poll() is None for p, _ in procs):
            if time.monotonic() > deadline:
                raise AssertionError(f"torchrun job did not end within {JOB_TIMEOUT}s\n" + job.explain())
            job.events = read_events(out)
            for e in job.of("pause"):
                i = e["fault"]
                if any(k["fault"] == i for k in job.kills):
                    continue
                starts = [s for s in job.of("start") if s["t"] <= e["t"] and s["rank"] != e["rank"]]
                survivors = {s["rank"]: s["pid"] for s in starts}  # the newest start of each other rank
                os.kill(e["pid"], signal.SIGKILL)
                t_kill = time.time()
                wipe = (faults or [])[i].get("wipe")
                if wipe:  # that node's disk is lost with it, before torchrun restarts the workers
                    shutil.rmtree(out / wipe, ignore_errors=True)
                (out / f"done-{i}").write_text("")
                kill = {"fault": i, "point": e["point"], "step": e["step"], "rank": e["rank"], "t": t_kill,
                        "survivors": survivors}
                job.kills.append(kill)
                pending.append(kill)
            for k in pending:
                if "survivor_s" not in k and all(gone(pid) for pid in k["survivors"].values()):
                    k["survivor_s"] = round(time.time() - k["t"], 1)
                if "resumed_s" not in k:
                    later = [s for s in job.of("start") if s["t"] > k["t"] and s["rank"] == k["rank"]]
                    if later:
                        k["resumed_s"] = round(later[0]["t"] - k["t"], 1)
                        k["resumed_at"] = later[0]["start"]
            if preempt_at is not None and not sent_term and job.of("preempt-ready"):
                procs[0][0].send_signal(signal.SIGTERM)  # the scheduler preempts: SIGTERM to the agent
                sent_term = True
            time.sleep(0.1)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            log.close()
    job.rcs = [p.returncode for p, _ in procs]
    job.events = read_events(out)
    return job


def torch_bootstrap_failed(job: Job) -> bool:
    """Whether the generations after the last kill died in ``init_process_group``
    (never reached ``start``), as torch's gloo bootstrap does under the shared store."""
    last = max((k["t"] for k in job.kills), default=0.0)
    logs = "".join(p.read_text() for p in job.out.glob("agent*.log"))
    return not [s for s in job.of("start") if s["t"] > last] and (
        "connectFullMesh failed" in logs or "in init_process_group" in logs
    )


def finals(job: Job) -> dict[int, dict[str, str]]:
    return {e["rank"]: e["digest"] for e in job.of("final")}


def one_attempt_per_generation(job: Job) -> None:
    """Every generation's ranks joined the same attempt, resuming the same step (no mixed attempts)."""
    starts = job.of("start")
    by_attempt: dict[int, set[tuple[int, int]]] = {}
    for s in starts:
        by_attempt.setdefault(s["attempt"], set()).add((s["rank"], s["start"]))
    for attempt, members in by_attempt.items():
        assert sorted(r for r, _ in members) == [0, 1], (attempt, members, job.explain())
        assert len({st for _, st in members}) == 1, (attempt, members, job.explain())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, str]]:
    """Every rank's final state after an uninterrupted job."""
    job = launch(tmp_path_factory.mktemp("reference") / "job")
    assert job.rcs == [0], job.explain()
    got = finals(job)
    assert sorted(got) == [0, 1], job.explain()
    return got


def seeded_faults(seed: int, n: int) -> list[dict[str, Any]]:
    """``n`` kills at increasing steps, each reachable after the previous one's restart."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    low = 1
    for _ in range(n):
        point = rng.choice(["step", "in_save", "before_publish"])
        if point == "step":
            step, rank = rng.randint(low, low + 4), rng.randint(0, 1)
        else:
            step = rng.choice([s for s in SAVE_STEPS if low <= s <= low + 5])
            rank = 0 if point == "before_publish" else rng.randint(0, 1)
        out.append({"rank": rank, "point": point, "step": step})
        low = step + 2
    return out


# (agents, torchrun's shared store?, seed, kills); restarts under the default
# store may also be spent on torch's own gloo bootstrap (docs/torchrun.md)
CONFIGS = [
    pytest.param(1, True, 11, 1, id="default-store-1-agent"),
    pytest.param(1, False, 12, 2, id="own-store-1-agent"),
    pytest.param(2, True, 13, 1, id="default-store-2-agents"),
    pytest.param(2, False, 14, 1, id="own-store-2-agents"),
]


@pytest.mark.parametrize(("agents", "share_store", "seed", "kills"), CONFIGS)
def test_killed_workers_resume_exactly(
    agents: int, share_store: bool, seed: int, kills: int, reference: dict[int, dict[str, str]], tmp_path: Path
) -> None:
    faults = seeded_faults(seed, kills)
    job = launch(tmp_path / "job", agents=agents, share_store=share_store, faults=faults)
    print(f"faults={faults} kills={job.kills} rcs={job.rcs}")
    # whatever torch did, ckptstore's part holds: every generation that opened
    # the run joined one attempt on every rank, and nothing is torn
    one_attempt_per_generation(job)
    store = CheckpointStore.open(tmp_path / "store", "run", mode="r")
    latest = store.latest_complete(deep=True)
    assert latest is not None and latest.record.world_size == 2
    if share_store and job.rcs != [0] * agents and torch_bootstrap_failed(job):
        # torch's own gloo bootstrap keys collide in the shared store (docs/torchrun.md)
        pytest.xfail("every restarted generation failed in init_process_group (gloo connectFullMesh)")
    assert job.rcs == [0] * agents, job.explain()
    assert len(job.kills) == len(faults), job.explain()
    assert finals(job) == reference, job.explain()  # bit for bit, every rank
    for k in job.kills:
        # the survivor leaves within seconds (not at torchrun's 30 s SIGKILL), and the job resumes
        assert k.get("survivor_s", SURVIVOR_BOUND) < SURVIVOR_BOUND, job.explain()
        assert "resumed_s" in k, job.explain()
    assert latest.step == STEPS - 1


def test_preemption_with_healthy_peers_saves_the_same_step_and_exits_75(
    reference: dict[int, dict[str, str]], tmp_path: Path
) -> None:
    job = launch(tmp_path / "job", preempt_at=4, max_restarts=0)
    exits = {e["rank"]: e for e in job.of("exit")}
    assert sorted(exits) == [0, 1], job.explain()
    assert [exits[r]["code"] for r in (0, 1)] == [75, 75], job.explain()
    steps = {exits[r]["step"] for r in (0, 1)}
    assert len(steps) == 1, job.explain()  # agreed: both ranks saved the same step
    store = CheckpointStore.open(tmp_path / "store", "run", mode="r")
    latest = store.latest_complete(deep=True)
    assert latest is not None and latest.step == steps.pop()
    assert sorted(latest.record.ranks or {}) == [0, 1]
    # the requeued job continues from it, exactly
    again = launch(tmp_path / "again")
    assert again.rcs == [0], again.explain()
    assert {s["start"] for s in again.of("start")} == {latest.step + 1}
    assert finals(again) == reference, again.explain()


@pytest.mark.parametrize("copies", [None, 0], ids=["peer-copies-default", "peer-copies-off"])
def test_a_node_lost_with_its_disk_costs_no_steps_with_peer_copies(
    copies: int | None, reference: dict[int, dict[str, str]], tmp_path: Path
) -> None:
    """Two agents (two nodes), each with its own local tier, ``replicate_every=3``
    (the newest durable save is step 2), a save every 3 steps, the job's
    defaults (asynchronous saves). Rank 1 is killed at step 9, right after the
    save of step 8 began on its background thread, with nothing waited for, and
    node 1's tier is deleted before torchrun restarts the workers.

    By default a save is complete only when its peer copies landed: rank 1's
    part comes back from rank 0's copy of the newest complete save (8, or 5
    when 8's copy was still under way), from the local tiers, no step of a
    complete save lost. A second round kills rank 0 at step 12 once the save of
    step 11 and its copies are done, and deletes node 0's tier: the job resumes
    at step 12, rank 0's part from rank 1's copy. With ``peer_copies=0`` (the
    kill once the save of step 8 is done) every rank reads the durable step 2:
    6 steps lost. Either way the job ends bit for bit where an
    uninterrupted job ends."""
    faults = [{"rank": 1, "point": "step", "step": 9, "wipe": "node-1", "settle": copies == 0}]
    if copies is None:
        faults.append({"rank": 0, "point": "step", "step": 12, "settle": True, "wipe": "node-0"})
    job = launch(tmp_path / "job", agents=2, share_store=False, faults=faults,
                 tiers={"every": 3, "peer_copies": copies})
    assert job.rcs == [0, 0], job.explain()
    assert len(job.kills) == len(faults), job.explain()
    one_attempt_per_generation(job)
    assert finals(job) == reference, job.explain()  # bit for bit, every rank
    store = CheckpointStore.open(tmp_path / "store", "run", mode="r")
    tier = [e["payload"] for e in store.events() if e["event"] == "resume-tier"]
    first = tier[1]
    if copies is None:
        assert first["step"] in (5, 8) and first["steps_lost_with_local_tier"] == 0, tier
        assert first["tier"] == "local" and first["peer_copies"] == "on", tier
        assert first["ranks"]["1"]["source"] == {"step": first["step"], "from": "peer", "holder": 0, "ok": True}, tier
        assert job.of("settled") and job.of("settled")[0]["flushed"], job.explain()
        second = tier[2]
        assert second["step"] == 11 and second["steps_lost_with_local_tier"] == 0, tier
        assert second["tier"] in ("local", "both"), tier
        assert second["ranks"]["0"]["source"] == {"step": 11, "from": "peer", "holder": 1, "ok": True}, tier
        assert {s["start"] for s in job.of("start") if s["gen"] == 2} == {12}, job.explain()
    else:
        assert first["step"] == 2 and first["tier"] == "durable", tier  # settled: the save of step 8 acknowledged
        assert first["peer_copies"] == "peer_copies=0" and first["steps_lost_with_local_tier"] == 6, tier
