"""A prometheus_client collector of a server's figures, for processes that already export some.

>>> from prometheus_client import REGISTRY  # doctest: +SKIP
>>> REGISTRY.register(ServerCollector(server))  # doctest: +SKIP

It yields what `/brpc_metrics` serves (each method's latencies as a summary, the rest as
gauges), read when the registry is scraped. prometheus_client is not a dependency of aiobrpc:
install it to use this.
"""

from __future__ import annotations

from .builtin import prometheus_text


class ServerCollector:
    """Collects `server`'s variables on every scrape."""

    def __init__(self, server) -> None:
        self.server = server

    def collect(self):
        from prometheus_client.parser import text_string_to_metric_families
        yield from text_string_to_metric_families(prometheus_text(self.server))
