"""What the conveniences cost a call, against a plain Channel in the same run: client
interceptors (1 and 3 that do nothing but `await proceed`), the blocking facade
(`aiobrpc.sync.Channel`, a thread hop per call), a channel made per call (sharing the server's
connection), and `aiobrpc.testing.ChannelFor` (in memory, no socket; its server is in this
process, so its figure holds the server's work too).

Run: python bench/ergonomics_cost.py [--calls 2000] [--rounds 5]

The server runs in a child process, so the CPU time measured (time.process_time of this
process) is the client's alone, except for ChannelFor. Calls go one at a time on uvloop,
variants interleaved within each round; a variant's figure is its median over the rounds,
compared with the plain channel's (the sync facade is timed by wall clock per call from its
calling thread: its work is split over two threads of this process, which process_time counts
together).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import uvloop  # noqa: E402

import aiobrpc  # noqa: E402
import aiobrpc.sync  # noqa: E402
from aiobrpc import _fast  # noqa: E402
from aiobrpc._proto import interop_pb2  # noqa: E402
from aiobrpc.testing import ChannelFor  # noqa: E402
from tests.helpers.interop_server import SERVICE, InteropEcho  # noqa: E402

REQUEST = interop_pb2.EchoRequest(message="x" * 16)


async def nothing(request, cntl, proceed):
    return await proceed(request, cntl)


async def serve() -> None:
    server = aiobrpc.Server()
    server.add_service(InteropEcho())
    await server.start("127.0.0.1:0")
    print(server.port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the client is done
    await server.stop()
    await server.join(5)


async def timed(stub, calls: int) -> float:
    t0 = time.process_time()
    for _ in range(calls):
        await stub.Echo(REQUEST)
    return (time.process_time() - t0) * 1e6 / calls


async def per_call_channel(address: str, calls: int) -> float:
    t0 = time.process_time()
    for _ in range(calls):
        channel = aiobrpc.Channel(address)
        await aiobrpc.Stub(channel, SERVICE).Echo(REQUEST)
        await channel.close()
    return (time.process_time() - t0) * 1e6 / calls


async def run_async(port: int, calls: int, rounds: int) -> dict[str, list[float]]:
    address = f"127.0.0.1:{port}"
    channels = {
        "plain": aiobrpc.Channel(address, aiobrpc.ChannelOptions(connection_group="plain")),
        "1 interceptor": aiobrpc.Channel(address, aiobrpc.ChannelOptions(interceptors=[nothing],
                                                                         connection_group="one")),
        "3 interceptors": aiobrpc.Channel(address, aiobrpc.ChannelOptions(interceptors=[nothing] * 3,
                                                                          connection_group="three")),
    }
    stubs = {k: aiobrpc.Stub(ch, SERVICE) for k, ch in channels.items()}
    out: dict[str, list[float]] = {k: [] for k in (*channels, "a Channel per call", "ChannelFor (in memory)")}
    keep = aiobrpc.Channel(address)  # holds the shared connection the per-call channels use
    async with ChannelFor([InteropEcho()]) as memory:
        memory_stub = aiobrpc.Stub(memory, SERVICE)
        try:
            await aiobrpc.Stub(keep, SERVICE).Echo(REQUEST)
            for stub in (*stubs.values(), memory_stub):
                await timed(stub, 200)  # connect and warm up
            for _ in range(rounds):
                for name, stub in stubs.items():
                    out[name].append(await timed(stub, calls))
                out["a Channel per call"].append(await per_call_channel(address, calls))
                out["ChannelFor (in memory)"].append(await timed(memory_stub, calls))
        finally:
            for channel in (*channels.values(), keep):
                await channel.close()
    return out


def run_sync(port: int, calls: int, rounds: int) -> list[float]:
    with aiobrpc.sync.Channel(f"127.0.0.1:{port}") as channel:
        stub = aiobrpc.sync.Stub(channel, SERVICE)
        for _ in range(200):
            stub.Echo(REQUEST)
        samples = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                stub.Echo(REQUEST)
            samples.append((time.perf_counter() - t0) * 1e6 / calls)
    return samples


async def wall_plain(port: int, calls: int, rounds: int) -> list[float]:
    channel = aiobrpc.Channel(f"127.0.0.1:{port}", aiobrpc.ChannelOptions(connection_group="wall"))
    stub = aiobrpc.Stub(channel, SERVICE)
    try:
        for _ in range(200):
            await stub.Echo(REQUEST)
        samples = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                await stub.Echo(REQUEST)
            samples.append((time.perf_counter() - t0) * 1e6 / calls)
        return samples
    finally:
        await channel.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls per variant per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--role", default="client", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "server":
        uvloop.run(serve())
        return 0
    server = subprocess.Popen([sys.executable, __file__, "--role", "server"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        cpu = uvloop.run(run_async(port, args.calls, args.rounds))
        walls = uvloop.run(wall_plain(port, args.calls, args.rounds))
        sync_walls = run_sync(port, args.calls, args.rounds)
    finally:
        server.stdin.close()
        server.wait(10)
    print(f"aiobrpc call path: {_fast.IMPLEMENTATION}; {args.rounds} rounds x {args.calls} calls, one at a time, "
          "uvloop; medians over the rounds")
    base = statistics.median(cpu["plain"])
    print(f"{'client CPU per call':<28}{'us':>8}{'ratio':>8}{'+us':>8}")
    for name, samples in cpu.items():
        m = statistics.median(samples)
        print(f"{name:<28}{m:>8.1f}{m / base:>8.2f}{m - base:>+8.1f}")
    base_wall = statistics.median(walls)
    sync_wall = statistics.median(sync_walls)
    print(f"{'wall time per call':<28}{'us':>8}{'ratio':>8}{'+us':>8}")
    print(f"{'await on the loop':<28}{base_wall:>8.1f}{1:>8.2f}{0:>+8.1f}")
    print(f"{'aiobrpc.sync from a thread':<28}{sync_wall:>8.1f}{sync_wall / base_wall:>8.2f}"
          f"{sync_wall - base_wall:>+8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
