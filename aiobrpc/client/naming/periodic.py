"""Naming services that fetch their list again at a fixed interval (brpc's
PeriodicNamingService, `-ns_access_interval`): `dlist://` and `http://` / `https://` / `dns://`.

Before the first good list, a failed fetch raises out of `watch()`: a Channel then fails the
calls waiting for a first list with ENODATA naming the fault and watches again after its
backoff. After it, a failed fetch keeps the last list (brpc publishes an empty list on the
first failure; keeping the list keeps calls working) and is logged once per fault.
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import AsyncIterator

from .base import NamingService, ServerNode, unique_servers
from .fault_log import FaultLog

# Seconds between two fetches, unless a service is given its own `refresh_s`.
REFRESH_S = 5.0


class PeriodicNamingService(NamingService):
    """Calls `fetch()` every `refresh_s` seconds (default: this module's REFRESH_S, read at each
    wait) and yields the list when it differs from the last one yielded. `url` names the
    service in log lines."""

    def __init__(self, url: str, refresh_s: float | None = None) -> None:
        if refresh_s is not None and not refresh_s > 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s!r}")
        self.url = url
        self.refresh_s = refresh_s
        self.faults = FaultLog(f"naming service {url}")
        self._closed = False

    @abstractmethod
    async def fetch(self) -> tuple[list[ServerNode], str]:
        """The servers now, and a description of what failed when the list is partial ("" when
        nothing did). Raises (OSError, ValueError, ...) when no list can be made."""

    async def watch(self) -> AsyncIterator[list[ServerNode]]:
        last: list[ServerNode] | None = None
        while not self._closed:
            try:
                servers, partial = await self.fetch()
            except Exception as e:
                if last is None:
                    raise
                self.faults.fault(f"{type(e).__name__}: {e}",
                                  f"keeping the last list ({len(last)} servers)")
            else:
                servers, dropped = unique_servers(servers)
                if dropped:
                    partial = "; ".join(filter(None, [partial, f"{dropped} servers past the cap "
                                                               f"of {len(servers)} dropped"]))
                if partial:
                    self.faults.fault(partial, f"publishing the {len(servers)} servers found")
                else:
                    self.faults.recovered()
                if servers != last:
                    last = servers
                    yield list(servers)
            await asyncio.sleep(REFRESH_S if self.refresh_s is None else self.refresh_s)

    async def close(self) -> None:
        self._closed = True
