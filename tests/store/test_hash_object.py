"""``RunIO.hash_object`` (the deep check's hash of one object): at most
``size + 1`` bytes read, a grown object seen as one byte longer, a short one
as its true length; large objects hashed through two reused buffers."""

from __future__ import annotations

import os

import blake3
import pytest

from ckptstore.backends.base import Backend
from ckptstore.core.bounded_io import RunIO

CHUNK = 64 << 10


@pytest.mark.parametrize("n", [0, 5, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK, 3 * CHUNK + 17])
@pytest.mark.backends("memory", "local", "moto")
def test_hash_object_sees_exactly_what_is_there(backend: Backend, n: int) -> None:
    data = os.urandom(n)
    backend.put("k", [data])
    io = RunIO(backend, "r")
    digest = blake3.blake3(data).hexdigest()
    assert io.hash_object("k", n, chunk=CHUNK) == (n, digest)
    assert io.hash_object("k", n) == (n, digest)
    if n:
        assert io.hash_object("k", n - 1, chunk=CHUNK) == (n, digest)  # grown past the claim: one byte more
    seen, _ = io.hash_object("k", n + 10, chunk=CHUNK)  # shorter than the claim: its true length
    assert seen == n
    before = io.bytes_read
    io.hash_object("k", n + 10 * CHUNK, chunk=CHUNK)
    assert io.bytes_read - before == n  # a short chunk ends the read
