"""Channel.counters counts what a channel sends and reads through the
rendezvous store (a real TCPStore on 127.0.0.1, one-rank gloo group)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from ckptstore.distributed import Channel, StoreCounters
from ckptstore.distributed.channel import encode


@pytest.fixture
def group() -> Iterator[None]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_message_posted_and_gathered_is_counted_in_messages_and_bytes(group: None) -> None:
    ch = Channel(name="counters")
    try:
        payload = {"ok": True, "components": {"rank0/model": [4096, "ab" * 32]}}
        before = ch.counters
        tag = ch.next()
        ch.post(tag, "inventory", payload)
        posted = ch.counters - before
        # the message itself and this rank's live-key record
        assert posted.messages == 2
        assert posted.bytes_sent > len(encode(payload))
        assert posted.bytes_received == 0
        got = ch.gather(tag, "inventory")
        assert got == {0: payload}
        read = ch.counters - before - posted
        assert read.bytes_received == len(encode(payload))
        assert read.messages == 0
        assert read.requests >= 2  # a check, then the get
    finally:
        ch.close()


def test_counters_subtract_field_by_field() -> None:
    a = StoreCounters(requests=10, messages=4, bytes_sent=300, bytes_received=200, beats=3)
    b = StoreCounters(requests=4, messages=1, bytes_sent=100, bytes_received=50, beats=1)
    assert a - b == StoreCounters(6, 3, 200, 150, 2)
