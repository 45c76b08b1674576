"""Per-call CPU of aiobrpc's client and server paths, each alone, with no socket.

bench/echo.py measures whole systems, where the client, the server and the kernel share two
CPUs; this isolates one side at a time so a change to the hot path shows in microseconds:

* server: a ServerConnection on a fake transport gets `--batch` echo requests per read (as a
  busy connection does) and the time until every reply was handed to the transport is
  divided by the number of requests;
* client: a Channel whose connection is on a fake transport that answers every request in
  the next loop iteration (a prebuilt reply with the correlation id patched in); `--concurrency`
  callers in a closed loop.

`--method-status off` runs the client with `ChannelOptions(method_status=False)`; `both` runs
it both ways and prints the ratio, what the per-method figures cost on the client.

`--server-compare status` runs the server side with and without `ServerOptions(method_status)`
(what /status's per-method figures cost); `--server-compare limits` with and without every limit
set high enough never to refuse (LIMITS: server and per-method max_concurrency, max_connections,
idle_timeout_sec, max_user_fields): what checking them costs; `all`: both at once against neither.
Alternated, best of each.

`--attachment N` puts an N-byte attachment on every request (server side; the handler echoes
it) and on every reply (client side), so the cost of receiving one shows.

    python bench/hotpath.py                      # both sides, both twins, uvloop
    python bench/hotpath.py --side server --profile   # cProfile of the server side
    python bench/hotpath.py --loop asyncio

Numbers are microseconds of one CPU per call (lower is better), the best of `--repeat` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvloop  # noqa: E402

from aiobrpc import _fast  # noqa: E402
import pure  # noqa: E402  (bench/pure.py)


class FakeTransport(asyncio.Transport):
    """Collects what is written; `on_write(buffers)` sees every writelines/write."""

    def __init__(self, on_write) -> None:
        super().__init__()
        self.on_write = on_write
        self.closed = False

    def writelines(self, buffers) -> None:
        self.on_write(buffers)

    def write(self, data) -> None:
        self.on_write([data])

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name, default)

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _frames(buffers):
    """(meta view, frame bytes) of every frame in what was written (joined or not)."""
    data = b"".join(bytes(b) for b in buffers)
    at = 0
    while at < len(data):
        _, body, meta_size = struct.unpack_from("!4sII", data, at)
        yield memoryview(data)[at + 12:at + 12 + meta_size]
        at += 12 + body


def deliver(conn, data: bytes) -> None:
    """Hand `data` to the protocol as the kernel would: get_buffer, fill, buffer_updated."""
    view = memoryview(data)
    while view:
        buf = conn.get_buffer(len(view))
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        conn.buffer_updated(n)
        view = view[n:]


def _echo_service():
    import aiobrpc
    from aiobrpc._proto import echo_pb2

    class Echo(aiobrpc.Servicer):
        SERVICE = echo_pb2.DESCRIPTOR.services_by_name["EchoService"]

        async def Echo(self, request, cntl):
            cntl.response_attachment = cntl.request_attachment
            return echo_pb2.EchoResponse(message=request.message)

    return Echo(), echo_pb2


def _request_frame(echo_pb2, cid: int, attachment: bytes = b"") -> bytes:
    from aiobrpc.protocol import baidu_std
    meta = _fast.RpcMeta()
    meta.has_request = True
    meta.service_name = "example.EchoService"
    meta.method_name = "Echo"
    meta.correlation_id = cid
    bufs = baidu_std.pack(meta, echo_pb2.EchoRequest(message="x" * 16).SerializeToString(),
                          attachment or None)
    return b"".join(bytes(b) for b in bufs)


LIMITS = dict(max_concurrency=1_000_000, method_max_concurrency=1_000_000, max_connections=10_000,
              idle_timeout_sec=3600, max_user_fields=64)
SERVER_COMPARE = {"status": ({}, {"method_status": False}), "limits": (LIMITS, {}),  # (with, without)
                  "all": (LIMITS, {"method_status": False})}


async def server_side(calls: int, batch: int, attachment: int = 0, options: dict | None = None) -> float:
    import aiobrpc
    from aiobrpc.server.connection import ServerConnection

    servicer, echo_pb2 = _echo_service()
    server = aiobrpc.Server(aiobrpc.ServerOptions(**(options or {})))
    server.add_service(servicer)
    loop = asyncio.get_running_loop()
    replies = 0
    done = loop.create_future()

    def on_write(buffers):
        nonlocal replies
        replies += sum(1 for _ in _frames(buffers))
        if replies >= calls and not done.done():
            done.set_result(None)

    conn = ServerConnection(server)
    conn.connection_made(FakeTransport(on_write))
    chunk = b"".join(_request_frame(echo_pb2, i + 1, b"a" * attachment) for i in range(batch))

    def feed():
        deliver(conn, chunk)

    start = time.process_time()
    sent = 0
    while sent < calls:
        loop.call_soon(feed)  # from a loop callback, as a socket read: no task is running
        sent += batch
        await asyncio.sleep(0)  # replies of this batch run and flush, as between two reads
    await done
    elapsed = time.process_time() - start
    conn.connection_lost(None)
    return elapsed / calls * 1e6


async def client_side(calls: int, concurrency: int, attachment: int = 0, method_status: bool = True) -> float:
    import aiobrpc
    from aiobrpc.client.connection import ClientConnection

    _, echo_pb2 = _echo_service()
    loop = asyncio.get_running_loop()
    ch = aiobrpc.Channel("127.0.0.1:1", aiobrpc.ChannelOptions(timeout_ms=5000, method_status=method_status))
    stub = aiobrpc.Stub(ch, echo_pb2.DESCRIPTOR.services_by_name["EchoService"])
    meta = _fast.RpcMeta()
    meta.has_response = True
    meta.error_code = 0
    meta.correlation_id = 0xFFFFFFFF  # 5 varint bytes; patched per reply below
    from aiobrpc.protocol import baidu_std
    reply = bytearray(b"".join(bytes(b) for b in baidu_std.pack(
        meta, echo_pb2.EchoResponse(message="x" * 16).SerializeToString(),
        b"a" * attachment or None)))
    cid_at = reply.find(b"\xff\xff\xff\xff\x0f")
    # Replies prebuilt for every correlation id the run will use (ids are issued in order),
    # so the fake peer costs a list slice per loop iteration, not an encode per call.
    replies = []
    for cid in range(1, calls + 1):
        r = bytearray(reply)
        enc = bytearray(((cid >> (7 * i)) & 0x7F) | 0x80 for i in range(5))
        enc[4] &= 0x7F  # a fixed 5-byte varint keeps the frame size constant
        r[cid_at:cid_at + 5] = enc
        replies.append(bytes(r))
    answered = 0
    requested = 0
    scheduled = False

    def answer():
        nonlocal scheduled, answered
        scheduled = False
        out = b"".join(replies[answered:requested])
        answered = requested
        deliver(conn, out)

    def on_write(buffers):
        nonlocal scheduled, requested
        requested += sum(1 for _ in _frames(buffers))
        if not scheduled:
            scheduled = True
            loop.call_soon(answer)

    pool = next(iter(ch.pools.values()))
    conn = ClientConnection(ch.stats, 1 << 26, 1 << 26, pool._connection_lost)
    conn.connection_made(FakeTransport(on_write))
    pool.single = conn
    pool.connections.add(conn)
    req = echo_pb2.EchoRequest(message="x" * 16)
    per_worker = calls // concurrency

    async def worker():
        for _ in range(per_worker):
            await stub.Echo(req)

    start = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.process_time() - start
    return elapsed / (per_worker * concurrency) * 1e6


NOT_COMPILED = (f"cython: the kernels of aiobrpc._fast are {_fast.IMPLEMENTATION!r} in this process, "
                "not compiled (python setup.py build_ext --inplace, AIOBRPC_NO_EXTENSIONS unset): "
                "skipping")


def run(side: str, args, method_status: bool = True, repeat: int | None = None,
        server_options: dict | None = None) -> float:
    new_loop = uvloop.new_event_loop if args.loop == "uvloop" else asyncio.new_event_loop
    best = float("inf")
    for _ in range(args.repeat if repeat is None else repeat):
        loop = new_loop()
        try:
            if side == "server":
                us = loop.run_until_complete(server_side(args.calls, args.batch, args.attachment, server_options))
            else:
                us = loop.run_until_complete(
                    client_side(args.calls, args.concurrency, args.attachment, method_status))
        finally:
            loop.close()
        best = min(best, us)
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", choices=["server", "client", "both"], default="both")
    p.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    p.add_argument("--calls", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=32, help="server: requests per read")
    p.add_argument("--concurrency", type=int, default=128, help="client: callers")
    p.add_argument("--attachment", type=int, default=0,
                   help="bytes of attachment on each request and reply (default none)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--twins", default="cython,python" if _fast.IMPLEMENTATION == "cython" else "python",
                   help="comma-separated, of cython and python (default: both where compiled)")
    p.add_argument("--profile", action="store_true", help="cProfile one run (first twin)")
    p.add_argument("--method-status", choices=["on", "off", "both"], default="on",
                   help="client: ChannelOptions.method_status; both: each way, and their ratio")
    p.add_argument("--server-compare", choices=sorted(SERVER_COMPARE),
                   help="server: with and without per-method status, or with and without the limits")
    args = p.parse_args(argv)
    if not set(args.twins.split(",")) <= {"cython", "python"}:
        p.error(f"--twins: {args.twins!r} is not a list of cython and python")
    sides = ["server", "client"] if args.side == "both" else [args.side]
    pure_args = [*(sys.argv[1:] if argv is None else argv), "--twins", "python"]
    if args.profile:
        if args.twins.split(",")[0] == "python" and pure.needs_own_process():
            raise SystemExit(pure.rerun(pure_args))
        if args.twins.split(",")[0] == "cython" and _fast.IMPLEMENTATION != "cython":
            raise SystemExit(NOT_COMPILED)
        args.repeat = 1
        for side in sides:
            prof = cProfile.Profile()
            prof.enable()
            run(side, args)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    for twin in args.twins.split(","):
        if twin == "python" and pure.needs_own_process():
            pure.rerun(pure_args)
            continue
        if twin == "cython" and _fast.IMPLEMENTATION != "cython":
            print(NOT_COMPILED)
            continue
        att = f" att={args.attachment}B" if args.attachment else ""
        for side in sides:
            if side == "server" and args.server_compare:
                with_opts, without_opts = SERVER_COMPARE[args.server_compare]
                on = off = float("inf")
                for _ in range(args.repeat):
                    on = min(on, run(side, args, repeat=1, server_options=with_opts))
                    off = min(off, run(side, args, repeat=1, server_options=without_opts))
                print(f"{side:6} {twin:6} {args.loop:7}{att} {on:6.2f} us/call with {args.server_compare}, "
                      f"{off:6.2f} without: {on / off:.3f}x (+{on - off:.2f} us)")
                continue
            if side == "server" or args.method_status != "both":
                us = run(side, args, args.method_status != "off")
                print(f"{side:6} {twin:6} {args.loop:7}{att} {us:6.2f} us/call")
                continue
            # Alternated, best of each: the two are measured under the same noise.
            on = off = float("inf")
            for _ in range(args.repeat):
                on = min(on, run(side, args, True, 1))
                off = min(off, run(side, args, False, 1))
            print(f"{side:6} {twin:6} {args.loop:7}{att} {on:6.2f} us/call with method status, "
                  f"{off:6.2f} without: {on / off:.3f}x (+{on - off:.2f} us)")


if __name__ == "__main__":
    main()
