"""A README claim is a test: the README's examples run as written, and the
documentation names only files that exist.

The examples are the fenced ``python`` blocks that follow a marker line
``<!-- docs-test: NAME -->`` in README.md. Each runs in a fresh interpreter,
in a temporary directory (its stores are relative paths), with this checkout
first on ``sys.path``. The site itself (links between pages, API references)
is checked by ``mkdocs build --strict`` in ``./dev test``; mkdocs cannot check
links to files outside ``docs/``, so the docs write those as plain paths and
:func:`test_paths_named_by_the_docs_exist` checks them here.
"""

from __future__ import annotations

import glob
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MARKED_BLOCK = re.compile(r"^<!-- docs-test: ([\w-]+) -->\n```python\n(.*?)^```", re.M | re.S)

#: a file of the repository named in prose: under one of these folders, ending in a file extension
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:protocol_spec|bench|tests|docs|ckptstore|devservers)/[\w./*-]*\.(?:md|py|json|svg|txt|toml))\b"
)


def readme_examples() -> dict[str, str]:
    found = MARKED_BLOCK.findall(README.read_text(encoding="utf-8"))
    examples = dict(found)
    assert len(examples) == len(found), "two README examples share a docs-test name"
    return examples


def run_example(code: str, cwd: Path, *, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    script = cwd / "example.py"
    script.write_text(code, encoding="utf-8")
    return subprocess.run(
        [sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def test_readme_has_the_two_examples() -> None:
    assert set(readme_examples()) == {"checkpointer", "raw-store"}


def test_raw_store_example_saves_selects_and_resumes(tmp_path: Path) -> None:
    code = readme_examples()["raw-store"]
    first = ok(run_example(code, tmp_path))
    assert first.splitlines() == ["latest: 0 []"]
    # run again: the open resumes from the save the first run published, verified
    second = ok(run_example(code, tmp_path))
    assert second.splitlines() == ["resumed: b'state at step 0'", "latest: 1 []"]


# What the README says of its loop: "kill it at any moment, run it again: it continues from the newest
# complete save with the same parameters, optimizer state and random streams". The test adds a seed in
# front (so two processes build the same initial model), a SIGKILL inside the loop for the killed run, and
# at the end a dump of the parameters, the optimizer's tensors and the global RNG state.
SEED = "import torch as _t\n_t.manual_seed(0)\n"
KILL_AT_STEP_25 = """
import os as _os, signal as _signal
from ckptstore.torch import Checkpointer as _Checkpointer
_step_end = _Checkpointer.step_end
def _killing_step_end(self, step, **kw):
    out = _step_end(self, step, **kw)
    if step == 25:
        self.wait()                                  # the save of step 19 is committed, 29 never started
        _os.kill(_os.getpid(), _signal.SIGKILL)
    return out
_Checkpointer.step_end = _killing_step_end
"""
DUMP = """
import pathlib as _pathlib
_parts = [p.detach().numpy().tobytes() for p in model.parameters()]
_parts += [v.numpy().tobytes() for s in opt.state.values() for _, v in sorted(s.items()) if torch.is_tensor(v)]
_parts.append(torch.get_rng_state().numpy().tobytes())
_pathlib.Path("final.bin").write_bytes(b"".join(_parts))
"""


def test_checkpointer_example_killed_and_rerun_ends_bit_for_bit_like_an_uninterrupted_run(tmp_path: Path) -> None:
    code = readme_examples()["checkpointer"]
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    clean.mkdir()
    killed.mkdir()

    out = ok(run_example(SEED + code + DUMP, clean))
    assert out.splitlines() == ["starting at step 0"]

    proc = run_example(SEED + KILL_AT_STEP_25 + code + DUMP, killed)
    assert proc.returncode == -9, proc.stderr
    assert not (killed / "final.bin").exists()

    out = ok(run_example(SEED + code + DUMP, killed))
    assert out.splitlines() == ["starting at step 20"]  # the newest complete save was step 19's
    assert (killed / "final.bin").read_bytes() == (clean / "final.bin").read_bytes()


def doc_files() -> list[Path]:
    # docs/contributing.md only includes CONTRIBUTING.md, whose code map describes the package layout
    return [README, *sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "contributing.md")]


def test_readme_links_resolve() -> None:
    text = README.read_text(encoding="utf-8")
    links = [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in t]
    assert links, "the README's where-next table links the docs"
    missing = [t for t in links if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_paths_named_by_the_docs_exist() -> None:
    missing = []
    for doc in doc_files():
        for path in sorted(set(REPO_PATH.findall(doc.read_text(encoding="utf-8")))):
            exists = glob.glob(str(ROOT / path)) if "*" in path else (ROOT / path).exists()
            if not exists:
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, "the docs name files that do not exist (moved? update the page):\n" + "\n".join(missing)


@pytest.mark.parametrize("name", ["checkpointer", "raw-store"])
def test_examples_fit_the_readme(name: str) -> None:
    # the README stays a front page: short examples, and the whole file about two screens
    assert len(readme_examples()[name].splitlines()) <= 16
    assert len(README.read_bytes()) <= 10_500


DOTTED = re.compile(r"(?<![\w./-])(ckptstore(?:\.[A-Za-z_]\w*)+)(?![\w/])")  # not a format name like ckptstore.artifact/1


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def test_python_names_in_the_docs_exist() -> None:
    # `ckptstore.x.y` in prose or examples: a module, class or function that moved makes the page wrong
    names = {n.rstrip(".") for doc in doc_files() for n in DOTTED.findall(doc.read_text(encoding="utf-8"))}
    names = {n for n in names if not n.endswith((".md", ".py"))}
    assert len(names) > 10
    missing = sorted(n for n in names if not resolves(n))
    assert not missing, f"the docs name Python objects that do not exist (moved? update the page): {missing}"


def test_the_code_map_names_every_folder_and_module() -> None:
    # CONTRIBUTING.md's code map is where the next engineer starts: a folder or module it does not
    # name, or one it names that is gone, fails here
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    section = text.split("## Code map", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not line.startswith("|") or set(cells[0]) <= {"-"} or cells[0] == "folder":
            continue
        folder = cells[0].strip("`")
        rows.setdefault(folder, set()).update(re.findall(r"`([A-Za-z_][\w]*/?)`", cells[1]))
    pkg = ROOT / "ckptstore"
    problems = []
    top = {p.stem for p in pkg.glob("*.py") if p.stem not in ("__init__", "__main__")}
    problems += [f"top-level module {m}.py is not in the code map" for m in sorted(top - rows.get("top level", set()))]
    problems += [f"the code map names top-level module {m}, which does not exist"
                 for m in sorted(rows.get("top level", set()) - top)]
    for d in sorted(p for p in pkg.iterdir() if (p / "__init__.py").exists()):
        named = rows.get(f"{d.name}/")
        if named is None:
            problems.append(f"folder {d.name}/ has no row in the code map")
            continue
        subs = [p for p in d.iterdir() if (p / "__init__.py").exists()]
        need = {p.stem for p in d.glob("*.py") if p.stem != "__init__"} | {f"{p.name}/" for p in subs}
        may = need | {p.stem for s in subs for p in s.glob("*.py") if p.stem != "__init__"}  # a sub-package's own
        problems += [f"{d.name}/{m} is not in the code map" for m in sorted(need - named)]
        problems += [f"the code map names {d.name}/{m}, which does not exist" for m in sorted(named - may)]
    assert not problems, "CONTRIBUTING.md's code map is out of date:\n" + "\n".join(problems)
