"""transport/memory.py: an in-memory transport pair behaves as a socket's transports do."""

from __future__ import annotations

import asyncio
import errno

import pytest

from aiobrpc.transport import memory
from tests.helpers.waiting import wait_until


class Recorder(asyncio.Protocol):
    """A plain Protocol that records what happens to it."""

    def __init__(self, keep_open_after_eof: bool = False) -> None:
        self.events: list = []
        self.transport = None
        self.keep_open = keep_open_after_eof
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.events.append("made")

    def data_received(self, data: bytes) -> None:
        self.events.append(data)

    def eof_received(self):
        self.events.append("eof")
        return self.keep_open

    def pause_writing(self) -> None:
        self.events.append("pause_writing")

    def resume_writing(self) -> None:
        self.events.append("resume_writing")

    def connection_lost(self, exc) -> None:
        self.events.append(("lost", type(exc).__name__ if exc else None))
        self.lost.set_result(exc)


class BufferedRecorder(asyncio.BufferedProtocol, Recorder):
    """Receives into a small buffer, so a write arrives in several reads."""

    def __init__(self, size: int = 3) -> None:
        Recorder.__init__(self)
        self.buf = bytearray(size)
        self.received = bytearray()
        self.reads = 0

    def get_buffer(self, sizehint: int):
        return self.buf

    def buffer_updated(self, nbytes: int) -> None:
        self.reads += 1
        self.received += self.buf[:nbytes]


@pytest.fixture
async def pair():
    """(client protocol, server protocol, server) joined in memory; the server closed after."""
    servers: list = []

    async def make(client_protocol=None, server_protocol=None):
        server_side = server_protocol or Recorder()
        server = memory.serve(asyncio.get_running_loop(), lambda: server_side)
        servers.append(server)
        _, client = await memory.connect(asyncio.get_running_loop(), lambda: client_protocol or Recorder(),
                                         server.port)
        return client, server_side, server

    yield make
    for server in servers:
        server.close()


async def test_bytes_arrive_on_a_later_iteration_in_order(pair):
    client, server, _ = await pair()
    assert client.events == ["made"] and server.events == ["made"]
    client.transport.write(b"one ")
    client.transport.writelines([b"two ", memoryview(b"three")])
    assert server.events == ["made"], "not delivered within write()"
    await asyncio.sleep(0)
    assert b"".join(e for e in server.events if isinstance(e, bytes)) == b"one two three"
    client.transport.close()
    server.transport.close()
    await asyncio.gather(client.lost, server.lost)


async def test_written_bytes_are_copied(pair):
    client, server, _ = await pair()
    data = bytearray(b"abc")
    client.transport.write(data)
    data[:] = b"xyz"
    await asyncio.sleep(0)
    assert server.events[1] == b"abc"
    client.transport.abort()
    await asyncio.gather(client.lost, server.lost)


async def test_a_buffered_protocol_reads_into_its_own_buffer(pair):
    client, server, _ = await pair(server_protocol=BufferedRecorder(size=3))
    client.transport.write(b"0123456789")
    await asyncio.sleep(0)
    assert server.received == b"0123456789" and server.reads == 4
    client.transport.close()
    await asyncio.gather(client.lost, server.lost)


async def test_paused_reading_holds_bytes_and_the_writer_is_paused_past_high_water(pair):
    client, server, _ = await pair()
    server.transport.pause_reading()
    client.transport.set_write_buffer_limits(high=10, low=4)
    assert client.transport.get_write_buffer_limits() == (4, 10)
    client.transport.write(b"x" * 8)
    assert client.events == ["made"]
    client.transport.write(b"y" * 8)
    assert client.events == ["made", "pause_writing"] and client.transport.get_write_buffer_size() == 16
    await asyncio.sleep(0.01)
    assert server.events == ["made"], "nothing is read while paused"
    server.transport.resume_reading()
    await asyncio.sleep(0.01)
    await wait_until(lambda: b"".join(server.events[1:]) == b"x" * 8 + b"y" * 8)
    assert b"".join(server.events[1:]) == b"x" * 8 + b"y" * 8
    assert client.events == ["made", "pause_writing", "resume_writing"]
    assert client.transport.get_write_buffer_size() == 0
    client.transport.close()
    await asyncio.gather(client.lost, server.lost)


async def test_close_delivers_what_was_written_then_eof_then_connection_lost(pair):
    client, server, _ = await pair()
    client.transport.write(b"last words")
    client.transport.close()
    assert client.transport.is_closing()
    assert await client.lost is None and await server.lost is None
    assert server.events == ["made", b"last words", "eof", ("lost", None)]


async def test_a_peer_that_keeps_open_after_eof_can_still_answer(pair):
    client, server, _ = await pair(server_protocol=Recorder(keep_open_after_eof=True))
    client.transport.write_eof()
    assert client.transport.can_write_eof()
    await asyncio.sleep(0)
    assert server.events == ["made", "eof"] and not server.transport.is_closing()
    server.transport.write(b"reply")
    server.transport.close()
    await asyncio.gather(client.lost, server.lost)
    assert client.events == ["made", b"reply", "eof", ("lost", None)]
    with pytest.raises(RuntimeError, match="after write_eof"):
        client.transport.write(b"more")


async def test_abort_drops_what_is_buffered_and_resets_the_peer(pair):
    client, server, _ = await pair()
    client.transport.write(b"dropped")
    client.transport.abort()
    assert await client.lost is None
    assert isinstance(await server.lost, ConnectionResetError)
    assert server.events == ["made", ("lost", "ConnectionResetError")]


async def test_a_protocol_that_raises_is_aborted_and_reported(pair):
    class Broken(Recorder):
        def data_received(self, data):
            raise ValueError("boom")

    loop = asyncio.get_running_loop()
    reported: list = []
    loop.set_exception_handler(lambda lp, ctx: reported.append(ctx))
    try:
        client, server, _ = await pair(server_protocol=Broken())
        client.transport.write(b"x")
        assert isinstance(await client.lost, ConnectionResetError)
        await server.lost
    finally:
        loop.set_exception_handler(None)
    assert [type(ctx["exception"]) for ctx in reported] == [ValueError]


async def test_ports_refusals_and_loops():
    loop = asyncio.get_running_loop()
    server = memory.serve(loop, Recorder)
    try:
        assert server.is_serving() and 0 < server.port <= 65535
        with pytest.raises(OSError) as e:
            memory.serve(loop, Recorder, server.port)
        assert e.value.errno == errno.EADDRINUSE
        with pytest.raises(ValueError, match="1..65535"):
            memory.serve(loop, Recorder, 70000)
        other = asyncio.new_event_loop()
        try:
            with pytest.raises(OSError, match="runs on another event loop"):
                await memory.connect(other, Recorder, server.port)
        finally:
            other.close()
    finally:
        server.close()
    assert not server.is_serving()
    with pytest.raises(ConnectionRefusedError):
        await memory.connect(loop, Recorder, server.port)


async def test_peer_and_local_names(pair):
    client, server, srv = await pair()
    assert client.transport.get_extra_info("peername") == (memory.MEMORY_HOST, srv.port)
    assert server.transport.get_extra_info("sockname") == (memory.MEMORY_HOST, srv.port)
    assert server.transport.get_extra_info("peername") == client.transport.get_extra_info("sockname")
    assert client.transport.get_extra_info("socket") is None
    assert client.transport.get_extra_info("ssl_object") is None
    client.transport.close()
    await asyncio.gather(client.lost, server.lost)
