"""Bus bandwidth of aiobrpc's ring all_reduce against torch.distributed's gloo, in one run.

Run: python bench/allreduce.py [--worlds 2 4] [--sizes 4K..64M] [--plot docs/img/allreduce_busbw.png]

For each world size, that many processes start on this machine (loopback); each runs both
gloo's allreduce and aiobrpc's (a `GroupThread` rendezvoused through the same torch TCPStore)
on float32 tensors of each size, alternating, and rank 0 reports the median time per call.
Bus bandwidth is NCCL-tests' convention: bytes / seconds * 2 (N - 1) / N. The CPU columns are
each process's CPU time (all its threads, user + system) per call, averaged over the ranks:
where the ranks outnumber the cores, CPU per call is what sets the rate. Needs torch (the
"train" extra); matplotlib (the "bench" extra) for --plot.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import multiprocessing as mp

SIZES = ["4K", "16K", "64K", "256K", "1M", "4M", "16M", "64M"]


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def calls_for(fn, budget_s: float) -> int:
    """How many calls of fn() fill budget_s, from a warm-up and two timed calls (3..200)."""
    fn()
    t0 = time.perf_counter()
    fn()
    fn()
    per_call = (time.perf_counter() - t0) / 2
    return max(3, min(200, int(budget_s / max(per_call, 1e-6))))


def worker(rank: int, world: int, port: int, sizes: list[int], budget_s: float, queue) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from aiobrpc.training import GroupThread

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=world)
    group = GroupThread(dist.PrefixStore("aiobrpc", store), rank, world, timeout=120,
                        **json.loads(os.environ.get("AIOBRPC_BENCH_OPTIONS", "{}")))
    rows = []
    try:
        for nbytes in sizes:
            t = torch.zeros(nbytes // 4)  # sums of zeros stay finite however often they repeat
            a = np.zeros(nbytes // 4, np.float32)

            def gloo():
                dist.all_reduce(t)

            def ours():
                group.all_reduce(a)

            results = {}
            cpu = {"gloo": torch.zeros(3, dtype=torch.float64), "aiobrpc": torch.zeros(3, dtype=torch.float64)}
            for name, fn in (("gloo", gloo), ("aiobrpc", ours), ("gloo", gloo), ("aiobrpc", ours)):
                dist.barrier()
                # the same number of calls on every rank: rank 0's estimate, broadcast
                n = torch.tensor([calls_for(fn, budget_s / 4)])
                dist.broadcast(n, 0)
                dist.barrier()
                times = [0.0] * int(n[0])
                c0 = os.times()
                for i in range(len(times)):
                    t0 = time.perf_counter()
                    fn()
                    times[i] = time.perf_counter() - t0
                c1 = os.times()
                cpu[name] += torch.tensor([c1.user - c0.user, c1.system - c0.system, len(times)], dtype=torch.float64)
                results.setdefault(name, []).extend(times)
            row = {"bytes": nbytes, "gloo_s": statistics.median(results["gloo"]),
                   "aiobrpc_s": statistics.median(results["aiobrpc"])}
            for name, c in cpu.items():  # CPU seconds per call, this process's threads, mean over ranks
                dist.all_reduce(c)
                row[f"{name}_user_s"] = float(c[0] / c[2])
                row[f"{name}_sys_s"] = float(c[1] / c[2])
            rows.append(row)
    finally:
        group.close()
        dist.destroy_process_group()
    if rank == 0:
        queue.put(rows)


def human(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", nargs="+", default=SIZES)
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of timing per size and backend")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes]
    ctx = mp.get_context("spawn")
    results = {}
    for world in args.worlds:
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, world, port, sizes, args.budget, queue)) for r in range(world)]
        for p in procs:
            p.start()
        rows = queue.get(timeout=1800)
        for p in procs:
            p.join()
        results[world] = rows
    print("| world | size | gloo busbw MB/s | aiobrpc busbw MB/s | aiobrpc / gloo | gloo ms | aiobrpc ms "
          "| gloo CPU ms user+sys | aiobrpc CPU ms user+sys |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for world, rows in results.items():
        factor = 2 * (world - 1) / world
        for row in rows:
            g = row["bytes"] / row["gloo_s"] * factor / 1e6
            o = row["bytes"] / row["aiobrpc_s"] * factor / 1e6
            print(f"| {world} | {human(row['bytes'])} | {g:,.0f} | {o:,.0f} | {o / g:.2f}x | "
                  f"{row['gloo_s'] * 1e3:.3f} | {row['aiobrpc_s'] * 1e3:.3f} | "
                  f"{row['gloo_user_s'] * 1e3:.2f}+{row['gloo_sys_s'] * 1e3:.2f} | "
                  f"{row['aiobrpc_user_s'] * 1e3:.2f}+{row['aiobrpc_sys_s'] * 1e3:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(k): v for k, v in results.items()}, f, indent=1)
    if args.plot:
        plot(results, args.plot)
    return 0


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for world, rows in results.items():
        factor = 2 * (world - 1) / world
        x = [r["bytes"] for r in rows]
        for name, style in (("gloo", "--"), ("aiobrpc", "-")):
            y = [r["bytes"] / r[f"{name}_s"] * factor / 1e6 for r in rows]
            ax.plot(x, y, style, marker="o", label=f"{name}, world {world}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tensor size (bytes)")
    ax.set_ylabel("bus bandwidth (MB/s)")
    ax.set_title("all_reduce on one machine (loopback), float32")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
