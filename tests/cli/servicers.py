"""A module for `aiobrpc serve`: an echo service that fails some requests on purpose."""

from __future__ import annotations

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import echo_pb2


class FlakyEchoService(aiobrpc.Servicer):
    """example.EchoService answering "bad" with EREQUEST and "crash" with EINTERNAL."""

    SERVICE = echo_pb2.DESCRIPTOR.services_by_name["EchoService"]

    async def Echo(self, request, cntl):
        if request.message == "bad":
            raise aiobrpc.RpcError(errors.EREQUEST, "bad is refused")
        if request.message == "crash":
            raise RuntimeError("crashed on purpose")
        return echo_pb2.EchoResponse(message=request.message)
