"""The mutation check: break the core on purpose and prove the suite turns red.

    .venv/bin/python tests/mutations/run.py            # every mutation
    .venv/bin/python tests/mutations/run.py NAME ...   # only these
    .venv/bin/python tests/mutations/run.py --list

For each entry of ``MUTATIONS`` the script copies the repository (tracked and
untracked, not ignored, files) to a scratch directory, applies the mutation's
text edits there, and runs the tests named in ``must_fail`` against the copy.
The mutation is *caught* when every named test node has at least one failing
case (so a mutated run skips a node's remaining cases after its first failure).
Before any mutation, the same tests run on an unmodified copy and must pass,
every case (otherwise a "caught" mutation would prove nothing). The object-store
servers are started once for the whole check, and every run shares one bytecode
cache outside the copies.

An edit is a unique snippet of the current source and its replacement. A
snippet that is missing or occurs more than once fails the run loudly
("retarget me"): the core is being refactored, and a mutation that silently
stops applying would report nothing. To retarget after a refactor, change only
``file`` and ``snippet`` in the table below; the rule each entry breaks is in
its ``rule``. (Retargeted once already: from the single ``store.py`` to the
layered core — writer, fencing, catalog, gcrun, runio, protocol/gcplan.)

Part of the default test command through ``tests/house/test_mutation_check.py``:
one test checks that every snippet still occurs exactly once (a refactor that
moves one fails there, by name), one runs this script and requires every
mutation caught.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PYTEST_TIMEOUT_S = 900


@dataclass(frozen=True)
class Mutation:
    name: str
    rule: str
    file: str
    edits: tuple[tuple[str, str], ...]  # (unique snippet of the current source, replacement)
    must_fail: tuple[str, ...]  # pytest node IDs (a parametrized test's name covers all its cases)
    backends: str = "memory,local"  # CKPT_BACKENDS for the run
    # edits in other files, for a rule kept in two places (file, snippet, replacement)
    elsewhere: tuple[tuple[str, str, str], ...] = ()
    survivor: bool = False  # one of the round-1 survivors


T_INV = "tests/store/test_injected_faults.py"
T_WIRE = "tests/backends/test_wire_faults.py"
T_PROTO = "tests/store/test_invariants.py"
T_CRASH = "tests/store/test_crash_consistency.py"
T_OUT = "tests/store/test_commit_outcomes.py"
WRITER = "ckptstore/core/writer.py"
CATALOG = "ckptstore/core/catalog.py"

INVENTORY = ("        _verify_inventory(ctx, step, save_id, comps)\n"
             "        ctx.attempts.check_not_superseded(ctx.attempt, step, committed=False)\n")
COMMIT = '        created = ctx.io.create(key, data, what="commit record")\n'
POST_FENCE = "    try:\n        ctx.attempts.check_not_superseded(ctx.attempt, step, committed=True)\n"
POST_FENCE_CALL = "    _post_fence(ctx, step)\n"

MUTATIONS: list[Mutation] = [
    # ---- the round-1 survivors
    Mutation(
        "inventory-removed",
        "the read-after-write inventory runs before the commit (PROTOCOL §4.3 step 4)",
        WRITER,
        ((INVENTORY, "        ctx.attempts.check_not_superseded(ctx.attempt, step, committed=False)\n"),),
        (f"{T_INV}::test_acknowledged_put_that_is_not_there_is_never_committed",),
        survivor=True,
    ),
    Mutation(
        "inventory-after-commit",
        "the inventory is checked before, not after, the commit record is created",
        WRITER,
        ((INVENTORY, "        ctx.attempts.check_not_superseded(ctx.attempt, step, committed=False)\n"),
         (POST_FENCE_CALL, "    _verify_inventory(ctx, step, save_id, comps)\n" + POST_FENCE_CALL)),
        (f"{T_INV}::test_acknowledged_put_that_is_not_there_is_never_committed",),
        survivor=True,
    ),
    Mutation(
        "gc-components-before-record",
        "gc deletes a save's commit record before its components (PROTOCOL §4.5 step 3)",
        "ckptstore/core/collector.py",
        (("""        if info.state in (SaveState.COMMITTED, SaveState.SUPERSEDED):
            actions.append(GcAction(catalog.commit_key(info.step, info.attempt), reason))
        for name in sorted(scan.save_objects.get(info.save_id, {})):
            actions.append(GcAction(component_key(io.run_id, info.save_id, name), reason))""",
          """        for name in sorted(scan.save_objects.get(info.save_id, {})):
            actions.append(GcAction(component_key(io.run_id, info.save_id, name), reason))
        if info.state in (SaveState.COMMITTED, SaveState.SUPERSEDED):
            actions.append(GcAction(catalog.commit_key(info.step, info.attempt), reason))"""),),
        (f"{T_INV}::test_crash_at_every_operation_of_gc",),
        survivor=True,
    ),
    Mutation(
        "attempt-plain-put",
        "attempt numbers are registered with create-if-absent (PROTOCOL §4.2 step 3), never a plain put",
        "ckptstore/core/fencing.py",
        (("""            if not self.io.create(attempt_key(self.io.run_id, number), rec.encode(), what="attempt record"):
                continue  # another process took this number; try the next one""",
          """            self.io.backend.put(attempt_key(self.io.run_id, number), [rec.encode()])"""),),
        (f"{T_INV}::test_processes_racing_to_open_get_distinct_attempts_and_fencing_holds",),
        backends="local",
        survivor=True,
    ),
    # ---- classic breaks
    Mutation(
        "commit-plain-put",
        "the commit record is created with create-if-absent, never overwritten (invariant 2)",
        WRITER,
        ((COMMIT, "        ctx.io.backend.put(key, [data])\n        created = True\n"),),
        (f"{T_PROTO}::test_threads_racing_one_step_in_one_attempt",
         f"{T_PROTO}::test_second_commit_of_same_step_in_attempt_refused"),
    ),
    Mutation(
        "lost-ack-read-back-is-conflict",
        "an 'already exists' after a lost reply is settled by reading the record back (§4.3 step 6)",
        "ckptstore/core/bounded_io.py",
        (("            return existing == data\n", "            return False\n"),),
        (f"{T_OUT}::test_lost_ack_on_commit_commits_exactly_once",
         f"{T_WIRE}::test_lost_acknowledgement_of_the_commit_is_real_and_settled"),
        backends="memory,moto,fakegcs",
    ),
    Mutation(
        "unknown-outcome-deletes-components",
        "after CommitUnknownError the writer keeps its components: the record may have landed (§4.3 step 6)",
        WRITER,
        ((COMMIT, "        try:\n            created = ctx.io.create(key, data, what=\"commit record\")\n"
                  "        except BaseException:\n            remove_components(ctx.io, save_id, comps)\n            raise\n"),),
        (f"{T_WIRE}::test_every_commit_answer_lost_is_unknown_and_nothing_is_lost",),
        backends="moto,fakegcs",
    ),
    Mutation(
        "no-pre-commit-fence",
        "a superseded writer publishes nothing (§4.3 step 5)",
        WRITER,
        ((INVENTORY, "        _verify_inventory(ctx, step, save_id, comps)\n"),),
        (f"{T_INV}::test_processes_racing_to_open_get_distinct_attempts_and_fencing_holds",),
        backends="local",
    ),
    Mutation(
        "no-post-commit-fence",
        "a commit that a newer attempt fenced off is not acknowledged (§4.3 step 7)",
        WRITER,
        ((POST_FENCE, "    try:\n        pass\n"),),
        (f"{T_INV}::test_attempt_registered_during_the_commit_fences_it",),
    ),
    Mutation(
        "selection-ignores-sizes",
        "selection checks every component's size (§4.4 step 3)",
        CATALOG,
        (("            if size != comp.size:\n", "            if False:\n"),),
        (f"{T_INV}::test_cheap_selection_skips_a_component_of_the_wrong_size",),
    ),
    Mutation(
        "selection-ignores-digests",
        "deep selection re-hashes every byte (§4.4 step 3)",
        CATALOG,
        (("                elif digest != comp.blake3:\n", "                elif False:\n"),),
        (f"{T_OUT}::test_bit_flip_in_flight_is_caught_before_commit_or_at_read",),
    ),
    Mutation(
        "selection-ignores-fencing",
        "a superseded commit is never selected (§5)",
        CATALOG,
        (("        if later is not None:\n            return Candidate(step, attempt, None, [(SkipReason.SUPERSEDED",
          "        if False:\n            return Candidate(step, attempt, None, [(SkipReason.SUPERSEDED"),),
        (f"{T_PROTO}::test_zombie_commit_that_slipped_through_is_superseded",),
        # selection also skips superseded candidates by name, before any record is read
        elsewhere=(("ckptstore/core/selection_limits.py",
                    "        if later is not None:\n            return SkipReason.SUPERSEDED",
                    "        if False:\n            return SkipReason.SUPERSEDED"),),
    ),
    Mutation(
        "gc-keeps-too-few",
        "gc keeps the keep_last newest complete saves, always the selected one (invariant 4)",
        "ckptstore/protocol/gcplan.py",
        (("            if complete_seen <= keep_last or", "            if complete_seen < keep_last or"),),
        (f"{T_PROTO}::test_gc_keeps_newest_complete_and_in_flight", f"{T_INV}::test_crash_at_every_operation_of_gc"),
    ),
    Mutation(
        "local-put-no-file-fsync",
        "a component's temp file is fsynced before its rename (§7)",
        "ckptstore/backends/local.py",
        (("        try:\n            self.ops.fsync(fd)\n        except BaseException:\n",
          "        try:\n            pass\n        except BaseException:\n"),),
        (f"{T_CRASH}::test_power_loss_at_every_syscall_local",),
    ),
    Mutation(
        "local-settle-no-file-fsync",
        "deferred puts (pieces) are fsynced before their rename (PROTOCOL.md §9.4)",
        "ckptstore/backends/local.py",
        (("                list(pool.map(self.ops.fsync, [h.fd for h in todo]))\n        elif todo:\n"
          "            self.ops.fsync(todo[0].fd)\n",
          "                pass\n        elif todo:\n            pass\n"),),
        ("tests/incremental/test_deferred_puts.py::test_a_power_loss_anywhere_leaves_no_torn_object",),
    ),
    Mutation(
        "local-put-no-dir-fsync",
        "the directory is fsynced after a component's rename (§7)",
        "ckptstore/backends/local.py",
        (("            self.ops.rename(tmp, final)\n            self.ops.fsync_dir(os.path.dirname(final))\n",
          "            self.ops.rename(tmp, final)\n"),),
        (f"{T_CRASH}::test_power_loss_at_every_syscall_local",),
    ),
    Mutation(
        "s3-create-unconditional",
        "the S3 commit is a PutObject with If-None-Match: * (§7.1)",
        "ckptstore/backends/s3.py",
        (('Body=data, IfNoneMatch="*")', "Body=data)"),),
        ("tests/backends/test_conformance.py::TestBackendConformance::test_create_if_absent",),
        backends="moto",
    ),
    # ---- issue 30 class 9: the plug-ins
    Mutation(
        "lightning-dir-followed",
        "below its checkpoint directories the Lightning plug-in opens every component without following a link "
        "(THREATS §4.5)",
        "ckptstore/integrations/lightning/paths.py",
        (("    root = dirs.root_of(path) if dirs is not None else None\n", "    root = None\n"),),
        ("tests/fail_closed/test_lightning_planted.py::test_a_linked_directory_in_a_removal_path_is_never_followed",),
        backends="local",
    ),
    Mutation(
        "lightning-removal-anywhere",
        "the Lightning plug-in removes a pointer only inside one of its checkpoint directories (THREATS §4.5)",
        "ckptstore/integrations/lightning/checkpoint_io.py",
        (("            if not inside:\n                return outside(self._dirs.roots())\n", ""),),
        ("tests/fail_closed/test_lightning_planted.py::test_a_pointer_outside_its_checkpoint_directories_is_never_removed",),
        backends="local",
    ),
    Mutation(
        "hf-publish-unbounded",
        "a published checkpoint-N is bounded by max_bytes before a byte is read (THREATS §4.6 rule 5)",
        "ckptstore/integrations/hf.py",
        (("            _check_size(d, files, max_bytes)\n", ""),),
        ("tests/fail_closed/test_hf_planted.py::test_a_planted_sparse_file_is_refused_before_a_byte_is_uploaded",),
        backends="local",
    ),
    # ---- issue 32: version 3 at version 2's cost
    Mutation(
        "anchor-from-resume-point",
        "the resume point is no anchor: the first save after a restart waits for its intent (PROTOCOL §9.4)",
        "ckptstore/core/pieces.py",
        (("""        if not own:
            self._floor = key if self._floor is None else max(self._floor, key)
            return
""", """        if not own:
            self.anchor, self.anchor_epoch = names, self.commits_started
            return
"""),),
        ("tests/incremental/test_anchor.py::test_the_first_save_after_a_restart_waits_for_its_intent",),
        backends="memory",
    ),
    Mutation(
        "anchor-after-another-commit",
        "a save begun before another commit of its writer relies on its intent, not the anchor (PROTOCOL §9.4)",
        "ckptstore/core/pieces.py",
        (("                ok = holds and save is not None and save.anchor_epoch == self.anchor_epoch\n",
          "                ok = save is not None and save.anchor_epoch >= 0\n"),),
        ("tests/incremental/test_anchor.py::test_a_save_begun_before_another_commit_of_its_writer_waits",),
        backends="memory",
    ),
    Mutation(
        "rank-anchor-unchecked",
        "a rank's anchor that is no longer the coordinator's waits for that rank's intent (PROTOCOL §9.4)",
        "ckptstore/core/piece_deadlines.py",
        (("    late = {r: d for r, d in sorted(deadlines.items()) if d.anchor is not None and d.anchor != anchor}\n",
          "    late: dict[int, PieceDeadline] = {}\n"),),
        ("tests/incremental/test_rank_anchor.py::"
         "test_a_part_anchored_on_a_commit_that_is_no_longer_the_newest_waits_for_its_intent",),
        backends="memory",
    ),
    Mutation(
        "sweep-ignores-age",
        "an unmarked piece of an uncommitted holder waits out the grace period (PROTOCOL §9.5 step 5)",
        "ckptstore/protocol/pieces.py",
        (("        elif p.holder not in settled and now - p.mtime < grace_seconds:\n", "        elif False:\n"),),
        ("tests/incremental/test_settled_sweep.py::test_a_killed_saves_pieces_wait_out_the_grace",
         "tests/incremental/test_gc_races.py::test_a_killed_writers_intent_expires"),
        backends="memory",
    ),
    Mutation(
        "replication-foreign-unnamed",
        "a replication names in its intent what it uploads under another save's ID (PROTOCOL §9.6 step 2)",
        "ckptstore/tiers/durable_intent.py",
        (("        guard = set(need) if every else reuse | foreign\n", "        guard = set(need) if every else reuse\n"),),
        ("tests/incremental/test_settled_sweep.py::test_a_replication_names_what_it_uploads_under_another_saves_id",),
        backends="memory",
    ),
]


def copy_repo(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in files:
        if not rel:
            continue
        src = ROOT / rel
        if not src.is_file():
            continue  # deleted in the work tree
        out = dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, out)


def edits_by_file(m: Mutation) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {m.file: list(m.edits)}
    for file, snippet, replacement in m.elsewhere:
        out.setdefault(file, []).append((snippet, replacement))
    return out


def apply(m: Mutation, scratch: Path) -> None:
    for file, edits in edits_by_file(m).items():
        path = scratch / file
        text = path.read_text()
        for snippet, replacement in edits:
            n = text.count(snippet)
            if n != 1:
                raise SystemExit(
                    f"mutation {m.name!r}: snippet found {n} times in {file} (must be exactly once); "
                    f"retarget it to the current code:\n{snippet}"
                )
            text = text.replace(snippet, replacement)
        path.write_text(text)


#: A pytest plug-in for the mutated runs (written into the scratch copy, loaded with ``-p``): once a
#: test function has a failing case, its remaining cases are skipped. A mutation is caught when every
#: named node has at least one failing case, so the cases after a node's first failure cannot change the
#: verdict; the baseline runs every case.
FIRST_FAILURE_PLUGIN = "ckpt_mutation_first_failure"
FIRST_FAILURE_SOURCE = '''"""tests/mutations/run.py: skip the rest of a test function's cases after its first failure."""
import pytest

_failed = set()


def _function(nodeid):
    return nodeid.split("[", 1)[0]


def pytest_runtest_setup(item):
    if _function(item.nodeid) in _failed:
        pytest.skip("this test function already failed under the mutation")


def pytest_runtest_logreport(report):
    if report.when == "call" and report.failed:  # what -rf reports as FAILED
        _failed.add(_function(report.nodeid))
'''


def run_pytest(scratch: Path, nodes: tuple[str, ...], backends: str, *, pycache: Path | None = None,
               servers: str | None = None, first_failure: bool = False) -> tuple[int, str]:
    """Run ``nodes`` in ``scratch``. ``pycache``: the bytecode cache outside any source tree
    (``PYTHONPYCACHEPREFIX``, the one tests/conftest.py gives the suite's processes): nothing is written
    into a copy or the environment, and pytest's assertion-rewritten modules (hypothesis and the other
    plug-ins: ~1.5 s of compiling per run) are compiled once, not once per run; the cache is keyed by
    source path, so each copy's ckptstore compiles its own (removed with the copy). ``servers``: the
    object-store servers this check started (``CKPT_TEST_SERVERS``, tests/conftest.py), instead of a
    fresh set per run."""
    env = {**os.environ, "CKPT_BACKENDS": backends}
    env.pop("PYTHONPATH", None)
    env.pop("CKPT_TEST_SERVERS", None)
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    if servers:
        env["CKPT_TEST_SERVERS"] = servers
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "--tb=line", *nodes]
    if first_failure:
        (scratch / f"{FIRST_FAILURE_PLUGIN}.py").write_text(FIRST_FAILURE_SOURCE)
        cmd[3:3] = ["-p", FIRST_FAILURE_PLUGIN]  # importable: ``python -m`` puts the copy's root on sys.path
    p = subprocess.run(cmd, check=False, cwd=scratch, env=env, capture_output=True, text=True, timeout=PYTEST_TIMEOUT_S)
    return p.returncode, p.stdout + p.stderr


def failed_nodes(output: str) -> list[str]:
    return re.findall(r"^FAILED (\S+)", output, flags=re.MULTILINE)


def check_imports_scratch(scratch: Path) -> None:
    p = subprocess.run([sys.executable, "-c", "import ckptstore, sys; sys.stdout.write(ckptstore.__file__)"],
                       cwd=scratch, capture_output=True, text=True, check=True)
    if not Path(p.stdout).resolve().is_relative_to(scratch.resolve()):
        raise SystemExit(f"the scratch copy does not import its own ckptstore (got {p.stdout}); aborting")


@contextlib.contextmanager
def started_servers(chosen: list[Mutation]) -> Iterator[str]:
    """The object-store servers the chosen mutations' backends need, started once for the whole check
    (moto takes ~3 s to start, SeaweedFS ~4 s) and handed to every run as ``CKPT_TEST_SERVERS``
    (tests/conftest.py attaches to them instead of starting its own); each test still works under its
    own unique prefix. A server that cannot start fails the check with its log."""
    kinds = sorted({k.strip().removesuffix("-obstore") for m in chosen for k in m.backends.split(",")}
                   & {"seaweedfs", "moto", "fakegcs"})
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from devservers.servers import SERVERS

    started: list[Any] = []
    try:
        for kind in kinds:
            started.append(SERVERS[kind]().start())
        yield json.dumps({srv.name: srv.port for srv in started})
    finally:
        for srv in started:
            srv.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        print(f"unknown mutations: {sorted(unknown)}", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            print(f"{m.name:32} {'survivor ' if m.survivor else ''}{m.file}: {m.rule}")
        return 0
    t0 = time.monotonic()
    results: list[tuple[Mutation, bool, str, float]] = []
    with tempfile.TemporaryDirectory(prefix="ckpt-mutations-") as tmp, started_servers(chosen) as servers:
        pycache = Path(os.environ.get("PYTHONPYCACHEPREFIX")
                       or Path(tempfile.gettempdir()) / f"ckptstore-pycache-{os.getuid()}")
        base = Path(tmp) / "baseline"
        copy_repo(base)
        check_imports_scratch(base)
        # baseline: every named test passes on the unmodified code, per backend set
        groups: dict[str, set[str]] = {}
        for m in chosen:
            groups.setdefault(m.backends, set()).update(m.must_fail)
        for backends, nodes in groups.items():
            rc, out = run_pytest(base, tuple(sorted(nodes)), backends, pycache=pycache, servers=servers)
            if rc != 0:
                print(out[-4000:])
                print(f"BASELINE FAILED (CKPT_BACKENDS={backends}): the named tests must pass on the unmodified code")
                return 1
        print(f"baseline: the named tests pass on the unmodified code ({time.monotonic() - t0:.0f}s)", flush=True)
        for m in chosen:
            t1 = time.monotonic()
            scratch = Path(tmp) / m.name
            copy_repo(scratch)
            apply(m, scratch)
            rc, out = run_pytest(scratch, m.must_fail, m.backends, pycache=pycache, servers=servers,
                                 first_failure=True)
            failed = failed_nodes(out)
            missed = [n for n in m.must_fail if not any(f == n or f.startswith(n + "[") for f in failed)]
            caught = rc == 1 and not missed
            if caught:
                detail = f"{len(failed)} failing case(s), e.g. {failed[0]}"
            elif rc not in (0, 1):
                detail = f"pytest exited {rc} (not a test failure):\n{out[-2000:]}"
            else:
                detail = f"still green: {', '.join(missed)}"
            results.append((m, caught, detail, time.monotonic() - t1))
            print(f"{'CAUGHT ' if caught else 'SURVIVED'} {m.name:32} {time.monotonic() - t1:5.0f}s  {detail}",
                  flush=True)
            shutil.rmtree(scratch, ignore_errors=True)
            shutil.rmtree(pycache / scratch.resolve().relative_to(scratch.resolve().anchor), ignore_errors=True)
    survived = [m.name for m, ok, _, _ in results if not ok]
    print(f"\n{len(results) - len(survived)}/{len(results)} mutations caught in {time.monotonic() - t0:.0f}s"
          + (f"; SURVIVED: {', '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
