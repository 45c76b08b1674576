"""`etcd://host:port[,host:port...]/prefix`: the servers registered under a key prefix of an
etcd v3 cluster, followed with a watch (no polling).

Layout: each key `<prefix><name>` is one server, its value `ip:port[ tag]` or a JSON object
(etcd_member.py; EtcdRegistration writes them). A malformed value is skipped and logged; two
keys naming the same server (address and tag) are one server. The list is in key order.

Following: a range read of the prefix gives the list and its revision; a watch from the next
revision then applies each PUT and DELETE as it happens, and the list is published when it
changes. A watch whose start revision was compacted starts again from a fresh read.

Faults: when etcd goes away (the watch breaks, or a call fails after
`etcd_target.CALL_TIMEOUT_S`), the last list is kept, the fault is logged once, and the
service connects again, to the next endpoint of the URL, after a backoff (`RETRY_MIN_S` doubling
up to `RETRY_MAX_S`), then reads the prefix afresh. Before a first list, a `watch()` that found
no endpoint answering raises ConnectionError instead: a Channel then fails the calls waiting for
a first list with ENODATA naming the fault, and watches again after its own backoff.

Bounded memory: at most `base.MAX_SERVERS` keys are followed (the first in key order); keys
put past that are dropped (logged once), and once a followed key is deleted the prefix is read
again. A range read is bounded by gRPC's 4 MiB message limit (a larger one fails, logged as a
fault).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from . import base
from .base import NamingService, ServerNode, unique_servers
from .etcd_member import parse_member
from .etcd_target import EtcdTarget
from .fault_log import FaultLog

if TYPE_CHECKING:
    import aetcd

log = logging.getLogger("aiobrpc.client.naming")

# Backoff between two connection attempts after a fault, doubled per failed round of endpoints.
RETRY_MIN_S = 0.1
RETRY_MAX_S = 5.0


class _ReadAgain(Exception):
    """The followed keys no longer match the prefix (keys were dropped past the cap)."""


class EtcdNamingService(NamingService):
    """Servers registered under a key prefix of etcd, followed with a watch."""

    def __init__(self, rest: str) -> None:
        self.target = EtcdTarget.parse(rest)
        self.faults = FaultLog(f"naming service {self.target.url}")
        self._endpoint = 0  # the endpoint to connect to next
        self._clients: set[aetcd.Client] = set()  # those of running watches; close() closes them
        self._closed = False

    async def watch(self) -> AsyncIterator[list[ServerNode]]:
        published: list[ServerNode] | None = None
        failures: list[str] = []  # since the last good list
        backoff = RETRY_MIN_S
        while not self._closed:
            client = self.target.client(self._endpoint)
            self._clients.add(client)
            try:
                async with contextlib.aclosing(self._follow(client)) as lists:
                    async for servers in lists:
                        failures.clear()
                        backoff = RETRY_MIN_S
                        self.faults.recovered()
                        if servers != published:
                            published = servers
                            yield list(servers)
            except Exception as e:
                if self._closed:
                    return
                fault = f"{self.target.endpoint_text(self._endpoint)}: {type(e).__name__}: {e}"
                failures.append(fault)
                self._endpoint = (self._endpoint + 1) % len(self.target.endpoints)
                if published is None:
                    if len(failures) >= len(self.target.endpoints):
                        raise ConnectionError(f"no etcd endpoint answered: {'; '.join(failures)}") from e
                    continue
                self.faults.fault(fault, f"keeping the last list ({len(published)} servers), "
                                         "connecting again")
                if len(failures) % len(self.target.endpoints) == 0:
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RETRY_MAX_S)
            finally:
                self._clients.discard(client)
                await client.close()

    async def close(self) -> None:
        self._closed = True
        for client in list(self._clients):
            await client.close()

    async def _follow(self, client: aetcd.Client) -> AsyncIterator[list[ServerNode]]:
        """The list after a fresh read, then after every change; ends when the service is
        closed, raises when etcd fails."""
        from aetcd.exceptions import RevisionCompactedError

        prefix = self.target.prefix.encode()
        while True:
            result = await client.get_prefix(prefix)
            members = _Members(self.target.url)
            for kv in result:
                members.put(kv.key, kv.value)
            yield members.listed()
            try:
                watch = await client.watch_prefix(prefix, start_revision=result.header.revision + 1)
                async with contextlib.aclosing(watch.__aiter__()) as events:
                    async for event in events:
                        changed = (members.delete(event.kv.key) if event.kind == "DELETE"
                                   else members.put(event.kv.key, event.kv.value))
                        if changed:
                            yield members.listed()
            except RevisionCompactedError as e:
                log.info("naming service %s: %s; reading the prefix again", self.target.url, e)
                continue
            except _ReadAgain:
                await watch.cancel()
                continue
            if self._closed:
                return
            raise ConnectionError("the watch ended")

    def __repr__(self) -> str:
        return f"<EtcdNamingService {self.target.url}>"


class _Members:
    """The servers under a prefix by key: at most `base.MAX_SERVERS` keys, malformed values
    skipped (logged)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.by_key: dict[bytes, ServerNode] = {}
        self.capped = False  # a key was dropped past the cap

    def put(self, key: bytes, value: bytes) -> bool:
        """A key set to `value`; whether the servers changed."""
        try:
            node = parse_member(value)
        except ValueError as e:
            log.warning("naming service %s: skipping key %s, malformed value %.200r: %s",
                        self.url, _text(key), value, e)
            return self.by_key.pop(key, None) is not None
        if key not in self.by_key and len(self.by_key) >= base.MAX_SERVERS:
            if not self.capped:  # once per read: the next keys are dropped the same way
                log.warning("naming service %s: key %s and any further key dropped: already "
                            "%d servers (the cap)", self.url, _text(key), base.MAX_SERVERS)
            self.capped = True
            return False
        changed = self.by_key.get(key) != node
        self.by_key[key] = node
        return changed

    def delete(self, key: bytes) -> bool:
        """A key deleted; whether the servers changed. Raises _ReadAgain when a key dropped
        past the cap may now fit."""
        removed = self.by_key.pop(key, None) is not None
        if removed and self.capped:
            raise _ReadAgain
        return removed

    def listed(self) -> list[ServerNode]:
        """The servers in key order, each once."""
        return unique_servers(self.by_key[key] for key in sorted(self.by_key))[0]


def _text(key: bytes) -> str:
    return key.decode("utf-8", "replace")
