"""Host name resolution for the naming services that re-resolve (`dlist://`, `http://`,
`https://`, `dns://`): every address, through the event loop's getaddrinfo."""

from __future__ import annotations

import asyncio
import ipaddress
import socket

# A resolver that does not answer within this many seconds counts as a failed resolution.
RESOLVE_TIMEOUT_S = 5.0


async def addresses(host: str, port: int) -> list[str]:
    """Every IPv4 and IPv6 address of `host` (A and AAAA records, /etc/hosts ...), in the
    resolver's order, without repeats; `host` itself when it is an IP address.

    Raises OSError (socket.gaierror) when the name does not resolve, asyncio.TimeoutError past
    RESOLVE_TIMEOUT_S.
    """
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM),
                                   RESOLVE_TIMEOUT_S)
    found = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not found:
        raise socket.gaierror(socket.EAI_NONAME, f"{host} has no address")
    return found
