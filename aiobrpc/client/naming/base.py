"""Server nodes, the naming-service interface, and the `addr[ tag]` entry syntax (brpc's docs/en/client.md).

>>> parse_entry("10.0.0.5:8000 shard-1")
ServerNode(host='10.0.0.5', port=8000, tag='shard-1')
>>> parse_entry("[::1]:8000").address
'[::1]:8000'
"""

from __future__ import annotations

import ipaddress
import re
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

# Hostnames are kept as given (resolution happens at connect); this only rejects text that no
# resolver could accept, so a typo fails at Init instead of at the first call.
_HOSTNAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_.])?")
_DOTTED = re.compile(r"[0-9.]+")

# Bounded memory: the dynamic naming services (file, dlist, http/dns, etcd) publish at most this
# many servers per list; the rest are dropped, and the service logs it.
MAX_SERVERS = 10_000


@dataclass(frozen=True, order=True)
class ServerNode:
    """One server of a cluster: address plus tag (brpc's ServerNode).

    The same address with different tags is a different server (a different connection).
    `host` holds an IPv6 address without brackets.

    >>> ServerNode("::1", 80, "a").address
    '[::1]:80'
    """

    host: str
    port: int
    tag: str = ""

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("ServerNode host must not be empty")
        if not isinstance(self.port, int) or isinstance(self.port, bool) \
                or not 0 < self.port < 65536:
            raise ValueError(f"ServerNode port must be an int in 1..65535, got {self.port!r}")

    @property
    def address(self) -> str:
        """`host:port`, with brackets around an IPv6 host."""
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return f"{self.address}(tag={self.tag})" if self.tag else self.address


class NamingService(ABC):
    """Produces server lists.

    `watch()` is an async iterator yielding the full list each time it changes; a static service
    yields once and then stops. `close()` releases what the service holds (default: nothing).
    """

    @abstractmethod
    def watch(self) -> AsyncIterator[list[ServerNode]]:
        """Yield the complete server list now and after every change."""

    async def close(self) -> None:
        """Stop producing lists and release resources."""


def unique_servers(nodes: Iterable[ServerNode], limit: int | None = None) -> tuple[list[ServerNode], int]:
    """The first occurrence of each node, in order, at most `limit` (default `MAX_SERVERS`) of
    them; and how many entries, not counting repeats of a kept node, were dropped past the limit.

    >>> unique_servers([ServerNode("a", 1), ServerNode("b", 1), ServerNode("a", 1)], limit=1)
    ([ServerNode(host='a', port=1, tag='')], 1)
    """
    limit = MAX_SERVERS if limit is None else limit
    kept: dict[ServerNode, None] = {}
    dropped = 0
    for node in nodes:
        if node in kept:
            continue
        if len(kept) < limit:
            kept[node] = None
        else:
            dropped += 1
    return list(kept), dropped


def split_entry(text: str) -> tuple[str, str] | None:
    """Split one entry into (address, tag); None for a blank entry or a `#` comment.

    brpc's rule (file_naming_service.cpp, shared by list:// and file://): the address is the
    first run of non-blanks, the tag everything after the following blanks up to `#`, with
    trailing blanks trimmed.

    >>> split_entry("  10.0.0.1:80   big tag  # rack 3")
    ('10.0.0.1:80', 'big tag')
    >>> split_entry("   ") is None
    True
    """
    text = text.strip()
    if not text or text.startswith("#"):
        return None
    parts = text.split(None, 1)
    tag = parts[1].split("#", 1)[0].rstrip() if len(parts) == 2 else ""
    return parts[0], tag


def parse_entry(text: str) -> ServerNode:
    """Parse `ip:port[ tag]`, `host:port[ tag]` or `[v6]:port[ tag]` into a ServerNode.

    Raises ValueError naming the entry when it is blank, has no or a bad port, or a bad host.

    >>> parse_entry("localhost:8000")
    ServerNode(host='localhost', port=8000, tag='')
    """
    split = split_entry(text)
    if split is None:
        raise ValueError(f"empty server entry {text!r}")
    addr, tag = split
    host, port = _split_host_port(addr, text.strip())
    return ServerNode(host, port, tag)


def _split_host_port(addr: str, entry: str) -> tuple[str, int]:
    if addr.startswith("["):
        end = addr.find("]")
        if end < 0 or addr[end + 1:end + 2] != ":":
            raise ValueError(f"bad server entry {entry!r}: expected [ipv6]:port")
        host, port_text = addr[1:end], addr[end + 2:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"bad server entry {entry!r}: {host!r} is not an IPv6 address") \
                from None
    else:
        host, sep, port_text = addr.rpartition(":")
        if not sep:
            raise ValueError(f"bad server entry {entry!r}: missing ':port'")
        if ":" in host:
            raise ValueError(f"bad server entry {entry!r}: put an IPv6 address in brackets, "
                             f"like [::1]:8000")
        _check_host(host, entry)
    if not port_text.isascii() or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad server entry {entry!r}: port must be 1..65535, got {port_text!r}")
    return host, int(port_text)


def _check_host(host: str, entry: str) -> None:
    if _DOTTED.fullmatch(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"bad server entry {entry!r}: {host!r} is not an IPv4 address") \
                from None
    elif not _HOSTNAME.fullmatch(host):
        raise ValueError(f"bad server entry {entry!r}: {host!r} is not a host name")
