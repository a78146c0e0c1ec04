"""The rank processes of the multi-rank tests are forked from a zygote with torch
imported (tests/workers/zygote.py, tests/workers/dist_launch.py). These tests hold
such a child to what ``python SCRIPT`` gives: the same view of argv, path,
working directory, environment and stdin, the same output, and the same end
(threads joined, atexit handlers, exit status, a traceback, a SIGKILL)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.workers.dist_launch import ROOT, zygote

PROBE = str(Path(__file__).parents[1] / "workers" / "launch_probe.py")


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def forked(end: str, tmp_path: Path, rank: int = 0, probe_env: str = "forked") -> tuple[int, str, str]:
    e = {**env(), "PROBE": probe_env}
    tmp_path.mkdir(parents=True, exist_ok=True)
    z = zygote(rank, env())
    with open(tmp_path / f"{rank}.out", "wb") as so, open(tmp_path / f"{rank}.err", "wb") as se:
        pid = z.spawn(PROBE, [json.dumps({"end": end})], e, so.fileno(), se.fileno())
    code = z.wait(pid, 60)
    assert code is not None
    return code, (tmp_path / f"{rank}.out").read_text(), (tmp_path / f"{rank}.err").read_text()


def fresh(end: str) -> tuple[int, str, str]:
    p = subprocess.run([sys.executable, PROBE, json.dumps({"end": end})], capture_output=True, text=True,
                       env={**env(), "PROBE": "fresh"}, stdin=subprocess.DEVNULL, timeout=60)
    return p.returncode, p.stdout, p.stderr


def same_view(out: str) -> list[str]:
    """The output without the values that differ between any two processes (the hash seed, the PROBE value)."""
    lines = out.splitlines()
    first = lines[0].split(" ")
    first[first.index("hash") + 1] = "H"
    first[first.index("draws") + 1] = "D"
    first[first.index("env") + 1] = "E"
    return [" ".join(first), *lines[1:]]


@pytest.mark.parametrize("end", ["return", "exit3", "message", "raise", "kill"])
def test_a_forked_rank_starts_and_ends_like_python_script(end: str, tmp_path: Path) -> None:
    f_code, f_out, f_err = forked(end, tmp_path)
    p_code, p_out, p_err = fresh(end)
    assert f_code == p_code  # 0, 3, 1, 1, -9
    assert f_out.split(" ")[f_out.split(" ").index("env") + 1] == "forked"  # the environment of the request
    assert same_view(f_out) == same_view(p_out)  # argv, sys.path[0], cwd, __main__, stdin, threads, atexit
    if end == "raise":  # the traceback, as the interpreter prints it (the zygote's frames above the script's)
        assert f_err.startswith("to stderr\nTraceback (most recent call last):\n")
        assert f_err.splitlines()[-1] == p_err.splitlines()[-1] == "ValueError: probe failed on purpose"
    else:
        assert f_err == p_err


def test_ranks_of_one_job_differ_in_hash_seed_like_fresh_processes(tmp_path: Path) -> None:
    def seed(out: str) -> str:
        first = out.splitlines()[0].split(" ")
        return first[first.index("hash") + 1]

    seeds = {seed(forked("return", tmp_path, rank)[1]) for rank in (0, 1)}
    fixed = os.environ.get("PYTHONHASHSEED", "random") != "random"  # then every process has that seed
    assert len(seeds) == (1 if fixed else 2)


def test_children_of_one_zygote_draw_different_random_numbers_like_fresh_processes(tmp_path: Path) -> None:
    """A fork inherits its parent's generators; the zygote seeds each child afresh
    (two runs of one trainer would otherwise augment alike by accident)."""
    def draws(out: str) -> str:
        first = out.splitlines()[0].split(" ")
        return first[first.index("draws") + 1]

    got = {draws(forked("return", tmp_path / str(i), 0)[1]) for i in range(3)}
    assert len(got) == 3, got
