"""FramedConnection.write: coalesced per loop iteration, at once for a message known to be alone."""

from __future__ import annotations

import asyncio

from aiobrpc.protocol.baidu_std import CLIENT
from aiobrpc.transport.tcp import EARLY_FLUSH_MESSAGES, FramedConnection


class Recorder(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data) -> None:
        self.writes.append(bytes(data))

    def writelines(self, buffers) -> None:
        self.writes.append(b"".join(bytes(b) for b in buffers))

    def get_extra_info(self, name, default=None):
        return default

    def get_write_buffer_size(self) -> int:
        return 0


async def test_messages_of_one_iteration_go_out_together():
    conn = FramedConnection(CLIENT, 1 << 20)
    t = Recorder()
    conn.connection_made(t)
    conn.write([b"a", b"b"])
    conn.write([b"c"])
    assert t.writes == []
    await asyncio.sleep(0)
    assert t.writes == [b"abc"]


async def test_a_message_alone_goes_out_at_once_unless_others_wait():
    conn = FramedConnection(CLIENT, 1 << 20)
    t = Recorder()
    conn.connection_made(t)
    conn.write([b"x"], alone=True)
    assert t.writes == [b"x"]  # no loop iteration of latency
    conn.write([b"y"])
    conn.write([b"z"], alone=True)  # something is queued: keep the order, one write
    assert t.writes == [b"x"]
    await asyncio.sleep(0)
    assert t.writes == [b"x", b"yz"]


async def test_requests_and_replies_go_out_in_groups_so_the_peer_starts_early():
    conn = FramedConnection(CLIENT, 1 << 20)
    t = Recorder()
    conn.connection_made(t)
    n = EARLY_FLUSH_MESSAGES
    for i in range(2 * n + 3):
        conn.write([b"%c" % (65 + i)], early=True)
        # every n messages go at once, without waiting for the end of the iteration
        assert len(t.writes) == (i + 1) // n
    await asyncio.sleep(0)
    letters = bytes(range(65, 65 + 2 * n + 3))
    assert t.writes == [letters[:n], letters[n:2 * n], letters[2 * n:]]  # in order, nothing lost
    await asyncio.sleep(0)
    assert len(t.writes) == 3  # the flush scheduled by the first one found nothing left


async def test_other_writes_wait_for_the_end_of_the_iteration_and_keep_their_order():
    conn = FramedConnection(CLIENT, 1 << 20)
    t = Recorder()
    conn.connection_made(t)
    for i in range(3 * EARLY_FLUSH_MESSAGES):
        conn.write([b"s"])  # stream frames: one send per iteration
    assert t.writes == []
    conn.write([b"r"], early=True)  # an early message goes after what was queued before it
    await asyncio.sleep(0)
    assert t.writes == [b"s" * 3 * EARLY_FLUSH_MESSAGES + b"r"]
