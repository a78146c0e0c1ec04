# Stand-in for Lightning-AI/pytorch-lightning tests/tests_pytorch/helpers/runif.py: the same wrapper around
# the installed lightning.pytorch.utilities.testing._runif_reasons (see tests/peer/lightning/PROVENANCE.md).
from typing import Any

import pytest
from lightning.pytorch.utilities.testing import _runif_reasons


def RunIf(**kwargs: Any) -> pytest.MarkDecorator:
    reasons, marker_kwargs = _runif_reasons(**kwargs)
    return pytest.mark.skipif(condition=len(reasons) > 0, reason=f"Requires: [{' + '.join(reasons)}]", **marker_kwargs)
