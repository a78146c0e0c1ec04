"""bench/ reads like a map (issue 19 item 6): every row of the suite is one
module of bench/rows/ with a ``run``, every module there is a row of the
suite, studies live apart, and the only committed result is latest.md."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _suite_rows() -> list[str]:
    tree = ast.parse((ROOT / "bench" / "suite.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ROWS" for t in node.targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, list)
            return [str(v) for v in value]
    raise AssertionError("bench/suite.py has no ROWS list")


def test_every_suite_row_is_one_module_with_run_and_every_module_is_a_row() -> None:
    rows = _suite_rows()
    modules = sorted(p.stem for p in (ROOT / "bench" / "rows").glob("*.py") if p.stem != "__init__")
    assert sorted(rows) == modules
    for name in rows:
        tree = ast.parse((ROOT / "bench" / "rows" / f"{name}.py").read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == "run" for n in tree.body), name


def test_studies_and_scratch_stay_out_of_the_suite() -> None:
    top = sorted(p.name for p in (ROOT / "bench").glob("*.py"))
    assert top == ["__init__.py", "common.py", "suite.py", "torchstate.py"]
    assert (ROOT / "bench" / "studies" / "hotspots.py").exists()
    tracked = subprocess.run(["git", "ls-files", "bench/results"], cwd=ROOT, capture_output=True, text=True, check=True)
    if tracked.returncode == 0 and tracked.stdout.strip():
        assert sorted(tracked.stdout.split()) == ["bench/results/.gitignore", "bench/results/latest.md"]
