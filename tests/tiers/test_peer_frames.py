"""The peer copies' frames (``ckptstore.tiers.peer_copies``): whatever a
sender's own copy does (reads whole, ends short, runs long, fails part way),
the frame it sends has exactly the chunks both sides compute from the
record, so the receiver stays in step; and a frame that fails, wholly or
only by its digest, is refused without a byte of it landing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore.errors import CorruptionError
from ckptstore.tiers import peer_frames as pc

SMALL = 10


def pieces(data: bytes, step: int) -> Iterator[bytes]:
    for i in range(0, len(data), step):
        yield data[i:i + step]


@settings(max_examples=200, deadline=None)
@given(size=st.integers(0, 45), step=st.integers(1, 23), how=st.sampled_from(["whole", "short", "long", "fails"]),
       at=st.integers(0, 45))
def test_a_component_is_always_sent_as_the_chunks_the_record_implies(size: int, step: int, how: str, at: int,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pc, "CHUNK", SMALL)
    data = bytes((i * 7) % 251 + 1 for i in range(size))  # never zero: a zero fill differs

    def source() -> Iterator[bytes]:
        if how == "short":
            yield from pieces(data[: max(0, size - 1 - at % (size or 1))], step)
        elif how == "long":
            yield from pieces(data + b"extra", step)
        elif how == "fails":
            yield from pieces(data[: at % (size + 1)], step)
            raise CorruptionError("the local copy does not match its BLAKE3 digest")
        else:
            yield from pieces(data, step)

    failed: list[str] = []
    out = list(pc._exact(source(), size, failed, "c"))
    assert [len(o) for o in out] == list(pc._chunk_sizes(size))  # in step, whatever happened
    whole = b"".join(out)
    if how == "whole" or (how == "short" and size == 0):
        assert whole == data and not failed
    elif how == "long":
        assert failed  # said; what was sent is the recorded length, judged by the receiver's digest
    elif how == "short" or at % (size + 1) < size:
        assert failed and whole != data  # said, and zeros stand for the rest: the receiver's digest refuses it
    else:
        assert failed  # the failure came after every byte was read
