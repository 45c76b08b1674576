"""`dlist://addr[ tag],...`: list:// whose host names are resolved again every
`periodic.REFRESH_S` (5) seconds (brpc's DomainListNamingService).

Entries use list://'s syntax. A host name stands for every one of its addresses (brpc takes
the first), each with the entry's tag. An entry whose name fails to resolve keeps the
addresses of its last resolution (none if it never resolved), logged once per fault.

>>> [str(s) for s in DomainListNamingService("localhost:80 a,10.0.0.1:81").entries]
['localhost:80(tag=a)', '10.0.0.1:81']
"""

from __future__ import annotations

import asyncio

from . import resolve
from .base import ServerNode
from .list import ListNamingService
from .periodic import PeriodicNamingService


class DomainListNamingService(PeriodicNamingService):
    """Servers from a comma-separated list whose host names are re-resolved periodically.

    A malformed entry raises ValueError at construction, as in list://.
    """

    def __init__(self, rest: str, *, refresh_s: float | None = None) -> None:
        if isinstance(rest, str) and rest.startswith("dlist://"):
            rest = rest[len("dlist://"):]
        self.entries = ListNamingService(rest).servers
        super().__init__(f"dlist://{rest}", refresh_s)
        self._resolved: dict[ServerNode, list[str]] = {}  # entry -> its last good resolution

    async def fetch(self) -> tuple[list[ServerNode], str]:
        results = await asyncio.gather(*(resolve.addresses(e.host, e.port) for e in self.entries),
                                       return_exceptions=True)
        servers: list[ServerNode] = []
        failed: list[str] = []
        for entry, result in zip(self.entries, results):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result
                failed.append(f"{entry.host}: {type(result).__name__}: {result}")
                result = self._resolved.get(entry, [])
            else:
                self._resolved[entry] = result
            servers.extend(ServerNode(ip, entry.port, entry.tag) for ip in result)
        if failed and not servers:
            raise OSError(f"no entry resolved ({'; '.join(failed)})")
        return servers, "; ".join(f"cannot resolve {f}" for f in failed)

    def __repr__(self) -> str:
        return f"<DomainListNamingService {', '.join(map(str, self.entries))}>"
