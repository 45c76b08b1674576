"""Point-to-point and all-to-all of aiobrpc's torch backend against gloo, in the same processes.

Run: python bench/p2p.py [--rounds 3] [--budget 1.5]

World 2 (two processes on this machine, loopback), both backends through torch.distributed as
a user calls them: gloo is the default group, aiobrpc a second group (`new_group(backend=
"aiobrpc")`) over the same ranks; samples alternate between them in each round and the table
gives the median of the rounds' medians.
- latency: a 4 KiB ping-pong (rank 0 sends, rank 1 receives and sends it back); half the
  round trip.
- bandwidth: 16 MiB sent by rank 0 and received by rank 1, a 1-element reply closing each
  sample; bytes / time. Beside it a raw TCP transfer of the same bytes between the same
  processes (sendall / recv_into with MSG_WAITALL, no framework): what loopback allows here. The raw sends
  write 512 KiB at a time, as aiobrpc's lanes and gloo (2 MiB) do: on this kernel one 16 MiB
  sendall is 25-45 % slower (the socket stays locked through the copy, the peer's ACKs
  wait in its backlog).
- all_to_all_single of 16 MiB per rank at world 4 (each rank sends 4 MiB to each rank):
  algorithm bandwidth, bytes per rank / time. Beside it the same exchange over raw TCP
  between the same processes (one socket per pair, the staggered order aiobrpc uses, each
  step's sends in a thread while recv_into fills the output, the rank's own part copied with
  numpy): what any Python all_to_all over loopback sockets costs, with no framework.
Needs torch (the "train" extra).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn, budget_s: float, sync) -> list[float]:
    """Times of fn() for budget_s (at least 3 calls); every rank makes the same number of calls."""
    import torch
    import torch.distributed as dist
    fn()
    t0 = time.perf_counter()
    fn()
    per_call = time.perf_counter() - t0
    n = torch.tensor([max(3, min(2000, int(budget_s / max(per_call, 1e-6))))])
    dist.broadcast(n, 0)
    sync()
    times = []
    c0 = os.times()
    for _ in range(int(n[0])):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    c1 = os.times()
    timed.cpu = ((c1.user - c0.user) / len(times), (c1.system - c0.system) / len(times))
    return times


def raw_pair(rank: int, port: int) -> socket.socket:
    if rank == 0:
        with socket.create_server(("127.0.0.1", port)) as srv:
            sock, _ = srv.accept()
    else:
        for _ in range(200):
            try:
                sock = socket.create_connection(("127.0.0.1", port))
                break
            except ConnectionRefusedError:
                time.sleep(0.05)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)  # one wakeup, as the lanes' readers
        if not n:
            raise ConnectionError("peer closed")
        got += n


def raw_mesh(rank: int, world: int, store) -> list:
    """One connected TCP socket to each other rank (None for this rank), ports via the store."""
    srv = socket.create_server(("127.0.0.1", 0))
    store.set(f"raw_a2a_{rank}", str(srv.getsockname()[1]))
    socks: list = [None] * world
    for peer in range(rank):  # connect to the lower ranks, accept the higher ones
        s = socket.create_connection(("127.0.0.1", int(store.get(f"raw_a2a_{peer}"))))
        s.sendall(rank.to_bytes(4, "big"))
        socks[peer] = s
    for _ in range(rank + 1, world):
        s, _ = srv.accept()
        hello = bytearray(4)
        recv_into(s, memoryview(hello))
        socks[int.from_bytes(hello, "big")] = s
    srv.close()
    for s in socks:
        if s is not None:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return socks


PIECE = 512 << 10


def send_pieces(sock: socket.socket, view) -> None:
    view = memoryview(view).cast("B")
    for at in range(0, len(view), PIECE):
        sock.sendall(view[at:at + PIECE])


def raw_all_to_all(rank: int, world: int, socks: list, sender, out, inp) -> None:
    """out[r] = rank r's inp[rank]: numpy byte views, the staggered order of exchange.py."""
    for k in range(1, world):
        dst, src = (rank + k) % world, (rank - k) % world
        sent = sender.submit(send_pieces, socks[dst], inp[dst])
        recv_into(socks[src], memoryview(out[src]))
        sent.result()
    out[rank][:] = inp[rank]


def worker(rank: int, world: int, port: int, raw_port: int, args, queue) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    import aiobrpc.training.torch_backend  # noqa: F401  (registers the "aiobrpc" backend)

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    ours = dist.new_group(backend="aiobrpc")
    groups = {"gloo": None, "aiobrpc": ours}
    samples: dict[str, list[float]] = {}

    def record(name: str, times: list[float]) -> None:
        samples.setdefault(name, []).append(statistics.median(times))
        samples.setdefault(name + "_cpu", []).append(timed.cpu)

    if world == 2:
        small = torch.arange(1024, dtype=torch.float32)  # 4 KiB
        big = torch.ones(args.big // 4)
        ack = torch.zeros(1)
        sock = raw_pair(rank, raw_port)
        raw_buf = bytearray(args.big)
        raw_view = memoryview(raw_buf)

        def pingpong(group):
            def fn():
                if rank == 0:
                    dist.send(small, 1, group=group)
                    dist.recv(small, 1, group=group)
                else:
                    dist.recv(small, 0, group=group)
                    dist.send(small, 0, group=group)
            return fn

        def one_way(group):
            def fn():
                if rank == 0:
                    dist.send(big, 1, group=group)
                    dist.recv(ack, 1, group=group)
                else:
                    dist.recv(big, 0, group=group)
                    dist.send(ack, 0, group=group)
            return fn

        def raw():
            if rank == 0:
                send_pieces(sock, raw_view)
                recv_into(sock, raw_view[:1])
            else:
                recv_into(sock, raw_view)
                sock.sendall(raw_view[:1])

        for _ in range(args.rounds):
            for name in ("gloo", "aiobrpc"):
                record(f"lat_{name}", [t / 2 for t in timed(pingpong(groups[name]), args.budget, dist.barrier)])
            for name in ("gloo", "aiobrpc", "raw"):
                fn = raw if name == "raw" else one_way(groups[name])
                record(f"bw_{name}", timed(fn, args.budget, dist.barrier))
        sock.close()
    else:
        import concurrent.futures
        per_rank = args.big
        send = torch.ones(per_rank // 4)
        recv = torch.empty(per_rank // 4)
        socks = raw_mesh(rank, world, store)
        sender = concurrent.futures.ThreadPoolExecutor(1)
        part = per_rank // world
        raw_in = [send.numpy().view("uint8")[r * part:(r + 1) * part] for r in range(world)]
        raw_out = [recv.numpy().view("uint8")[r * part:(r + 1) * part] for r in range(world)]
        fns = {"raw": lambda: raw_all_to_all(rank, world, socks, sender, raw_out, raw_in)}
        for name in ("gloo", "aiobrpc"):
            fns[name] = lambda g=groups[name]: dist.all_to_all_single(recv, send, group=g)
        for _ in range(args.rounds):
            for name in ("gloo", "aiobrpc", "raw"):
                record(f"a2a_{name}", timed(fns[name], args.budget, dist.barrier))
        sender.shutdown()
        for s in socks:
            if s is not None:
                s.close()
    dist.destroy_process_group(ours)
    dist.destroy_process_group()
    if rank == 0:
        queue.put(samples)


def run_world(world: int, args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port, raw_port = free_port(), free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, raw_port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    samples = queue.get(timeout=1800)
    for p in procs:
        p.join()
    return samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=1.5, help="seconds of timing per sample")
    ap.add_argument("--big", type=int, default=16 << 20, help="bytes of the bandwidth and all_to_all messages")
    ap.add_argument("--skip-world4", action="store_true")
    args = ap.parse_args()
    two = run_world(2, args)
    four = {} if args.skip_world4 else run_world(4, args)
    both = {**two, **four}
    med = {k: statistics.median(v) for k, v in both.items() if not k.endswith("_cpu")}
    cpu = {k[:-4]: tuple(statistics.median(c[i] for c in v) for i in (0, 1)) for k, v in both.items()
           if k.endswith("_cpu")}
    mb = args.big / 1e6
    print(f"| measurement (median of {args.rounds} rounds) | gloo | aiobrpc | aiobrpc / gloo | raw socket |")
    print("|---|---:|---:|---:|---:|")
    print(f"| 4 KiB send/recv latency, world 2 (us, lower is better) | {med['lat_gloo'] * 1e6:,.0f} | "
          f"{med['lat_aiobrpc'] * 1e6:,.0f} | {med['lat_gloo'] / med['lat_aiobrpc']:.2f}x | |")
    print(f"| {args.big >> 20} MiB send/recv bandwidth, world 2 (MB/s) | {mb / med['bw_gloo']:,.0f} | "
          f"{mb / med['bw_aiobrpc']:,.0f} | {med['bw_gloo'] / med['bw_aiobrpc']:.2f}x | {mb / med['bw_raw']:,.0f} |")
    if four:
        print(f"| all_to_all_single {args.big >> 20} MiB per rank, world 4 (MB/s) | {mb / med['a2a_gloo']:,.0f} | "
              f"{mb / med['a2a_aiobrpc']:,.0f} | {med['a2a_gloo'] / med['a2a_aiobrpc']:.2f}x | {mb / med['a2a_raw']:,.0f} |")
    print("(aiobrpc / gloo: speed ratio, >= 1.00x means aiobrpc is as fast or faster)")
    print()
    print("CPU per call of rank 0's process (all its threads), user + system, microseconds:")
    for k, (user, system) in sorted(cpu.items()):
        print(f"  {k:12s} {user * 1e6:9,.0f} + {system * 1e6:9,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
