"""The public import paths: every module a user may import, each importing,
and the moved ones kept as deprecated aliases for one release.

:data:`PUBLIC` is the list of modules users may import. It is derived from the
documentation — the ``:::`` API pages under ``docs/api/`` (wired in
``mkdocs.yml``), the README and the guide pages — and checked against both:
every module the docs name is listed, and every listed module exists in the
package. Every subpackage of ``ckptstore`` is either public or named in
:data:`INTERNAL_PACKAGES`, so a new one has to be classified here.

:data:`ALIASES` maps each path that moved (and was named in an earlier README)
to its new home: a real module that warns once at import with a
``DeprecationWarning`` naming the new path, and re-exports the new module's
public names (its ``__all__``) as the same objects. CHANGELOG.md says when
they go.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import typing
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "ckptstore"

PUBLIC = [
    "ckptstore",
    "ckptstore.errors",
    "ckptstore.identity",
    "ckptstore.retry",
    "ckptstore.options",
    "ckptstore.backends",
    "ckptstore.backends.faults",
    "ckptstore.tiers",
    "ckptstore.torch",
    "ckptstore.torch.codec",
    "ckptstore.distributed",
    "ckptstore.distributed.ranked",
    "ckptstore.distributed.dcp",
    "ckptstore.distributed.dcp.compat",
    "ckptstore.integrations",
    "ckptstore.integrations.hf",
    "ckptstore.integrations.lightning",
    "ckptstore.integrations.lightning.async_io",
    "ckptstore.ops",
    "ckptstore.ops.decision",
    "ckptstore.ops.promote",
    "ckptstore.ops.artifact",
    "ckptstore.ops.status",
    "ckptstore.ops.artifact_check",
    "ckptstore.testing",
    "ckptstore.testing.conformance",
    "ckptstore.testing.invariants",
    "ckptstore.testing.raw",
    "ckptstore.testing.simfs",
    "ckptstore.testing.wireproxy",
]

#: old path -> new path (deprecated in 0.2.0, removed in 0.3.0)
ALIASES = {
    "ckptstore.faults": "ckptstore.backends.faults",
    "ckptstore.runs": "ckptstore.ops",
    "ckptstore.runs.decision": "ckptstore.ops.decision",
    "ckptstore.distributed.dcp_compat": "ckptstore.distributed.dcp.compat",
    "ckptstore.integrations.lightning_async": "ckptstore.integrations.lightning.async_io",
}

#: subpackages that are the implementation, not an import path users rely on
INTERNAL_PACKAGES = {
    "ckptstore.cli", "ckptstore.core", "ckptstore.ops.drill", "ckptstore.protocol", "ckptstore.shims",
    "ckptstore.util",
}

DOTTED = re.compile(r"(?<![\w.])ckptstore(?:\.[A-Za-z_]\w*)+")


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT / rel.with_suffix(".py")).is_file() or (ROOT / rel / "__init__.py").is_file()


def _module_named(token: str) -> str:
    """The longest prefix of a dotted name that is a module of the package
    (``ckptstore.torch.codec.register_type`` -> ``ckptstore.torch.codec``)."""
    parts = token.split(".")
    for n in range(len(parts), 0, -1):
        if _is_module(".".join(parts[:n])):
            return ".".join(parts[:n])
    raise AssertionError(token)


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_module_the_docs_name_is_listed() -> None:
    named: dict[str, str] = {}
    for path in _doc_files():
        for token in DOTTED.findall(path.read_text(encoding="utf-8")):
            named.setdefault(_module_named(token), f"{path.relative_to(ROOT)}: {token}")
    missing = {m: where for m, where in named.items() if m not in PUBLIC and m not in ALIASES}
    assert not missing, f"modules the docs name but PUBLIC does not list: {missing}"


def test_the_api_pages_document_only_listed_modules_and_are_in_the_site() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted((ROOT / "docs" / "api").glob("*.md"))
    assert pages
    for page in pages:
        assert f"api/{page.name}" in nav, f"{page.name} is not in mkdocs.yml's nav"
        targets = re.findall(r"^::: (\S+)", page.read_text(encoding="utf-8"), re.M)
        assert targets, page
        for t in targets:
            assert _module_named(t) in PUBLIC, f"{page.name} documents {t}, whose module is not in PUBLIC"


def test_the_list_matches_the_package() -> None:
    for name in [*PUBLIC, *ALIASES, *ALIASES.values(), *INTERNAL_PACKAGES]:
        assert _is_module(name), f"{name} is listed but is not a module of the package"
    assert not set(PUBLIC) & set(ALIASES) and len(set(PUBLIC)) == len(PUBLIC)
    assert set(ALIASES.values()) <= set(PUBLIC), "an alias must point at a public path"
    packages = {".".join(p.parent.relative_to(ROOT).parts) for p in PKG.rglob("__init__.py")}
    unclassified = packages - set(PUBLIC) - set(ALIASES) - INTERNAL_PACKAGES
    assert not unclassified, f"subpackages neither public nor internal: {sorted(unclassified)} (classify them here)"


@pytest.mark.parametrize("name", PUBLIC)
def test_each_public_path_imports(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # a public path is never one of the aliases
        mod = importlib.import_module(name)
    for n in getattr(mod, "__all__", []):
        assert hasattr(mod, n), f"{name}.__all__ names {n}, which it does not define"


def _classes_in(hint: object) -> list[type]:
    out = [hint] if isinstance(hint, type) else []
    for arg in typing.get_args(hint):
        out += _classes_in(arg)
    return out


def test_the_types_the_entry_points_take_are_exported() -> None:
    """A type a user passes to an entry point can be imported from a package's ``__all__``
    (not only from the module that defines it): ``PieceTiming`` from ``ckptstore``,
    ``RankStore`` from ``ckptstore.distributed``, the Checkpointer's store and streams
    contracts from ``ckptstore.torch``."""
    import ckptstore
    import ckptstore.distributed
    import ckptstore.torch

    pkgs = (ckptstore, ckptstore.distributed, ckptstore.torch)
    exported = {id(getattr(m, n)) for m in pkgs for n in m.__all__}
    entry = (ckptstore.CheckpointStore.open, ckptstore.distributed.open_distributed,
             ckptstore.distributed.RankStore.__init__, ckptstore.torch.Checkpointer.__init__)
    missing = sorted(
        f"{f.__qualname__}({arg}): {c.__module__}.{c.__qualname__}"
        for f in entry for arg, hint in typing.get_type_hints(f).items() for c in _classes_in(hint)
        if c.__module__.split(".")[0] == "ckptstore" and id(c) not in exported
    )
    assert not missing, missing
    assert ckptstore.PieceTiming is importlib.import_module("ckptstore.core.intents").PieceTiming
    assert ckptstore.distributed.RankStore is importlib.import_module("ckptstore.distributed.ranked").RankStore


def _fresh_import(name: str) -> subprocess.CompletedProcess[str]:
    """``import name`` twice in a fresh interpreter (a user's import statement), recording every warning."""
    code = (
        "import json, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    import {name}\n"
        f"    import {name}\n"
        "print(json.dumps([[w.category.__name__, str(w.message), w.filename] for w in caught]))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          check=False)


@pytest.mark.parametrize("old,new", sorted(ALIASES.items()))
def test_each_alias_warns_once_naming_the_new_path(old: str, new: str) -> None:
    import json

    r = _fresh_import(old)
    assert r.returncode == 0, r.stderr
    caught = json.loads(r.stdout)
    own = [w for w in caught if w[1].startswith(f"{old} is deprecated")]
    assert len(own) == 1, caught  # once, though imported twice
    category, message, filename = own[0]
    assert category == "DeprecationWarning"
    assert f"import {new} instead" in message and "0.3.0" in message
    assert filename == "<string>", "the warning points at the importing code, not at ckptstore"


@pytest.mark.parametrize("old,new", sorted(ALIASES.items()))
def test_each_alias_is_a_real_module_exposing_the_same_objects(old: str, new: str) -> None:
    with pytest.warns(DeprecationWarning):
        sys.modules.pop(old, None)
        alias = importlib.import_module(old)
    target = importlib.import_module(new)
    assert alias is not target and alias.__file__ and Path(alias.__file__).is_file()
    public = list(getattr(target, "__all__", []))
    assert sorted(alias.__all__) == sorted(public)
    for n in public:
        assert getattr(alias, n) is getattr(target, n), f"{old}.{n} is not {new}.{n}"
