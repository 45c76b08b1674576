"""One parameter-server shard as a process: `python -m aiobrpc.training.ps --port 0 --workers 2 --mode sync`.

It prints `listening on HOST:PORT`, serves until SIGINT or SIGTERM, then prints `stopped`.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from ... import Server, ServerOptions, event_loop_policy
from . import MODES, SGD, Adam, ParameterServer, Sum


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m aiobrpc.training.ps", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    p.add_argument("--workers", type=int, required=True, help="number of workers (num_workers)")
    p.add_argument("--mode", choices=MODES, default="async")
    p.add_argument("--staleness", type=int, default=0, help="steps ahead a worker may run (mode bounded)")
    p.add_argument("--optimizer", choices=("sum", "sgd", "adam"), default="sgd")
    p.add_argument("--lr", type=float, default=None, help="learning rate (sgd: 0.01, adam: 0.001)")
    p.add_argument("--no-average", action="store_true", help="sync mode: apply the sum of a step's pushes")
    p.add_argument("--max-wait-s", type=float, default=30.0, help="the longest a pull waits for other workers")
    p.add_argument("--max-body-size", type=int, default=1 << 28, help="largest request accepted, bytes")
    return p.parse_args(argv)


def make_optimizer(name: str, lr: float | None):
    if name == "sum":
        return Sum()
    if name == "sgd":
        return SGD(lr if lr is not None else 0.01)
    return Adam(lr if lr is not None else 1e-3)


async def serve(ps: ParameterServer, args: argparse.Namespace) -> None:
    server = Server(ServerOptions(max_body_size=args.max_body_size))
    server.add_service(ps)
    await server.start(f"{args.host}:{args.port}")
    print(f"listening on {server.address}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    ps.stop()
    await server.stop()
    await server.join(5.0)
    print("stopped", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        ps = ParameterServer(args.workers, mode=args.mode, staleness=args.staleness,
                             optimizer=make_optimizer(args.optimizer, args.lr), average=not args.no_average,
                             max_wait_s=args.max_wait_s)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"python -m aiobrpc.training.ps: {e}") from None
    asyncio.set_event_loop_policy(event_loop_policy())
    asyncio.run(serve(ps, args))


if __name__ == "__main__":
    main()
