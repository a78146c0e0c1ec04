"""The one backend conformance suite, run against every backend kind."""

from ckptstore.testing.conformance import BackendConformance


class TestBackendConformance(BackendConformance):
    pass
