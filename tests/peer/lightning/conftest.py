"""Lightning's own checkpoint tests, run with ckptstore's CheckpointIO in place of TorchCheckpointIO.

Every ``Trainer`` built in these tests gets a :class:`StoreCheckpointIO` on a
fresh local directory store (one per test; each Trainer is a new attempt of
the same run, as a new process would be) wherever Lightning would have made
its default ``TorchCheckpointIO``. Nothing else in the tests is changed.

The default suite runs only ``FAST`` (a few seconds); the whole set is
``CKPT_PEER=full ./dev test tests/peer/lightning -p no:randomly``, which needs
the ``peer`` extra (``pip install -e '.[peer]'``: cloudpickle, jsonargparse,
tensorboard, omegaconf). The classification of each failure is in
``tests/peer/lightning/RESULTS.md``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
FULL = os.environ.get("CKPT_PEER") == "full"
#: CKPT_PEER_COMPAT=1 also routes the tests' own torch.load / pl_load of a pointer file through
#: StoreCheckpointIO.load_checkpoint, so the checkpoint *contents* those tests assert are checked too
COMPAT = os.environ.get("CKPT_PEER_COMPAT") == "1"
#: CKPT_PEER_BASELINE=1 leaves Lightning's TorchCheckpointIO in place (to tell version drift from our failures)
BASELINE = os.environ.get("CKPT_PEER_BASELINE") == "1"
#: CKPT_PEER_ASYNC=1 swaps in AsyncStoreCheckpointIO (background saves) instead of StoreCheckpointIO
ASYNC = os.environ.get("CKPT_PEER_ASYNC") == "1"

# every module-level import the vendored files need; a missing one skips the file instead of erroring the suite
_NEEDS = {
    "tests_pytorch/checkpointing/test_model_checkpoint.py": ["lightning", "cloudpickle", "jsonargparse", "yaml"],
    "tests_pytorch/checkpointing/test_trainer_checkpoint.py": ["lightning"],
    "tests_pytorch/trainer/connectors/test_checkpoint_connector.py": ["lightning"],
}
collect_ignore = [f for f, mods in _NEEDS.items() if any(importlib.util.find_spec(m) is None for m in mods)]
if "lightning" in {m for f in collect_ignore for m in _NEEDS[f]} and importlib.util.find_spec("lightning") is None:
    collect_ignore.append("tests_pytorch")

#: the subset of the default suite: quick, and each exercises a save + load through the pointer files
FAST = {
    "test_loops_restore",
    "test_strict_loading[None-True]",
    "test_hpc_max_ckpt_version",
    "test_model_checkpoint_topk_all",
    "test_resume_and_old_checkpoint_files_remain[True]",
    "test_save_last_versioning",
}

if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # `import tests_pytorch.helpers.runif`, as upstream


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        if Path(str(item.fspath)).is_relative_to(HERE):
            item.add_marker(pytest.mark.peer)
            (keep if FULL or item.name in FAST else drop).append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True)
def _store_checkpoint_io(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Swap Lightning's default TorchCheckpointIO for a store-backed one, per test."""
    import lightning.pytorch.strategies.strategy as strategy_mod

    root = tmp_path_factory.mktemp("ckptstore")
    if BASELINE:
        yield root
        return

    from ckptstore import RunIdentity
    from ckptstore.integrations.lightning import AsyncStoreCheckpointIO, StoreCheckpointIO

    ident = RunIdentity(data_digest="boring", code_digest="lightning-peer-tests")

    def factory() -> StoreCheckpointIO:
        return StoreCheckpointIO(url=str(root), run_id="peer", identity=ident)

    monkeypatch.setattr(strategy_mod, "TorchCheckpointIO", factory)

    # make the plug-in now, so that a strategy sent to spawned workers carries it (a worker re-imports
    # Lightning and would otherwise make its own TorchCheckpointIO)
    from lightning.pytorch import Trainer

    init = Trainer.__init__

    def eager_init(self: Any, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        io = self.strategy.checkpoint_io
        if ASYNC and type(io) is StoreCheckpointIO:  # what Trainer(plugins=[AsyncStoreCheckpointIO(...)]) gives
            self.strategy.checkpoint_io = AsyncStoreCheckpointIO(io)

    monkeypatch.setattr(Trainer, "__init__", eager_init)
    if COMPAT:
        _route_direct_loads(monkeypatch, factory)
    yield root


def _route_direct_loads(monkeypatch: pytest.MonkeyPatch, factory: Any) -> None:
    import torch
    from lightning.fabric.utilities import cloud_io
    from lightning.pytorch.core import saving

    from ckptstore.integrations.lightning import POINTER_FORMAT

    def is_pointer(path: Any) -> bool:
        try:
            with open(os.fspath(path), "rb") as f:
                head = f.read(4096)
        except (OSError, TypeError):
            return False
        return head.startswith(b"{") and POINTER_FORMAT.encode() in head

    def wrap(orig: Any) -> Any:
        def load(path: Any, *a: Any, **kw: Any) -> Any:
            if is_pointer(path):
                return factory().load_checkpoint(path)
            return orig(path, *a, **kw)

        return load

    monkeypatch.setattr(torch, "load", wrap(torch.load))
    monkeypatch.setattr(cloud_io, "_load", wrap(cloud_io._load))
    monkeypatch.setattr(saving, "pl_load", wrap(saving.pl_load))  # type: ignore[attr-defined]
    mod = sys.modules.get("tests_pytorch.checkpointing.test_model_checkpoint")
    if mod is not None:
        monkeypatch.setattr(mod, "pl_load", wrap(mod.pl_load))


@pytest.fixture
def xla_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """As upstream's tests_pytorch/conftest.py: pretend torch_xla is importable."""
    from unittest.mock import Mock

    import lightning

    for mod in ("pytorch.strategies.xla", "pytorch.strategies.single_xla", "pytorch.plugins.precision.xla",
                "pytorch.strategies.launchers.xla", "fabric.accelerators.xla", "fabric.plugins.environments.xla",
                "fabric.plugins.io.xla", "fabric.strategies.xla", "fabric.strategies.launchers.xla"):
        module = sys.modules.get(f"lightning.{mod}") or importlib.import_module(f"lightning.{mod}")
        monkeypatch.setattr(module, "_XLA_AVAILABLE", True, raising=False)
    for name in ("torch_xla", "torch_xla.core.xla_model", "torch_xla.experimental"):
        monkeypatch.setitem(sys.modules, name, Mock())
    del lightning


@pytest.fixture
def caplog(caplog: Any) -> Iterator[Any]:
    """As upstream: let caplog see Lightning's loggers, which do not propagate."""
    import logging

    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    saved = [lg.propagate for lg in loggers]
    for lg in loggers:
        lg.propagate = True
    yield caplog
    for lg, p in zip(loggers, saved):
        lg.propagate = p
