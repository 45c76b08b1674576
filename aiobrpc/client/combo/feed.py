"""A naming service whose server list its owner sets: how a PartitionChannel gives each
partition's Channel that partition's servers (a Channel takes a NamingService object as well
as a URL).

>>> feed = ServerFeed("partition 0/2 of demo")
>>> feed.set_servers([ServerNode("10.0.0.1", 80, "0/2")])
>>> feed.servers
(ServerNode(host='10.0.0.1', port=80, tag='0/2'),)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

from ..naming import NamingService, ServerNode


class ServerFeed(NamingService):
    """Server lists set by its owner; `watch()` yields the current list, then each new one."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._servers: tuple[ServerNode, ...] = ()
        self._version = 0
        self._waiters: set[asyncio.Future] = set()

    @property
    def servers(self) -> tuple[ServerNode, ...]:
        return self._servers

    def set_servers(self, servers: Iterable[ServerNode]) -> None:
        """Replace the list; watchers get it at their next step (unchanged lists are not sent)."""
        servers = tuple(servers)
        if servers == self._servers:
            return
        self._servers = servers
        self._version += 1
        waiters, self._waiters = self._waiters, set()
        for fut in waiters:
            if not fut.done() and not fut.get_loop().is_closed():
                fut.set_result(None)

    async def watch(self) -> AsyncIterator[list[ServerNode]]:
        while True:
            version = self._version
            yield list(self._servers)
            while version == self._version:
                fut = asyncio.get_running_loop().create_future()
                self._waiters.add(fut)
                try:
                    await fut
                finally:
                    self._waiters.discard(fut)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<ServerFeed {self.name!r} {len(self._servers)} servers>"
