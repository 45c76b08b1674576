"""Under torchrun with init_process_group("aiobrpc"): point-to-point, the collectives beyond DDP
and sub-groups / a 2-D DeviceMesh, each against gloo run in the same processes (a second group,
backend "gloo"). argv[1]: a comma-separated list of parts to run (p2p, colls, mesh). Prints
"ok" per rank."""

import os
import sys
import datetime

import torch
import torch.distributed as dist

sys.path.insert(0, os.environ.get("AIOBRPC_REPO", "."))
import aiobrpc.training.torch_backend  # noqa: E402,F401

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64]
SIZES = [0, 1, 1000, 300_000]  # 300_000 float32: over the eager limit, sent announced and in place


def data(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_complex:
        return torch.randn(n, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 10).to(dtype)
    lo, hi = (0, 255) if dtype == torch.uint8 else (-100, 100)
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a.view(torch.uint8) if a.numel() and a.dtype != torch.bool else a,
                       b.view(torch.uint8) if b.numel() and b.dtype != torch.bool else b), what


def close(ours, theirs, what):
    """Float reductions: gloo's result up to the rounding of another summation order (values
    here are of magnitude <= 100; float32's epsilon is 1.2e-7)."""
    assert ours.dtype == theirs.dtype, what
    atol = {torch.float64: 1e-9, torch.float32: 1e-6 * 100, torch.bfloat16: 0.0}[ours.dtype]
    assert torch.allclose(ours.double(), theirs.double(), rtol=1e-6, atol=atol), (what, (ours - theirs).abs().max())


def both(gloo, fn):
    """fn(group) run on the default group (aiobrpc), then on gloo: the two results."""
    return fn(None), fn(gloo)


def check_p2p(rank, world, gloo):
    right, left = (rank + 1) % world, (rank - 1) % world
    for dtype in DTYPES:
        for n in SIZES[:3] if dtype != torch.float32 else SIZES:
            def ring(group):
                out = torch.full((n,), 0, dtype=dtype) if dtype != torch.bool else torch.zeros(n, dtype=torch.bool)
                mine = data(dtype, n, 100 * rank + n)
                if rank % 2 == 0:
                    dist.send(mine, right, group=group, tag=3)
                    dist.recv(out, left, group=group, tag=3)
                else:
                    dist.recv(out, left, group=group, tag=3)
                    dist.send(mine, right, group=group, tag=3)
                return out
            ours, theirs = both(gloo, ring)
            same(ours, theirs, ("send/recv", dtype, n))
            same(ours, data(dtype, n, 100 * left + n), ("send/recv value", dtype, n))

    # isend/irecv, several tags and messages in flight, in place into a posted recv
    for group in (None, gloo):
        outs = [torch.empty(50_000) for _ in range(3)]
        reqs = [dist.irecv(outs[k], left, group=group, tag=k) for k in (2, 1, 0)][::-1]
        sends = [dist.isend(torch.full((50_000,), float(10 * rank + k)), right, group=group, tag=k) for k in range(3)]
        for w in reqs + sends:
            w.wait()
        assert [o[0].item() for o in outs] == [float(10 * left + k) for k in range(3)], outs

    # two messages on one tag come in order, the first held before its recv is posted
    first, second = torch.empty(4, dtype=torch.int64), torch.empty(4, dtype=torch.int64)
    dist.send(torch.arange(4) + rank, right)
    dist.send(torch.arange(4) * 100 + rank, right)
    dist.recv(first, left)
    dist.recv(second, left)
    assert first.tolist() == (torch.arange(4) + left).tolist()
    assert second.tolist() == (torch.arange(4) * 100 + left).tolist()

    # recv from any source: rank 0 takes one message from every other rank
    for group in (None, gloo):
        if rank == 0:
            got = {}
            for _ in range(world - 1):
                t = torch.empty(2, dtype=torch.int32)
                src = dist.recv(t, group=group, tag=5)
                got[src] = t.tolist()
            assert got == {r: [r, -r] for r in range(1, world)}, got
        else:
            dist.send(torch.tensor([rank, -rank], dtype=torch.int32), 0, group=group, tag=5)

    # batch_isend_irecv around the ring
    def batch(group):
        out = torch.empty(3, 4)
        ops = [dist.P2POp(dist.isend, torch.arange(12.0).reshape(3, 4) + rank, right, group),
               dist.P2POp(dist.irecv, out, left, group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return out
    ours, theirs = both(gloo, batch)
    same(ours, theirs, "batch_isend_irecv")

    # non-contiguous tensors sent and received (gloo refuses them: checked against the values)
    def noncontig(group):
        src = (torch.arange(20.0).reshape(4, 5) + rank).t()
        out = torch.zeros(4, 5).t()
        if rank % 2 == 0:
            dist.send(src, right, group=group)
            dist.recv(out, left, group=group)
        else:
            dist.recv(out, left, group=group)
            dist.send(src, right, group=group)
        return out.contiguous()
    same(noncontig(None), (torch.arange(20.0).reshape(4, 5) + left).t().contiguous(), "non-contiguous")

    # a caller's mistakes raise at once, naming them
    for bad in (world, -1):
        try:
            dist.send(torch.zeros(1), bad)
        except (ValueError, RuntimeError) as e:
            assert "rank" in str(e).lower(), e
        else:
            raise AssertionError(f"send to {bad} did not raise")


def check_colls(rank, world, gloo):
    # reduce: every op gloo has, on its dtypes, to every root
    ops = [(dist.ReduceOp.SUM, [torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8]),
           (dist.ReduceOp.PRODUCT, [torch.float32, torch.int64]),
           (dist.ReduceOp.MIN, [torch.float32, torch.int32, torch.bfloat16]),
           (dist.ReduceOp.MAX, [torch.float64, torch.int8]),
           (dist.ReduceOp.BAND, [torch.int64, torch.uint8]),
           (dist.ReduceOp.BOR, [torch.int32]),
           (dist.ReduceOp.BXOR, [torch.int64])]
    for op, dtypes in ops:
        for dtype in dtypes:
            for root in range(world):
                def red(group):
                    t = data(dtype, 257, rank * 7 + root)
                    if op == dist.ReduceOp.PRODUCT and not dtype.is_floating_point:
                        t = t % 3 + 1
                    elif op == dist.ReduceOp.PRODUCT:
                        t = t / 10
                    dist.reduce(t, root, op=op, group=group)
                    return t
                ours, theirs = both(gloo, red)
                if rank == root:
                    if dtype.is_floating_point:
                        close(ours, theirs, (op, dtype, root))
                    else:
                        same(ours, theirs, ("reduce", op, dtype, root))
                # and all_reduce with the same op
                if root == 0:
                    def allred(group):
                        t = data(dtype, 101, rank + 1)
                        if op == dist.ReduceOp.PRODUCT:
                            t = t % 3 + 1 if not dtype.is_floating_point else t / 10
                        dist.all_reduce(t, op=op, group=group)
                        return t
                    ours, theirs = both(gloo, allred)
                    if dtype.is_floating_point:
                        close(ours, theirs, (op, dtype))
                    else:
                        same(ours, theirs, ("all_reduce", op, dtype))

    # gather and scatter, every root, a few dtypes
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        for root in range(world):
            def gat(group):
                outs = [torch.zeros(3, 5, dtype=dtype) for _ in range(world)] if rank == root else None
                dist.gather(data(dtype, 15, rank).reshape(3, 5), outs, dst=root, group=group)
                return torch.stack(outs) if outs else torch.zeros(0)
            ours, theirs = both(gloo, gat)
            same(ours, theirs, ("gather", dtype, root))

            def sca(group):
                out = torch.zeros(6, dtype=dtype)
                ins = [data(dtype, 6, 10 * r + root) for r in range(world)] if rank == root else None
                dist.scatter(out, ins, src=root, group=group)
                return out
            ours, theirs = both(gloo, sca)
            same(ours, theirs, ("scatter", dtype, root))

    # all_to_all (lists of different sizes) and all_to_all_single with uneven splits
    for dtype in (torch.float32, torch.int64, torch.complex64):
        def a2a(group):
            ins = [data(dtype, 5, 31 * rank + j) for j in range(world)]
            outs = [torch.zeros(5, dtype=dtype) for j in range(world)]
            dist.all_to_all(outs, ins, group=group)
            return torch.cat(outs)
        ours, theirs = both(gloo, a2a)
        same(ours, theirs, ("all_to_all", dtype))
        # tensors of different sizes per pair: gloo refuses them, checked against the values
        outs = [torch.zeros(j + 2 * rank + 1, dtype=dtype) for j in range(world)]
        dist.all_to_all(outs, [data(dtype, rank + 2 * j + 1, 31 * rank + j) for j in range(world)])
        for j in range(world):
            same(outs[j], data(dtype, j + 2 * rank + 1, 31 * j + rank), ("all_to_all uneven", dtype, j))

        def a2a_single(group):
            in_splits = [(rank + j) % 3 for j in range(world)]
            out_splits = [(j + rank) % 3 for j in range(world)]
            inp = data(dtype, sum(in_splits) * 4, rank).reshape(-1, 4)
            out = torch.zeros(sum(out_splits), 4, dtype=dtype)
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
            return out
        ours, theirs = both(gloo, a2a_single)
        same(ours, theirs, ("all_to_all_single", dtype))

    def a2a_even(group):
        out = torch.zeros(world * 300_000)
        dist.all_to_all_single(out, torch.arange(world * 300_000.0) + rank, group=group)
        return out
    ours, theirs = both(gloo, a2a_even)
    same(ours, theirs, "all_to_all_single even, large")

    # all_gather_into_tensor / reduce_scatter_tensor, as FSDP calls them, and coalesced
    def fsdp_like(group):
        shard = data(torch.float32, 1001, rank)
        full = torch.empty(world * 1001)
        dist.all_gather_into_tensor(full, shard, group=group)
        out = torch.empty(1001)
        dist.reduce_scatter_tensor(out, full * (rank + 1), group=group)
        outs = [torch.empty(world * 7), torch.empty(world * 3)]
        with dist._coalescing_manager(group=group, async_ops=True) as cm:
            dist.all_gather_into_tensor(outs[0], torch.full((7,), float(rank)), group=group)
            dist.all_gather_into_tensor(outs[1], torch.full((3,), float(-rank)), group=group)
        cm.wait()
        return torch.cat([full, out, *outs])
    ours, theirs = both(gloo, fsdp_like)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-5), (ours - theirs).abs().max()

    # object collectives
    for group in (None, gloo):
        objs = [None] * world
        dist.all_gather_object(objs, {"rank": rank, "x": [rank] * rank}, group=group)
        assert objs == [{"rank": r, "x": [r] * r} for r in range(world)], objs
        lst = [f"from {rank}", rank] if rank == 1 else [None, None]
        dist.broadcast_object_list(lst, src=1, group=group)
        assert lst == ["from 1", 1], lst
        got = [None] * world if rank == 0 else None
        dist.gather_object(("g", rank), got, dst=0, group=group)
        if rank == 0:
            assert got == [("g", r) for r in range(world)], got
        out = [None]
        dist.scatter_object_list(out, [{"s": r} for r in range(world)] if rank == world - 1 else None,
                                 src=world - 1, group=group)
        assert out == [{"s": rank}], out

    # caller's mistakes
    try:
        dist.all_to_all_single(torch.zeros(3), torch.zeros(3), [1] * world, [5] * world)
    except ValueError as e:
        assert "split" in str(e), e
    else:
        raise AssertionError("bad splits did not raise")
    try:
        dist.all_reduce(torch.zeros(2), op=dist.ReduceOp.BAND)
    except ValueError as e:
        assert "BAND" in str(e), e
    else:
        raise AssertionError("BAND on float did not raise")


def check_mesh(rank, world, gloo):
    from torch.distributed.device_mesh import init_device_mesh
    assert dist.group.WORLD.group_name
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
        assert dp.getBackendName() == "aiobrpc" and tp.getBackendName() == "aiobrpc"
        assert dp.size() == 2 and tp.size() == 2 and dp.group_name != tp.group_name
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=dp)
        assert t.item() == {0: 2.0, 2: 2.0, 1: 4.0, 3: 4.0}[rank], t  # dp groups: {0, 2}, {1, 3}
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=tp)
        assert t.item() == {0: 1.0, 1: 1.0, 2: 5.0, 3: 5.0}[rank], t  # tp groups: {0, 1}, {2, 3}
        peer = dist.get_global_rank(tp, 1 - tp.rank())
        out = torch.empty(2)
        reqs = [dist.isend(torch.tensor([rank, 7.0]), group_dst=1 - tp.rank(), group=tp),
                dist.irecv(out, group_src=1 - tp.rank(), group=tp)]
        for w in reqs:
            w.wait()
        assert out.tolist() == [float(peer), 7.0], out
    # a sub-group without this rank's neighbour, and one without some ranks at all
    sub = dist.new_group([0, world - 1])
    if rank in (0, world - 1):
        t = torch.tensor([rank + 1])
        dist.all_reduce(t, group=sub)
        assert t.item() == world + 1
        objs = [None, None]
        dist.all_gather_object(objs, rank, group=sub)
        assert objs == [0, world - 1]
    subgroups = dist.new_subgroups(group_size=2) if world % 2 == 0 else None
    if subgroups:
        mine, _ = subgroups
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mine)
        assert t.item() == float(rank // 2 * 4 + 1), t


def main():
    parts = sys.argv[1].split(",")
    dist.init_process_group("aiobrpc", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    if "p2p" in parts:
        check_p2p(rank, world, gloo)
    if "colls" in parts:
        check_colls(rank, world, gloo)
    if "mesh" in parts:
        check_mesh(rank, world, gloo)
    dist.barrier()
    dist.destroy_process_group()
    print("ok", flush=True)


if __name__ == "__main__":
    main()
