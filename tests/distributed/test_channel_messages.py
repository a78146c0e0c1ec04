"""Messages between ranks are canonical JSON, decoded strictly and bounded;
the coordinator's phase seam names its phases."""

from __future__ import annotations

import pytest

from ckptstore.distributed import coordinator
from ckptstore.distributed.channel import MAX_MESSAGE_BYTES, ChannelError, decode, encode
from ckptstore.errors import InvalidInputError
from ckptstore.protocol.canonical import canonical_json


def test_a_message_is_the_canonical_json_of_its_payload_and_decodes_back() -> None:
    payload = {"ok": True, "ref": {"step": 3, "name": "ü"}, "ranks": [1, 2]}
    assert encode(payload) == canonical_json(payload)
    assert decode(encode(payload)) == payload


@pytest.mark.parametrize("data", [
    b'{"a":1,"a":2}',              # a key twice
    b'{"a":NaN}',                  # no NaN
    b'{"a":' + b"9" * 40 + b"}",   # an unbounded integer
    b"\xff\xfe",                   # not UTF-8
    b"[1,2]",                      # not an object
    b" " * (MAX_MESSAGE_BYTES + 1),  # over the bound, refused before parsing
])
def test_a_hostile_message_is_a_channel_error(data: bytes) -> None:
    with pytest.raises(ChannelError):
        decode(data)


def test_at_phase_refuses_an_unknown_phase_and_removes_a_callback() -> None:
    with pytest.raises(InvalidInputError, match="before_gather, before_publish, after_publish"):
        coordinator.at_phase("before_lunch", lambda: None)
    coordinator.at_phase("before_publish", lambda: None)
    coordinator.at_phase("before_publish", None)
    coordinator.at_phase("after_publish", None)  # nothing installed: no error
