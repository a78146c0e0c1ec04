"""Two tiers: a local directory committed at local-disk speed, replicated to
the durable store in the background (``docs/tiers.md``, PROTOCOL.md
§"Tiers"). Opened through ``CheckpointStore.open(..., options=OpenOptions(tiers=TierOptions(...)))``; for
a job of many ranks through ``open_distributed(..., local_tier=...)``, each
rank's tier holding its own part (:mod:`.parts`)."""

from .replicator import ReplicationStatus
from .tiered import NotDurableAtExitWarning

__all__ = ["NotDurableAtExitWarning", "ReplicationStatus"]
