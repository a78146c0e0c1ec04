"""ckptstore: crash-consistent training checkpoints on any storage.

The core imports without torch, numpy or matplotlib; the PyTorch adapter lives
in ``ckptstore.torch`` (extra ``torch``), run management (drill, budget, report)
in ``ckptstore.ops`` (extra ``runs``).
"""

from .backends.base import Backend, Capabilities, ObjectInfo
from .backends.schemes import register_scheme
from .core.intents import PieceTiming
from .core.reader import VerifyReport
from .core.record_auth import RecordAuth, UnauthenticatedWarning, keyring_from_env, keyring_from_file
from .core.writer import StagedSave
from .errors import (
    CkptStoreError,
    CommitConflictError,
    CommitUnknownError,
    CorruptionError,
    ExtraRequiredError,
    IdentityMismatchError,
    InvalidInputError,
    NotFoundError,
    RunRecordMismatchError,
    SaveAbortedError,
    SaveNotPublishedError,
    StoreUnavailableError,
    SupersededError,
    TransientError,
    UnsupportedBackendError,
)
from .identity import RunIdentity, digest_tree
from .options import AuthOptions, OpenOptions, TierOptions
from .protocol import PROTOCOL_VERSION
from .protocol.auth import AuthPolicy, Keyring
from .protocol.records import ComponentEntry
from .protocol.selection import SaveInfo, SaveRef, SaveState, Selection, Skip, SkipReason
from .retry import RetryPolicy
from .store import DEFAULT_GRACE_SECONDS, CheckpointStore, GcReport, ReplicationStatus, SaveWriter

__version__ = "0.2.0"

__all__ = [
    "DEFAULT_GRACE_SECONDS",
    "PROTOCOL_VERSION",
    "AuthOptions",
    "AuthPolicy",
    "GcReport",
    "Keyring",
    "OpenOptions",
    "PieceTiming",
    "RecordAuth",
    "RetryPolicy",
    "TierOptions",
    "UnauthenticatedWarning",
    "Backend",
    "Capabilities",
    "CheckpointStore",
    "CkptStoreError",
    "CommitConflictError",
    "CommitUnknownError",
    "ComponentEntry",
    "CorruptionError",
    "ExtraRequiredError",
    "IdentityMismatchError",
    "InvalidInputError",
    "NotFoundError",
    "RunRecordMismatchError",
    "ObjectInfo",
    "RunIdentity",
    "SaveAbortedError",
    "SaveNotPublishedError",
    "SaveInfo",
    "ReplicationStatus",
    "SaveRef",
    "SaveState",
    "SaveWriter",
    "Selection",
    "Skip",
    "SkipReason",
    "StagedSave",
    "StoreUnavailableError",
    "SupersededError",
    "TransientError",
    "UnsupportedBackendError",
    "VerifyReport",
    "digest_tree",
    "keyring_from_env",
    "keyring_from_file",
    "register_scheme",
]
