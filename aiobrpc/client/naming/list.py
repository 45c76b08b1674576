"""`list://addr[ tag],...`: a fixed server list given in the URL (brpc's docs/en/client.md).

>>> ns = ListNamingService("list://10.0.0.1:80, 10.0.0.2:80 canary,10.0.0.1:80")
>>> [str(s) for s in ns.servers]
['10.0.0.1:80', '10.0.0.2:80(tag=canary)']
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from .base import NamingService, ServerNode, parse_entry, split_entry

SCHEME = "list"


class ListNamingService(NamingService):
    """Servers from a comma-separated list; `watch()` yields that list once.

    Entries are `addr[ tag]` with blanks trimmed; empty entries and `#` comments are skipped;
    duplicates (same address and tag) keep their first occurrence; hostnames are kept as
    given (resolved at connect). Unlike brpc, which logs and skips an unparsable entry, a bad
    entry raises ValueError: the list is static, so a typo would otherwise never be noticed.
    """

    def __init__(self, url: str) -> None:
        if not isinstance(url, str):
            raise TypeError(f"ListNamingService needs a str, got {type(url).__name__}")
        rest = url[len(SCHEME) + 3:] if url.startswith(SCHEME + "://") else url
        if "://" in rest:
            raise ValueError(f"ListNamingService needs list://..., got {url!r}")
        self._servers = _parse_list(rest)

    @property
    def servers(self) -> tuple[ServerNode, ...]:
        return self._servers

    async def watch(self) -> AsyncIterator[list[ServerNode]]:
        yield list(self._servers)

    def __repr__(self) -> str:
        return f"<ListNamingService {', '.join(map(str, self._servers))}>"


def _parse_list(text: str) -> tuple[ServerNode, ...]:
    seen: set[ServerNode] = set()
    servers: list[ServerNode] = []
    for entry in text.split(","):
        if split_entry(entry) is None:
            continue
        node = parse_entry(entry)
        if node not in seen:
            seen.add(node)
            servers.append(node)
    return tuple(servers)
