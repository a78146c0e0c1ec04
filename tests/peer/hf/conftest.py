"""Hugging Face's resume tests with every checkpoint going through the store.

* Every ``Trainer`` gets a :class:`StoreCallback`: each ``checkpoint-N`` it
  writes is published as one save (run ID from the output directory; each
  Trainer opens the run anew, as a restarted process would).
* ``trainer.train(resume_from_checkpoint=<dir>/checkpoint-N)``: the local
  directory is first moved away and ``checkpoint-N`` is restored from the store
  (``restore_step``), so the Trainer resumes from the store's verified copy.
  ``resume_from_checkpoint=True``: ``restore_latest`` first. A path the store
  does not know (the tests' "bogus checkpoint") is passed through untouched.

Their assertions (resumed weights and trainer state equal to the
uninterrupted run's) then check the store round trip. Runs in the default
suite only under ``CKPT_PEER=full`` (about a minute); see RESULTS.md.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest

HERE = Path(__file__).parent
FULL = os.environ.get("CKPT_PEER") == "full"
BASELINE = os.environ.get("CKPT_PEER_BASELINE") == "1"  # leave the Trainer alone (to tell drift from our failures)
collect_ignore = [] if all(importlib.util.find_spec(m) for m in ("transformers", "accelerate")) else ["."]
_CKPT = re.compile(r"^checkpoint-(0|[1-9][0-9]*)$")  # the one spelling the callback accepts (ASCII digits)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if FULL:
        return
    drop = [i for i in items if Path(str(i.fspath)).is_relative_to(HERE)]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [i for i in items if i not in drop]


@pytest.fixture(autouse=True)
def _through_the_store(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    from transformers import Trainer

    if BASELINE:
        yield HERE
        return

    from ckptstore import CheckpointStore, RunIdentity
    from ckptstore.integrations.hf import StoreCallback, restore_latest, restore_step

    url = str(tmp_path_factory.mktemp("ckptstore"))
    ident = RunIdentity(data_digest="regression", code_digest="hf-peer-tests")

    def run_of(output_dir: Any) -> str:
        return "hf-" + blake3.blake3(os.path.abspath(str(output_dir)).encode()).hexdigest()[:16]

    init = Trainer.__init__
    train = Trainer.train

    def init_with_store(self: Any, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        run = run_of(self.args.output_dir)
        self.add_callback(StoreCallback(lambda: CheckpointStore.open(url, run, identity=ident)))

    def train_from_store(self: Any, resume_from_checkpoint: Any = None, *a: Any, **kw: Any) -> Any:
        out = Path(str(self.args.output_dir))
        run = run_of(out)
        known = (Path(url) / run).exists()
        if isinstance(resume_from_checkpoint, (str, os.PathLike)) and known:
            ckpt = Path(resume_from_checkpoint)
            m = _CKPT.match(ckpt.name)
            if m and ckpt.parent.resolve() == out.resolve() and ckpt.is_dir():
                ckpt.rename(ckpt.with_name(ckpt.name + ".local-copy"))  # resume from the store's copy only
                restored = restore_step(url, out, int(m.group(1)), run_id=run)
                assert restored == str(ckpt), f"the store has no complete save of {ckpt.name}"
        elif resume_from_checkpoint is True and known:
            restore_latest(url, out, run_id=run)
        return train(self, resume_from_checkpoint, *a, **kw)

    monkeypatch.setattr(Trainer, "__init__", init_with_store)
    monkeypatch.setattr(Trainer, "train", train_from_store)
    yield Path(url)
