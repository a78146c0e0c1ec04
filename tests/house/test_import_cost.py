"""A restart pays only for what it uses: importing ckptstore.torch does not
import torch.distributed.checkpoint (DTensor, sympy: 0.6 s on the bench
machine); the DCP layer's private torch names load on first use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print('\\n'.join(sys.modules))"], cwd=ROOT,
                         capture_output=True, text=True, check=True, env=os.environ | {"PYTHONPATH": str(ROOT)})
    return set(out.stdout.split())


def test_importing_ckptstore_torch_does_not_import_dcp() -> None:
    mods = _modules_after("import ckptstore.torch, ckptstore.torch.loaders, ckptstore.torch.sampler")
    assert "ckptstore.torch.checkpointer" in mods
    assert "torch.distributed.checkpoint" not in mods


def test_the_dcp_layer_gets_its_private_torch_names_on_first_use() -> None:
    from ckptstore.shims import torch_private

    assert torch_private.StorageWriterTransforms.__module__ == "torch.distributed.checkpoint.filesystem"
    mods = _modules_after("import ckptstore.distributed.dcp")
    assert "torch.distributed.checkpoint" in mods
