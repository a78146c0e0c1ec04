"""The one backend conformance suite, run against every backend kind."""

import pytest

from ckptstore.testing.conformance import BackendConformance
from tests.backends.test_object_stores import ATOMIC_CREATE


class TestBackendConformance(BackendConformance):
    def create_is_exclusive_under_races(self, request: pytest.FixtureRequest) -> bool:
        kind = str(request.getfixturevalue("backend_kind"))
        return kind in ("memory", "local") or kind in ATOMIC_CREATE
