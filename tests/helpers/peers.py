"""Fake peers that speak raw bytes, for hostile-input tests."""

from __future__ import annotations

import asyncio
import socket
import struct


class FakeServer:
    """A raw asyncio server: `on_data(writer, data)` decides what to send back."""

    def __init__(self, on_data) -> None:
        self.on_data = on_data
        self.received = bytearray()
        self.writers: list = []
        self._server = None
        self.port = 0

    async def __aenter__(self) -> FakeServer:
        async def handle(reader, writer):
            self.writers.append(writer)
            try:
                while True:
                    data = await reader.read(65536)
                    if not data:
                        break
                    self.received += data
                    res = self.on_data(writer, data)
                    if asyncio.iscoroutine(res):
                        await res
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()
        self._server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        for w in self.writers:
            w.close()
        self._server.close()
        await self._server.wait_closed()


def reset(writer) -> None:
    """Close with RST instead of FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def raw_exchange(port: int, data: bytes, *, shutdown: bool = False, read_timeout: float = 1.0,
                       want: int | None = None, until=None) -> tuple[bytes, bool]:
    """Send bytes to a server; return (everything received, whether it closed).

    Reading stops at the server's close, after `want` bytes, once `until(received)` holds, or
    after `read_timeout` of silence (where a test expects more answers, give `until`, so a busy
    machine's late answer is still waited for: `read_timeout` is then only a hang guard)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    if shutdown:
        writer.write_eof()
    got = b""
    closed = False
    try:
        while (want is None or len(got) < want) and (until is None or not until(got)):
            chunk = await asyncio.wait_for(reader.read(65536), read_timeout)
            if not chunk:
                closed = True
                break
            got += chunk
    except ConnectionResetError:
        closed = True
    except asyncio.TimeoutError:
        pass
    writer.close()
    return got, closed


async def exchange_frames(port: int, data: bytes, n: int, timeout: float = 2.0) -> tuple[list, bool]:
    """Send bytes; return the first `n` response events (fewer if the server closes) and
    whether it closed."""
    from aiobrpc.protocol import baidu_std
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    dec = baidu_std.Decoder(baidu_std.CLIENT)
    events: list = []
    closed = False
    try:
        while len(events) < n:
            chunk = await asyncio.wait_for(reader.read(65536), timeout)
            if not chunk:
                closed = True
                break
            dec.feed(chunk)
            events += dec.events()
    except ConnectionResetError:
        closed = True
    writer.close()
    return events, closed
