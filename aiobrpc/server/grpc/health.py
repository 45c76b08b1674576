"""The standard gRPC health service, `grpc.health.v1.Health` (ServerOptions.grpc_health).

Check and Watch answer the status of a service by its full name, and of the whole server by
the empty name "". Every service added is SERVING, and so is "", until the server stops: then
all are NOT_SERVING (a load balancer stops sending new calls while the calls in flight end),
and Watch streams send that last status and end, so that they never hold `join()` up.
`Server.grpc_health.set_status(name, serving)` sets one status by hand (say, while a
dependency is down). A name that is no service here is NOT_FOUND for Check and
SERVICE_UNKNOWN for Watch, as the gRPC health protocol says.
"""

from __future__ import annotations

import asyncio

from ...errors import EINTERNAL, RpcError
from ...protocol import grpc as codec
from ...stub import Servicer
from ..._proto.grpc_health.v1 import health_pb2

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer(Servicer):
    """grpc.health.v1.Health for `server` (made by the server when `grpc_health` is on)."""

    SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"]

    def __init__(self, server) -> None:
        self.server = server
        self._overrides: dict[str, int] = {}
        self._changed: asyncio.Future | None = None

    def set_status(self, service: str, serving: bool) -> None:
        """Report `service` ("" for the whole server) SERVING or NOT_SERVING from now on."""
        self._overrides[service] = SERVING if serving else NOT_SERVING
        self.changed()

    def changed(self) -> None:
        """Wake the Watch streams: a status may have changed (the server calls it when it stops)."""
        fut, self._changed = self._changed, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def status_of(self, service: str) -> int | None:
        """The status of `service`; None for a name that is no service here."""
        if service and service not in self.server.registry.services:
            return None
        if self.server.stopping:
            return NOT_SERVING
        return self._overrides.get(service, SERVING)

    async def Check(self, request, cntl):
        status = self.status_of(request.service)
        if status is None:
            cntl._grpc_status = codec.NOT_FOUND  # the health protocol's answer; no brpc code maps to it
            raise RpcError(EINTERNAL, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def List(self, request, cntl):
        response = health_pb2.HealthListResponse()
        for name in ["", *self.server.registry.services]:
            response.statuses[name].status = self.status_of(name)
        return response

    async def Watch(self, request, cntl):
        last = None
        while True:
            status = self.status_of(request.service)
            if status is None:
                status = SERVICE_UNKNOWN
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            if self.server.stopping:
                return
            if self._changed is None:
                self._changed = asyncio.get_running_loop().create_future()
            # shielded: a watcher cancelled (its client gone) must not cancel the future every
            # other watcher waits on (each would then fail, and every later Watch at once)
            await asyncio.shield(self._changed)
