"""The torch Checkpointer on a tiered store, unchanged: saves commit locally,
resume reads the verified local copy bit for bit, and a preemption waits for
the durable tier and says whether it got there."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.backends.faults import FaultyBackend, transient
from ckptstore.backends.local import LocalBackend
from ckptstore.torch import Checkpointer

IDENT = {"model": "lin"}


def model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def train(m: torch.nn.Module, o: torch.optim.Optimizer, step: int) -> None:
    x = torch.full((2, 8), float(step + 1))
    o.zero_grad()
    m(x).sum().backward()
    o.step()


def test_resume_from_the_local_tier_is_bit_exact(tmp_path: Path) -> None:
    st = CheckpointStore.open(tmp_path / "durable", "run", identity=IDENT, local_tier=tmp_path / "nvme")
    m, o = model()
    ck = Checkpointer(st, {"model": m, "optimizer": o}, every_steps=2, handle_signals=False, keep_last=2)
    for step in range(6):
        train(m, o, step)
        ck.step_end(step)
    ck.finish(5)
    want = {k: v.clone() for k, v in m.state_dict().items()}
    st.close()
    st2 = CheckpointStore.open(tmp_path / "durable", "run", identity=IDENT, local_tier=tmp_path / "nvme",
                               resume_verify="cheap")
    m2, o2 = model()
    ck2 = Checkpointer(st2, {"model": m2, "optimizer": o2}, every_steps=2, handle_signals=False)
    assert ck2.resume() == 6
    assert st2.resumed_from is not None and st2.resumed_from.tier == "both"
    for k, v in m2.state_dict().items():
        assert torch.equal(v, want[k])
    ck2.close()
    st2.close()


@pytest.mark.parametrize("durable_up", [True, False])
def test_preemption_waits_for_the_durable_tier_and_reports_it(tmp_path: Path, durable_up: bool) -> None:
    down = threading.Event()
    durable = FaultyBackend(LocalBackend(tmp_path / "durable")).fail(
        None, transient(), persistent=True, when=lambda op, key: down.is_set() and "/events/" not in key)
    st = CheckpointStore.open(durable, "run", identity=IDENT, local_tier=tmp_path / "nvme", replicate_every=100,
                              close_flush_seconds=0.1)
    m, o = model()
    ck = Checkpointer(st, {"model": m, "optimizer": o}, every_steps=1, handle_signals=False, exit_on_preempt=False,
                      preempt_flush_seconds=0.5 if not durable_up else 30)
    train(m, o, 0)
    ck.step_end(0)
    ck.wait()
    assert st.flush(30)  # step 0 is durable
    if not durable_up:
        down.set()
    train(m, o, 1)
    ck.request_preemption()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ck.step_end(1) is True
    assert ck.preempt_durable is durable_up
    ev = [e["payload"] for e in st.events() if e["event"] == "preempt-flush"]
    assert ev and ev[-1]["durable"] is durable_up and ev[-1]["step"] == 1
    assert any("did not reach the durable tier" in str(w.message) for w in caught) is not durable_up
    st.close()
    # replicate_every=100 skipped the step-1 save in the loop; the preemption made it durable anyway
    r = CheckpointStore.open(LocalBackend(tmp_path / "durable"), "run", mode="r")
    latest = r.latest_complete()
    assert latest is not None and latest.step == (1 if durable_up else 0)
