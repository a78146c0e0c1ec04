"""The training state the torch rows save and restore, and the peers' ways of saving it.

A stack of bias-free Linear layers plus Adam: parameters and both moments make
``nbytes`` of float32 (to within one layer).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from bench.common import fsync_dir, fsync_tree, fsync_write


def build(nbytes: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    width = 4096  # the widest square layer that still gives about 4 or more layers
    while width > 256 and width * width * 4 * 3 * 4 > nbytes:
        width //= 2
    layer = width * width * 4
    n_layers = max(1, round(nbytes / 3 / layer))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(n_layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():  # materialize Adam's moments without a costly forward pass
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    for p in model.parameters():
        p.grad = None
    return model, opt


def tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the state, flat (what safetensors can hold; Adam's scalar ``step`` included)."""
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for idx, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optimizer.{idx}.{k}"] = v
    return out


def perturb(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Change every value of the state a little, in place, as a training step between two saves
    does (every parameter and both moments): a save after it writes every byte again, whatever
    the format (a version-3 save of an unchanged state writes nothing). Untimed by the rows."""
    with torch.no_grad():
        for t in tensors(model, opt).values():
            if t.dim() > 0 and t.is_floating_point():
                t.add_(1e-7)


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(model, opt).values())


def buffers(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[memoryview]:
    """The state's bytes as buffers (zero copy), for the raw floors."""
    return [t.contiguous().numpy().data.cast("B") for t in tensors(model, opt).values() if t.dim() > 0]


def state_dict(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


# ------------------------------------------------------------------ peers' saves (durable: every file and directory fsynced)


def raw_save(path: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    fsync_write(path, buffers(model, opt))


def torch_save(path: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    with open(path, "wb") as f:
        torch.save(state_dict(model, opt), f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(os.path.dirname(path))


def safetensors_save(path: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    from safetensors.torch import save_file

    save_file(tensors(model, opt), path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(path))


def dcp_save(path: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    save(state_dict(model, opt), storage_writer=FileSystemWriter(path, sync_files=True))
    fsync_tree(path)  # sync_files covers the data files; the directory entries and .metadata need this
    fsync_dir(os.path.dirname(path))


def torch_load(path: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    sd = torch.load(path, weights_only=True)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optimizer"])


def dcp_load(path: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load

    sd = state_dict(model, opt)  # loaded in place into the live tensors
    load(sd, storage_reader=FileSystemReader(path))
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optimizer"])


def same(a: tuple[torch.nn.Module, torch.optim.Optimizer], b: tuple[torch.nn.Module, torch.optim.Optimizer]) -> bool:
    ta, tb = tensors(*a), tensors(*b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
