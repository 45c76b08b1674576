"""Registering a running Server in etcd, where `etcd://` channels find it (docs/naming.md).

>>> async with EtcdRegistration(server, "etcd://127.0.0.1:2379/services/echo", tag="0/2"):  # doctest: +SKIP
...     await serve_until_told_to_stop()
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from typing import TYPE_CHECKING

from .client.naming.base import ServerNode, parse_entry
from .client.naming.etcd_member import format_member
from .client.naming.etcd_target import CALL_TIMEOUT_S, EtcdTarget
from .client.naming.fault_log import FaultLog

if TYPE_CHECKING:
    import aetcd

    from .server.server import Server

log = logging.getLogger(__name__)

# After a failed keepalive, the next try comes this long after, doubled per failure up to the
# keepalive interval (a third of the lease's TTL).
RETRY_MIN_S = 0.1


class EtcdRegistration:
    """Keeps one server registered under an etcd prefix while it runs.

    `start()` grants a lease of `ttl` seconds and puts the key `<prefix><name>` with the JSON
    value `{"address": "ip:port", "tag": ...}` attached to it (the layout `etcd://` channels
    read, docs/naming.md); a task then refreshes the lease every third of its TTL. `stop()`
    revokes the lease, which deletes the key; a process that dies without stopping leaves a
    lease that expires after `ttl` seconds, and the key goes with it. Use it as
    `async with EtcdRegistration(...):`, or call `start()` and `stop()`. Stop it before
    stopping the server, so that clients move away before the server refuses their calls.

    While etcd is unreachable the refresh is retried (to the next endpoint of the URL each
    time), logged once per fault. A lease found expired when etcd answers again (etcd was
    gone for longer than the TTL) is replaced by a new one, with the key put again.

    Args:
        server: The `Server` to register, started by the time `start()` is called (its
            `address` is registered), or an "ip:port" string.
        url: `etcd://host:port[,host:port...]/prefix`.
        tag: The server's tag (a weight for wrr/wr, "i/n" for a partition channel ...).
        weight: A positive integer weight, written as the tag; not with `tag`.
        ttl: Seconds the key outlives the last refresh (etcd may grant more).
        name: The key's name under the prefix; default: the registered address.
        address: The "ip:port" to register instead of the server's own (needed when the
            server listens on every interface, 0.0.0.0 or ::).

    Attributes:
        key (str): The key, known once started.
        lease_id (int | None): The current lease, None when not registered.
        granted_ttl (int): The TTL etcd granted the current lease.
    """

    def __init__(self, server: Server | str, url: str, *, tag: str = "", weight: int | None = None,
                 ttl: int = 10, name: str | None = None, address: str | None = None) -> None:
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1:
            raise ValueError(f"ttl must be an int >= 1 (seconds), got {ttl!r}")
        format_member("127.0.0.1:1", tag=tag, weight=weight)  # tag and weight checked now
        if name is not None and (not isinstance(name, str) or not name or "/" in name):
            raise ValueError(f"name must be a non-empty str without '/', got {name!r}")
        self.target = EtcdTarget.parse(url)
        self.server = server
        self.tag, self.weight, self.ttl, self.name, self.address = tag, weight, ttl, name, address
        self.key = ""
        self.lease_id: int | None = None
        self.granted_ttl = 0
        self.faults = FaultLog(f"etcd registration in {self.target.url}")
        self._value = b""
        self._endpoint = 0
        self._client: aetcd.Client | None = None
        self._task: asyncio.Task | None = None

    @property
    def registered(self) -> bool:
        """Whether the key is in etcd, as of the last call that reached it."""
        return self.lease_id is not None

    async def start(self) -> None:
        """Register now; raises (and holds nothing) when no etcd endpoint accepts it."""
        if self._task is not None:
            raise RuntimeError("EtcdRegistration is already started")
        address = self._registered_address()
        self.key = self.target.prefix + (self.name or address)
        self.faults.subject = f"etcd registration of {self.key} in {self.target.url}"
        self._value = format_member(address, tag=self.tag, weight=self.weight)
        errors = []
        for _ in self.target.endpoints:
            try:
                await self._register()
                break
            except Exception as e:
                errors.append(f"{self.target.endpoint_text(self._endpoint)}: {type(e).__name__}: {e}")
                await self._next_endpoint()
        else:
            await self._close_client()
            raise ConnectionError(f"cannot register {self.key} in etcd: {'; '.join(errors)}")
        log.info("registered %s = %s in %s (lease %x, ttl %d s)", self.key, self._value.decode(),
                 self.target.url, self.lease_id, self.granted_ttl)
        self._task = asyncio.get_running_loop().create_task(self._keep_alive())

    async def stop(self) -> None:
        """Unregister: stop refreshing, revoke the lease (deleting the key). When etcd cannot be
        reached, the key goes when the lease expires; logged."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        lease_id, self.lease_id = self.lease_id, None
        try:
            errors = []
            for _ in self.target.endpoints if lease_id is not None else ():
                try:
                    await asyncio.wait_for(self._client_now().revoke_lease(lease_id), CALL_TIMEOUT_S)
                    break
                except Exception as e:
                    errors.append(f"{self.target.endpoint_text(self._endpoint)}: {e!r}")
                    await self._next_endpoint()
            else:
                if errors:
                    log.warning("cannot revoke the lease of %s in %s (%s): the key goes when the "
                                "lease expires, within %d s", self.key, self.target.url,
                                "; ".join(errors), self.granted_ttl)
        finally:
            await self._close_client()

    async def __aenter__(self) -> EtcdRegistration:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def _registered_address(self) -> str:
        if self.address is not None:
            text = self.address
        elif isinstance(self.server, str):
            text = self.server
        else:
            if not self.server.port:
                raise RuntimeError("start the server before registering it")
            if ipaddress.ip_address(self.server.host).is_unspecified:
                raise ValueError(f"the server listens on every interface ({self.server.address}): "
                                 "give address='ip:port' to register")
            text = ServerNode(self.server.host, self.server.port).address
        node = parse_entry(text)
        if node.tag:
            raise ValueError(f"address must be 'ip:port' alone, got {text!r}")
        return node.address

    async def _register(self) -> None:
        """Grant a new lease and put the key with it."""
        client = self._client_now()
        lease = await client.lease(self.ttl)
        await client.put(self.key.encode(), self._value, lease=lease.id)
        self.lease_id, self.granted_ttl = lease.id, lease.ttl

    async def _keep_alive(self) -> None:
        retry: float | None = None  # the delay after a failed try; None while all is well
        while True:
            interval = max(self.granted_ttl / 3, RETRY_MIN_S)
            await asyncio.sleep(interval if retry is None else retry)
            try:
                if self.lease_id is None:
                    await self._register()
                    log.info("registered %s again in %s", self.key, self.target.url)
                else:
                    reply = await self._client_now().refresh_lease(self.lease_id)
                    if reply is None or reply.TTL <= 0:
                        log.warning("the lease of %s in %s expired: registering again",
                                    self.key, self.target.url)
                        self.lease_id = None
                        await self._register()
            except Exception as e:
                self.faults.fault(f"{self.target.endpoint_text(self._endpoint)}: {type(e).__name__}: {e}",
                                  "retrying; the key goes if its lease expires meanwhile")
                retry = RETRY_MIN_S if retry is None else min(retry * 2, interval)
                await self._next_endpoint()
            else:
                self.faults.recovered()
                retry = None

    def _client_now(self) -> aetcd.Client:
        if self._client is None:
            self._client = self.target.client(self._endpoint)
        return self._client

    async def _next_endpoint(self) -> None:
        await self._close_client()
        self._endpoint = (self._endpoint + 1) % len(self.target.endpoints)

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    def __repr__(self) -> str:
        state = f"lease {self.lease_id:x}" if self.lease_id is not None else "not registered"
        return f"<EtcdRegistration {self.key or self.target.url} {state}>"
