"""The mutation check is part of the test command, so it cannot go stale.

``tests/mutations/run.py`` breaks the core on purpose (one rule per mutation)
and proves that the tests named for that rule turn red. Two tests here:

* every mutation's snippets occur exactly once in today's source (fast: a
  refactor that moves a snippet fails here with the mutation's name, instead
  of silently detaching the break);
* the whole check runs and catches every mutation.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "mutations" / "run.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ckpt_mutations", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def test_every_mutation_snippet_is_in_the_source_exactly_once() -> None:
    mod = _load()
    assert len(mod.MUTATIONS) >= 16
    for m in mod.MUTATIONS:
        for file, edits in mod.edits_by_file(m).items():
            text = (ROOT / file).read_text()
            for snippet, replacement in edits:
                assert snippet != replacement, m.name
                assert text.count(snippet) == 1, (
                    f"mutation {m.name!r}: its snippet occurs {text.count(snippet)} times in {file}; "
                    "retarget it in tests/mutations/run.py"
                )
                text = text.replace(snippet, replacement)
        for node in m.must_fail:
            path = node.split("::", 1)[0]
            assert (ROOT / path).is_file(), f"mutation {m.name!r} names a missing test file {path}"


@pytest.mark.slow
def test_every_mutation_is_caught() -> None:
    mod = _load()
    p = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                       check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    n = len(mod.MUTATIONS)
    assert re.search(rf"^{n}/{n} mutations caught in \d+s$", out, flags=re.MULTILINE), out[-3000:]
    assert out.count("CAUGHT ") == n, out[-3000:]
