"""Typed stubs: an echo server and a client of it, written against the generated
`echo_aiobrpc` module (protoc-gen-aiobrpc) and checked by `mypy --strict`.

    python examples/typed_echo.py --message hi

Starts a server on a free port of 127.0.0.1, calls it twice through `EchoServiceStub` (once
with an empty message, which the server rejects with EREQUEST) and prints what came back.
"""

from __future__ import annotations

import argparse
import asyncio

import aiobrpc
from aiobrpc._proto import echo_aiobrpc, echo_pb2  # from proto/echo.proto


class EchoService(echo_aiobrpc.EchoServiceServicer):
    async def Echo(self, request: echo_pb2.EchoRequest, cntl: aiobrpc.Controller) -> echo_pb2.EchoResponse:
        if not request.message:
            raise aiobrpc.RpcError(aiobrpc.errors.EREQUEST, "message must not be empty")
        cntl.response_attachment = cntl.request_attachment  # sent back without a copy
        return echo_pb2.EchoResponse(message=request.message)


async def call(stub: echo_aiobrpc.EchoServiceStub, message: str) -> str:
    cntl = aiobrpc.Controller(log_id=7)
    cntl.request_attachment = b"x" * 1024
    try:
        resp = await stub.Echo(echo_pb2.EchoRequest(message=message), cntl)
    except aiobrpc.RpcError as e:
        return f"failed: code={e.code}"
    return f"response: {resp.message!r}, attachment: {len(cntl.response_attachment)} bytes"


async def main(message: str) -> None:
    server = aiobrpc.Server()
    server.add_service(EchoService())
    await server.start("127.0.0.1:0")
    try:
        async with aiobrpc.Channel(server.address, aiobrpc.ChannelOptions(timeout_ms=1000)) as channel:
            stub = echo_aiobrpc.EchoServiceStub(channel)
            print(await call(stub, message))
            print(await call(stub, ""))
    finally:
        await server.stop()
        await server.join()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--message", default="hello")
    args = parser.parse_args()
    asyncio.run(main(args.message))
