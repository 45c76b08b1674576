"""Throughput of one stream, beside a raw socket copy and unary calls, in one run.

For 4 KiB, 1 MiB and 16 MiB messages, a writer in this process and a reader in a second one
(`--processes 2`, the default: as a stream is used, the two ends run at once on two cores) or
on the same event loop as the writer (`--processes 1`):

* raw: an asyncio socket pair, the writer sending the same buffers with backpressure (paused by
  the transport, resumed at its low-water mark) and the reader a BufferedProtocol that counts
  what the kernel put in its buffer: the ceiling for moving bytes on this loop;
* raw, windowed: the same socket pair with the stream's flow control and nothing else: the
  writer keeps at most `--max-buf-size` bytes unacknowledged and the reader sends back an
  8-byte count per read that completed a message (what a FEEDBACK carries): the ceiling for
  any protocol with that window on this loop, without framing, meta or dispatch;
* stream: one aiobrpc stream (default window, `max_buf_size` 2 MiB), the reader a handler that
  counts each batch (so FEEDBACK flows as in real use);
* unary: Echo calls carrying the message as the request attachment, 4 in flight, with an
  empty response.

Each figure is MB/s (10^6 bytes the reader received) over `--seconds` after a short warm-up,
the median of `--rounds` rounds; ratios are against raw measured in the same round (the median
of the rounds' ratios, with their range: the machine's noise). `--clock cpu` divides by the
CPU time of both ends (this process and the reader's) instead of the wall clock: that is the
work done per byte, which holds still on a machine whose cores other processes share (with
`--processes 1` everything runs on one thread and both measure the same thing).

    python bench/stream_bench.py [--processes 1] [--loop asyncio] [--seconds 1] [--rounds 5]
                                 [--max-buf-size N] [--clock cpu] [--sizes 1MiB ...]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiobrpc  # noqa: E402
from aiobrpc._proto import interop_pb2  # noqa: E402

SERVICE = interop_pb2.DESCRIPTOR.services_by_name["EchoService"]
SIZES = [("4 KiB", 4096), ("1 MiB", 1 << 20), ("16 MiB", 16 << 20)]


class _Sink(asyncio.BufferedProtocol):
    def __init__(self, counter: list) -> None:
        self.buf = memoryview(bytearray(1 << 20))
        self.counter = counter

    def get_buffer(self, sizehint):
        return self.buf

    def buffer_updated(self, nbytes):
        self.counter[0] += nbytes


class _Source(asyncio.Protocol):
    def __init__(self) -> None:
        self.resumed: asyncio.Future | None = None
        self.paused = False

    def pause_writing(self):
        self.paused = True

    def resume_writing(self):
        self.paused = False
        if self.resumed is not None and not self.resumed.done():
            self.resumed.set_result(None)


class _Readers:
    """The reading ends of every kind, served on the running loop: `raw_port`,
    `windowed_ports[size]`, `address` (the aiobrpc server); `counter[0]` counts the bytes they
    received."""

    async def start(self, max_buf_size: int, sizes: list) -> _Readers:
        loop = asyncio.get_running_loop()
        self.counter = counter = [0]
        self._servers = [await loop.create_server(lambda: _Sink(counter), "127.0.0.1", 0)]
        self.raw_port = self._servers[0].sockets[0].getsockname()[1]
        self.windowed_ports = {}
        for size in sizes:
            server = await loop.create_server(lambda size=size: _AckingSink(counter, size), "127.0.0.1", 0)
            self._servers.append(server)
            self.windowed_ports[size] = server.sockets[0].getsockname()[1]
        self.server = aiobrpc.Server()
        self.server.add_service(_Servicer(counter, max_buf_size))
        await self.server.start("127.0.0.1:0")
        self.address = self.server.address
        return self

    async def count(self) -> tuple[int, float]:
        """(bytes received so far, CPU seconds the reading ends used apart from this process)"""
        return self.counter[0], 0.0

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        await self.server.stop()
        await self.server.join(timeout=2)


class _RemoteReaders:
    """The same reading ends in a child process; `count` asks it over a control connection."""

    async def start(self, max_buf_size: int, sizes: list, loop_name: str) -> _RemoteReaders:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve_readers, args=(child, max_buf_size, sizes, loop_name), daemon=True)
        self.proc.start()
        loop = asyncio.get_running_loop()
        ready = await loop.run_in_executor(None, parent.recv)
        self.raw_port, self.windowed_ports, self.address, control = ready
        self._control = await asyncio.open_connection("127.0.0.1", control)
        return self

    async def count(self) -> tuple[int, float]:
        reader, writer = self._control
        writer.write(b"?\n")
        nbytes, cpu = (await reader.readline()).split()
        return int(nbytes), float(cpu)

    async def close(self) -> None:
        self._control[1].close()
        self.proc.kill()
        self.proc.join()


def _serve_readers(conn, max_buf_size: int, sizes: list, loop_name: str) -> None:
    async def main() -> None:
        readers = await _Readers().start(max_buf_size, sizes)

        async def control(reader, writer) -> None:
            while await reader.readline():
                writer.write(b"%d %.6f\n" % (readers.counter[0], time.process_time()))
        server = await asyncio.start_server(control, "127.0.0.1", 0)
        conn.send((readers.raw_port, readers.windowed_ports, readers.address,
                   server.sockets[0].getsockname()[1]))
        await asyncio.Event().wait()  # until killed
    if loop_name == "uvloop":
        import uvloop
        uvloop.run(main())
    else:
        asyncio.run(main())


async def raw(size: int, seconds: float, readers) -> float:
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_connection(_Source, "127.0.0.1", readers.raw_port)
    message = bytes(size)

    async def pump(until: float) -> None:
        while loop.time() < until:
            transport.write(message)
            if proto.paused:
                proto.resumed = loop.create_future()
                await proto.resumed
    rate = await _measure(pump, readers, seconds)
    transport.close()
    return rate


class _AckingSink(_Sink):
    """A _Sink that acknowledges each read completing a message with the bytes received so far."""

    def __init__(self, counter: list, size: int) -> None:
        super().__init__(counter)
        self.size = size
        self.got = 0
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def buffer_updated(self, nbytes):
        self.counter[0] += nbytes
        before = self.got // self.size
        self.got += nbytes
        if self.got // self.size != before:
            self.transport.write(self.got.to_bytes(8, "little"))


class _WindowedSource(asyncio.Protocol):
    def __init__(self) -> None:
        self.acked = 0
        self.waiter: asyncio.Future | None = None
        self.pending = b""

    def data_received(self, data):
        data = self.pending + data
        whole = len(data) - len(data) % 8
        if whole:
            self.acked = int.from_bytes(data[whole - 8:whole], "little")
        self.pending = data[whole:]
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


async def raw_windowed(size: int, seconds: float, window: int, readers) -> float:
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_connection(_WindowedSource, "127.0.0.1", readers.windowed_ports[size])
    message = bytes(size)
    sent = 0

    async def pump(until: float) -> None:
        nonlocal sent
        while loop.time() < until:
            while sent - proto.acked >= window:  # as a stream: past the window by one message at most
                proto.waiter = loop.create_future()
                await proto.waiter
            transport.write(message)
            sent += size
    rate = await _measure(pump, readers, seconds)
    transport.close()
    return rate


class _Counting(aiobrpc.StreamHandler):
    def __init__(self, counter: list) -> None:
        self.counter = counter

    def on_received_messages(self, stream, messages):
        n = 0
        for m in messages:
            n += len(m)
        self.counter[0] += n


class _Servicer(aiobrpc.Servicer):
    SERVICE = SERVICE

    def __init__(self, counter: list, max_buf_size: int) -> None:
        self.counter = counter
        self.max_buf_size = max_buf_size

    async def StartStream(self, request, cntl):
        aiobrpc.Stream.accept(cntl, handler=_Counting(self.counter), max_buf_size=self.max_buf_size)
        return interop_pb2.EchoResponse(message="")

    async def Echo(self, request, cntl):
        self.counter[0] += len(cntl.request_attachment)
        return interop_pb2.EchoResponse(message="")


def _channel(readers):
    channel = aiobrpc.Channel(readers.address, aiobrpc.ChannelOptions(timeout_ms=60000))
    return channel, aiobrpc.Stub(channel, SERVICE)


async def stream(size: int, seconds: float, max_buf_size: int, readers) -> float:
    channel, stub = _channel(readers)
    cntl = aiobrpc.Controller()
    s = aiobrpc.Stream.create(cntl, max_buf_size=max_buf_size)
    await stub.StartStream(interop_pb2.EchoRequest(message=""), cntl)
    message = bytes(size)
    loop = asyncio.get_running_loop()

    async def pump(until: float) -> None:
        while loop.time() < until:
            await s.write(message)
    rate = await _measure(pump, readers, seconds)
    await s.close()
    await channel.close()
    return rate


async def unary(size: int, seconds: float, readers, concurrency: int = 4) -> float:
    channel, stub = _channel(readers)
    message = bytes(size)
    loop = asyncio.get_running_loop()
    req = interop_pb2.EchoRequest(message="")

    async def one(until: float) -> None:
        while loop.time() < until:
            await stub.Echo(req, aiobrpc.Controller(request_attachment=message))

    async def pump(until: float) -> None:
        await asyncio.gather(*[one(until) for _ in range(concurrency)])
    rate = await _measure(pump, readers, seconds)
    await channel.close()
    return rate


_clock = "wall"


async def _measure(pump, readers, seconds: float) -> float:
    loop = asyncio.get_running_loop()
    await pump(loop.time() + min(0.3, seconds / 4))  # warm-up
    start_bytes, start_cpu = await readers.count()
    start_wall, start_own = time.perf_counter(), time.process_time()
    await pump(loop.time() + seconds)
    end_bytes, end_cpu = await readers.count()
    if _clock == "cpu":
        elapsed = time.process_time() - start_own + end_cpu - start_cpu
    else:
        elapsed = time.perf_counter() - start_wall
    return (end_bytes - start_bytes) / elapsed / 1e6


async def run(seconds: float, max_buf_size: int, rounds: int, sizes: list | None = None,
              processes: int = 2, loop_name: str = "uvloop") -> list:
    """Per size, `rounds` rounds of raw, windowed, stream and unary one after the other: each
    figure is the median of its rounds, each ratio the median of the ratios of one round (a
    round's figures share the machine's state of that moment)."""
    sizes = sizes or SIZES
    if processes == 2:
        readers = await _RemoteReaders().start(max_buf_size, [b for _, b in sizes], loop_name)
    else:
        readers = await _Readers().start(max_buf_size, [b for _, b in sizes])
    window = max_buf_size if max_buf_size > 0 else 1 << 62
    rows = []
    try:
        for name, size in sizes:
            rates: list[tuple[float, float, float, float]] = []
            for _ in range(rounds):
                r = await raw(size, seconds, readers)
                w = await raw_windowed(size, seconds, window, readers)
                s = await stream(size, seconds, max_buf_size, readers)
                u = await unary(size, seconds, readers)
                rates.append((r, w, s, u))
            rows.append((name, *(statistics.median(col) for col in zip(*rates)),
                         statistics.median(w / r for r, w, _, _ in rates),
                         statistics.median(s / r for r, _, s, _ in rates),
                         statistics.median(u / r for r, _, _, u in rates),
                         min(s / r for r, _, s, _ in rates), max(s / r for r, _, s, _ in rates)))
    finally:
        await readers.close()
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, choices=(1, 2), default=2,
                   help="2: the reading ends in a second process (default); 1: all on one loop")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    p.add_argument("--seconds", type=float, default=1.0, help="length of one measurement")
    p.add_argument("--rounds", type=int, default=5, help="measurements of each kind per size")
    p.add_argument("--max-buf-size", type=int, default=2 * 1024 * 1024, help="the stream's window")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="divide by wall time or by the CPU time of both ends")
    p.add_argument("--sizes", nargs="+", choices=[name.replace(" ", "") for name, _ in SIZES],
                   help="only these message sizes (default all), e.g. --sizes 16MiB")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0:
        p.error("--rounds must be at least 1 and --seconds positive")
    global _clock
    _clock = args.clock
    sizes = [(n, b) for n, b in SIZES if args.sizes is None or n.replace(" ", "") in args.sizes]
    work = run(args.seconds, args.max_buf_size, args.rounds, sizes, args.processes, args.loop)
    if args.loop == "uvloop":
        import uvloop
        rows = uvloop.run(work)
    else:
        rows = asyncio.run(work)
    print(f"processes={args.processes} loop={args.loop} implementation={aiobrpc.implementation()} "
          f"seconds={args.seconds} rounds={args.rounds} max_buf_size={args.max_buf_size} clock={args.clock} "
          f"cpus={os.cpu_count()}")
    print("| message | raw socket MB/s | raw, windowed MB/s | stream MB/s | unary (attachment) MB/s "
          "| windowed / raw | stream / raw | (min..max) | unary / raw |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r, w, s, u, wr, sr, ur, lo, hi in rows:
        print(f"| {name} | {r:.0f} | {w:.0f} | {s:.0f} | {u:.0f} | {wr:.2f} | {sr:.2f} | {lo:.2f}..{hi:.2f} "
              f"| {ur:.2f} |")


if __name__ == "__main__":
    main()
