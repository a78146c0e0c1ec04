"""Multi-rank checkpoints: one attempt per job, all ranks or none, and a
``torch.distributed.checkpoint`` storage layer backed by the store.

Importing this package imports torch; the core ``ckptstore`` never does.
"""

from .agreement import PeerLostError
from .channel import Channel, ChannelError, CoordinatorLostError, RanksFailedError, StoreCounters
from .coordinator import DistributedRun, DistributedSave, open_distributed
from .errors import RemoteError, WorldSizeMismatchError
from .ranked import RankStore

__all__ = [
    "Channel",
    "ChannelError",
    "CoordinatorLostError",
    "DistributedRun",
    "DistributedSave",
    "PeerLostError",
    "RankStore",
    "RanksFailedError",
    "RemoteError",
    "StoreCounters",
    "WorldSizeMismatchError",
    "open_distributed",
]
