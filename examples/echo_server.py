"""Echo server: answers example.EchoService/Echo and sends the request's attachment back.

    python examples/echo_server.py --port 8000    # --port 0: any free port

It prints the address it listens on, then serves until Ctrl-C or SIGTERM; where it cannot
listen (a host not of this machine, a port taken) it says why in one line, with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import aiobrpc
from aiobrpc._proto import echo_pb2  # example.EchoService, from proto/echo.proto


class EchoService(aiobrpc.Servicer):
    SERVICE = echo_pb2.DESCRIPTOR.services_by_name["EchoService"]

    async def Echo(self, request, cntl):
        if not request.message:
            raise aiobrpc.RpcError(aiobrpc.errors.EREQUEST, "message must not be empty")
        cntl.response_attachment = cntl.request_attachment  # sent back without a copy
        return echo_pb2.EchoResponse(message=request.message)


async def main(host: str, port: int) -> int:
    server = aiobrpc.Server(aiobrpc.ServerOptions(max_concurrency=1000))
    server.add_service(EchoService())
    try:
        await server.start(f"{host}:{port}")
    except (OSError, ValueError) as e:  # a host not found or not of this machine, a port taken or out of range
        print(f"cannot listen on {host}:{port}: {e}", file=sys.stderr)
        return 1
    print(f"listening on {server.address}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()  # serve until Ctrl-C or SIGTERM
    await server.stop()  # refuse new requests (ELOGOFF) ...
    await server.join()  # ... and let the ones in flight finish
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.host, args.port)))
