"""The work of one all_to_all of the training layer, without torch or a second CPU.

Four ranks of `aiobrpc.training.Group` in one process, on one event loop, exchange `--bytes`
per pair `--calls` times: on the group's lanes (the default: blocking threads, the data
received straight into the output), or with `--calls-path` through the group's calls
(announced, then placed straight into the output) as before lanes. Made for
callgrind, whose instruction counts hold on a busy machine where timings do not: the work of
one all_to_all of all four ranks is the difference of two runs divided by the difference of
their calls. The per-second sampling of each server's variables (builtin pages' plots) runs
by wall clock, which callgrind slows fifty-fold, so it is turned off here.

    PY=$(python -c 'import sys; print(sys.executable)')   # the real binary, not pyenv's shim
    for n in 20 60; do OPENBLAS_NUM_THREADS=1 PYTHONHASHSEED=0 valgrind --tool=callgrind \\
        --callgrind-out-file=/dev/null $PY bench/a2a_cost.py --calls $n 2>&1 | grep Collected; done
    # per all_to_all of 4 ranks: (I(60) - I(20)) / 40

Without valgrind it prints the user and system CPU per all_to_all (all four ranks).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from aiobrpc.training import FileStore, Group  # noqa: E402

WORLD = 4


async def run(calls: int, per_pair: int, lanes: bool = True) -> None:
    with tempfile.TemporaryDirectory() as store_dir:
        store = FileStore(store_dir)
        groups = list(await asyncio.gather(*(Group.create(store, r, WORLD, timeout=60, lanes=lanes) for r in range(WORLD))))
        for g in groups:
            g._server.series = None  # sampled by wall clock, not per call: see the docstring
        ins = [[np.full(per_pair, r, np.uint8) for _ in range(WORLD)] for r in range(WORLD)]
        outs = [[np.empty(per_pair, np.uint8) for _ in range(WORLD)] for _ in range(WORLD)]
        for _ in range(3):  # connections made, buffers grown
            await asyncio.gather(*(g.all_to_all(outs[r], ins[r]) for r, g in enumerate(groups)))
        c0, t0 = os.times(), time.perf_counter()
        for _ in range(calls):
            await asyncio.gather(*(g.all_to_all(outs[r], ins[r]) for r, g in enumerate(groups)))
        c1, t1 = os.times(), time.perf_counter()
        if not all((outs[r][s] == s).all() for r in range(WORLD) for s in range(WORLD)):
            raise SystemExit("all_to_all delivered wrong bytes")
        await asyncio.gather(*(g.close() for g in groups))
    if calls:
        print(f"{calls} all_to_all of {WORLD} ranks, {per_pair} bytes per pair: per call "
              f"user {(c1.user - c0.user) / calls * 1e3:.2f} ms, system "
              f"{(c1.system - c0.system) / calls * 1e3:.2f} ms, wall {(t1 - t0) / calls * 1e3:.2f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--bytes", type=int, default=4 << 20, help="bytes each rank sends each rank")
    ap.add_argument("--calls-path", action="store_true", help="all_to_all through calls, not lanes")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = ap.parse_args()
    if args.loop == "uvloop":
        import uvloop
        new_loop = uvloop.new_event_loop
    else:
        new_loop = asyncio.new_event_loop
    loop = new_loop()
    try:
        loop.run_until_complete(run(args.calls, args.bytes, not args.calls_path))
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
