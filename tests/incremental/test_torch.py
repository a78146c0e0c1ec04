"""The Checkpointer on a version-3 run (§9): a frozen backbone is written
once; later saves write the head and the optimizer state; a fresh process
resumes bit for bit."""

from __future__ import annotations

import torch

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from ckptstore.torch import Checkpointer
from tests.incremental.common import long_timing

backend_kinds = ["memory", "local"]
IDENT = {"data_digest": "d", "code_digest": "c"}


def frozen_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512), torch.nn.Linear(512, 4))
    for p in list(m.parameters())[:4]:
        p.requires_grad_(False)  # the backbone: ~2 MiB of float32 that never changes
    o = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.01)
    return m, o


def step(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
    o.zero_grad()
    m(torch.linspace(-1, 1, 8 * 512).reshape(8, 512)).pow(2).mean().backward()  # no RNG: both processes share one
    o.step()


def test_frozen_backbone_written_once_and_resumed_exactly(backend: Backend) -> None:
    store = CheckpointStore.open(backend, "run", identity=IDENT, protocol_version=3, piece_timing=long_timing())
    m, o = frozen_model()
    ck = Checkpointer(store, {"model": m, "optimizer": o}, async_save=False, handle_signals=False)
    assert ck.resume() == 0
    refs = []
    for s in (1, 2, 3):
        step(m, o)
        refs.append(ck.save(s, blocking=True))
    ck.close()
    first, last = refs[0], refs[-1]
    assert first is not None and last is not None
    assert last.record.bytes_written() < first.record.bytes_written() / 10
    m2, o2 = frozen_model(seed=1)
    ck2 = Checkpointer(CheckpointStore.open(backend, "run", identity=IDENT, piece_timing=long_timing()),
                       {"model": m2, "optimizer": o2}, async_save=False, handle_signals=False)
    assert ck2.resume() == 4  # the step after the saved one
    for a, b in zip(m.state_dict().values(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    step(m, o)
    step(m2, o2)
    for a, b in zip(m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)
    ck2.close()
