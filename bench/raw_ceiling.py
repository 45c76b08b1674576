"""The raw ceiling of bench/echo.py: what a perfect Python RPC on the same event loop could do.

An asyncio BufferedProtocol echo server and client with the least framing an RPC needs, a
12-byte header (magic b"RAW0", body_size, id; big-endian), and nothing else: no meta, no
protobuf, no controller, no timeouts, no limits. It does what aiobrpc's design says an RPC
should do (DESIGN.md, "performance model") and no more:

* the client makes one future per call, kept in a dict by id and completed from the
  protocol callback;
* writes made during one loop iteration are flushed with one `writelines` per iteration
  (uvloop sends them with one scatter-gather call; on plain asyncio small buffers are joined
  and large ones written alone, as aiobrpc's transport does);
* the kernel reads straight into a shared block; a small body is copied out of it
  (`bytes`, cheap below 64 KiB), a large body gets its own exact-size bytearray that the
  kernel fills directly, and after a large frame only the next 12-byte header is read so a
  stream of large frames is received with no copy in user space.

The server echoes inline in the protocol callback. With `task_per_request=True` it runs an
`async def` handler in a Task per request, as aiobrpc's server does (one task per request so
a slow one never delays the others); bench/echo.py calls that variant (e) and the inline one
(d), and the difference is the price of that task.

Used by bench/echo.py (which imports `RawClient` and runs this file with --serve), or by hand:

    python bench/raw_ceiling.py --serve [--task] [--loop asyncio]   # prints "PORT <n> raw"
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import struct
import sys

MAGIC = b"RAW0"
HEADER = struct.Struct("!4sII")  # magic, body_size, id
HEADER_SIZE = HEADER.size
BLOCK_SIZE = 256 * 1024
LARGE_THRESHOLD = 64 * 1024  # bodies above this get their own exact-size buffer
_JOIN_LIMIT = 64 * 1024  # plain asyncio only: smaller buffers are joined before write()


class RawConnection(asyncio.BufferedProtocol):
    """One end of a raw connection; subclasses implement `frame_received(id, body)`.

    The third header word is passed on as `id`; bench/protocol_floor.py reuses this class for
    baidu_std frames (magic PRPC), whose third word is the meta's size.
    """

    MAGIC = MAGIC

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport = None
        self._block = bytearray(BLOCK_SIZE)
        self._view = memoryview(self._block)
        self._start = 0
        self._end = 0
        self._header_only = False
        self._large: bytearray | None = None
        self._large_view: memoryview | None = None
        self._large_filled = 0
        self._large_id = 0
        self._out: list = []
        self._flush_scheduled = False
        self._writelines_ok = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        self._writelines_ok = type(transport).__module__.startswith("uvloop")
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc) -> None:
        self.transport = None

    # -- receiving ---------------------------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        if self._large is not None:
            return self._large_view[self._large_filled:]
        start, end = self._start, self._end
        if start == end:
            self._start = self._end = end = 0
            if self._header_only:
                # After a large frame read just the next header, so that a following large
                # body goes straight into its own buffer.
                return self._view[:HEADER_SIZE]
        elif BLOCK_SIZE - end < LARGE_THRESHOLD + HEADER_SIZE:
            # Room for the rest of a small frame: move the partial frame to the front.
            n = end - start
            self._block[:n] = self._view[start:end]
            self._start, self._end = 0, n
            end = n
        return self._view[end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._large is not None:
            self._large_filled += nbytes
            if self._large_filled == len(self._large):
                body, self._large, self._large_view = self._large, None, None
                self._header_only = True
                self.frame_received(self._large_id, body)
            return
        self._end += nbytes
        self._header_only = False
        block, view, unpack, expected = self._block, self._view, HEADER.unpack_from, self.MAGIC
        start, end = self._start, self._end
        while end - start >= HEADER_SIZE:
            magic, size, ident = unpack(block, start)
            if magic != expected:
                self.transport.abort()
                return
            body_start = start + HEADER_SIZE
            if end - body_start >= size:
                start = body_start + size
                self._start = start
                self.frame_received(ident, bytes(view[body_start:start]))
                continue
            if size > LARGE_THRESHOLD:
                have = end - body_start
                large = self.large_buffer(size)
                large[:have] = view[body_start:end]
                self._large, self._large_view = large, memoryview(large)
                self._large_filled = have
                self._large_id = ident
                start = end
            break
        self._start = start

    def frame_received(self, ident: int, body) -> None:
        raise NotImplementedError

    def large_buffer(self, size: int) -> bytearray:
        """The buffer a large body is read into (its own: the echo sends it back as it is)."""
        return bytearray(size)

    # -- sending -----------------------------------------------------------------------------
    def send(self, ident: int, body, nbytes: int) -> None:
        out = self._out
        out.append(HEADER.pack(MAGIC, nbytes, ident))
        out.append(body)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, []
        transport = self.transport
        if transport is None:
            return
        if self._writelines_ok:
            transport.writelines(out)
            return
        small: list = []
        for buf in out:
            if type(buf) is not bytes:
                buf = memoryview(buf).cast("B")  # asyncio's write() takes no numpy array
            if len(buf) < _JOIN_LIMIT:
                small.append(buf)
                continue
            if small:
                transport.write(b"".join(small))
                small = []
            transport.write(buf)
        if small:
            transport.write(b"".join(small))


class RawClient(RawConnection):
    """`call(payload)` returns a future of the echoed body (bytes or bytearray)."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: dict[int, asyncio.Future] = {}
        self._next_id = 0

    @classmethod
    async def connect(cls, host: str, port: int) -> RawClient:
        _, client = await asyncio.get_running_loop().create_connection(cls, host, port)
        return client

    def call(self, payload) -> asyncio.Future:
        ident = self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        fut = self.loop.create_future()
        self.pending[ident] = fut
        nbytes = len(payload) if type(payload) is bytes else memoryview(payload).nbytes
        self.send(ident, payload, nbytes)
        return fut

    def frame_received(self, ident: int, body) -> None:
        fut = self.pending.pop(ident, None)
        if fut is not None and not fut.done():
            fut.set_result(body)

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError("raw connection lost"))
        self.pending.clear()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class RawEchoServer(RawConnection):
    """Echoes each body back inline, from the protocol callback."""

    def frame_received(self, ident: int, body) -> None:
        self.send(ident, body, len(body))


class RawSinkServer(RawConnection):
    """Answers each body with an empty one: a one-way transfer with nothing else (the raw
    reference of bench/ps_bench.py).

    A body is dropped once received, so large ones are all read into one buffer, reused.
    """

    _kept = bytearray()

    def frame_received(self, ident: int, body) -> None:
        self.send(ident, b"", 0)

    def large_buffer(self, size: int) -> bytearray:
        if len(self._kept) != size:
            self._kept = bytearray(size)
        return self._kept


class RawTaskEchoServer(RawConnection):
    """Echoes each body from an `async def` handler run in a Task per request."""

    def frame_received(self, ident: int, body) -> None:
        self.loop.create_task(self._serve(ident, body))

    async def _serve(self, ident: int, body) -> None:
        reply = await self.handle(body)
        if self.transport is not None:
            self.send(ident, reply, len(reply))

    async def handle(self, body):
        return body


async def serve(host: str = "127.0.0.1", port: int = 0, task_per_request: bool = False,
                sink: bool = False) -> None:
    """Serve until SIGTERM/SIGINT; print "PORT <n> raw" once listening."""
    factory = RawSinkServer if sink else RawTaskEchoServer if task_per_request else RawEchoServer
    await serve_until_signal(factory, "raw", host, port)


async def serve_until_signal(factory, label: str, host: str, port: int) -> None:
    """Serve `factory`'s protocol until SIGTERM/SIGINT; print "PORT <n> <label>" once listening."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(factory, host, port, reuse_address=True)
    print(f"PORT {server.sockets[0].getsockname()[1]} {label}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


def run(coro, loop_name: str):
    if loop_name == "uvloop":
        import uvloop
        return uvloop.run(coro)
    return asyncio.run(coro)


def parse_serve_args(doc: str, argv=None, configure=None) -> argparse.Namespace:
    """The command line of a bench server script (this one, bench/protocol_floor.py): --serve,
    --port, --loop, and what `configure(parser)` adds."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--serve", action="store_true", help="run the echo server")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    if configure is not None:
        configure(p)
    args = p.parse_args(argv)
    if not args.serve:
        p.error("only --serve is runnable by itself; bench/echo.py drives the client")
    return args


def _server_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", action="store_true", help="a Task per request (variant e)")
    p.add_argument("--sink", action="store_true", help="answer every body with an empty one (bench/ps_bench.py)")


def main(argv=None) -> None:
    args = parse_serve_args(__doc__, argv, _server_options)
    run(serve(port=args.port, task_per_request=args.task, sink=args.sink), args.loop)


if __name__ == "__main__":
    sys.exit(main())
