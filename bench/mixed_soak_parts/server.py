"""One server of the mixed soak, in a process of its own (so that it can be SIGKILLed).

    python bench/mixed_soak_parts/server.py --port 9001 [--loop uvloop] [--idle-timeout 2]
                                            [--stream-idle-ms 2000]

Serves interop.EchoService (baidu_std unary, HTTP/JSON, brpc streams) and
aiobrpc.test.GrpcTestService (gRPC) on one port; prints "READY <port>" once it listens.
  Echo(message=id)                 -> message=id; Echo(message="__stats__") -> this server's
                                      figures as JSON (RSS, fds, tasks, handlers, streams, loop errors)
  StartStream(message="echo")      -> every message of the stream written back, until it ends
  StartStream(message="push:id:n:size") -> n messages "id:i:" + padding to `size`, then close
  gRPC Unary(text)                 -> text
  gRPC ServerStream(text, count)   -> count messages (text, count=i); text "slow:id:size" pads
                                      each message's data to `size` bytes
  gRPC Bidi(stream (text, count))  -> each (text, count) back
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import aiobrpc  # noqa: E402
from bench.mixed_soak_parts.common import ECHO, GRPC, STATS, Msg, Resp, rss_bytes, run, trim_heap  # noqa: E402


class Figures:
    def __init__(self) -> None:
        self.loop_errors: list[str] = []
        self.served = 0
        self.handlers = 0  # streaming handlers and stream tasks running now
        self.stream_tasks: set = set()


class SoakEcho(aiobrpc.Servicer):
    SERVICE = ECHO

    def __init__(self, fig: Figures, server: aiobrpc.Server, stream_idle_ms: int) -> None:
        self.fig = fig
        self.server = server
        self.stream_idle_ms = stream_idle_ms

    async def Echo(self, request, cntl):
        if request.message == STATS:
            trim_heap()
            fig = self.fig
            return Resp(message=json.dumps({
                "pid": os.getpid(), "rss": rss_bytes(), "fds": len(os.listdir("/proc/self/fd")),
                "tasks": len(asyncio.all_tasks()), "concurrency": self.server.concurrency,
                "connections": len(self.server.connections), "streams": self.server.stream_count(),
                "handlers": fig.handlers, "stream_tasks": len(fig.stream_tasks),
                "loop_errors": fig.loop_errors[:5], "loop_error_count": len(fig.loop_errors),
                "served": fig.served}))
        self.fig.served += 1
        if request.sleep_ms:
            await asyncio.sleep(request.sleep_ms / 1000)
        return Resp(message=request.message)

    async def StartStream(self, request, cntl):
        if not cntl.has_remote_stream:
            raise aiobrpc.RpcError(aiobrpc.errors.EREQUEST, "no stream")
        echo = request.message == "echo"
        # An echo stream whose client vanished unseen (its RST lost) ends after stream_idle_ms
        # without a message; a push stream is only written (its client is never killed).
        stream = aiobrpc.Stream.accept(cntl, idle_timeout_ms=self.stream_idle_ms if echo else -1)
        if echo:
            coro = self._echo(stream)
        elif request.message.startswith("push:"):
            _, cid, n, size = request.message.split(":")
            coro = self._push(stream, cid, int(n), int(size))
        else:
            raise aiobrpc.RpcError(aiobrpc.errors.EREQUEST, "unknown mode")
        task = asyncio.get_running_loop().create_task(coro)
        self.fig.stream_tasks.add(task)
        task.add_done_callback(self.fig.stream_tasks.discard)
        self.fig.served += 1
        return Resp(message=request.message)

    async def _echo(self, stream) -> None:
        try:
            async for message in stream:
                await stream.write(message)
        except aiobrpc.RpcError:
            pass

    async def _push(self, stream, cid: str, n: int, size: int) -> None:
        try:
            for i in range(n):
                head = f"{cid}:{i}:".encode()
                await stream.write(head + bytes(max(0, size - len(head))))
            await stream.close()
        except aiobrpc.RpcError:
            pass


class SoakGrpc(aiobrpc.Servicer):
    SERVICE = GRPC

    def __init__(self, fig: Figures) -> None:
        self.fig = fig

    async def Unary(self, request, cntl):
        self.fig.served += 1
        return Msg(text=request.text, count=request.count)

    async def ServerStream(self, request, cntl):
        self.fig.served += 1
        self.fig.handlers += 1
        try:
            data = b""
            if request.text.startswith("slow:"):
                data = bytes(int(request.text.rsplit(":", 1)[1]))
            for i in range(request.count):
                yield Msg(text=request.text, count=i, data=data)
        finally:
            self.fig.handlers -= 1

    async def Bidi(self, requests, cntl):
        self.fig.served += 1
        self.fig.handlers += 1
        try:
            while (r := await requests.read()) is not None:
                yield Msg(text=r.text, count=r.count)
        finally:
            self.fig.handlers -= 1


async def serve(port: int, idle_s: float, stream_idle_ms: int) -> None:
    loop = asyncio.get_running_loop()
    fig = Figures()
    loop.set_exception_handler(lambda lp, ctx: fig.loop_errors.append(
        repr(ctx.get("exception", ctx.get("message")))))
    # A client killed while the network drops its packets leaves a half-open connection: found
    # by keepalive when idle and by TCP_USER_TIMEOUT when replies wait unacknowledged, within a
    # phase's settling time here (the defaults take 90 s: docs/soak.md, "Half-open connections")
    server = aiobrpc.Server(aiobrpc.ServerOptions(idle_timeout_sec=idle_s, socket_keepalive_idle_s=1,
                                                  socket_keepalive_interval_s=1, socket_keepalive_count=2,
                                                  tcp_user_timeout_ms=3000))
    server.add_service(SoakEcho(fig, server, stream_idle_ms))
    server.add_service(SoakGrpc(fig))
    for attempt in range(250):  # the port may still be held for a moment after a kill
        try:
            await server.start(f"127.0.0.1:{port}")
            break
        except OSError:
            if attempt == 249:
                raise
            await asyncio.sleep(0.02)
    print(f"READY {server.port}", flush=True)
    await asyncio.Event().wait()  # until SIGKILL (or SIGTERM)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    ap.add_argument("--idle-timeout", type=float, default=-1, help="ServerOptions.idle_timeout_sec")
    ap.add_argument("--stream-idle-ms", type=int, default=-1, help="idle_timeout_ms of accepted echo streams")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING if a.verbose else logging.CRITICAL)
    run(lambda: serve(a.port, a.idle_timeout, a.stream_idle_ms), a.loop)


if __name__ == "__main__":
    main()
