"""How a partition channel follows its naming service: every server list is handed to the
channel; a watch that raises is logged and started again after a backoff (the last list is
kept); a static `list://` is read at once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ...errors import EINVAL, RpcError
from ..naming.follow import follow_naming
from ..naming import ListNamingService, ServerNode, create_naming_service, is_naming_url

log = logging.getLogger(__name__)

RETRY_MIN_S = 0.1
RETRY_MAX_S = 10.0


class NamingFollower:
    """Follows the naming service of `url`, calling `on_list(servers)` with each full list.

    ValueError for a URL that is not a naming-service URL or names an unknown scheme.
    """

    def __init__(self, url: str, on_list: Callable[[list[ServerNode]], None]) -> None:
        if not isinstance(url, str):
            raise TypeError(f"naming_url must be a str like 'list://host:port tag,...', got {type(url).__name__}")
        if not is_naming_url(url):
            raise ValueError(f"naming_url must be a naming service URL like 'list://host:port tag,...', got {url!r}")
        self.url = url
        self.naming = create_naming_service(url)
        self._on_list = on_list
        self.error = ""  # the naming service's last fault, until its next good list
        self.has_list = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._first: asyncio.Future | None = None
        self.static = isinstance(self.naming, ListNamingService)
        if self.static:
            self._deliver(list(self.naming.servers))

    def _deliver(self, servers) -> None:
        if isinstance(servers, (str, bytes)) or not hasattr(servers, "__iter__"):
            raise TypeError(f"a server list must be an iterable of ServerNode, got {type(servers).__name__}")
        servers = list(servers)
        for node in servers:
            if not isinstance(node, ServerNode):
                raise TypeError(f"a server list must hold ServerNode items, got {node!r}")
        self._on_list(servers)
        self.has_list = True
        self.error = ""
        self._release()

    def _release(self) -> None:
        if self._first is not None and not self._first.done():
            self._first.set_result(None)

    async def ready(self, timeout_s: float | None) -> None:
        """Follow the service from the running loop; wait up to `timeout_s` (None: no limit)
        for its first list, or its first fault."""
        if self.static:
            return
        loop = asyncio.get_running_loop()
        if loop is self._loop and (self.has_list or self.error):
            return  # the usual case, on every call
        if loop is not self._loop:
            old = self._loop
            if old is not None and old.is_running() and not old.is_closed():
                raise RpcError(EINVAL, f"the naming service {self.url} is followed from an event loop still "
                                       "running in another thread: a channel belongs to one loop at a time")
            if self._task is not None:
                try:
                    self._task.cancel()
                except RuntimeError:  # its loop is closed: nothing of it runs again
                    pass
            self._loop = loop
            self._first = loop.create_future()
            self._task = loop.create_task(self._follow())
        if self.has_list or self.error:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._first), timeout_s)
        except asyncio.TimeoutError:
            pass

    async def _follow(self) -> None:
        await follow_naming(self.naming, self._deliver, self._failed, lambda: self.has_list,
                            RETRY_MIN_S, RETRY_MAX_S)

    def _failed(self, why: str) -> None:
        self.error = f"naming service {self.url} {why}"
        log.warning("%s; keeping the last list", self.error)
        self._release()

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            try:
                task.cancel()
            except RuntimeError:  # its loop is closed: nothing of it runs again
                pass
            else:
                if task.get_loop() is asyncio.get_running_loop():
                    await asyncio.gather(task, return_exceptions=True)
        try:
            await self.naming.close()
        except Exception as e:
            log.error("naming service %s failed to close: %r", self.url, e, exc_info=e)
