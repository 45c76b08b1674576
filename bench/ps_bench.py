"""Parameter server: pushes and pulls per second of aiobrpc.training.ps against the same server written
on torch.distributed.rpc (TensorPipe), the same model, in the same two processes, one run.

    python bench/ps_bench.py                # ~40 s; needs torch (the 'train' extra)
    python bench/ps_bench.py --seconds 0.5  # quicker, rougher
    python bench/ps_bench.py --tensorpipe tcp   # TensorPipe over TCP only, as between hosts
                                                # (its default shared-memory transport keeps a
                                                # polling thread busy in both processes for the
                                                # whole run: on 2 cores read this run for
                                                # aiobrpc against the raw transfer)
    python bench/ps_bench.py --rounds 3 --seconds 1   # every cell 3 times, taking turns: medians

Two processes on 127.0.0.1: this one is the worker; it spawns the server process, which joins
torch.distributed.rpc as "ps" (rank 0) and also serves aiobrpc.training.ps's ParameterServer. Both
servers hold the same keys and take the same SGD step (w -= lr * g) on each push; both pull
answers carry every key. The worker alternates: torch rpc_sync(push), rpc_sync(pull), then
aiobrpc.training.ps PsWorker.push, PsWorker.pull (async mode, uvloop), one call at a time (closed loop),
for each model:

  16 B     one key of 4 float32           (call rate)
  1 MiB    16 keys of 64 KiB              (many tensors in one call)
  16 MiB   one key of 4 Mi float32        (bandwidth)

Printed per model and operation: calls/s and MB/s (10^6 bytes of tensors one way) of each, and
the ratio aiobrpc.training.ps / torch rpc; then the raw transfer, messages of the model's size
per second one way between two processes, each answered by an empty one, through
bench/raw_ceiling.py with no protocol and no update (`raw_rate`), and our rate as a fraction of
it: a reference for small messages; large ones outrun it, so it is no bound there.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from statistics import median

import numpy as np

MODELS = {"16 B": (1, 4), "1 MiB": (16, 16384), "16 MiB": (1, 4 << 20)}  # keys, float32 each
LR = 1e-6

# -- the torch.distributed.rpc parameter server (runs in the server process) -----------------

_torch_params: dict = {}
_torch_lock = threading.Lock()


def torch_init(params: dict) -> None:
    with _torch_lock:
        _torch_params.clear()
        _torch_params.update(params)


def torch_push(grads: dict) -> None:
    with _torch_lock:  # rpc runs functions on a thread pool
        for k, g in grads.items():
            _torch_params[k].sub_(g, alpha=LR)


def torch_pull() -> dict:
    with _torch_lock:
        return {k: v.clone() for k, v in _torch_params.items()}


# -- processes --------------------------------------------------------------------------------

def rpc_options(master_port: int, tensorpipe: str):
    from torch.distributed import rpc
    extra = {}
    if tensorpipe == "tcp":
        # Between two local processes TensorPipe moves tensors through shared memory and
        # cross-memory attach (its "shm" transport, "cma" channel) where it can; this pins it to
        # its TCP transport and plain channel, what it uses between hosts.
        extra = {"_transports": ["uv"], "_channels": ["basic"]}
    return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{master_port}", rpc_timeout=60, **extra)


def server(master_port: int, tensorpipe: str) -> None:
    from torch.distributed import rpc

    import aiobrpc
    from aiobrpc.training.ps import SGD, ParameterServer

    rpc.init_rpc("ps", rank=0, world_size=2, rpc_backend_options=rpc_options(master_port, tensorpipe))

    async def serve():
        srv = aiobrpc.Server(aiobrpc.ServerOptions(max_body_size=1 << 30))
        srv.add_service(ParameterServer(1, mode="async", optimizer=SGD(lr=LR)))
        await srv.start("127.0.0.1:0")
        print(f"listening on {srv.address}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the worker closes it
        await srv.stop()
        await srv.join(5)

    asyncio.set_event_loop_policy(aiobrpc.event_loop_policy())
    asyncio.run(serve())
    rpc.shutdown()


async def raw_rate(nbytes: int, seconds: float) -> float:
    """Messages of `nbytes` per second one way over loopback TCP, each answered by an empty
    one: bench/raw_ceiling.py's client against its sink server (a future per message, 12-byte
    frames; no protocol, no tensors, no update), on the worker's loop. A reference for the
    transfer alone, not a bound: for large messages aiobrpc's transport outruns it (as in
    bench/echo.py at 16 MiB)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from raw_ceiling import RawClient
    server = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parent / "raw_ceiling.py"),
                               "--serve", "--sink"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline().split()[1])
        client = await RawClient.connect("127.0.0.1", port)
        data = np.ones(nbytes, np.uint8)
        try:
            return (await arate(lambda: client.call(data), seconds))[0]
        finally:
            client.close()
    finally:
        server.terminate()
        server.wait(30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rate(call, seconds: float) -> tuple[float, int]:
    for _ in range(3):
        call()  # warm up
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        call()
        n += 1
    return n / elapsed, n


async def arate(call, seconds: float) -> tuple[float, int]:
    for _ in range(3):
        await call()
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        await call()
        n += 1
    return n / elapsed, n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=2.0, help="measurement time of each cell")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every cell this many times, taking turns; print medians")
    p.add_argument("--tensorpipe", choices=("default", "tcp"), default="default",
                   help="TensorPipe's transports: its default (shared memory between local processes "
                        "where it can), or TCP only, as between hosts")
    p.add_argument("--role", choices=("worker", "server"), default="worker", help=argparse.SUPPRESS)
    p.add_argument("--master-port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    try:
        import torch
        from torch.distributed import rpc
    except ImportError:
        raise SystemExit("ps_bench needs torch (pip install -e '.[train]')") from None
    if args.role == "server":
        return server(args.master_port, args.tensorpipe)

    import aiobrpc
    from aiobrpc.training.ps import PsWorker

    master_port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--role", "server", "--master-port", str(master_port),
                             "--tensorpipe", args.tensorpipe],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rows = []
    try:
        rpc.init_rpc("worker", rank=1, world_size=2, rpc_backend_options=rpc_options(master_port, args.tensorpipe))
        m = re.fullmatch(r"listening on (\S+)\n", proc.stdout.readline())
        if not m:
            raise SystemExit("the server process did not start")
        address = m.group(1)

        async def ours(params, grads, seconds):
            async with PsWorker([address], 0, timeout_s=60, max_body_size=1 << 30) as w:
                await w.init(params)
                push = await arate(lambda: w.push(grads), seconds)
                pull = await arate(lambda: w.pull(), seconds)
            return push, pull

        asyncio.set_event_loop_policy(aiobrpc.event_loop_policy())
        for model, (nkeys, size) in MODELS.items():
            params = {f"layer{i}": torch.zeros(size) for i in range(nkeys)}
            grads = {k: torch.ones(size) for k in params}
            nbytes = nkeys * size * 4
            rpc.rpc_sync("ps", torch_init, args=(params,))
            # Keys of their own per model: a server keeps what it was given (first init wins).
            o_params = {f"{model}/{k}": v.numpy() for k, v in params.items()}
            o_grads = {f"{model}/{k}": v.numpy() for k, v in grads.items()}
            rounds = []  # (torch push, torch pull, our push, our pull, raw transfer), calls/s
            for _ in range(args.rounds):
                t_push = rate(lambda: rpc.rpc_sync("ps", torch_push, args=(grads,)), args.seconds)[0]
                t_pull = rate(lambda: rpc.rpc_sync("ps", torch_pull), args.seconds)[0]
                o_push, o_pull = asyncio.run(ours(o_params, o_grads, args.seconds))
                raw = asyncio.run(raw_rate(nbytes, args.seconds))
                rounds.append((t_push, t_pull, o_push[0], o_pull[0], raw))
            for op, t, o in (("push", 0, 2), ("pull", 1, 3)):
                # Rates are the median over rounds; ratios the median of each round's own ratio.
                tc, oc, raw = (median(r[i] for r in rounds) for i in (t, o, 4))
                rows.append((model, op, tc, tc * nbytes / 1e6, oc, oc * nbytes / 1e6,
                             median(r[o] / r[t] for r in rounds), raw, median(r[o] / r[4] for r in rounds)))
    finally:
        proc.stdin.close()
        if rpc.api._is_current_rpc_agent_set():
            rpc.shutdown()
        proc.wait(60)

    print(f"aiobrpc.training.ps vs torch.distributed.rpc (TensorPipe, {args.tensorpipe} transports), "
          f"{aiobrpc.implementation()} twins, "
          f"{args.seconds:g} s per cell, median of {args.rounds} round(s), cpus={os.cpu_count()}")
    print("| model | op | torch rpc calls/s | torch rpc MB/s | aiobrpc.training.ps calls/s | aiobrpc.training.ps MB/s | ratio "
          "| raw transfer calls/s | aiobrpc / raw |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for model, op, tc, tm, oc, om, ratio, raw, of_raw in rows:
        print(f"| {model} | {op} | {tc:,.0f} | {tm:,.1f} | {oc:,.0f} | {om:,.1f} | {ratio:.2f}x | {raw:,.0f} "
              f"| {of_raw:.2f} |")


if __name__ == "__main__":
    main()
