"""One exception hierarchy for everything ckptstore raises on purpose.

Every error carries a message meant for the person who has to act on it: what
happened, to which object, and what to do next. Callers that need to branch
catch a class; callers that only report print ``str(err)``.
"""

from __future__ import annotations

from collections.abc import Sequence


class CkptStoreError(Exception):
    """Base class of every error ckptstore raises deliberately."""


class InvalidInputError(CkptStoreError, ValueError):
    """An argument is malformed (bad URL, run ID, step, component name, data type).

    Raised before anything is written.
    """


class StoreUnavailableError(CkptStoreError):
    """The storage behind a URL cannot be reached or used (missing bucket,
    bad credentials, unreachable endpoint, permission denied)."""


class TransientError(StoreUnavailableError):
    """A failure that may succeed on retry (timeout, connection reset, HTTP 5xx,
    429, S3 409 ConditionalRequestConflict). Backends raise it; the store
    retries with bounded exponential backoff above the backend."""


class LimitReachedError(StoreUnavailableError):
    """A bound on the work ckptstore does for one operation was reached: more
    candidate commit records than selection reads, a directory chain deeper
    than any key of the protocol. Never taken for "nothing there": nothing was
    selected, registered or deleted. The message names what was found and the
    way out (records to remove, an explicit resume point)."""


class LocalTierRefusedError(StoreUnavailableError):
    """The local tier of a two-tier store cannot be used as found (``docs/tiers.md``
    "What the tier refuses"): a symbolic link or non-directory where one of the
    tier's folders belongs (``rank-<r>``, the run's folder, ``.quarantine``), a
    tier whose run folder is the durable run's folder or lies inside it (or holds
    it), or a local run folder that must be set aside but cannot be moved. Nothing
    was written through the link or into the durable store; the message names the
    path and what to do (remove the link, choose another ``local_tier``)."""


class ResumeRefusedError(CkptStoreError):
    """A writer's open with ``resume_from="latest"`` was refused: the run has
    commits in its history but none can be selected, and starting from nothing
    would supersede them (and the trainer's retention would then delete them).
    Nothing was registered; the refusal is recorded in the run's ledger
    (``resume-refused``). The message names the newest candidates and the way
    out: repair or remove them, or pass an explicit ``resume_from``."""


class UnsupportedBackendError(CkptStoreError):
    """The backend lacks a capability the operation needs (for example an
    atomic create-if-absent, without which ckptstore refuses to commit)."""


class NotFoundError(CkptStoreError, FileNotFoundError):
    """A run, save or component that was asked for does not exist."""


class SaveNotPublishedError(CkptStoreError):
    """A save did not become an acknowledged, selectable save. Subclasses say
    why: aborted before its commit, a conflicting commit, superseded by a newer
    attempt, or an outcome that could not be settled. Catch this class to treat
    every such case as "not saved"."""


class CommitConflictError(SaveNotPublishedError):
    """Another writer already committed this step in this attempt."""


class SupersededError(SaveNotPublishedError):
    """A newer attempt of the run has registered; this writer is a zombie.

    ``committed`` tells whether the commit record landed before the newer
    attempt was seen (it will then never be selected).
    """

    def __init__(self, message: str, *, committed: bool = False) -> None:
        super().__init__(message)
        self.committed = committed


class CommitUnknownError(SaveNotPublishedError):
    """The outcome of a commit could not be settled (the create's reply was
    lost and the record could not be read back). The save must be treated as
    not acknowledged; ``latest_complete()`` will tell what actually landed."""


class CorruptionError(CkptStoreError):
    """Stored bytes or records do not match what the commit record promises,
    or a stored record is malformed, oversized or not canonical."""


class RunRecordMismatchError(CorruptionError):
    """A run's ``RUN.json`` disagrees with its commit records: it states a
    protocol version whose commit names or records are not the ones the run
    holds (an edited run record, THREATS.md §4.13). Nothing was selected,
    registered or deleted; the message names both versions, the records that
    say so, and the fix."""


class ExtraRequiredError(CkptStoreError, ImportError):
    """A command or module needs an optional dependency group that is not
    installed; the message names the ``pip install`` line."""

    def __init__(self, what: str, extra: str, missing: str) -> None:
        self.extra = extra
        super().__init__(f"{what} needs the '{extra}' extra ({missing} is not installed): pip install 'ckptstore[{extra}]'")


class IdentityMismatchError(CkptStoreError):
    """A run was opened with an identity that differs from the one bound at
    its creation. ``fields`` lists every mismatched field."""

    def __init__(self, run_id: str, fields: Sequence[str], details: dict[str, tuple[object, object]]) -> None:
        self.run_id = run_id
        self.fields = list(fields)
        self.details = details
        shown = "; ".join(f"{k}: stored {details[k][0]!r}, requested {details[k][1]!r}" for k in self.fields)
        if self.fields == ["world_size"]:
            # the one difference that has a supported continuation: resharding
            advice = (
                "Only the number of ranks changed: to continue this run on the new world size, open it with "
                "open_distributed(..., reshard=True) and load the save with the DCP reader "
                "(ckptstore.distributed.dcp.writer), which reshards; the per-rank Checkpointer path (RankStore) cannot. "
                "Or resume with the original world size."
            )
        else:
            advice = ("A changed identity is a new experiment: open a new run ID (lineage=... records where it came "
                      "from) instead of resuming this one.")
        super().__init__(
            f"run {run_id!r} is bound to a different identity ({len(self.fields)} field(s) differ: {shown}). {advice}"
        )


class SaveAbortedError(SaveNotPublishedError):
    """A save was abandoned before its commit (an exception inside the ``with``
    block, an I/O error, or a failed verification). Nothing was published."""


class PromotionRefusedError(CkptStoreError):
    """A run may not be promoted to a serving artifact; ``reasons`` lists every
    reason (budget-stopped, not finished, final save incomplete or corrupt, ...).
    Nothing was written."""

    def __init__(self, run_id: str, reasons: Sequence[str]) -> None:
        self.run_id = run_id
        self.reasons = list(reasons)
        super().__init__(f"run {run_id!r} is not promotable: " + "; ".join(self.reasons))
