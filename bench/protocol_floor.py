"""The protocol floor of bench/echo.py: the raw ceiling's transport carrying real baidu_std frames.

What any Python implementation of baidu_std with protobuf messages must do per call, and
nothing more: the raw ceiling (bench/raw_ceiling.py: one BufferedProtocol per side, a future per
call in a dict, one `writelines` per loop iteration, inline echo) plus, on each side, the
RpcMeta encoded and decoded by aiobrpc's compiled kernel (`_fast.pack_head`, `_fast.decode_meta`),
the request and response protobuf messages serialized and parsed (upb), the attachment split
off the body, and the server's `async def` handler stepped inline (`coro.send(None)`, no Task).
No controller, timeout, retry, limit, checksum, compression, error path or stream: a frame that
is not a plain request or reply aborts the connection.

Its frames are brpc's: a C++ brpc client could call this server's EchoService.Echo. The gap
between it and the raw ceiling (d) is the price of the protocol and of protobuf's Python API;
the gap between aiobrpc (a) and it is the price of the framework. bench/echo.py calls it (f).

    python bench/protocol_floor.py --serve [--loop asyncio]   # prints "PORT <n> floor-cython"
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from raw_ceiling import RawClient, RawConnection, parse_serve_args, run, serve_until_signal  # noqa: E402

from aiobrpc import _fast  # noqa: E402
from aiobrpc._proto import echo_pb2  # noqa: E402

MAGIC = b"PRPC"
SERVICE = "example.EchoService"


def _body_parts(meta_size: int, body):
    """(meta, protobuf bytes, attachment) of a frame body: views, no copy but the meta's."""
    view = memoryview(body)
    meta = _fast.decode_meta(view[:meta_size])
    attached = meta.attachment_size or 0
    end = len(view) - attached
    return meta, view[meta_size:end], view[end:]


# Frames written in one loop iteration leave in one send at its end, or (GROUP > 0) also every
# GROUP frames, so that the peer starts on the first ones while this side makes the rest, as
# aiobrpc's transport does with groups of 8 (BENCH_FLOOR_GROUP, read by server and client alike;
# 0, the default: the raw ceiling's way).
GROUP = int(os.environ.get("BENCH_FLOOR_GROUP", "0"))


class FloorConnection(RawConnection):
    MAGIC = MAGIC
    _queued = 0

    def send_frame(self, meta, data: bytes, attachment) -> None:
        out = self._out
        out.append(_fast.pack_head(MAGIC, meta, len(data) + len(attachment)))
        out.append(data)
        if len(attachment):
            out.append(attachment)
        self._queued += 1
        if self._queued == GROUP:
            self._send_group()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._send_group)

    def _send_group(self) -> None:
        self._queued = 0
        if self._out:
            self._flush()


class FloorClient(FloorConnection, RawClient):
    """`call(request, attachment)` returns a future of (EchoResponse, attachment view).

    RawClient's pending map, connect, close and connection_lost, with baidu_std frames.
    """

    def call(self, request, attachment) -> asyncio.Future:
        cid = self._next_id = self._next_id + 1
        fut = self.loop.create_future()
        self.pending[cid] = fut
        meta = _fast.RpcMeta()
        meta.has_request = True
        meta.service_name = SERVICE
        meta.method_name = "Echo"
        meta.correlation_id = cid
        attachment = memoryview(attachment).cast("B")
        meta.attachment_size = len(attachment)
        self.send_frame(meta, request.SerializeToString(), attachment)
        return fut

    def frame_received(self, meta_size: int, body) -> None:
        meta, data, attachment = _body_parts(meta_size, body)
        if not meta.has_response or meta.error_code:
            self.transport.abort()
            return
        fut = self.pending.pop(meta.correlation_id, None)
        if fut is not None and not fut.done():
            fut.set_result((echo_pb2.EchoResponse.FromString(data), attachment))


async def echo(request, attachment):
    return echo_pb2.EchoResponse(message=request.message), attachment


class FloorServer(FloorConnection):
    """Decodes each request, steps the `async def` handler inline, sends its reply."""

    METHODS = {(SERVICE, "Echo"): (echo_pb2.EchoRequest.FromString, echo)}

    def frame_received(self, meta_size: int, body) -> None:
        meta, data, attachment = _body_parts(meta_size, body)
        method = self.METHODS.get((meta.service_name, meta.method_name)) if meta.has_request else None
        if method is None:
            self.transport.abort()
            return
        parse, handler = method
        coro = handler(parse(data), attachment)
        try:
            coro.send(None)
        except StopIteration as done:
            response, reply_attachment = done.value
        else:  # the echo handler never suspends; a floor needs no Task for it
            coro.close()
            self.transport.abort()
            return
        reply = _fast.RpcMeta()
        reply.has_response = True
        reply.correlation_id = meta.correlation_id
        reply.attachment_size = len(reply_attachment)
        self.send_frame(reply, response.SerializeToString(), reply_attachment)


async def serve(host: str = "127.0.0.1", port: int = 0) -> None:
    """Serve until SIGTERM/SIGINT; print "PORT <n> floor-<twin>" once listening."""
    await serve_until_signal(FloorServer, f"floor-{_fast.IMPLEMENTATION}", host, port)


def main(argv=None) -> None:
    args = parse_serve_args(__doc__, argv)
    run(serve(port=args.port), args.loop)


if __name__ == "__main__":
    sys.exit(main())
