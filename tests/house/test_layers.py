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

PKG = Path(__file__).resolve().parents[2] / "ckptstore"



def _written_order() -> list[str]:
    """The one written layer order: the ``::`` block of ``ckptstore/core/__init__.py``'s docstring."""
    doc = ast.get_docstring(ast.parse((PKG / "core" / "__init__.py").read_text())) or ""
    block = doc.split("::", 1)[1]
    return [ln.split()[0] for ln in block.splitlines() if ln.strip()]


# The core, bottom to top. A module may import only modules listed before it
# (and itself-level siblings of the protocol package, which is one layer).
CORE_ORDER = _written_order()
OPTIONAL_ROOTS = ("torch", "numpy", "matplotlib", "safetensors", "torchdata", "lightning", "transformers", "obstore",
                  "prometheus_client")


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
        for node in ast.walk(ast.parse(path.read_text())):  # imports only: docstrings may point to the kit
            if isinstance(node, ast.ImportFrom):
                base = "." * node.level + (node.module or "")
                names = [base] + [base + ("." if node.module else "") + a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any(n.startswith("ckptstore.testing") or n.lstrip(".").startswith("testing") for n in names), path


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
        import ckptstore, ckptstore.cli.commands, ckptstore.store, ckptstore.backends.schemes, ckptstore.backends.faults
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
        from ckptstore.cli.commands import main
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
        from ckptstore.cli.commands import main
        sys.exit(main([]))
    """
    r = _run_blocked(code, tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "pip install 'ckptstore[runs]'" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_the_torch_adapter_without_its_extra_says_which_to_install(tmp_path: Path) -> None:
    code = """
        try:
            import ckptstore.torch
        except ImportError as exc:
            from ckptstore import ExtraRequiredError
            print(type(exc).__name__, isinstance(exc, ExtraRequiredError), exc)
    """
    r = _run_blocked(code, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ExtraRequiredError True import ckptstore.torch needs the 'torch' extra"), r.stdout
    assert r.stdout.strip().endswith("pip install 'ckptstore[torch]'"), r.stdout


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


# ------------------------------------------------------------------ cycles and private names


def _all_modules() -> dict[str, Path]:
    return {_module_of(p): p for p in sorted(PKG.rglob("*.py"))}


def _graph() -> dict[str, set[str]]:
    """Every import between modules of the package (module level and inside functions)."""
    mods = _all_modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        deps = set()
        for dep in _imports(path, mod):
            # a package import ("core") counts as an import of its __init__
            if dep in mods and dep != mod:
                deps.add(dep)
        graph[mod] = deps
    return graph


def test_every_core_module_is_in_the_written_order() -> None:
    written = set(CORE_ORDER)
    core = [m for m in _all_modules() if m.split(".")[0] in ("core", "util", "backends") and m not in
            ("core", "util", "backends")]
    missing = sorted(m for m in core if m not in written)
    assert not missing, f"add these to the layer order in ckptstore/core/__init__.py: {missing}"


def test_no_import_cycle() -> None:
    graph = _graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:  # iterative enough for a package of ~120 modules
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_names(tree: ast.AST) -> set[str]:
    """Names a module defines itself: functions, classes, assignments, ``self._x = ...``."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
    return out


SHIMS = "shims"  # the one place another library's private names may appear


def test_no_private_name_crosses_a_module() -> None:
    """No ``_name`` is imported from another module of the package, or touched on
    another module's object; another library's private names appear only in
    ``ckptstore/shims/`` (one module per library)."""
    problems = []
    for mod, path in _all_modules().items():
        tree = ast.parse(path.read_text())
        own = _defined_names(tree)
        in_shims = mod.split(".")[0] == SHIMS
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                ours = bool(node.level) or (node.module or "").startswith("ckptstore")
                for a in node.names:
                    if _private(a.name) and (ours or not in_shims):
                        problems.append(f"{mod} imports {a.name} from {'.' * node.level}{node.module or ''}")
                if not ours and not in_shims and any(_private(p) for p in (node.module or "").split(".")):
                    problems.append(f"{mod} imports from the private module {node.module}")
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                root = node.value
                if isinstance(root, ast.Name) and root.id in ("self", "cls"):
                    continue
                if isinstance(root, ast.Call) and isinstance(root.func, ast.Name) and root.func.id == "super":
                    continue
                if node.attr in own and not in_shims:
                    continue  # the module's own attribute, on another instance of its own class
                if not in_shims:
                    problems.append(f"{mod}:{node.lineno} touches {ast.unparse(node)}")
    assert not problems, "private names across modules:\n" + "\n".join(problems)


@pytest.mark.parametrize("shim, dist, tested", [
    ("torch_private", "torch", ">=2.4,<3"),
    ("lightning_private", "lightning", ">=2.5,<3"),
])
def test_each_shim_pins_the_versions_it_was_tested_with(shim: str, dist: str, tested: str) -> None:
    """An upgrade outside a shim's tested range fails here, with the shim named,
    before a user's save meets a moved private name."""
    import importlib
    from importlib.metadata import version

    pytest.importorskip(dist)
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    mod = importlib.import_module(f"ckptstore.shims.{shim}")
    assert mod.TESTED == tested
    installed = Version(version(dist).split("+")[0])
    assert installed in SpecifierSet(mod.TESTED), (
        f"{dist} {installed} is outside ckptstore/shims/{shim}.py's tested range {mod.TESTED}: check each private "
        "name it uses against the new release, then widen TESTED (and the extra's range in pyproject.toml)")


#: add-ons: code that builds on the store from outside it
ADDONS = ("integrations", "cli", "distributed")
#: the public surface an add-on may import besides its own package: the facade, the pure protocol,
#: the backends, the errors, and the other add-on layers
ADDON_MAY_IMPORT = ("", "store", "options", "protocol", "backends", "errors", "util", "identity", "retry", "defaults", "torch",
                    "ops", "integrations", "cli", "distributed", "shims")
#: packages whose ``__init__`` (their public names) an add-on may import, not their modules
ADDON_MAY_IMPORT_PACKAGE = ("tiers", "core")
#: internals an add-on still imports, each with why; the list only shrinks (issue 31 item 3 moves these
#: protocol steps behind the placement interface)
ADDON_EXCEPTIONS = {
    # the coordinator runs PROTOCOL.md §9.4's deadline check for every rank's inventory
    ("distributed.coordinator", "core.piece_deadlines"),
}


def test_add_ons_import_the_public_surface_not_core_or_tiers() -> None:
    graph = _graph()
    bad = sorted(
        (m, d) for m, deps in graph.items() if m.split(".")[0] in ADDONS
        for d in deps if d.split(".")[0] not in ADDON_MAY_IMPORT and d not in ADDON_MAY_IMPORT_PACKAGE
        and (m, d) not in ADDON_EXCEPTIONS
    )
    assert not bad, f"an add-on imports internals (import them from the ckptstore facade instead): {bad}"
    stale = sorted(e for e in ADDON_EXCEPTIONS if e[1] not in graph.get(e[0], ()))
    assert not stale, f"no longer imported: remove from ADDON_EXCEPTIONS: {stale}"
