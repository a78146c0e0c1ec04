"""The package's shape: imports only downward, a pure protocol, a core that
runs without torch/numpy/matplotlib, and one-line errors for missing extras."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "ckptstore"

# The core, bottom to top. A module may import only modules listed before it
# (and itself-level siblings of the protocol package, which is one layer).
CORE_ORDER = [
    "errors",
    "redact",
    "protocol",
    "identity",
    "retry",
    "streams",
    "backends.base",
    "backends.memory",
    "backends.posix",
    "backends.local",
    "backends.fsspec_base",
    "backends.s3",
    "backends.gcs",
    "guards",
    "registry",
    "runio",
    "authn",
    "runbind",
    "fencing",
    "commits",
    "selectlimits",
    "catalog",
    "writer",
    "reader",
    "gcrun",
    "ledger",
    "resumepoint",
    "signrun",
    "store",
]
OPTIONAL_ROOTS = ("torch", "numpy", "matplotlib", "safetensors", "torchdata", "lightning", "transformers", "obstore")


def _layer(module: str) -> str:
    return "protocol" if module.startswith("protocol") else module


def _imports(path: Path, module: str) -> set[str]:
    """Modules of the package that ``path`` imports (relative or absolute)."""
    tree = ast.parse(path.read_text())
    pkg_parts = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[: len(pkg_parts) - (node.level - 1)]
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.startswith("ckptstore"):
                target = node.module[len("ckptstore.") :]
            else:
                continue
            names = [a.name for a in node.names]
            for n in names:
                cand = f"{target}.{n}" if target else n
                out.add(cand if (PKG / (cand.replace(".", "/") + ".py")).exists() else target)
    return {t for t in out if t}


def _module_of(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def test_core_imports_only_downward() -> None:
    rank = {m: i for i, m in enumerate(CORE_ORDER)}
    problems = []
    for path in sorted(PKG.rglob("*.py")):
        mod = _module_of(path)
        layer = _layer(mod)
        if layer not in rank:
            continue
        for dep in _imports(path, mod):
            dl = _layer(dep)
            if dl == layer:
                continue
            if dl not in rank or rank[dl] >= rank[layer]:
                problems.append(f"{mod} imports {dep}")
    assert not problems, "imports that do not go downward:\n" + "\n".join(problems)


def test_protocol_is_pure() -> None:
    """No I/O, no backends, no stores: only the standard library, blake3 and errors."""
    allowed_std = {
        "__future__", "json", "math", "re", "time", "uuid", "enum", "collections", "dataclasses", "typing", "hmac",
    }
    for path in (PKG / "protocol").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert roots <= allowed_std | {"blake3"}, f"{path.name} imports {roots}"
        src = path.read_text()
        assert "open(" not in src and "os." not in src, f"{path.name} does I/O"


def test_production_code_never_imports_the_test_kit() -> None:
    for path in PKG.rglob("*.py"):
        if "testing" in path.relative_to(PKG).parts:
            continue
        src = path.read_text()
        assert "ckptstore.testing" not in src and "from ..testing" not in src and "from .testing" not in src, path


# A subprocess in which torch, numpy and matplotlib cannot be imported.
BLOCKER = textwrap.dedent(
    """
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {roots!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
            return None
    sys.meta_path.insert(0, Block())
    import importlib.util
    _orig = importlib.util.find_spec
    importlib.util.find_spec = lambda n, *a: None if n.split(".")[0] in {roots!r} else _orig(n, *a)
    """
).format(roots=OPTIONAL_ROOTS)


def _run_blocked(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(PKG.parent))
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + textwrap.dedent(code)], capture_output=True, text=True, cwd=cwd, env=env,
        timeout=120,
    )


def test_core_import_graph_reaches_no_optional_dependency(tmp_path: Path) -> None:
    code = f"""
        import sys
        import ckptstore, ckptstore.cli, ckptstore.store, ckptstore.registry, ckptstore.faults
        import ckptstore.backends.local, ckptstore.backends.memory, ckptstore.backends.s3, ckptstore.backends.gcs
        import ckptstore.backends.obstore_s3, ckptstore.testing.raw
        bad = sorted(m for m in sys.modules if m.split(".")[0] in {OPTIONAL_ROOTS!r})
        print("LOADED", bad)
        sys.exit(1 if bad else 0)
    """
    r = _run_blocked(code, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_cli_works_with_the_core_alone(tmp_path: Path) -> None:
    store = tmp_path / "store"
    code = f"""
        import sys
        from ckptstore import CheckpointStore
        from ckptstore.cli import main
        st = CheckpointStore.open({str(store)!r}, "r1", identity={{"data_digest": "d"}})
        for step in (1, 2, 3):
            with st.save(step) as s:
                s.put("model", b"w" * step)
        for argv in (["ls"], ["latest", "--deep"], ["verify"], ["gc", "--keep-last", "1"], ["inspect"]):
            rc = main([argv[0], {str(store)!r}, "r1", *argv[1:]])
            assert rc == 0, (argv, rc)
        print("CLI-OK")
    """
    r = _run_blocked(code, tmp_path)
    assert r.returncode == 0 and "CLI-OK" in r.stdout, r.stdout + r.stderr
    assert "step 3" in r.stdout or "3" in r.stdout


def test_drill_without_its_extra_says_which_to_install(tmp_path: Path) -> None:
    code = """
        import sys
        from ckptstore.cli import main
        sys.exit(main([]))
    """
    r = _run_blocked(code, tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "pip install 'ckptstore[runs]'" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("scheme", ["az", "weird"])
def test_unknown_scheme_names_the_known_ones(scheme: str) -> None:
    from ckptstore import CheckpointStore, InvalidInputError

    with pytest.raises(InvalidInputError, match="known: .*file.*s3"):
        CheckpointStore.open(f"{scheme}://bucket/x", "r")


def test_a_plugin_scheme_opens_through_the_registry() -> None:
    from ckptstore import CheckpointStore, register_scheme
    from ckptstore.backends.memory import MemoryBackend

    mem = MemoryBackend("plugin")
    register_scheme("plug", lambda url, opts: mem)
    st = CheckpointStore.open("plug://anything", "r1", identity={"data_digest": "d"})
    with st.save(1) as s:
        s.put("m", b"x")
    assert st.backend is mem and st.latest_complete() is not None


def test_writer_open_inside_a_multi_rank_job_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank opening the run would register its own attempt and fence the
    others: refused, pointing at the distributed entry point (the check looks at
    torch.distributed only if the caller imported it; a stub stands in here)."""
    import types

    from ckptstore import CheckpointStore, InvalidInputError
    from ckptstore.backends.memory import MemoryBackend

    stub = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_world_size=lambda: 2)
    monkeypatch.setitem(sys.modules, "torch.distributed", stub)
    mem = MemoryBackend()
    with pytest.raises(InvalidInputError, match="open_distributed"):
        CheckpointStore.open(mem, "r", identity={"data_digest": "d"})
    st = CheckpointStore.open(mem, "r", identity={"data_digest": "d"}, single_writer=True)  # rank 0 saves
    assert st.attempt is not None
    member = CheckpointStore.open(mem, "r", identity={"data_digest": "d"}, join_attempt=st.attempt.number)
    assert member.attempt == st.attempt and len(member.attempts()) == 1


def test_obstore_url_without_its_extra_says_which_to_install(tmp_path: Path) -> None:
    code = """
        from ckptstore import CheckpointStore
        from ckptstore.errors import ExtraRequiredError
        try:
            CheckpointStore.open("s3+obstore://bucket/prefix", "run", mode="r")
        except ExtraRequiredError as exc:
            assert exc.extra == "obstore" and "pip install 'ckptstore[obstore]'" in str(exc), exc
            print("EXTRA-OK")
    """
    r = _run_blocked(code, tmp_path)
    assert r.returncode == 0 and "EXTRA-OK" in r.stdout, r.stdout + r.stderr
