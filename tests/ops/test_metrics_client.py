"""The Prometheus metrics through ``prometheus-client`` (extra ``metrics``):
the same names, labels, help, types and values as the hand-written format of
0.1 wrote; a live registry users serve themselves; and without the extra, one
line naming ``pip install 'ckptstore[metrics]'``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from ckptstore import CheckpointStore
from ckptstore.backends.memory import MemoryBackend
from ckptstore.cli.commands import main
from ckptstore.errors import InvalidInputError
from ckptstore.ops.status import run_status, status_registry, status_samples
from ckptstore.torch import Checkpointer
from ckptstore.torch.metrics import METRICS
from ckptstore.util.prometheus import Sample, registry, render

ROOT = Path(__file__).resolve().parents[2]
IDENT = {"data_digest": "d", "code_digest": "c"}

#: what 0.1's hand-written renderer wrote for SAMPLES (kept verbatim: the client must agree on every line but
#: the spelling of numbers)
SAMPLES = [
    Sample("ckptstore_last_complete_save_timestamp_seconds", 1796236977.5998065, "Unix time", "gauge", {"run": "r"}),
    Sample("ckptstore_last_complete_step", 2, "Step", "gauge", {"run": "r"}),
    Sample("ckptstore_last_complete_step", 7, "Step", "gauge", {"run": 'a"b\\c\nd'}),
    Sample("ckptstore_saves_completed_total", 3, "Committed saves", "counter", {"run": "r"}),
    Sample("ckptstore_status_ok", 1.0, "1 when ok\nand fresh"),
]
OLD_TEXT = """\
# HELP ckptstore_last_complete_save_timestamp_seconds Unix time
# TYPE ckptstore_last_complete_save_timestamp_seconds gauge
ckptstore_last_complete_save_timestamp_seconds{run="r"} 1796236977.5998065
# HELP ckptstore_last_complete_step Step
# TYPE ckptstore_last_complete_step gauge
ckptstore_last_complete_step{run="r"} 2
ckptstore_last_complete_step{run="a\\"b\\\\c\\nd"} 7
# HELP ckptstore_saves_completed_total Committed saves
# TYPE ckptstore_saves_completed_total counter
ckptstore_saves_completed_total{run="r"} 3
# HELP ckptstore_status_ok 1 when ok\\nand fresh
# TYPE ckptstore_status_ok gauge
ckptstore_status_ok 1
"""


def parse(text: str) -> list[tuple[str, float | None]]:
    """Each line of the text format: comments as they are, a sample as (name{labels}, its value as a number)."""
    out: list[tuple[str, float | None]] = []
    for line in text.splitlines():
        if line.startswith("#"):
            out.append((line, None))
        else:
            key, value = line.rsplit(" ", 1)
            out.append((key, float(value)))
    return out


def test_the_client_writes_what_the_hand_written_format_wrote() -> None:
    assert parse(render(SAMPLES)) == parse(OLD_TEXT)


def test_a_counter_without_total_and_bad_names_are_refused() -> None:
    for bad in (Sample("saves", 1, "x", "counter"), Sample("a-b", 1, "x"), Sample("a", 1, "x", "histogram"),
                Sample("a", 1, "x", labels={"__x": "y"})):
        with pytest.raises(InvalidInputError):
            render([bad])
        with pytest.raises(InvalidInputError):
            registry([bad])


def _store_with_saves(url: str) -> CheckpointStore:
    st = CheckpointStore.open(url, "r", identity=IDENT)
    for step in range(3):
        with st.save(step) as w:
            w.put("m", b"x" * (step + 1))
    return CheckpointStore.open(url, "r", mode="r")


def test_status_prom_file_and_status_registry_hold_the_status_samples(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    st = _store_with_saves(url)
    prom = tmp_path / "status.prom"
    assert main(["status", url, "r", "--prom", str(prom)]) == 0
    text = prom.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s", "status.prom"]  # no temporary file left beside it
    status = run_status(st)
    samples = status_samples(status)
    names = {s.name for s in samples}
    assert {"ckptstore_last_complete_step", "ckptstore_saves_completed_total", "ckptstore_status_ok"} <= names
    got = {k: v for k, v in parse(text) if v is not None}
    for s in samples:
        if s.name != "ckptstore_last_complete_save_age_seconds":  # the age moves between the two reads
            assert got[f'{s.name}{{run="r"}}'] == s.value, s.name
    assert "# TYPE ckptstore_saves_completed_total counter" in text.splitlines()
    reg = status_registry([status])
    assert isinstance(reg, CollectorRegistry)
    assert generate_latest(reg).decode() == render(samples)


def test_the_checkpointer_registry_is_read_at_every_scrape(tmp_path: Path) -> None:
    prom = tmp_path / "train.prom"
    st = CheckpointStore.open(MemoryBackend(), "r", identity=IDENT)
    ck = Checkpointer(st, {"model": torch.nn.Linear(2, 2)}, every_steps=1, async_save=False, handle_signals=False,
                      metrics_path=str(prom))
    reg = ck.metrics_registry()
    ck.resume()
    before = dict(x for x in parse(generate_latest(reg).decode()) if x[1] is not None)
    assert before['ckptstore_saves_completed_total{run="r"}'] == 0
    ck.step_end(0)
    ck.step_end(1)
    ck.close()
    after = dict(x for x in parse(generate_latest(reg).decode()) if x[1] is not None)
    assert after['ckptstore_saves_completed_total{run="r"}'] == 2 and after['ckptstore_last_complete_step{run="r"}'] == 1
    in_file = dict(x for x in parse(prom.read_text()) if x[1] is not None)
    for name in METRICS:  # the textfile and the registry carry the same metrics
        assert (f'{name}{{run="r"}}' in in_file) == (f'{name}{{run="r"}}' in after), name
    assert in_file['ckptstore_saves_completed_total{run="r"}'] == 2


def test_the_registry_without_metrics_path_keeps_them_in_memory() -> None:
    st = CheckpointStore.open(MemoryBackend(), "r", identity=IDENT)
    ck = Checkpointer(st, {"model": torch.nn.Linear(2, 2)}, every_steps=1, async_save=False, handle_signals=False)
    assert ck.metrics is None
    reg = ck.metrics_registry()
    ck.resume()
    ck.step_end(0)
    ck.close()
    got = dict(x for x in parse(generate_latest(reg).decode()) if x[1] is not None)
    assert got['ckptstore_saves_completed_total{run="r"}'] == 1 and ck.metrics is not None and ck.metrics.path is None


BLOCK_CLIENT = textwrap.dedent(
    """
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "prometheus_client":
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None
    sys.meta_path.insert(0, Block())
    """
)


def _without_client(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", BLOCK_CLIENT + textwrap.dedent(code)], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=120, check=False)


def test_without_the_extra_status_and_the_checkpointer_name_it(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    _store_with_saves(url)
    code = f"""
        import sys, torch
        from ckptstore import CheckpointStore, ExtraRequiredError
        from ckptstore.backends.memory import MemoryBackend
        from ckptstore.cli.commands import main
        from ckptstore.torch import Checkpointer
        assert main(["status", {url!r}, "r"]) == 0          # status itself needs no extra
        print("PROM-RC", main(["status", {url!r}, "r", "--prom", "out.prom"]))
        st = CheckpointStore.open(MemoryBackend(), "r", identity={{"data_digest": "d"}})
        try:
            Checkpointer(st, {{"model": torch.nn.Linear(2, 2)}}, metrics_path="t.prom", handle_signals=False)
        except ExtraRequiredError as exc:
            print("CKPT:", exc)
    """
    r = _without_client(code, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PROM-RC 2" in r.stdout and "Traceback" not in r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "pip install 'ckptstore[metrics]'" in err[0] and "out.prom" in err[0], r.stderr
    assert "CKPT:" in r.stdout and "pip install 'ckptstore[metrics]'" in r.stdout and "t.prom" in r.stdout
    assert not (tmp_path / "out.prom").exists() and not (tmp_path / "t.prom").exists()
