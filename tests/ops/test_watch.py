"""Watching a run (issue 22): ``ckptstore status``, the Prometheus metrics of
the store and of the Checkpointer, the timeline picture, progress bars."""

from __future__ import annotations

import io
import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.backends.memory import MemoryBackend
from ckptstore.cli.commands import main
from ckptstore.errors import InvalidInputError
from ckptstore.ops.budget import Budget
from ckptstore.ops.report import build_record, nice_ticks, render_timeline_svg
from ckptstore.ops.status import parse_age, run_status
from ckptstore.torch import Checkpointer
from ckptstore.torch.metrics import METRICS
from ckptstore.util.progress import progress
from ckptstore.util.prometheus import Sample, render, write_textfile
from tests.incremental.common import stored_objects

IDENT = {"data_digest": "d", "code_digest": "c", "planned_steps": 10}


def small_run(url: str, run_id: str = "r", steps: int = 4) -> CheckpointStore:
    st = CheckpointStore.open(url, run_id, identity=IDENT)
    for s in range(steps):
        st.record_event("progress", {"step": s})
    with st.save(steps - 1) as w:
        w.put("m", b"x" * 10)
    st.record_event("save", {"step": steps - 1, "seconds": 0.5, "bytes": 10})
    return st


def test_status_is_ok_when_fresh_and_alerts_when_stale_or_over_budget(tmp_path: Path, capsys: Any) -> None:
    url = str(tmp_path / "s")
    small_run(url, "fresh")
    small_run(url, "stale")
    st = CheckpointStore.open(url, "stale", mode="r")
    now = time.time()
    ok = run_status(st, max_age=1800, now=now)
    assert ok.ok and ok.latest_step == 3 and ok.last_save_seconds == 0.5
    stale = run_status(st, max_age=1800, now=now + 3600)
    assert not stale.ok and "old, more than 30m00s" in stale.problems[0]
    spent = run_status(st, budget=Budget(limit_gpu_hours=0.2, gpu_hours_per_step=0.1), now=now)
    assert not spent.ok and "budget spent" in spent.problems[0]
    assert main(["status", url, "fresh", "stale", "--max-age", "30m"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("fresh: latest complete step 3") and lines[0].endswith("OK")
    assert main(["status", url, "fresh", "--max-age", "30m", "--budget-gpu-hours", "0.2",
                 "--gpu-hours-per-step", "0.1", "--json"]) == 1
    assert "budget spent" in json.loads(capsys.readouterr().out)[0]["problems"][0]
    prom = tmp_path / "status.prom"
    assert main(["status", url, "fresh", "--prom", str(prom)]) == 0
    text = prom.read_text()
    assert 'ckptstore_last_complete_save_age_seconds{run="fresh"}' in text and "ckptstore_status_ok" in text


def test_status_of_a_run_without_a_complete_save_exits_non_zero(tmp_path: Path, capsys: Any) -> None:
    st = CheckpointStore.open(str(tmp_path / "s"), "r", identity=IDENT)
    w = st.save(5)
    w.put("m", b"half")  # never committed
    s = run_status(CheckpointStore.open(str(tmp_path / "s"), "r", mode="r"))
    assert not s.ok and s.problems == ["no complete save"]
    assert main(["status", str(tmp_path / "s"), "r"]) == 1


@pytest.mark.parametrize("text,seconds", [("90", 90), ("90s", 90), ("30m", 1800), ("2h", 7200), ("1d", 86400)])
def test_max_age_units(text: str, seconds: float) -> None:
    assert parse_age(text) == seconds


@pytest.mark.parametrize("bad", ["", "0", "-5m", "5x", "m"])
def test_bad_max_age_is_refused(bad: str) -> None:
    with pytest.raises(InvalidInputError):
        parse_age(bad)


def test_prometheus_text_format_and_atomic_textfile(tmp_path: Path) -> None:
    samples = [Sample("a_total", 3, "A count", "counter", {"run": 'x"y\n'}), Sample("b", 0.5, "B")]
    text = render(samples)
    # the client's spelling of numbers (3.0, Go-style exponents); names, labels and values as before
    assert text.splitlines() == ["# HELP a_total A count", "# TYPE a_total counter", 'a_total{run="x\\"y\\n"} 3.0',
                                 "# HELP b B", "# TYPE b gauge", "b 0.5"]
    with pytest.raises(InvalidInputError):
        render([Sample("bad-name", 1, "x")])
    with pytest.raises(InvalidInputError):
        write_textfile(tmp_path / "m.txt", samples)
    write_textfile(tmp_path / "m.prom", samples)
    assert (tmp_path / "m.prom").read_text() == text and [p.name for p in tmp_path.iterdir()] == ["m.prom"]


def test_the_checkpointer_exports_every_metric_when_asked(tmp_path: Path) -> None:
    prom = tmp_path / "train.prom"
    b = MemoryBackend()
    model = torch.nn.Linear(3, 2)
    st = CheckpointStore.open(b, "r", identity=IDENT)
    ck = Checkpointer(st, {"model": model}, every_steps=2, async_save=False, handle_signals=False,
                      metrics_path=str(prom))
    ck.resume()
    for s in range(4):
        st.record_event("progress", {"step": s})
        ck.step_end(s)
    ck.close()
    # a second attempt after a crash at step 3 (the save of step 3 committed, 2 steps were not)
    st.record_event("progress", {"step": 5})
    st2 = CheckpointStore.open(b, "r", identity=IDENT)
    ck2 = Checkpointer(st2, {"model": model}, every_steps=2, async_save=False, handle_signals=False,
                       metrics_path=str(prom))
    assert ck2.resume() == 4
    ck2.step_end(4)
    ck2.close()
    text = prom.read_text()
    for name in METRICS:
        assert f'{name}{{run="r"}}' in text, name
    v = ck2.metrics.values  # type: ignore[union-attr]
    assert v["ckptstore_restarts"] == 1 and v["ckptstore_wasted_steps"] == 2 and v["ckptstore_last_complete_step"] == 3
    with pytest.raises(InvalidInputError, match=r"\.prom"):
        Checkpointer(st2, {"model": model}, metrics_path=str(tmp_path / "x.txt"), handle_signals=False)
    # off by default
    assert Checkpointer(st2, {"model": model}, handle_signals=False, async_save=False).metrics is None


def budget_stopped_record() -> dict[str, Any]:
    b = MemoryBackend()
    st = CheckpointStore.open(b, "bud", identity=IDENT)
    for s in range(6):
        st.record_event("progress", {"step": s})
        if s == 3:
            with st.save(3) as w:
                w.put("m", b"x")
            st.record_event("save", {"step": 3, "seconds": 0.1, "bytes": 1})
    st2 = CheckpointStore.open(b, "bud", identity=IDENT)  # restart: resumes from step 3
    st2.record_event("resume", {"resumed_from": 3})
    for s in range(4, 8):
        st2.record_event("progress", {"step": s})
    st2.record_event("budget-exhausted", {"step": 7, "spent_gpu_hours": 1.0, "limit_gpu_hours": 1.0})
    return build_record(CheckpointStore.open(b, "bud", mode="r"),
                        Budget(limit_gpu_hours=1.0, gpu_hours_per_step=0.1, restart_gpu_hours=0.2))


def test_the_timeline_has_ticks_gpu_hours_budget_stop_restarts_and_a_legend() -> None:
    rec = budget_stopped_record()
    svg = render_timeline_svg(rec)
    root = ET.fromstring(svg)  # well-formed XML: any browser shows it
    assert root.tag.endswith("svg")
    texts = [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert any(t.startswith("wall time (s") for t in texts)
    assert "GPU-hours spent (cumulative)" in texts and "optimizer step" in texts
    assert "budget 1 GPU-h" in texts and "budget stop" in texts
    assert "restart #1: from step 3" in texts
    for legend in ("committed save", "interrupted", "wasted (done again)", "recovery point", "budget stop"):
        assert legend in texts, legend
    assert len([t for t in texts if t.replace(".", "").isdigit()]) >= 8  # tick labels on three axes


def test_nice_ticks() -> None:
    assert nice_ticks(0, 10) == [0, 2, 4, 6, 8, 10]
    assert nice_ticks(0, 0.9, 4) == [0, 0.25, 0.5, 0.75]
    assert nice_ticks(0, 0) == [0]


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_only_on_a_terminal_and_never_under_json() -> None:
    tty = FakeTTY()
    with progress("verify", 100, stream=tty, use_rich=False) as bar:
        bar.advance(100)
    assert "verify" in tty.getvalue() and "100.0%" in tty.getvalue()
    quiet = FakeTTY()
    with progress("verify", 100, stream=quiet, quiet=True) as bar:
        bar.advance(100)
    assert quiet.getvalue() == ""
    piped = io.StringIO()
    with progress("verify", 100, stream=piped) as bar:
        bar.advance(100)
    assert piped.getvalue() == ""
    hostile = FakeTTY()
    with progress("step \x1b[2J", 1, stream=hostile, use_rich=False) as bar:
        bar.advance(1)
    assert "\x1b" not in hostile.getvalue()


def test_cli_verify_and_gc_print_no_bar_when_not_a_terminal(tmp_path: Path, capsys: Any) -> None:
    url = str(tmp_path / "s")
    small_run(url)
    assert main(["verify", url, "r"]) == 0
    assert main(["gc", url, "r", "--apply", "--json"]) == 0
    err = capsys.readouterr().err
    assert "%" not in err and "[" not in err


def test_cli_verify_on_a_terminal_streams_under_a_bar_and_still_finds_corruption(tmp_path: Path, capsys: Any,
                                                                                 monkeypatch: Any) -> None:
    import sys

    url = str(tmp_path / "s")
    ref = small_run(url).latest_complete()
    assert ref is not None
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["verify", url, "r"]) == 0
    assert "OK: step 3" in capsys.readouterr().out
    ((key, _, _),) = stored_objects("r", ref, "m")  # its file; on version 3 its one piece
    comp = tmp_path / "s" / key
    comp.write_bytes(b"y" * 10)  # same size, other bytes
    assert main(["verify", url, "r"]) == 1
    assert "CORRUPT" in capsys.readouterr().out
