"""A tiered store that is never closed (issue 31 item 9): at interpreter exit
the pending saves are replicated within ``close_flush_seconds``, or a
:class:`~ckptstore.tiers.NotDurableAtExitWarning` names how many stay local
and the fix. The durable tier's commit create is slowed by a fault point, so
replication is certainly still pending when the script's last line returns."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from ckptstore import CheckpointStore, SaveState
from ckptstore.backends.local import LocalBackend

SCRIPT = textwrap.dedent("""
    import sys
    from ckptstore import CheckpointStore, OpenOptions, TierOptions
    from ckptstore.backends.faults import FaultyBackend
    from ckptstore.backends.local import LocalBackend

    durable, local, delay, flush = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    slow = FaultyBackend(LocalBackend(durable)).slow(
        None, delay, when=lambda op, key: op == "create" and "/commits/" in key)
    store = CheckpointStore.open(slow, "run", identity={"data": "d"},
                                 options=OpenOptions(tiers=TierOptions(local, close_flush_seconds=flush)))
    with store.save(1) as s:
        s.put("model", b"weights" * 1000)
    assert store.replication_status().pending == (1,), store.replication_status()
    print("saved", flush=True)
    # no close(): the interpreter exits here
""")


def run(tmp_path: Path, delay: float, flush: float) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "forgets_close.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), str(tmp_path / "durable"), str(tmp_path / "local"),
                           str(delay), str(flush)], capture_output=True, text=True, timeout=120)


def durable_steps(tmp_path: Path) -> list[int]:
    r = CheckpointStore.open(LocalBackend(tmp_path / "durable"), "run", mode="r")
    return [s.step for s in r.list_saves() if s.state is SaveState.COMMITTED]


def test_a_store_never_closed_replicates_its_newest_save_at_exit(tmp_path: Path) -> None:
    out = run(tmp_path, delay=1.0, flush=60)
    assert out.returncode == 0, out.stderr
    assert "saved" in out.stdout
    assert "NotDurableAtExitWarning" not in out.stderr
    assert durable_steps(tmp_path) == [1]


def test_a_flush_that_runs_out_at_exit_warns_with_the_count_and_the_fix(tmp_path: Path) -> None:
    out = run(tmp_path, delay=30.0, flush=0.2)
    assert out.returncode == 0, out.stderr
    assert "NotDurableAtExitWarning" in out.stderr
    assert "1 local save(s) (step(s) 1)" in out.stderr and "close the store" in out.stderr


def test_a_defect_in_the_copy_is_reported_and_replication_goes_on(tmp_path: Path) -> None:
    """An exception that is not the library's (a bug, a library below raising ValueError)
    skips that save with reason "error" instead of killing the replicator thread (which
    left the save "pending" forever and every flush waiting its whole timeout)."""
    from ckptstore.backends.faults import FaultyBackend

    durable = FaultyBackend(LocalBackend(tmp_path / "durable")).fail(
        None, ValueError("boom"), when=lambda op, key: op == "create" and "/commits/" in key)
    store = CheckpointStore.open(durable, "run", identity={"data": "d"}, local_tier=tmp_path / "local")
    with store.save(1) as s:
        s.put("model", b"one" * 100)
    assert store.flush(timeout=30)
    st = store.replication_status()
    assert st is not None and st.pending == () and st.skipped == ((1, "error"),)
    assert st.last_error is not None and "ValueError: boom" in st.last_error
    durable.faults.clear()
    with store.save(2) as s:
        s.put("model", b"two" * 100)
    assert store.flush(timeout=30)
    store.close()
    assert durable_steps(tmp_path) == [2]
