"""PyTorch adapter: save the whole training state without pickle, resume it exactly.

Importing this module imports torch; the core ``ckptstore`` never does.
"""

from .checkpointer import Checkpointer
from .codec import flatten, unflatten
from .sampler import ResumableSampler
from .state import (
    CheckpointMismatchError,
    capture_rng,
    read_state,
    restore_rng,
    restore_state,
    save_state,
    torch_environment,
)

__all__ = [
    "CheckpointMismatchError",
    "Checkpointer",
    "ResumableSampler",
    "capture_rng",
    "flatten",
    "read_state",
    "restore_rng",
    "restore_state",
    "save_state",
    "torch_environment",
    "unflatten",
]
