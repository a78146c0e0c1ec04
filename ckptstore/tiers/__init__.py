"""Two tiers: a local directory committed at local-disk speed, replicated to
the durable store in the background (``docs/tiers.md``, PROTOCOL.md
§"Tiers"). Opened through ``CheckpointStore.open(..., local_tier=...)``."""

from .replicator import ReplicationStatus

__all__ = ["ReplicationStatus"]
