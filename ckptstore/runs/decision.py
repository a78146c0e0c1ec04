"""Deprecated alias of :mod:`ckptstore.ops.decision` (the module moved there in 0.2.0; this path goes in 0.3.0).

Importing it warns once (a :class:`DeprecationWarning` naming the new path) and
re-exports the new module's public names: the objects are the same.
"""

import warnings

from ..ops.decision import Action, Decision, decide, plan_resume

__all__ = ["Action", "Decision", "decide", "plan_resume"]

warnings.warn(
    "ckptstore.runs.decision is deprecated and will be removed in ckptstore 0.3.0: "
    "import ckptstore.ops.decision instead",
    DeprecationWarning,
    stacklevel=2,
)
