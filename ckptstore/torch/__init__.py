"""PyTorch adapter: save the whole training state without pickle, resume it exactly.

Importing this module imports torch; the core ``ckptstore`` never does.
Without the ``torch`` extra (torch, safetensors, numpy) the import fails with
one :class:`~ckptstore.ExtraRequiredError` (an ``ImportError``) naming
``pip install 'ckptstore[torch]'``.
"""

from importlib.util import find_spec

from ..errors import ExtraRequiredError

for _module in ("torch", "safetensors", "numpy"):
    if find_spec(_module) is None:
        raise ExtraRequiredError("import ckptstore.torch", "torch", _module)

from .checkpointer import EX_TEMPFAIL, Checkpointer, ConfigChangeWarning
from .codec import flatten, unflatten
from .contract import CheckpointerStore
from .loaders import ResumableLoader, WorkerRngState, sample_seed
from .restore import (
    ConfigDiff,
    restore_state,
)
from .sampler import InexactResumeWarning, ResumableSampler, RngPitfallWarning
from .state import (
    CheckpointMismatchError,
    CopyStreams,
    capture_rng,
    read_state,
    restore_rng,
    save_state,
    torch_environment,
)

__all__ = [
    "EX_TEMPFAIL",
    "InexactResumeWarning",
    "CheckpointMismatchError",
    "Checkpointer",
    "CheckpointerStore",
    "ConfigChangeWarning",
    "ConfigDiff",
    "CopyStreams",
    "ResumableLoader",
    "ResumableSampler",
    "RngPitfallWarning",
    "WorkerRngState",
    "capture_rng",
    "flatten",
    "read_state",
    "restore_rng",
    "restore_state",
    "sample_seed",
    "save_state",
    "torch_environment",
    "unflatten",
]
