"""Echo client: one call to an echo server, with an attachment.

    python examples/echo_client.py 127.0.0.1:8000 --message hi

Prints the response, the attachment's size and the latency; on failure prints brpc's error
(such as `[E111]Fail to connect ...` when nothing listens there) and exits with status 1; a
malformed address is told in one line, with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import aiobrpc
from aiobrpc._proto import echo_pb2  # example.EchoService, from proto/echo.proto


async def main(address: str, message: str) -> int:
    try:
        channel = aiobrpc.Channel(address, aiobrpc.ChannelOptions(timeout_ms=500, max_retry=0))
    except ValueError as e:  # not an address a Channel takes
        print(f"bad address: {e}", file=sys.stderr)
        return 2
    async with channel:
        stub = aiobrpc.Stub(channel, echo_pb2.DESCRIPTOR.services_by_name["EchoService"])
        cntl = aiobrpc.Controller(log_id=7)
        cntl.request_attachment = b"x" * 1024  # any buffer: bytes, memoryview, a numpy array
        try:
            resp = await stub.Echo(echo_pb2.EchoRequest(message=message), cntl)
        except aiobrpc.RpcError as e:
            print(f"failed: {e} (code {e.code})", file=sys.stderr)
            return 1
        print(f"response: {resp.message!r}, attachment: {len(cntl.response_attachment)} bytes, "
              f"from {cntl.remote_side} in {cntl.latency_us} us")
        return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of an echo server")
    parser.add_argument("--message", default="hello")
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.address, args.message)))
