"""One rank of a test group. argv: scenario rank world store_dir; the twin and the loop come
from the environment (AIOBRPC_NO_EXTENSIONS, AIOBRPC_TEST_LOOP), as the parent test runs, and
so does the group's thread_bytes (AIOBRPC_TEST_THREAD_BYTES; 0 takes every segment on the
reduce thread).

check: every collective against numpy, over sizes that do not divide evenly; prints "ok".
loop: all_reduce until one fails; prints {"error": ..., "ranks": [...], "after_s": ...} (the
test kills or stops one rank meanwhile). p2p_loop: the same with send/recv around the ring and
all_to_all.
"""

import asyncio
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.environ.get("AIOBRPC_REPO", "."))
from aiobrpc.training import CollectiveError, FileStore, GroupThread, ReduceOp  # noqa: E402

SIZES = [0, 1, 7, 1001, 20_011]


def loop_factory():
    if os.environ.get("AIOBRPC_TEST_LOOP") == "asyncio":
        return asyncio.new_event_loop()
    import uvloop
    return uvloop.new_event_loop()


def inputs(world: int, numel: int, dtype: str) -> list[np.ndarray]:
    out = []
    for r in range(world):
        g = np.random.default_rng(1000 * r + numel)
        if dtype in ("float16", "float32", "float64"):
            out.append((g.standard_normal(numel) * 10).astype(dtype))
        else:
            out.append(g.integers(-100, 100, numel).astype(dtype))
    return out


def check(g: GroupThread) -> None:
    rank, world = g.rank, g.world_size
    for numel in SIZES:
        for dtype, op, reduce in [("float32", ReduceOp.SUM, np.sum), ("float64", ReduceOp.AVG, np.mean),
                                  ("int32", ReduceOp.MAX, np.max), ("int64", ReduceOp.MIN, np.min),
                                  ("float16", ReduceOp.SUM, None)]:
            xs = inputs(world, numel, dtype)
            mine = xs[rank].copy()
            g.all_reduce(mine, op)
            if reduce is None:  # float16: float32 accumulation, one rounding
                want = np.sum([x.astype(np.float64) for x in xs], axis=0).astype(np.float16)
                np.testing.assert_allclose(mine.astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=1e-2)
            else:
                want = reduce(np.stack(xs), axis=0) if numel else np.zeros(0)
                np.testing.assert_allclose(mine, want, rtol=1e-5, atol=1e-4)
            # identical on every rank
            every = g.all_gather(mine)
            assert all(every[r].tobytes() == mine.tobytes() for r in range(world)), (numel, dtype)
        xs = inputs(world, numel, "int64")
        part = g.reduce_scatter(xs[rank])
        total = np.sum(np.stack(xs), axis=0) if numel else np.zeros(0, np.int64)
        assert part.tolist() == np.array_split(total, world)[rank].tolist(), numel
        gathered = g.all_gather(xs[rank].astype(np.int16).reshape(-1, 1))
        assert gathered.shape == (world, numel, 1)
        assert gathered.reshape(world, -1).tolist() == [x.astype(np.int16).tolist() for x in xs]
        for root in range(world):
            b = xs[rank].astype(np.uint8)
            g.broadcast(b, root)
            assert b.tolist() == xs[root].astype(np.uint8).tolist()
        g.barrier()
    print("ok", flush=True)


def placed(g: GroupThread) -> None:
    """Segments over 64 KiB that are only copied into place (all-gather steps, broadcast) are
    received straight into the tensor: the results are the same, and it happened."""
    rank, world = g.rank, g.world_size
    big = [np.random.default_rng(r).standard_normal(300_001).astype(np.float32) for r in range(world)]
    mine = big[rank].copy()
    g.all_reduce(mine)
    np.testing.assert_allclose(mine, np.sum(np.stack(big), axis=0), rtol=1e-4, atol=1e-4)
    every = g.all_gather(big[rank])
    assert all(np.array_equal(every[r], big[r]) for r in range(world))
    b = big[rank].copy()
    g.broadcast(b, world - 1)
    assert np.array_equal(b, big[world - 1])
    assert g.group.segments_placed >= 1, g.group.segments_placed


def fail_loop(g: GroupThread) -> None:
    x = np.ones(50_000, np.float32)
    g.all_reduce(x)
    print("ready", flush=True)
    start = time.monotonic()
    try:
        while True:
            start = time.monotonic()
            g.all_reduce(x)
            x[:] = 1
    except CollectiveError as e:
        print(json.dumps({"error": str(e), "ranks": list(e.ranks), "after_s": time.monotonic() - start,
                          "type": type(e).__name__}), flush=True)
        try:
            g.barrier()
        except CollectiveError as again:
            assert str(again) == str(e), "a broken group raises its error again"


def fail_p2p_loop(g: GroupThread) -> None:
    """Send around the ring and all_to_all, until that fails (the test kills a rank)."""
    rank, world = g.rank, g.world_size
    right, left = (rank + 1) % world, (rank - 1) % world
    x, y = np.ones(100_000, np.float32), np.zeros(100_000, np.float32)
    ins = [np.full(20_000, rank, np.int64) for _ in range(world)]
    outs = [np.zeros(20_000, np.int64) for _ in range(world)]

    def once() -> None:
        got = g.submit(g.group.recv, y, left)
        g.submit(g.group.send, x, right).result()
        got.result()
        g.submit(g.group.all_to_all, outs, ins).result()
    once()
    print("ready", flush=True)
    start = time.monotonic()
    try:
        while True:
            start = time.monotonic()
            once()
    except CollectiveError as e:
        print(json.dumps({"error": str(e), "ranks": list(e.ranks), "after_s": time.monotonic() - start,
                          "type": type(e).__name__}), flush=True)


def main() -> None:
    scenario, rank, world, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    timeout = float(os.environ.get("AIOBRPC_TEST_TIMEOUT", "30"))
    thread_bytes = int(os.environ.get("AIOBRPC_TEST_THREAD_BYTES", 256 << 10))
    with GroupThread(FileStore(path, timeout=30), rank, world, timeout=timeout, segment_bytes=4096,
                     thread_bytes=thread_bytes, loop_factory=loop_factory) as g:
        {"check": check, "loop": fail_loop, "p2p_loop": fail_p2p_loop}[scenario](g)
    if scenario == "check":  # and with the default segments, large enough to be placed
        with GroupThread(FileStore(path, timeout=30), rank, world, timeout=timeout, prefix="big",
                         thread_bytes=thread_bytes, loop_factory=loop_factory) as g:
            placed(g)


if __name__ == "__main__":
    main()
