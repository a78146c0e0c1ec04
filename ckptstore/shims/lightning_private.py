"""Lightning's private APIs that the Lightning plug-in relies on (tested:
lightning 2.5 and 2.6, the extra says ``>=2.5,<3``).

* ``_PATH``: Lightning's type for a checkpoint path (``str | Path``).
* ``_load_state`` and ``_pl_migrate_checkpoint``: what Lightning's own
  ``load_from_checkpoint`` does after its ``torch.load``; the plug-in's
  :func:`~ckptstore.integrations.lightning.load_module` does the same after
  its verified read.
"""

from __future__ import annotations

from lightning.fabric.utilities.types import _PATH as PATH
from lightning.pytorch.core.saving import _load_state as load_state
from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint as migrate_checkpoint

#: the lightning releases these names were tested with
TESTED = ">=2.5,<3"

__all__ = ["PATH", "TESTED", "load_state", "migrate_checkpoint"]
