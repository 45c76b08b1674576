"""`http://host[:port][/path]`, `https://...` and `dns://host:port`: every address of a host
name (brpc's DomainNamingService), resolved again every `periodic.REFRESH_S` (5) seconds.

The path (and anything after it) is ignored; the default port is 80 for http, 443 for https;
`dns://` has no default port. Servers have no tag.

>>> DnsNamingService("localhost:8080/api?x=1", scheme="http").host_port
('localhost', 8080)
>>> DnsNamingService("[::1]", scheme="https").host_port
('::1', 443)
"""

from __future__ import annotations

from urllib.parse import urlsplit

from . import resolve
from .base import ServerNode
from .periodic import PeriodicNamingService

# The port of a URL that gives none, by scheme; None: the URL must give one.
DEFAULT_PORTS: dict[str, int | None] = {"http": 80, "https": 443, "dns": None}


class DnsNamingService(PeriodicNamingService):
    """The servers at every IPv4 and IPv6 address of one host name, on one port.

    `rest` is the URL after "scheme://": `host[:port][/path]`, with an IPv6 address in
    brackets. Without a port, the scheme's port in DEFAULT_PORTS is used (ValueError when it
    has none). Unlike brpc, which takes the A records only unless `-dns_support_ipv6` is set,
    AAAA records count too.
    """

    def __init__(self, rest: str, *, scheme: str = "dns", refresh_s: float | None = None) -> None:
        if not isinstance(rest, str):
            raise TypeError(f"DnsNamingService needs a str, got {type(rest).__name__}")
        if scheme not in DEFAULT_PORTS:
            raise ValueError(f"scheme must be one of {sorted(DEFAULT_PORTS)}, got {scheme!r}")
        if rest.startswith(f"{scheme}://"):
            rest = rest[len(scheme) + 3:]
        parts = urlsplit("//" + rest)
        try:
            host, port = parts.hostname, parts.port
        except ValueError as e:
            raise ValueError(f"bad host:port in {scheme}://{rest}: {e}") from None
        if not host:
            raise ValueError(f"no host name in {scheme}://{rest}")
        if port is None:
            port = DEFAULT_PORTS[scheme]
            if port is None:
                raise ValueError(f"no port in {scheme}://{rest}: give host:port")
        if not 0 < port < 65536:
            raise ValueError(f"port must be 1..65535 in {scheme}://{rest}")
        super().__init__(f"{scheme}://{rest}", refresh_s)
        self.host_port = (host, port)

    async def fetch(self) -> tuple[list[ServerNode], str]:
        host, port = self.host_port
        return [ServerNode(ip, port) for ip in await resolve.addresses(host, port)], ""

    def __repr__(self) -> str:
        return f"<DnsNamingService {self.host_port[0]}:{self.host_port[1]}>"
