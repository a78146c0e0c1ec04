"""The wheel is what users install: test it, not the source tree.

The sdist and the wheel are built from a copy of the checkout with
``python -m build`` (the wheel from the sdist, so a file the sdist leaves out
breaks the wheel too; no isolated build environment: the ``test`` extra
brings ``build`` and ``setuptools``). The wheel is installed into a bare
virtualenv with the core's dependencies only (from the package index, as
``pip install ckptstore`` would), and from there — never this checkout — the
README's raw-store example runs, then ``ckptstore --help`` and ``ckptstore ls``
on the store it made; ``import ckptstore.torch`` fails with one
``ExtraRequiredError`` naming ``pip install 'ckptstore[torch]'``. With the
``torch`` extra's packages available (the test interpreter's torch,
safetensors and numpy, through a path file), the README's training loop runs
from the installed wheel too.

Everything lives under the test's temporary directory (pip's cache off).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.house.test_docs import readme_examples

ROOT = Path(__file__).resolve().parents[2]
SKIP = {".git", ".venv", "build", "dist", "site", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache",
        ".mypy_cache", ".bench-tmp", "drill-out", ".whl", ".gl"}
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]


def _env(tmp: Path) -> dict[str, str]:
    """No PYTHONPATH (nothing of this checkout importable), no pip cache, no user site."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}}
    env.update(PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONNOUSERSITE="1", HOME=str(tmp / "home"))
    (tmp / "home").mkdir(exist_ok=True)
    return env


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"{proc.args}: exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(sdist, wheel, a bare venv with the wheel and the core's dependencies only)."""
    tmp = tmp_path_factory.mktemp("wheel")
    env = _env(tmp)
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=lambda d, names: [n for n in names if n in SKIP or n.endswith(".egg-info")])
    _ok(_run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "dist"), str(src)], tmp, env))
    sdists = list((tmp / "dist").glob(f"ckptstore-{VERSION}.tar.gz"))
    wheels = list((tmp / "dist").glob(f"ckptstore-{VERSION}-py3-none-any.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, list((tmp / "dist").iterdir())
    bare = tmp / "bare"
    _ok(_run([sys.executable, "-m", "venv", str(bare)], tmp, env))
    _ok(_run([str(bare / "bin" / "python"), "-m", "pip", "install", "-q", str(wheels[0])], tmp, env))
    return sdists[0], wheels[0], bare


def test_the_wheel_holds_the_package_and_nothing_of_the_repository(built: tuple[Path, Path, Path]) -> None:
    _, wheel, _ = built
    names = zipfile.ZipFile(wheel).namelist()
    assert "ckptstore/py.typed" in names and "ckptstore/torch/__init__.py" in names
    assert not [n for n in names if n.split("/")[0] in {"tests", "bench", "devservers", "docs", "protocol_spec"}]
    meta = zipfile.ZipFile(wheel).read(f"ckptstore-{VERSION}.dist-info/METADATA").decode()
    assert "Provides-Extra: metrics" in meta and "Provides-Extra: torch" in meta


def test_the_bare_install_runs_the_readme_store_example_and_the_cli(built: tuple[Path, Path, Path],
                                                                    tmp_path: Path) -> None:
    _, _, bare = built
    env = _env(tmp_path)
    py, cli = str(bare / "bin" / "python"), str(bare / "bin" / "ckptstore")
    # the interpreter imports the installed wheel: no optional dependency, not this checkout
    where = _ok(_run([py, "-c", "import importlib.metadata as m, importlib.util as u, ckptstore; "
                      "print(ckptstore.__file__); print(ckptstore.__version__, m.version('ckptstore')); "
                      "print([n for n in ('torch', 'numpy', 's3fs', 'prometheus_client') if u.find_spec(n)])"],
                     tmp_path, env)).splitlines()
    assert where[0].startswith(str(bare)) and not where[0].startswith(str(ROOT)), where
    assert where[1] == f"{VERSION} {VERSION}" and where[2] == "[]", where
    (tmp_path / "example.py").write_text(readme_examples()["raw-store"], encoding="utf-8")
    assert _ok(_run([py, "example.py"], tmp_path, env)).splitlines() == ["latest: 0 []"]
    assert _ok(_run([py, "example.py"], tmp_path, env)).splitlines() == ["resumed: b'state at step 0'", "latest: 1 []"]
    assert "usage: ckptstore" in _ok(_run([cli, "--help"], tmp_path, env))
    listing = _ok(_run([cli, "ls", "ckpt-raw", "demo"], tmp_path, env))
    rows = [ln.split() for ln in listing.splitlines() if "committed" in ln]
    assert [r[1] if r[0] == "*" else r[0] for r in rows] == ["1", "0"], listing  # both saves, newest selected
    r = _run([py, "-c", "import ckptstore.torch"], tmp_path, env)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ckptstore.errors.ExtraRequiredError:") and "pip install 'ckptstore[torch]'" in last, r.stderr


def test_with_the_torch_extra_the_readme_training_loop_runs_from_the_wheel(built: tuple[Path, Path, Path],
                                                                           tmp_path: Path) -> None:
    _, wheel, bare = built
    env = _env(tmp_path)
    venv = tmp_path / "torchvenv"
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env))
    py = str(venv / "bin" / "python")
    _ok(_run([str(bare / "bin" / "python"), "-m", "pip", "--python", py, "install", "-q", "--no-deps", str(wheel)],
             tmp_path, env))
    # torch, safetensors and numpy (and blake3, fsspec) from the test's own interpreter: appended after the venv's own site-packages
    # (a path line, so that directory's own .pth files - an editable ckptstore - are not processed)
    site = Path(_ok(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env)).strip())
    (site / "torch-from-test.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    code = readme_examples()["checkpointer"] + "\nimport ckptstore.torch as _ct\nprint('FROM', _ct.__file__)\n"
    (tmp_path / "loop.py").write_text(code, encoding="utf-8")
    out = _ok(_run([py, "loop.py"], tmp_path, env, timeout=300)).splitlines()
    assert out[0] == "starting at step 0", out
    assert out[-1].startswith(f"FROM {site}"), out
    out = _ok(_run([py, "loop.py"], tmp_path, env, timeout=300)).splitlines()
    assert out[0] == "starting at step 50", out  # resumed from the wheel's own saves
