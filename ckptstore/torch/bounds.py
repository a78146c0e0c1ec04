"""How many bytes a save's tensor components may claim, from the live objects.

A commit record is storage input: the size it claims for a component is
allocated before a byte is read. A restore into live objects bounds each
entry's component by what those objects can hold before allocating, so a
forged or damaged claim (1 TiB for a small model) is a
:class:`~ckptstore.CorruptionError` of that save (and the Checkpointer falls
back to the previous one), never an allocation attempt:

* a model (``torch.nn.Module``): the bytes of its ``state_dict()`` tensors
  (a save that fits has exactly these shapes and dtypes);
* an optimizer: :data:`OPTIMIZER_SLOTS` parameter-shaped tensors per
  parameter at up to 8 bytes per element (16 for complex parameters), plus
  :data:`SCALAR_ALLOWANCE` bytes per parameter and per group for scalar
  state, or its live state if that is larger;
* the RNG entry: the live generators' state plus :data:`RNG_ALLOWANCE`;

each plus the safetensors header cap (:data:`~.safetensors_io.MAX_HEADER`
and its 8-byte length field). Entries whose size the live objects do not
imply (plain trees, schedulers, loaders, entries no live object takes) get no
bound here; their allocation failures still become ``CorruptionError``
(:mod:`.tensor_read`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .safetensors_io import MAX_HEADER
from .state import RNG_KEY, capture_rng

#: parameter-shaped state tensors an optimizer may keep per parameter (Adam
#: with amsgrad keeps three; the bound leaves room for every optimizer in torch)
OPTIMIZER_SLOTS = 8
#: bytes of scalar (0-dim) state allowed per parameter and per group
SCALAR_ALLOWANCE = 1024
#: extra RNG bytes (generators of data loaders and devices the live process lacks)
RNG_ALLOWANCE = 1 << 20
#: what a safetensors file may add to its tensors' bytes: the length field and the header cap
HEADER_ALLOWANCE = 8 + MAX_HEADER


def _tensor_bytes(tree: Any) -> int:
    """Bytes of every tensor / array in a state tree (iterative, no copy)."""
    total = 0
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, np.ndarray):
            total += int(x.nbytes)
        elif isinstance(x, Mapping):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total


def _optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    bound = 0
    for group in opt.param_groups:
        bound += SCALAR_ALLOWANCE
        for p in group["params"]:
            per_element = 16 if p.is_complex() else 8
            bound += OPTIMIZER_SLOTS * p.numel() * per_element + SCALAR_ALLOWANCE
    return max(bound, _tensor_bytes(opt.state_dict().get("state", {})))


def component_bounds(objects: Mapping[str, Any]) -> dict[str, int]:
    """``{entry: most bytes its tensor component may have}`` for the entries
    whose size the live ``objects`` imply (see the module docstring); the
    RNG entry always."""
    out: dict[str, int] = {}
    for name, obj in objects.items():
        try:
            if isinstance(obj, torch.nn.Module):
                out[name] = _tensor_bytes(obj.state_dict()) + HEADER_ALLOWANCE
            elif isinstance(obj, torch.optim.Optimizer):
                out[name] = _optimizer_bytes(obj) + HEADER_ALLOWANCE
        except (RuntimeError, ValueError, TypeError):
            continue  # e.g. a lazy module not yet initialized: its size is not known, no bound
    if RNG_KEY not in objects:
        out[RNG_KEY] = _tensor_bytes(capture_rng()) + RNG_ALLOWANCE + HEADER_ALLOWANCE
    return out
