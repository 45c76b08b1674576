"""What TLS costs: the same calls over plaintext and over TLS, rounds interleaved in one run.

    python bench/tls.py [--rounds 3] [--seconds 2] [--concurrency 64] [--mib 4]

Server and client share one process and loop (uvloop), as in `python -m aiobrpc demo`; the
certificates are made by trustme (the test extra). Prints calls/s of 16-byte calls with
`--concurrency` in flight, MiB/s of `--mib` attachments echoed one at a time, and each TLS
figure as a ratio of the plaintext one measured in the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trustme  # noqa: E402
import uvloop  # noqa: E402

import aiobrpc  # noqa: E402
from aiobrpc._proto import echo_pb2  # noqa: E402

SERVICE = echo_pb2.DESCRIPTOR.services_by_name["EchoService"]


class Echo(aiobrpc.Servicer):
    SERVICE = SERVICE

    async def Echo(self, request, cntl):
        cntl.response_attachment = cntl.request_attachment
        return echo_pb2.EchoResponse(message=request.message)


async def one_round(files: dict, tls: bool, args) -> tuple[float, float]:
    server = aiobrpc.Server(aiobrpc.ServerOptions(ssl=aiobrpc.ServerTlsOptions(cert_file=files["server"])))
    server.add_service(Echo())
    await server.start("127.0.0.1:0")
    ssl = aiobrpc.ClientTlsOptions(ca_file=files["ca"]) if tls else None
    channel = aiobrpc.Channel(server.address, aiobrpc.ChannelOptions(ssl=ssl, timeout_ms=30000))
    stub = aiobrpc.Stub(channel, SERVICE)
    try:
        await stub.Echo(echo_pb2.EchoRequest(message="warm"))
        calls = 0
        end = time.perf_counter() + args.seconds

        async def caller():
            nonlocal calls
            while time.perf_counter() < end:
                await stub.Echo(echo_pb2.EchoRequest(message="0123456789abcdef"))
                calls += 1
        await asyncio.gather(*[caller() for _ in range(args.concurrency)])
        small = calls / args.seconds
        attachment = os.urandom(args.mib << 20)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            cntl = aiobrpc.Controller()
            cntl.request_attachment = attachment
            await stub.Echo(echo_pb2.EchoRequest(message="big"), cntl=cntl)
            n += 1
        large = n * args.mib * 2 / (time.perf_counter() - t0)  # both directions
        return small, large
    finally:
        await channel.close()
        await server.stop()
        await server.join(timeout=2)


async def main(args) -> None:
    ca = trustme.CA()
    with tempfile.TemporaryDirectory() as d:
        files = {"ca": f"{d}/ca.pem", "server": f"{d}/server.pem"}
        ca.cert_pem.write_to_path(files["ca"])
        ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(files["server"])
        small_ratios, large_ratios = [], []
        print(f"{'round':>5} {'plain calls/s':>14} {'tls calls/s':>12} {'ratio':>6} "
              f"{'plain MiB/s':>12} {'tls MiB/s':>10} {'ratio':>6}")
        for r in range(args.rounds):
            ps, pl = await one_round(files, False, args)
            ts, tl = await one_round(files, True, args)
            small_ratios.append(ts / ps)
            large_ratios.append(tl / pl)
            print(f"{r:>5} {ps:>14,.0f} {ts:>12,.0f} {ts / ps:>6.2f} {pl:>12,.0f} {tl:>10,.0f} {tl / pl:>6.2f}")
        print(f"median TLS/plaintext: 16 B calls {statistics.median(small_ratios):.2f}x, "
              f"{args.mib} MiB attachments {statistics.median(large_ratios):.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--mib", type=int, default=4)
    args = parser.parse_args()
    uvloop.run(main(args)) if hasattr(uvloop, "run") else asyncio.run(main(args))
