"""Throughput of one stream, beside a raw socket copy and unary calls, in one run.

For 4 KiB, 1 MiB and 16 MiB messages, in one process on one event loop (client and server
share it, as do the baselines):

* raw: an asyncio socket pair, the writer sending the same buffers with backpressure (paused by
  the transport, resumed at its low-water mark) and the reader a BufferedProtocol that counts
  what the kernel put in its buffer: the ceiling for moving bytes on this loop;
* raw, windowed: the same socket pair with the stream's flow control and nothing else: the
  writer keeps at most `--max-buf-size` bytes unacknowledged and the reader sends back an
  8-byte count per message it received (what a FEEDBACK carries): the ceiling for any
  protocol with that window on this loop, without framing, meta or dispatch;
* stream: one aiobrpc stream (default window, `max_buf_size` 2 MiB), the reader a handler that
  counts each batch (so FEEDBACK flows as in real use);
* unary: Echo calls carrying the message as the request attachment, 4 in flight, with an
  empty response.

Each figure is MB/s (10^6 bytes) over `--seconds` after a short warm-up, the median of
`--rounds` rounds; ratios are against raw measured in the same round (the median of the rounds'
ratios, with their range: the machine's noise). `--clock cpu` divides by the process's CPU time instead of the wall
clock: everything runs on one thread, so that is the work done per byte, and it holds still on
a machine whose cores other processes share.

    python bench/stream_bench.py [--loop asyncio] [--seconds 1] [--rounds 5] [--max-buf-size N] [--clock cpu]
"""

from __future__ import annotations

import argparse
import asyncio
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


async def raw(size: int, seconds: float) -> float:
    loop = asyncio.get_running_loop()
    counter = [0]
    server = await loop.create_server(lambda: _Sink(counter), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport, proto = await loop.create_connection(_Source, "127.0.0.1", port)
    message = bytes(size)

    async def pump(until: float) -> None:
        while loop.time() < until:
            transport.write(message)
            if proto.paused:
                proto.resumed = loop.create_future()
                await proto.resumed
    rate = await _measure(pump, counter, seconds)
    transport.close()
    server.close()
    await server.wait_closed()
    return rate


class _AckingSink(asyncio.BufferedProtocol):
    """Counts what arrives and acknowledges each complete message with its byte count."""

    def __init__(self, counter: list, size: int) -> None:
        self.buf = memoryview(bytearray(1 << 20))
        self.counter = counter
        self.size = size
        self.got = 0
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint):
        return self.buf

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


async def raw_windowed(size: int, seconds: float, window: int) -> float:
    loop = asyncio.get_running_loop()
    counter = [0]
    server = await loop.create_server(lambda: _AckingSink(counter, size), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport, proto = await loop.create_connection(_WindowedSource, "127.0.0.1", port)
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
    rate = await _measure(pump, counter, seconds)
    transport.close()
    server.close()
    await server.wait_closed()
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


async def _with_server(counter: list, max_buf_size: int):
    server = aiobrpc.Server()
    server.add_service(_Servicer(counter, max_buf_size))
    await server.start("127.0.0.1:0")
    channel = aiobrpc.Channel(server.address, aiobrpc.ChannelOptions(timeout_ms=60000))
    return server, channel, aiobrpc.Stub(channel, SERVICE)


async def _stop(server, channel) -> None:
    await channel.close()
    await server.stop()
    await server.join(timeout=2)


async def stream(size: int, seconds: float, max_buf_size: int) -> float:
    counter = [0]
    server, channel, stub = await _with_server(counter, max_buf_size)
    cntl = aiobrpc.Controller()
    s = aiobrpc.Stream.create(cntl, max_buf_size=max_buf_size)
    await stub.StartStream(interop_pb2.EchoRequest(message=""), cntl)
    message = bytes(size)
    loop = asyncio.get_running_loop()

    async def pump(until: float) -> None:
        while loop.time() < until:
            await s.write(message)
    rate = await _measure(pump, counter, seconds)
    await s.close()
    await _stop(server, channel)
    return rate


async def unary(size: int, seconds: float, concurrency: int = 4) -> float:
    counter = [0]
    server, channel, stub = await _with_server(counter, 0)
    message = bytes(size)
    loop = asyncio.get_running_loop()
    req = interop_pb2.EchoRequest(message="")

    async def one(until: float) -> None:
        while loop.time() < until:
            await stub.Echo(req, aiobrpc.Controller(request_attachment=message))

    async def pump(until: float) -> None:
        await asyncio.gather(*[one(until) for _ in range(concurrency)])
    rate = await _measure(pump, counter, seconds)
    await _stop(server, channel)
    return rate


_clock = time.perf_counter


async def _measure(pump, counter: list, seconds: float) -> float:
    loop = asyncio.get_running_loop()
    await pump(loop.time() + min(0.3, seconds / 4))  # warm-up
    start_bytes, start = counter[0], _clock()
    await pump(loop.time() + seconds)
    return (counter[0] - start_bytes) / (_clock() - start) / 1e6


async def run(seconds: float, max_buf_size: int, rounds: int, sizes: list | None = None) -> list:
    """Per size, `rounds` rounds of raw, stream and unary one after the other: each figure is the
    median of its rounds, each ratio the median of the ratios of one round (a round's three
    figures share the machine's state of that moment)."""
    rows = []
    for name, size in sizes or SIZES:
        rates: list[tuple[float, float, float, float]] = []
        for _ in range(rounds):
            r = await raw(size, seconds)
            w = await raw_windowed(size, seconds, max_buf_size if max_buf_size > 0 else 1 << 62)
            s = await stream(size, seconds, max_buf_size)
            u = await unary(size, seconds)
            rates.append((r, w, s, u))
        rows.append((name, *(statistics.median(col) for col in zip(*rates)),
                     statistics.median(w / r for r, w, _, _ in rates),
                     statistics.median(s / r for r, _, s, _ in rates),
                     statistics.median(u / r for r, _, _, u in rates),
                     min(s / r for r, _, s, _ in rates), max(s / r for r, _, s, _ in rates)))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    p.add_argument("--seconds", type=float, default=1.0, help="length of one measurement")
    p.add_argument("--rounds", type=int, default=5, help="measurements of each kind per size")
    p.add_argument("--max-buf-size", type=int, default=2 * 1024 * 1024, help="the stream's window")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="divide by wall time or by this process's CPU time")
    p.add_argument("--sizes", nargs="+", choices=[name.replace(" ", "") for name, _ in SIZES],
                   help="only these message sizes (default all), e.g. --sizes 16MiB")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0:
        p.error("--rounds must be at least 1 and --seconds positive")
    global _clock
    _clock = time.process_time if args.clock == "cpu" else time.perf_counter
    sizes = [(n, b) for n, b in SIZES if args.sizes is None or n.replace(" ", "") in args.sizes]
    if args.loop == "uvloop":
        import uvloop
        rows = uvloop.run(run(args.seconds, args.max_buf_size, args.rounds, sizes))
    else:
        rows = asyncio.run(run(args.seconds, args.max_buf_size, args.rounds, sizes))
    print(f"loop={args.loop} implementation={aiobrpc.implementation()} seconds={args.seconds} "
          f"rounds={args.rounds} max_buf_size={args.max_buf_size} clock={args.clock}")
    print("| message | raw socket MB/s | raw, windowed MB/s | stream MB/s | unary (attachment) MB/s "
          "| windowed / raw | stream / raw | (min..max) | unary / raw |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r, w, s, u, wr, sr, ur, lo, hi in rows:
        print(f"| {name} | {r:.0f} | {w:.0f} | {s:.0f} | {u:.0f} | {wr:.2f} | {sr:.2f} | {lo:.2f}..{hi:.2f} "
              f"| {ur:.2f} |")


if __name__ == "__main__":
    main()
