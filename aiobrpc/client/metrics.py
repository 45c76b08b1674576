"""What a channel keeps per method (`ChannelOptions.method_status`): the server's figures, seen
from the caller, plus the retries and backup requests the calls made.

A call is counted once, when it ends (client/call.py, `Call._complete`; a call refused before
it starts, by `Channel.call_method`): its latency, as `Controller.latency_us`, and whether it
failed, into the method's `LatencyRecorder` (aiobrpc/metrics.py).

The table is bounded: past `MAX_METHODS` distinct methods, the calls of any new one are counted
under `OTHER`, so a channel called with unbounded method names keeps bounded memory. A method
holds one recorder, up to 11 slots of 520 counters (~46 KB once it has been called in 11
different seconds): at most ~47 MB per channel at the cap. Lower `MAX_METHODS` before making
channels to keep less.
"""

from __future__ import annotations

from ..metrics import LatencyRecorder, figures

MAX_METHODS = 1024  # read when a channel is made
OTHER = "other"  # no method's key: those are "package.Service/Method"


class ClientMethodStatus:
    """One method's calls (`latency`), and the retries and backup requests they made."""

    __slots__ = ("latency", "retries", "backups")

    def __init__(self) -> None:
        self.latency = LatencyRecorder()
        self.retries = 0
        self.backups = 0

    def describe(self) -> dict:
        """The server's figures by the same names (count, qps, error, eps, latency,
        latency_50 .. latency_9999, max_latency), then retries and backups."""
        d = figures(self.latency)
        d["retries"] = self.retries
        d["backups"] = self.backups
        return d


class MethodTable:
    """A channel's `ClientMethodStatus` by service, then method; at most `max_methods` of them
    by name, the calls of the others under one `OTHER` entry."""

    __slots__ = ("_by_service", "_size", "max_methods", "other")

    def __init__(self, max_methods: int | None = None) -> None:
        self._by_service: dict[str, dict[str, ClientMethodStatus]] = {}
        self._size = 0
        self.max_methods = MAX_METHODS if max_methods is None else max_methods
        self.other: ClientMethodStatus | None = None

    def ended(self, service: str, method: str, us: int, failed: bool, retried: int, backup: bool) -> None:
        """A call of `service`/`method` ended after `us` microseconds; `retried`: its attempts
        after the first, `backup` (one of them) among them."""
        methods = self._by_service.get(service)  # two lookups of the caller's own str: no key made
        status = methods.get(method) if methods is not None else None
        if status is None:
            status = self._add(service, method)
        status.latency.record(us, failed)
        if retried:
            if backup:
                status.backups += 1
                retried -= 1
            status.retries += retried

    def _add(self, service: str, method: str) -> ClientMethodStatus:
        if self._size >= self.max_methods:
            if self.other is None:
                self.other = ClientMethodStatus()
            return self.other
        status = ClientMethodStatus()
        self._by_service.setdefault(service, {})[method] = status
        self._size += 1
        return status

    def __len__(self) -> int:
        """Methods kept by name (`OTHER` not counted)."""
        return self._size

    def describe(self) -> dict[str, dict]:
        """{"package.Service/Method": figures, ..., "other": figures (only past the cap)}."""
        out = {f"{service}/{method}": status.describe()
               for service, methods in self._by_service.items() for method, status in methods.items()}
        if self.other is not None:
            out[OTHER] = self.other.describe()
        return out
