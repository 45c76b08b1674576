"""Following a naming service for its owner (a Channel, a partition channel): the lists go to
`deliver`, the service's faults to `failed`, and a watch that raises is started again after a
backoff doubling from `min_s` to `max_s`, so the owner keeps its last list meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from .base import NamingService, ServerNode


async def follow_naming(naming: NamingService, deliver: Callable[[Iterable[ServerNode]], None],
                        failed: Callable[[str], None], has_list: Callable[[], bool],
                        min_s: float, max_s: float) -> None:
    """Run until a static service has yielded its list (or forever, for one that watches).

    `deliver` raising TypeError/ValueError is a bad list: reported to `failed` and skipped. A
    static service that ends before any list was delivered (`has_list()` false) is a fault too."""
    backoff = min_s
    while True:
        try:
            async for servers in naming.watch():
                try:
                    deliver(servers)
                except (TypeError, ValueError) as e:
                    failed(f"gave a bad server list: {e}")
                else:
                    backoff = min_s
        except Exception as e:
            failed(f"failed: {e!r}")
        else:
            if not has_list():
                failed("stopped with no server listed")
            return  # a static service: it yielded its list and is done
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, max_s)
