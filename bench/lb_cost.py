"""What each load balancer costs a call: a cluster channel over list:// of 3 servers with each
balancer against a one-server Channel("127.0.0.1:port"), and the bare select() of each.

Run: python bench/lb_cost.py [--calls 2000] [--rounds 5] [--selects 20000]

The 3 servers run in a child process, so the CPU time measured (time.process_time of this
process, user + system) is the client's alone. Calls go one at a time on uvloop, each variant's batch of
`--calls` in turn within every round (interleaved, so a drift of the machine spreads over all
of them); a variant's figures are its median and its minimum over the rounds (the minimum is
the least disturbed by other work on the machine), each compared with the one-server channel's. Every variant passes a Controller (one, reused), with a request_code
set per call for the consistent-hashing balancers. Then `select()` alone: 3 servers, all
available, nothing excluded; for la and p2c also select() followed by its feedback, the pair
every attempt costs them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import uvloop  # noqa: E402

import aiobrpc  # noqa: E402
from aiobrpc import _fast  # noqa: E402
from aiobrpc._proto import interop_pb2  # noqa: E402
from aiobrpc.client.lb import create_load_balancer  # noqa: E402
from aiobrpc.client.naming import ServerNode  # noqa: E402
from tests.helpers.interop_server import SERVICE, InteropEcho  # noqa: E402

BALANCERS = ("rr", "random", "wrr", "wr", "la", "p2c", "c_murmurhash", "c_md5", "c_ketama")
WEIGHTED = ("wrr", "wr")  # their servers carry a weight tag


async def serve() -> None:
    servers = []
    for _ in range(3):
        server = aiobrpc.Server()
        server.add_service(InteropEcho())
        await server.start("127.0.0.1:0")
        servers.append(server)
    print(" ".join(str(s.port) for s in servers), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the client is done
    for server in servers:
        await server.stop()
        await server.join(5)


def make_channel(variant: str, ports: list[int]) -> aiobrpc.Channel:
    if variant == "single":
        return aiobrpc.Channel(f"127.0.0.1:{ports[0]}")
    tag = " 1" if variant in WEIGHTED else ""
    return aiobrpc.Channel("list://" + ",".join(f"127.0.0.1:{p}{tag}" for p in ports),
                           load_balancer=variant)


async def run_calls(ports: list[int], calls: int, rounds: int) -> dict[str, list[float]]:
    variants = ("single",) + BALANCERS
    channels = {v: make_channel(v, ports) for v in variants}
    stubs = {v: aiobrpc.Stub(ch, SERVICE) for v, ch in channels.items()}
    request = interop_pb2.EchoRequest(message="x" * 16)
    cpu_us: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for variant in variants:  # connect and warm up
            cntl = aiobrpc.Controller()
            for i in range(200):
                cntl.request_code = i
                await stubs[variant].Echo(request, cntl)
        for _ in range(rounds):
            for variant in variants:
                stub = stubs[variant]
                cntl = aiobrpc.Controller()
                hashed = variant.startswith("c_")
                t0 = time.process_time()
                for i in range(calls):
                    if hashed:
                        cntl.request_code = i
                    await stub.Echo(request, cntl)
                cpu_us[variant].append((time.process_time() - t0) * 1e6 / calls)
    finally:
        for channel in channels.values():
            await channel.close()
    return cpu_us


def select_cost(name: str, selects: int) -> tuple[float, float | None]:
    """µs per select() and, for a balancer that learns, per select() + its feedback."""
    lb = create_load_balancer(name)
    tag = "1" if name in WEIGHTED else ""
    lb.set_servers([ServerNode("10.0.0.1", 8000 + i, tag) for i in range(3)])
    codes = [random.randrange(1 << 32) for _ in range(1024)]
    select = lb.select
    t0 = time.perf_counter()
    for i in range(selects):
        select(request_code=codes[i & 1023])
    alone = (time.perf_counter() - t0) * 1e6 / selects
    if not lb.wants_feedback:
        return alone, None
    feedback = lb.attempt_ended
    t0 = time.perf_counter()
    for i in range(selects):
        feedback(select(request_code=codes[i & 1023]), 0, 300 + (i & 63), 1000, 0, 0)
    return alone, (time.perf_counter() - t0) * 1e6 / selects


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls per variant per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--selects", type=int, default=20000, help="select() calls per balancer")
    ap.add_argument("--role", default="client", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "server":
        uvloop.run(serve())
        return 0
    server = subprocess.Popen([sys.executable, __file__, "--role", "server"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline().split()
        if len(line) != 3:
            raise SystemExit("the server process did not start")
        cpu_us = uvloop.run(run_calls([int(p) for p in line], args.calls, args.rounds))
    finally:
        server.stdin.close()
        server.wait(10)
    print(f"aiobrpc call path: {_fast.IMPLEMENTATION}; {args.rounds} rounds x {args.calls} calls per "
          f"variant, one at a time, uvloop; client CPU per call over the rounds")
    base = statistics.median(cpu_us["single"])
    base_min = min(cpu_us["single"])
    print(f"{'channel':<26}{'median us':>10}{'ratio':>7}{'+us':>7}{'min us':>9}{'ratio':>7}")
    for variant, samples in cpu_us.items():
        median, low = statistics.median(samples), min(samples)
        label = "Channel(host:port)" if variant == "single" else f"list:// x3, {variant}"
        print(f"{label:<26}{median:>10.1f}{median / base:>7.2f}{median - base:>7.1f}"
              f"{low:>9.1f}{low / base_min:>7.2f}")
    print(f"\nselect() alone, 3 servers, {args.selects} selections each")
    print(f"{'balancer':<14}{'us/select':>10}{'us/select+feedback':>20}")
    for name in BALANCERS:
        alone, with_feedback = select_cost(name, args.selects)
        pair = f"{with_feedback:.2f}" if with_feedback is not None else "-"
        print(f"{name:<14}{alone:>10.2f}{pair:>20}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
