"""Two tiers: a local directory committed at local-disk speed, replicated to
the durable store in the background (``docs/tiers.md``, PROTOCOL.md
§"Tiers"). Opened through ``CheckpointStore.open(..., options=OpenOptions(tiers=TierOptions(...)))``; for
a job of many ranks through ``open_distributed(..., options=OpenOptions(tiers=...))``, each
rank's tier holding its own part (:mod:`.parts`) and, on many nodes, a copy of a peer's
part (:mod:`.peer_copies`). The names below are what the add-ons (``ckptstore.distributed``) use."""

from .parts import local_holdings
from .peer_copies import PEER_WAIT_SECONDS, assign_receivers, copy_pairs, node_name
from .peer_frames import PeerCopyError, PeerLink, receive_frame
from .peer_repair import RepairPlan, durable_attempts, peer_holdings, plan_repair, send_held_part, write_back
from .replicator import PeerStatus, ReplicationStatus
from .tiered import NotDurableAtExitWarning, PeerCopiesOffWarning

__all__ = [
    "PEER_WAIT_SECONDS", "NotDurableAtExitWarning", "PeerCopiesOffWarning", "PeerCopyError", "PeerLink",
    "PeerStatus", "RepairPlan", "ReplicationStatus", "assign_receivers", "copy_pairs", "durable_attempts",
    "local_holdings", "node_name", "peer_holdings",
    "plan_repair", "receive_frame", "send_held_part", "write_back",
]
