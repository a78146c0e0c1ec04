"""No silent inexact resume (issue 24, item 6): the loader set-ups the Checkpointer cannot make exact are
named, with the one-line fix, when the Checkpointer is built (or, for a sampler it never sees the loader of,
at the first batch); the exact set-ups stay quiet. Kill-and-resume runs: tests/pytorch/test_loaders.py."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.backends.memory import MemoryBackend
from ckptstore.torch import Checkpointer, InexactResumeWarning, ResumableLoader, ResumableSampler, WorkerRngState

pytest.importorskip("torchdata")
from torchdata.stateful_dataloader import StatefulDataLoader  # type: ignore[import-untyped]  # noqa: E402

IDENT = {"data_digest": "d", "code_digest": "c"}
DATA = torch.utils.data.TensorDataset(torch.arange(16.0))


def _inexact(fn: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in seen if issubclass(w.category, InexactResumeWarning)]


def _build(loader: Any) -> None:
    Checkpointer(CheckpointStore.open(MemoryBackend(), "r", identity=IDENT), {"loader": loader}, handle_signals=False)


def test_stateful_loader_with_workers_and_no_worker_rng_state_is_warned_at_build_time() -> None:
    got = _inexact(lambda: _build(StatefulDataLoader(DATA, batch_size=4, num_workers=2)))
    assert len(got) == 1 and "StatefulDataLoader(ckptstore.torch.WorkerRngState(dataset), ...)" in got[0]
    assert _inexact(lambda: _build(StatefulDataLoader(WorkerRngState(DATA), batch_size=4, num_workers=2))) == []
    assert _inexact(lambda: _build(StatefulDataLoader(DATA, batch_size=4, num_workers=0))) == []


def test_persistent_workers_and_replacement_are_warned_with_their_fix() -> None:
    got = _inexact(lambda: _build(StatefulDataLoader(WorkerRngState(DATA), batch_size=4, num_workers=2,
                                                     persistent_workers=True)))
    assert len(got) == 1 and "Fix: persistent_workers=False" in got[0]
    sampler = torch.utils.data.RandomSampler(DATA, replacement=True)
    got = _inexact(lambda: _build(StatefulDataLoader(DATA, batch_size=4, sampler=sampler)))
    assert len(got) == 1 and "with replacement" in got[0] and "Fix: shuffle=True without replacement" in got[0]


def test_a_warning_filter_makes_it_a_refusal() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", InexactResumeWarning)
        with pytest.raises(InexactResumeWarning, match="WorkerRngState"):
            _build(StatefulDataLoader(DATA, batch_size=4, num_workers=2))


def test_a_resumable_sampler_read_by_worker_processes_is_warned_at_the_first_batch() -> None:
    sampler = ResumableSampler(len(DATA))
    loader = torch.utils.data.DataLoader(DATA, batch_size=4, sampler=sampler, num_workers=2)
    got = _inexact(lambda: list(loader))
    assert len(got) == 1 and "ckptstore.torch.ResumableLoader(dataset" in got[0] and "ahead" in got[0]
    assert _inexact(lambda: list(loader)) == []  # once per sampler
    manual = ResumableSampler(len(DATA))
    manual.advance(0)
    got = _inexact(lambda: list(torch.utils.data.DataLoader(DATA, batch_size=4, sampler=manual, num_workers=2)))
    assert len(got) == 1 and "not saved" in got[0] and "ahead" not in got[0]


def test_exact_set_ups_stay_quiet() -> None:
    assert _inexact(lambda: list(torch.utils.data.DataLoader(DATA, batch_size=4, sampler=ResumableSampler(16)))) == []
    assert _inexact(lambda: list(ResumableLoader(DATA, batch_size=4, num_workers=2))) == []
    assert _inexact(lambda: list(ResumableLoader(DATA, batch_size=4, num_workers=2, persistent_workers=True))) == []
