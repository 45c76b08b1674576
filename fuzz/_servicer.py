"""The servicer the server harnesses serve: interop.EchoService (tests/helpers/interop_server.py's
InteropEcho, made stateless so that every input's replies depend on that input alone, and bounded:
no sleep over 5 ms, no reply attachment over 64 KiB)."""

from __future__ import annotations

import asyncio
import zlib

import aiobrpc
import aiobrpc.errors
from aiobrpc._proto import interop_pb2
from aiobrpc.protocol import checksum

SERVICE = interop_pb2.DESCRIPTOR.services_by_name["EchoService"]
MAX_EXTRA = 64 * 1024


class FuzzEcho(aiobrpc.Servicer):
    SERVICE = SERVICE

    def __init__(self) -> None:
        self.stream_tasks: set = set()

    async def Echo(self, request, cntl):
        if request.sleep_ms > 0:
            await asyncio.sleep(min(request.sleep_ms, 5) / 1000)
        if request.close_connection:
            cntl.close_connection("asked by the request")
            return None
        if request.HasField("fail_code") and request.fail_code != 0:  # 0: set_failed refuses it (ValueError), a handler bug
            cntl.set_failed(request.fail_code, request.fail_text)
            return None
        att = bytes(cntl.request_attachment) if cntl.request_attachment is not None else b""
        message = request.message
        resp = interop_pb2.EchoResponse(
            message=message, log_id=cntl.log_id or 0,
            request_compress_type=cntl.request_compress_type, request_attachment_size=len(att),
            request_attachment_crc32=zlib.crc32(att),
            server_timeout_ms=cntl.timeout_ms if cntl.timeout_ms is not None else -1,
            calls_served=1, payload_size=len(request.payload), payload_crc32=zlib.crc32(request.payload))
        if cntl.authentication_data:
            resp.authentication_data = cntl.authentication_data
        fields = cntl.request_user_fields
        if fields:
            resp.user_fields.extend(sorted(f"{k}={v}" for k, v in fields.items()))
            cntl.response_user_fields = dict(reversed(list(fields.items())))
            asked = fields.get("x-interop-response-checksum")
            if asked is not None:
                cntl.response_checksum_type = checksum.CRC32C
                cntl.response_checksum_with_attachment = asked.endswith("+attachment")
        cntl.response_compress_type = request.response_compress_type
        n = max(0, min(request.response_attachment_size, MAX_EXTRA))
        extra = (bytes(range(251)) * (n // 251 + 1))[:n]
        if request.echo_attachment and att or extra:
            cntl.response_attachment = (att if request.echo_attachment else b"") + extra
        return resp

    async def StartStream(self, request, cntl):
        if cntl.has_remote_stream and not request.HasField("fail_code"):
            accepted = aiobrpc.Stream.accept(cntl, max_buf_size=256 * 1024)
            for stream in accepted if isinstance(accepted, list) else [accepted]:
                task = asyncio.get_running_loop().create_task(_echo_stream(stream))
                self.stream_tasks.add(task)
                task.add_done_callback(self.stream_tasks.discard)
        return await self.Echo(request, cntl)


async def _echo_stream(stream) -> None:
    try:
        async for message in stream:
            await stream.write(message)
    except aiobrpc.RpcError:
        pass


class Credential:
    """An authenticator: b"secret" is let in (sync), b"async-secret" after a loop iteration."""

    def verify_credential(self, credential: bytes, peer):
        if credential == b"async-secret":
            return _later(True)
        return credential == b"secret"

    def generate_credential(self) -> bytes:
        return b"secret"


async def _later(v: bool) -> bool:
    await asyncio.sleep(0)
    return v
