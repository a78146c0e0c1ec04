"""Test helpers shipped with ckptstore: the backend conformance suite and
fault-injecting wrappers, so a third-party backend can prove itself.
(Importing this package needs pytest, the test extra.)

Writing a backend
-----------------

A backend is a subclass of :class:`ckptstore.backends.Backend` that moves
bytes and reports what happened; the contract (what ``put``, ``create``,
``list``, ``list_keys``, ``get_many``... promise) is the docstring of
:mod:`ckptstore.backends.base`. The abstract methods are ``get``,
``get_range``, ``put``, ``create`` (an atomic create-if-absent), ``list``,
``size`` and ``delete``; the others have defaults. Use
:func:`~ckptstore.backends.base.check_key` on every key,
:func:`~ckptstore.backends.base.check_depth` on recursive listings and
:func:`~ckptstore.backends.base.only_flat` for ``flat=True``, and raise
:class:`~ckptstore.errors.NotFoundError` for a missing key. Make it openable
by URL with :func:`ckptstore.backends.register_scheme`.

Prove it with the conformance suite: subclass :class:`BackendConformance` in
a pytest module, give it a ``backend`` fixture returning a fresh, empty
backend, and the three raw hooks, which reach the storage without the
backend's own methods (the suite plants objects with them and checks what was
really stored)::

    import pytest
    from ckptstore.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        @pytest.fixture
        def backend(self, tmp_path):
            return MyBackend(tmp_path / "store")

        def set_raw(self, backend, key, data):   # store bytes as another program would
            (backend.root / key).parent.mkdir(parents=True, exist_ok=True)
            (backend.root / key).write_bytes(data)

        def get_raw(self, backend, key):          # the stored bytes, or None
            p = backend.root / key
            return p.read_bytes() if p.is_file() else None

        def delete_raw(self, backend, key):       # remove it; nothing if absent
            (backend.root / key).unlink(missing_ok=True)

Instead of the three methods, a ``raw_storage`` fixture may return an object
with ``set``/``get``/``delete`` (:class:`~ckptstore.testing.raw.RawStorage`);
ckptstore's own backends do that with the classes of
:mod:`ckptstore.testing.raw`.

Capability flags are fixtures to override: ``create_is_atomic_under_races``
(default True) says whether 8 threads racing to ``create`` one key get exactly
one winner; answer False only for a test double whose conditional write is not
atomic (moto is one, protocol_spec/PROTOCOL.md §7.1), and the race test then
asserts what still holds. ``race_rounds`` (default 3) sets how many rounds it
runs. tests/backends/test_third_party.py in ckptstore's repository is a
complete example: a dict-backed backend, defined in the test file, passing the
whole suite.
"""

from .conformance import BackendConformance, race_create_round
from .raw import RawStorage

__all__ = ["BackendConformance", "RawStorage", "race_create_round"]
