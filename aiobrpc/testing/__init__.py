"""Testing code that uses aiobrpc: a Channel connected in memory to servicers of the same process.

`ChannelFor(servicers)` starts a `Server` serving them at an in-memory address (no socket, no
port; aiobrpc/transport/memory.py) and yields a `Channel` to it. A call still goes through
everything a call over TCP does: the baidu_std codec both ways, the server's dispatch, its
limits, deadlines, compression, attachments, user fields and error codes. So a test of code
that calls a service sees real serialization and real errors.

>>> async with ChannelFor([KvService()]) as channel:  # doctest: +SKIP
...     stub = aiobrpc.Stub(channel, KV)
...     await stub.Put(kv_pb2.PutRequest(key="color", value=b"blue"))

For pytest: `pytest_plugins = ["aiobrpc.testing.pytest_plugin"]` in a conftest.py gives the
`aiobrpc_channel_for` fixture.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..client.channel import Channel
from ..options import ChannelOptions, ServerOptions
from ..server.server import Server
from ..stub import Servicer
from ..transport.memory import MEMORY_HOST

__all__ = ["ChannelFor", "MEMORY_HOST"]


class ChannelFor:
    """A `Channel` to a `Server` serving `servicers` in memory, on the running event loop.

    `async with ChannelFor(servicers) as channel:` starts the server and yields the channel;
    leaving the block closes the channel and stops the server: requests in flight get
    `join_timeout` seconds to finish (a handler a test abandoned, past its deadline, is then
    cancelled).
    `start()` and `close()` do the same without a block. While open, `server` is the server
    (its `stats`, `options`) and `channel` the channel.

    Args:
        servicers: `Servicer` instances to serve, one per service.
        options: The channel's options (defaults when None).
        server_options: The server's options (defaults when None).
        join_timeout: `Server.join`'s timeout when closing (None: wait for every request).

    >>> async with ChannelFor([Echo()], ChannelOptions(timeout_ms=100)) as channel:  # doctest: +SKIP
    ...     reply = await aiobrpc.Stub(channel, ECHO).Echo(echo_pb2.EchoRequest(message="hi"))
    """

    def __init__(self, servicers: Iterable[Servicer], options: ChannelOptions | None = None, *,
                 server_options: ServerOptions | None = None, join_timeout: float | None = 1.0) -> None:
        self.servicers = list(servicers)
        if not self.servicers:
            raise ValueError("ChannelFor needs at least one servicer to serve")
        self.options = options
        self.server_options = server_options
        self.join_timeout = join_timeout
        self.server: Server | None = None
        self.channel: Channel | None = None

    async def start(self) -> Channel:
        """Start the server and return a channel to it."""
        if self.server is not None:
            raise RuntimeError("this ChannelFor is already started")
        server = Server(self.server_options)
        for servicer in self.servicers:
            server.add_service(servicer)
        await server.start(f"{MEMORY_HOST}:0")
        self.server = server
        self.channel = Channel(server.address, self.options)
        return self.channel

    async def close(self) -> None:
        """Close the channel, then stop the server and wait for it (nothing when not started)."""
        channel, server = self.channel, self.server
        self.channel = self.server = None
        if channel is not None:
            await channel.close()
        if server is not None:
            await server.stop()
            await server.join(self.join_timeout)

    async def __aenter__(self) -> Channel:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()
