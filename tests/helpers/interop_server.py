"""A Python twin of the golden captures' C++ probe_server (interop.EchoService)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import zlib

import aiobrpc
from aiobrpc._proto import interop_pb2
from aiobrpc.protocol import checksum

SERVICE = interop_pb2.DESCRIPTOR.services_by_name["EchoService"]


@functools.lru_cache(maxsize=8)
def extra_bytes(n: int) -> bytes:
    """The `i % 251` bytes probe_server appends to its reply attachment."""
    return (bytes(range(251)) * (n // 251 + 1))[:n]


class InteropEcho(aiobrpc.Servicer):
    """The behaviour written in interop.proto's comments and the golden README."""

    SERVICE = SERVICE

    def __init__(self) -> None:
        self.calls_served = 0
        self.executed: list[int] = []
        self.stream_tasks: set = set()
        self.streams: list = []  # every stream accepted, in order

    async def Echo(self, request, cntl):
        self.calls_served += 1
        served = self.calls_served
        self.executed.append(cntl.correlation_id)
        if request.sleep_ms:
            await asyncio.sleep(request.sleep_ms / 1000)
        if request.close_connection:
            cntl.close_connection("asked by the request")
            return None
        if request.HasField("fail_code"):
            cntl.set_failed(request.fail_code, request.fail_text)
            return None
        att = bytes(cntl.request_attachment) if cntl.request_attachment is not None else b""
        resp = interop_pb2.EchoResponse(
            message=request.message,
            log_id=cntl.log_id or 0,
            request_compress_type=cntl.request_compress_type,
            request_attachment_size=len(att),
            request_attachment_crc32=zlib.crc32(att),
            server_timeout_ms=cntl.timeout_ms if cntl.timeout_ms is not None else -1,
            calls_served=served,
            payload_size=len(request.payload),
            payload_crc32=zlib.crc32(request.payload),
        )
        if cntl.authentication_data:
            resp.authentication_data = cntl.authentication_data
        fields = cntl.request_user_fields
        if fields:
            resp.user_fields.extend(sorted(f"{k}={v}" for k, v in fields.items()))
            cntl.response_user_fields = dict(reversed(list(fields.items())))
            asked = fields.get("x-interop-response-checksum")
            if asked is not None:  # probe_server: "crc32c+attachment" covers the attachment too
                cntl.response_checksum_type = checksum.CRC32C
                cntl.response_checksum_with_attachment = asked.endswith("+attachment")
        cntl.response_compress_type = request.response_compress_type
        extra = extra_bytes(request.response_attachment_size)
        if request.echo_attachment and att or extra:
            cntl.response_attachment = (cntl.request_attachment if request.echo_attachment and not extra
                                        else (att if request.echo_attachment else b"") + extra)
        return resp

    async def StartStream(self, request, cntl):
        """Accepts the streams the call offers (unless the request fails) and writes every
        message back on the stream it came on, until the stream ends."""
        if cntl.has_remote_stream and not request.HasField("fail_code"):
            accepted = aiobrpc.Stream.accept(cntl)
            for stream in accepted if isinstance(accepted, list) else [accepted]:
                self.streams.append(stream)
                task = asyncio.get_running_loop().create_task(echo_stream(stream))
                self.stream_tasks.add(task)
                task.add_done_callback(self.stream_tasks.discard)
        return await self.Echo(request, cntl)


async def echo_stream(stream) -> None:
    """Write every message of `stream` back to it, until it ends (whichever way)."""
    try:
        async for message in stream:
            await stream.write(message)
    except aiobrpc.RpcError:
        pass


@contextlib.asynccontextmanager
async def running_echo(options: aiobrpc.ServerOptions | None = None, servicer: InteropEcho | None = None):
    """(server, servicer) of `servicer` (an InteropEcho by default) on an ephemeral 127.0.0.1
    port; on exit the server stops and must have closed every connection."""
    servicer = servicer if servicer is not None else InteropEcho()
    server = aiobrpc.Server(options)
    server.add_service(servicer)
    await server.start("127.0.0.1:0")
    try:
        yield server, servicer
    finally:
        await server.stop()
        await server.join(timeout=2)
        tasks = getattr(servicer, "stream_tasks", None)
        if tasks:  # the streams ended with their connections: so do the echoes
            await asyncio.wait(list(tasks), timeout=2)
    assert not server.connections
    assert not getattr(servicer, "stream_tasks", None)
