"""ckptstore: crash-consistent training checkpoints on any storage.

The core imports without torch; the PyTorch adapter lives in ``ckptstore.torch``.
"""

from .backends.base import Backend, Capabilities, ObjectInfo
from .errors import (
    BudgetExhaustedError,
    CkptStoreError,
    CommitConflictError,
    CommitUnknownError,
    CorruptionError,
    IdentityMismatchError,
    InvalidInputError,
    NotFoundError,
    SaveAbortedError,
    StoreUnavailableError,
    SupersededError,
    TransientError,
    UnsupportedBackendError,
)
from .identity import RunIdentity, digest_tree
from .protocol import PROTOCOL_VERSION
from .selection import SaveState, Skip, SkipReason
from .store import CheckpointStore, SaveInfo, SaveRef, SaveWriter, Selection, VerifyReport

__version__ = "0.1.0"

__all__ = [
    "PROTOCOL_VERSION",
    "Backend",
    "BudgetExhaustedError",
    "Capabilities",
    "CheckpointStore",
    "CkptStoreError",
    "CommitConflictError",
    "CommitUnknownError",
    "CorruptionError",
    "IdentityMismatchError",
    "InvalidInputError",
    "NotFoundError",
    "ObjectInfo",
    "RunIdentity",
    "SaveAbortedError",
    "SaveInfo",
    "SaveRef",
    "SaveState",
    "SaveWriter",
    "Selection",
    "Skip",
    "SkipReason",
    "StoreUnavailableError",
    "SupersededError",
    "TransientError",
    "UnsupportedBackendError",
    "VerifyReport",
    "digest_tree",
]
