"""The peer copies' transport and their steps at open (``docs/tiers.md`` "Peer
copies"; the storage side is :mod:`ckptstore.tiers.peer_copies`).

* :class:`GlooPeerLink`: ``torch.distributed`` point-to-point (``send`` /
  ``recv`` of CPU ``uint8`` tensors) on a gloo group created for the peer
  copies alone at open, with the channel's deadline as the group's timeout.
  The job's own process group (NCCL or gloo) is never used by the copies, so
  the background thread never interleaves with the training loop's
  collectives. Nothing is pickled: frames are bytes (PROTOCOL.md §4.8 item 8).
* :func:`setup_peers`, collective, inside :func:`~ckptstore.distributed.open_distributed`
  before the hello: every rank names its node; the copy pairs follow
  (:func:`~ckptstore.tiers.peer_copies.assign_receivers`); when there are any,
  the gloo group is created; then every rank reports what it holds verified
  (its own folder and its peer folders), the coordinator plans the write-back
  (:func:`~ckptstore.tiers.peer_copies.plan_repair`), and each rank lacking its
  part of that save receives it from a holder and writes it back into its own
  folder. What each rank holds afterwards is what its hello reports.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import RecordAuth
from ..errors import CkptStoreError
from ..options import TierOptions
from ..retry import RetryPolicy
from ..tiers import (
    PEER_WAIT_SECONDS,
    PeerCopyError,
    RepairPlan,
    assign_receivers,
    copy_pairs,
    durable_attempts,
    local_holdings,
    node_name,
    peer_holdings,
    plan_repair,
    receive_frame,
    send_held_part,
    write_back,
)
from .channel import Channel

__all__ = ["GlooPeerLink", "PeerSetup", "setup_peers"]


class GlooPeerLink:
    """:class:`~ckptstore.tiers.peer_copies.PeerLink` on a dedicated gloo group."""

    def __init__(self, group: dist.ProcessGroup, rank: int, ranks: list[int]) -> None:
        self.group = group
        self.rank = rank
        #: group rank -> global rank (what ``dist.send`` takes)
        self._global = ranks

    def send(self, dst: int, data: bytes | bytearray | memoryview) -> None:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        try:
            dist.send(t, dst=self._global[dst], group=self.group)
        except RuntimeError as exc:
            raise PeerCopyError(f"rank {self.rank}: sending to rank {dst} failed ({str(exc)[:300]})") from None

    def recv(self, src: int, n: int) -> bytes:
        t = torch.empty(n, dtype=torch.uint8)
        try:
            dist.recv(t, src=self._global[src], group=self.group)
        except RuntimeError as exc:
            raise PeerCopyError(f"rank {self.rank}: receiving from rank {src} failed ({str(exc)[:300]})") from None
        return t.numpy().tobytes()


@dataclass
class PeerSetup:
    """What :func:`setup_peers` leaves for the rest of the open."""

    #: the transport (None: no copy pairs, see ``off``)
    link: GlooPeerLink | None
    #: sender -> receivers
    receivers: dict[int, tuple[int, ...]]
    #: why peer copies are off for this job (None: on)
    off: str | None
    #: this rank's own holdings after the write-back (what its hello reports)
    held: list[dict[str, Any]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    #: where this rank's part of the planned save came from: "own", "peer" (written back), or None
    source: dict[str, Any] | None = None
    #: the newest step of which every rank's part was held somewhere (own folder or a peer's)
    newest_everywhere: int | None = None
    #: the newest step of which any rank held any part
    newest_anywhere: int | None = None
    #: the coordinator: every rank's source (rank -> its ``source``)
    sources: dict[int, Any] = field(default_factory=dict)
    #: how long a save waits for its peer copies at most (the channel's timeout, the link's deadline)
    wait_seconds: float = PEER_WAIT_SECONDS


def setup_peers(ch: Channel, tiers: TierOptions, run_id: str, url: str | os.PathLike[str],
                storage_options: Mapping[str, Any] | None, identity_digest: str, auth: RecordAuth,
                retry: RetryPolicy | None) -> PeerSetup:
    """Collective (every rank of the channel, in the same order): see the module docstring."""
    tag = ch.next()
    ch.post(tag, "node", {"node": node_name(tiers.node), "copies": tiers.peer_copies})
    if ch.is_coordinator:  # the coordinator alone reads every rank's node and tells the pairs (one message each way)
        said = ch.gather(tag, "node")
        nodes = {r: str(m.get("node")) for r, m in said.items()}
        k = min(1 if (c := m.get("copies")) is None else int(c) for m in said.values())
        receivers = assign_receivers(nodes, k)
        n_nodes = len(set(nodes.values()))
        ch.post(tag, "pairs", {"k": k, "nodes": n_nodes,
                               "receivers": {str(r): list(h) for r, h in receivers.items()}})
    else:
        msg = ch.receive(tag, "pairs")
        k, n_nodes = int(msg["k"]), int(msg["nodes"])
        receivers = {int(r): tuple(int(x) for x in h) for r, h in dict(msg["receivers"]).items()}
    pairs = copy_pairs(receivers)
    if pairs and ch.group is not None and dist.get_world_size(ch.group) != dist.get_world_size():
        pairs = []  # the copies' group must be created by every process of the job (the whole world)
    if not pairs:
        off = "peer_copies=0" if k == 0 else "every rank is on one node" if n_nodes <= 1 else \
            "the job's group is a subgroup of the world (peer copies need the whole world's group)"
        held, why = local_holdings(tiers.path, run_id, ch.rank, identity_digest, auth)
        return PeerSetup(None, receivers, off, held, why)
    ranks = list(range(ch.world_size)) if ch.group is None else \
        [dist.get_global_rank(ch.group, r) for r in range(ch.world_size)]
    group = dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=ch.timeout))
    link = GlooPeerLink(group, ch.rank, ranks)
    setup = PeerSetup(link, receivers, None, wait_seconds=ch.timeout)
    _repair(ch, tag, setup, tiers, run_id, url, storage_options, identity_digest, auth, retry)
    return setup


def _repair(ch: Channel, tag: str, setup: PeerSetup, tiers: TierOptions, run_id: str, url: str | os.PathLike[str],
            storage_options: Mapping[str, Any] | None, identity_digest: str, auth: RecordAuth,
            retry: RetryPolicy | None) -> None:
    assert setup.link is not None
    own, why = local_holdings(tiers.path, run_id, ch.rank, identity_digest, auth)
    peer, peer_why = peer_holdings(tiers.path, run_id, ch.rank, identity_digest, auth)
    ch.post(tag, "held", {"own": own, "peer": {str(s): h for s, h in peer.items()}, "reasons": (why + peer_why)[:20]})
    if ch.is_coordinator:
        reports = ch.gather(tag, "held")
        owns = {r: list(m.get("own") or []) for r, m in reports.items()}
        peers = {r: {int(s): list(h) for s, h in dict(m.get("peer") or {}).items() if str(s).isdigit()}
                 for r, m in reports.items()}
        try:  # a zombie's save is judged by the durable attempt records, never by a folder's copies
            attempts = durable_attempts(url, storage_options, run_id, auth, retry)
        except (CkptStoreError, OSError):
            attempts = None  # unreadable: nothing is written back (fail closed); the open itself then says why
        plan, everywhere, anywhere = plan_repair(owns, peers, ch.world_size, attempts if attempts is not None else {})
        if attempts is None:
            plan = None
        msg: dict[str, Any] = {"plan": plan.to_json() if plan else None, "everywhere": everywhere,
                               "anywhere": anywhere}
        ch.post(tag, "plan", msg)
    else:
        msg = ch.receive(tag, "plan")
    plan = RepairPlan.from_json(msg["plan"]) if msg.get("plan") else None
    setup.newest_everywhere = msg.get("everywhere") if isinstance(msg.get("everywhere"), int) else None
    setup.newest_anywhere = msg.get("anywhere") if isinstance(msg.get("anywhere"), int) else None
    setup.held, setup.reasons = own, why + peer_why
    if plan is None:
        return
    step, attempt, sid, digest = plan.target
    setup.source = {"step": step, "from": "own"} if ch.rank not in plan.fetch else None
    for owner, holder in sorted(plan.fetch.items()):
        if ch.rank == holder:
            send_held_part(setup.link, owner, tiers.path, holder, owner, run_id, step, attempt, identity_digest, auth)
        elif ch.rank == owner:
            setup.source = {"step": step, "from": "peer", "holder": holder}
            setup.source.update(_receive_own(setup, holder, plan, tiers, run_id, url, storage_options,
                                             identity_digest, auth, retry))
    if setup.source is not None and setup.source.get("from") == "peer" and setup.source.get("ok"):
        setup.held, again = local_holdings(tiers.path, run_id, ch.rank, identity_digest, auth)  # re-hashed
        setup.reasons = again + peer_why
    tag2 = ch.next()
    ch.post(tag2, "source", {"source": setup.source})
    if ch.is_coordinator:
        setup.sources = {r: m.get("source") for r, m in ch.gather(tag2, "source").items()}


def _receive_own(setup: PeerSetup, holder: int, plan: RepairPlan, tiers: TierOptions, run_id: str,
                 url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None, identity_digest: str,
                 auth: RecordAuth, retry: RetryPolicy | None) -> dict[str, Any]:
    """Receive this rank's part of the planned save from ``holder`` and write it back (verified)."""
    assert setup.link is not None
    step, attempt, sid, digest = plan.target
    try:
        frame = receive_frame(setup.link, holder, setup.link.rank, run_id)
    except CkptStoreError as exc:
        return {"ok": False, "why": f"{exc}"[:300]}
    if frame is None:
        return {"ok": False, "why": f"rank {holder} could not read its peer copy"}
    if (frame.record.save_id, frame.record.manifest_digest()) != (sid, digest):
        frame.drain()
        return {"ok": False, "why": f"rank {holder} sent another save than step {step}'s"}
    try:
        write_back(frame, tiers.path, setup.link.rank, url, storage_options, auth, identity_digest, retry)
    except (CkptStoreError, OSError) as exc:
        return {"ok": False, "why": f"{type(exc).__name__}: {exc}"[:300]}
    return {"ok": True}
