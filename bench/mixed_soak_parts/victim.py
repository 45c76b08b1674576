"""The client of the mixed soak that is SIGKILLed mid-call (so that the servers clean up after
it). It calls the cluster of `--naming` (a file:// list) with every kind of call until killed,
and prints "<started> <ended>" every 0.1 s. Its calls cannot be checked for completion: the
soak counts them apart.

    python bench/mixed_soak_parts/victim.py --naming /tmp/x/servers --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import aiobrpc  # noqa: E402
from bench.mixed_soak_parts.common import ECHO, GRPC, Msg, Req, run  # noqa: E402


async def calls(naming: str, concurrency: int, seed: int) -> None:
    rng = random.Random(seed)
    url = "file://" + naming
    ch = aiobrpc.Channel(url, aiobrpc.ChannelOptions(timeout_ms=500, max_retry=2), load_balancer="rr")
    gch = aiobrpc.Channel(url, aiobrpc.ChannelOptions(protocol="grpc", timeout_ms=1000, max_retry=2),
                          load_balancer="rr")
    echo, grpc = aiobrpc.Stub(ch, ECHO), aiobrpc.Stub(gch, GRPC)
    counts = [0, 0]

    async def one(i: int) -> None:
        kind = rng.randrange(5)
        if kind == 0:
            await echo.Echo(Req(message=str(i), sleep_ms=rng.choice((0, 0, 5, 50))))
        elif kind == 1:
            await grpc.Unary(Msg(text=str(i)))
        elif kind == 2:  # a long server stream, read slowly: often cut by the kill
            async with grpc.ServerStream(Msg(text=str(i), count=rng.randint(1, 200))) as s:
                async for _ in s:
                    await asyncio.sleep(0.001)
        elif kind == 3:
            cntl = aiobrpc.Controller()
            stream = aiobrpc.Stream.create(cntl, idle_timeout_ms=1000)
            await echo.StartStream(Req(message="echo"), cntl)
            for j in range(rng.randint(1, 20)):
                await stream.write(b"%d" % j)
                await stream.read()
            if rng.random() < 0.5:
                await stream.close()
            # else: left open, for the kill to cut
        else:
            async def reqs():
                for j in range(rng.randint(1, 20)):
                    yield Msg(text=str(i), count=j)
                    await asyncio.sleep(0.002)
            async with grpc.Bidi(reqs()) as s:
                async for _ in s:
                    pass

    async def lane() -> None:
        while True:
            counts[0] += 1
            try:
                await one(counts[0])
            except aiobrpc.RpcError:
                pass
            counts[1] += 1

    async def report() -> None:
        while True:
            print(f"{counts[0]} {counts[1]}", flush=True)
            await asyncio.sleep(0.1)

    await asyncio.gather(report(), *(lane() for _ in range(concurrency)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--naming", required=True)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    a = ap.parse_args()
    logging.basicConfig(level=logging.CRITICAL)
    run(lambda: calls(a.naming, a.concurrency, a.seed), a.loop)


if __name__ == "__main__":
    main()
