"""A naming service whose server list its owner sets: how a PartitionChannel gives each
partition's Channel that partition's servers.

A Channel takes its servers from a naming-service URL; `ServerFeed.url` is one
(`combo-feed://<name>`), registered while the feed exists, whose watch yields the list that
`set_servers` set, now and after every change.

>>> feed = ServerFeed("demo")
>>> feed.set_servers([ServerNode("10.0.0.1", 80, "0/2")])
>>> create_naming_service(feed.url) is feed
True
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections.abc import AsyncIterator, Iterable

from ..naming import NamingService, ServerNode, register_naming_service
from ..naming import create_naming_service  # noqa: F401  (the example above)

SCHEME = "combo-feed"

_feeds: weakref.WeakValueDictionary[str, ServerFeed] = weakref.WeakValueDictionary()
_ids = itertools.count(1)
_registered = False


def _lookup(rest: str) -> ServerFeed:
    feed = _feeds.get(rest)
    if feed is None:
        raise ValueError(f"{SCHEME}://{rest} names no live server feed (they are made by partition channels)")
    return feed


class ServerFeed(NamingService):
    """Server lists set by its owner; `watch()` yields the current list, then each new one."""

    def __init__(self, name: str) -> None:
        global _registered
        if not _registered:
            register_naming_service(SCHEME, _lookup)
            _registered = True
        self.key = f"{name} #{next(_ids)}"
        self.url = f"{SCHEME}://{self.key}"
        self._servers: tuple[ServerNode, ...] = ()
        self._version = 0
        self._waiters: set[asyncio.Future] = set()
        _feeds[self.key] = self

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

    def __repr__(self) -> str:
        return f"<ServerFeed {self.url} {len(self._servers)} servers>"
