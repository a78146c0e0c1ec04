"""The one options object every entry point takes, and the one table of refused combinations.

:class:`OpenOptions` is how a store behaves, nested by concern
(:class:`TierOptions`, :class:`AuthOptions`, :class:`~ckptstore.core.intents.PieceTiming`);
:meth:`CheckpointStore.open <ckptstore.CheckpointStore.open>`,
:func:`ckptstore.distributed.open_distributed` and
:meth:`Checkpointer.open <ckptstore.torch.Checkpointer.open>` take the same
object, so an option added here reaches every path. What a call is about —
the URL, the run ID, its identity, read or write, where to resume from — stays
a keyword of each call. Each field is documented once, here.

The flat keywords of earlier releases (``local_tier=``, ``auth_policy=``, ...)
are still accepted for one release, mapped onto this object by
:func:`options_from_keywords` with a :class:`DeprecationWarning`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from .core.intents import PieceTiming
from .errors import InvalidInputError
from .protocol.auth import AuthPolicy, Keyring
from .protocol.layout import DEFAULT_VERSION
from .retry import RetryPolicy

__all__ = ["FLAT_KEYWORDS", "AuthOptions", "OpenOptions", "TierOptions", "check_combination", "new_run_version",
           "options_from_keywords"]


@dataclass(frozen=True)
class TierOptions:
    """Two tiers (``docs/tiers.md``): a directory on this machine in front of the store.

    The store's URL is the durable tier, the one source of truth for identity,
    attempts and fencing; each save is committed in ``path`` first (same save
    ID, same manifest digest) and made durable by a background thread. On many
    ranks (:func:`ckptstore.distributed.open_distributed`) ``path`` is the job's
    tier root and rank ``r`` keeps ``<path>/rank-<r>`` (``docs/tiers.md`` "Many
    ranks"). Below ``path`` nothing is followed: a link or non-directory at the
    rank folder, the run's folder or ``.quarantine``, or a tier whose run folder
    is (or lies inside, or holds) the durable run's folder, is
    :class:`~ckptstore.errors.LocalTierRefusedError`.
    """

    #: the local tier's directory
    path: str | os.PathLike[str]
    #: saves kept in the local tier besides those waiting for replication
    keep: int = 2
    #: replicate every K-th local save (the resume point and preemption saves always). The
    #: count starts at each open with the first save handed to replication (the resume point
    #: when only the local tier holds it, else the first new save): after a restart the
    #: durable steps are not those an uninterrupted run would have made (docs/tiers.md)
    replicate_every: int = 1
    #: saves waiting for replication at most; beyond it the oldest are skipped (newest wins)
    max_lag: int = 2
    #: seconds ``close()`` (and interpreter exit, for a store not closed) waits for replication
    close_flush_seconds: float = 30.0
    #: copy each component to the durable tier as soon as its local write returns, not after
    #: the local commit (durable sooner, at the cost of local-save speed when the two compete)
    early_replication: bool = False
    #: many ranks: the ranks on other nodes that also hold each rank's local part (``docs/tiers.md``
    #: "Peer copies"; a version-3 part travels as its pieces, those the holder lacks). None: 1; 0: off.
    #: Capped at the number of other nodes
    peer_copies: int | None = None
    #: this process's node for the peer copies (default: torchrun's ``GROUP_RANK``, else the host name);
    #: ranks of one node never hold each other's copies
    node: str | None = None
    #: set by ``open_distributed`` on each rank (this rank's number); not for direct use
    rank: int | None = None
    #: set by ``open_distributed`` on the coordinator (what every other rank holds verified); not for direct use
    peers: Mapping[int, Mapping[str, Any]] | None = None
    #: set by ``open_distributed`` on each rank (the peer copies' transport and the write-back's outcome,
    #: ``ckptstore.distributed.peer_link.PeerSetup``); not for direct use
    peer_job: Any = None


@dataclass(frozen=True)
class AuthOptions:
    """Authenticated records (``protocol_spec/THREATS.md``).

    With a ``keyring`` (or ``CKPTSTORE_AUTH_KEYS`` in the environment when it
    is None) every record the store writes carries a keyed-BLAKE3 tag.
    ``"warn"`` uses unauthenticated records with an
    :class:`~ckptstore.UnauthenticatedWarning`; ``"require"`` refuses them:
    selection skips such commits, such attempt records fence nothing and stop
    gc, and an unauthenticated run is not opened.
    """

    policy: AuthPolicy | str = "off"
    keyring: Keyring | None = None


@dataclass(frozen=True)
class OpenOptions:
    """How a store behaves: the one object :meth:`CheckpointStore.open`,
    ``open_distributed`` and ``Checkpointer.open`` take (``dataclasses.replace``
    makes a variant). Every field has the default a store gets without it."""

    #: the backoff policy for transient storage errors
    retry: RetryPolicy | None = None
    #: how the resume point is checked at open: ``"deep"`` re-hashes every byte of the
    #: candidate (a bit flip at rest never becomes the resume point); ``"cheap"`` checks sizes
    #: and leaves the digests to the restore, which always verifies
    resume_verify: Literal["deep", "cheap"] = "deep"
    #: of a run this open creates (default 3: saves stored as pieces addressed by content,
    #: PROTOCOL.md §9, so what did not change is not written again, :func:`new_run_version`;
    #: 2 and 1 stay readable by releases that know only them). An existing run keeps its own
    protocol_version: int | None = None
    #: version 3: the window and intent lifetime every writer and gc of the run must share
    pieces: PieceTiming = field(default_factory=PieceTiming)
    #: authenticated records
    auth: AuthOptions = field(default_factory=AuthOptions)
    #: two tiers; None: one tier
    tiers: TierOptions | None = None
    #: where a new run came from (``store.lineage_of(ref)`` of the source run); written once, with the run
    lineage: Mapping[str, Any] | None = None
    #: inside a torch.distributed job of many ranks, this process alone writes (else opening for
    #: writing without ``join_attempt`` is refused there)
    single_writer: bool = False


def new_run_version(o: OpenOptions) -> int:
    """The protocol version of a run this open creates (an existing run keeps
    its own): ``protocol_version`` when given; else 3 (pieces addressed by
    content, PROTOCOL.md §9). The one place this default is decided."""
    if o.protocol_version is not None:
        return o.protocol_version
    return DEFAULT_VERSION


def check_combination(o: OpenOptions, *, joined: bool = False) -> None:
    """The one table of option combinations a store refuses at open, each with
    its reason and fix (``docs/combinations.md``), run before anything is
    written. None depends on the run's protocol version: every option works on
    versions 2 and 3. ``joined``: the store joins a coordinator's attempt."""
    t = o.tiers
    if t is None:
        return
    refused = [
        (joined and t.rank is None,
         "local_tier with join_attempt needs the rank's tier (open the ranks with "
         "ckptstore.distributed.open_distributed(..., options=OpenOptions(tiers=TierOptions(...))))"),
        (t.rank is not None and t.rank < 0, "the tier's rank must be >= 0"),
        (t.keep < 1 or t.replicate_every < 1 or t.max_lag < 1,
         "TierOptions keep, replicate_every and max_lag must be at least 1"),
        (t.close_flush_seconds < 0, "TierOptions close_flush_seconds must be >= 0"),
        # a rank of many copies its part after the local commit (tiers.parts)
        (t.rank is not None and t.early_replication,
         "early_replication is for one process; a rank of many replicates its part "
         "after the local commit (open the job without early_replication)"),
        (t.peer_copies is not None and t.peer_copies < 0, "TierOptions peer_copies must be >= 0"),
        # a peer copy is a rank's part sent to another node's rank: there is no part without ranks
        (t.peer_copies and t.rank is None and not joined,
         "peer_copies is for many ranks (ckptstore.distributed.open_distributed); one process has no peers "
         "(open without peer_copies)"),
    ]
    for hit, why in refused:
        if hit:
            raise InvalidInputError(why)


#: the flat keywords of earlier releases: name -> (field path in OpenOptions)
FLAT_KEYWORDS: dict[str, tuple[str, ...]] = {
    "retry": ("retry",), "resume_verify": ("resume_verify",), "protocol_version": ("protocol_version",),
    "piece_timing": ("pieces",), "lineage": ("lineage",), "single_writer": ("single_writer",),
    "auth_policy": ("auth", "policy"), "keyring": ("auth", "keyring"),
    "local_tier": ("tiers", "path"), "local_keep": ("tiers", "keep"),
    "replicate_every": ("tiers", "replicate_every"), "max_replication_lag": ("tiers", "max_lag"),
    "close_flush_seconds": ("tiers", "close_flush_seconds"), "early_replication": ("tiers", "early_replication"),
}


def options_from_keywords(options: OpenOptions | None, keywords: Mapping[str, Any], where: str,
                          *, stacklevel: int = 3) -> OpenOptions:
    """``options`` (default: :class:`OpenOptions`) with the deprecated flat
    ``keywords`` of ``where`` applied (one :class:`DeprecationWarning` naming
    the new spelling). An unknown keyword is a :class:`TypeError`, as Python's own."""
    o = options if options is not None else OpenOptions()
    if not isinstance(o, OpenOptions):
        raise InvalidInputError(f"{where}: options must be an OpenOptions, got {type(o).__name__}")
    if not keywords:
        return o
    unknown = sorted(k for k in keywords if k not in FLAT_KEYWORDS)
    if unknown:
        raise TypeError(f"{where}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
    top: dict[str, Any] = {}
    auth: dict[str, Any] = {}
    tiers: dict[str, Any] = {}
    for k, v in keywords.items():
        path = FLAT_KEYWORDS[k]
        if len(path) == 1:
            top[path[0]] = v if not (k == "piece_timing" and v is None) else PieceTiming()
        elif path[0] == "auth":
            auth[path[1]] = v
        else:
            tiers[path[1]] = v
    if auth:
        top["auth"] = replace(o.auth, **auth)
    if tiers:
        base = o.tiers
        if tiers.get("path", base.path if base is not None else None) is None:
            tiers.pop("path", None)  # local_tier=None with other tier keywords: one tier, as before
            top["tiers"] = None if base is None else base
        else:
            top["tiers"] = replace(base, **tiers) if base is not None else TierOptions(**tiers)
    new = ", ".join(f"{'.'.join(FLAT_KEYWORDS[k])}" for k in sorted(keywords))
    warnings.warn(
        f"{where}(): the flat keyword(s) {', '.join(sorted(keywords))} are deprecated and go in the next release; "
        f"pass options=OpenOptions(...) instead (fields {new}; ckptstore.options)",
        DeprecationWarning, stacklevel=stacklevel)
    return replace(o, **top)
