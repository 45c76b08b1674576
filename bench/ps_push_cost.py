"""CPU per call of aiobrpc.training.ps, in the worker and in the server, one key of a given size.

Run: python bench/ps_push_cost.py [--mib 16] [--keys 1] [--op push|pull] [--seconds 3]

A server process (async mode, SGD) and this worker process on 127.0.0.1 push (or pull) float32
keys (`--keys` of them, `--mib` in all), one call at a time, and each reports its CPU time (all threads, user and system)
per call. Where the two processes share 2 cores, the sum is what bounds the rate: a large push
costs the kernel's two socket copies (the worker's send, the server's receive) and the SGD
pass over the key, and no protocol can do with less over TCP.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import aiobrpc  # noqa: E402
from aiobrpc.training.ps import SGD, ParameterServer, PsWorker  # noqa: E402


async def serve() -> None:
    srv = aiobrpc.Server(aiobrpc.ServerOptions(max_body_size=1 << 30))
    srv.add_service(ParameterServer(1, mode="async", optimizer=SGD(lr=0.01)))
    await srv.start("127.0.0.1:0")
    print(srv.address, flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)  # the worker says when it starts timing
    t0 = os.times()
    await loop.run_in_executor(None, sys.stdin.readline)  # ... and when it stops
    t1 = os.times()
    print(f"{t1.user - t0.user} {t1.system - t0.system}", flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the worker has closed its channel
    await srv.stop()
    await srv.join(5)


async def work(address: str, server: subprocess.Popen, elems: int, keys: int, op: str, seconds: float) -> tuple:
    async with PsWorker([address], 0, timeout_s=60, max_body_size=1 << 30) as w:
        await w.init({f"w{i}": np.zeros(elems // keys, np.float32) for i in range(keys)})
        grads = {f"w{i}": np.ones(elems // keys, np.float32) for i in range(keys)}
        call = (lambda: w.push(grads)) if op == "push" else w.pull
        for _ in range(5):
            await call()
        server.stdin.write("\n")
        server.stdin.flush()
        n, c0, t0 = 0, os.times(), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            await call()
            n += 1
        elapsed, c1 = time.perf_counter() - t0, os.times()
        if op == "push":
            await w.pull()  # answered once the last SGD step is done: the server counts it
        server.stdin.write("\n")
        server.stdin.flush()
    return n, elapsed, c1.user - c0.user, c1.system - c0.system


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=16.0, help="size of the key in MiB")
    ap.add_argument("--keys", type=int, default=1, help="keys the size is split into")
    ap.add_argument("--op", choices=["push", "pull"], default="push")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--role", default="worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    asyncio.set_event_loop_policy(aiobrpc.event_loop_policy())
    if args.role == "server":
        asyncio.run(serve())
        return 0
    server = subprocess.Popen([sys.executable, __file__, "--role", "server"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().strip()
        if not address:
            raise SystemExit("the server process did not start")
        n, elapsed, user, system = asyncio.run(
            work(address, server, int(args.mib * (1 << 20)) // 4, args.keys, args.op, args.seconds))
        s_user, s_system = (float(x) for x in server.stdout.readline().split())
        server.stdin.close()
    finally:
        server.wait(10)
    ms = 1e3 / n
    print(f"{args.op} of {args.mib:g} MiB in {args.keys} key(s): {n / elapsed:,.0f} calls/s ({n} calls); CPU per call: "
          f"worker {user * ms:.2f} user + {system * ms:.2f} sys ms, server {s_user * ms:.2f} user + "
          f"{s_system * ms:.2f} sys ms; total {(user + system + s_user + s_system) * ms:.2f} ms "
          f"(at most {len(os.sched_getaffinity(0)) * 1e3 / ((user + system + s_user + s_system) * ms):,.0f} "
          f"calls/s on this machine's cores)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
