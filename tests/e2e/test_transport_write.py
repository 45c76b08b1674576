"""FramedConnection.write: coalesced per loop iteration, at once for a message known to be alone."""

from __future__ import annotations

import asyncio

from aiobrpc.protocol.baidu_std import CLIENT
from aiobrpc.transport.tcp import FramedConnection


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
