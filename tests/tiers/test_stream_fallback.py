"""``iter_read`` of a save held by both tiers when the local stream fails
part way (PROTOCOL.md §"Tiers", docs/tiers.md): the stream goes on from the
durable copy at the same offset, that copy verified whole; when bytes already
handed out were bad, a clear error says to discard them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from ckptstore.errors import CorruptionError
from ckptstore.protocol.selection import SaveRef
from tests.tiers.test_tiers import local_file, open_tiered, payload, save

CHUNK = 1000  # the 3,000-byte component streams in three chunks


def saved(backend_factory: Callable[[], Backend], tmp_path: Path) -> tuple[CheckpointStore, SaveRef, Path]:
    s = open_tiered(backend_factory(), tmp_path / "nvme")
    save(s, 4)
    assert s.flush(30)
    ref = s.latest_complete()
    assert ref is not None and ref.tier == "both"
    return s, ref, local_file(tmp_path / "nvme", ref, "a")


def flip(f: Path, offset: int) -> None:
    b = bytearray(f.read_bytes())
    b[offset] ^= 1
    f.write_bytes(bytes(b))


@pytest.mark.parametrize("damage", ["truncated", "flip-in-last-chunk", "removed-mid-stream"])
def test_a_local_stream_that_fails_part_way_goes_on_from_the_durable_copy(
        backend_factory: Callable[[], Backend], tmp_path: Path, damage: str) -> None:
    s, ref, f = saved(backend_factory, tmp_path)
    if damage == "truncated":
        f.write_bytes(f.read_bytes()[:-10])
    elif damage == "flip-in-last-chunk":
        flip(f, 2500)
    it = s.iter_read(ref, "a", CHUNK)
    first = next(it)  # a local chunk was handed out before anything failed
    assert first == payload(4)[:CHUNK]
    if damage == "removed-mid-stream":
        f.unlink()
    got = first + b"".join(it)
    assert got == payload(4)
    s.close()


def test_bad_bytes_already_handed_out_raise_a_clear_error(
        backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    s, ref, f = saved(backend_factory, tmp_path)
    flip(f, 10)  # in the first chunk: handed out before the local digest could be checked
    it = s.iter_read(ref, "a", CHUNK)
    first = next(it)
    assert first != payload(4)[:CHUNK]
    with pytest.raises(CorruptionError, match="discard what was read"):
        for _ in it:
            pass
    # the local copy is bad: a deep selection passes it over, and the read of the durable copy is whole
    again = s.latest_complete(deep=True)
    assert again is not None
    assert b"".join(s.iter_read(again, "a", CHUNK)) == payload(4)
    s.close()


def test_a_local_only_save_still_raises(backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    """Nothing to fall back to: the local stream's error reaches the caller."""
    s = open_tiered(backend_factory(), tmp_path / "nvme", replicate_every=1000)
    save(s, 1)
    assert s.flush(30)
    save(s, 2)  # not replicated (replicate_every)
    ref = s.latest_complete()
    assert ref is not None and (ref.step, ref.tier) == (2, "local")
    f = local_file(tmp_path / "nvme", ref, "a")
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(CorruptionError):
        b"".join(s.iter_read(ref, "a", CHUNK))
    s.close()
