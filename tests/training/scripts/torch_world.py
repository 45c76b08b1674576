"""Under torchrun, with init_process_group("aiobrpc"): every op of the process group against
what it must give; DDP over "aiobrpc" against DDP over gloo (same model, data and steps); DDP
with the aiobrpc comm hook over a gloo group. Prints "ok" per rank."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.environ.get("AIOBRPC_REPO", "."))
from aiobrpc.training import GroupThread  # noqa: E402
from aiobrpc.training.torch_backend import AiobrpcWork, allreduce_hook  # noqa: E402

STEPS = 5


def check_ops(rank: int, world: int) -> None:
    t = torch.full((5,), float(rank + 1))
    work = dist.all_reduce(t, async_op=True)
    assert isinstance(work, AiobrpcWork)
    assert work.wait() and work.is_completed()
    assert t.tolist() == [world * (world + 1) / 2] * 5
    assert torch.equal(work.get_future().wait()[0], t)

    for dtype in (torch.bfloat16, torch.float16):
        h = torch.full((3, 3), 0.1 * (rank + 1), dtype=dtype)
        dist.all_reduce(h, op=dist.ReduceOp.AVG)
        want = torch.tensor(sum(0.1 * (r + 1) for r in range(world)) / world).to(dtype)
        assert torch.all(h == want), (dtype, h, want)
    m = torch.tensor([rank, -rank], dtype=torch.int64)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    assert m.tolist() == [world - 1, 0]

    nc = torch.arange(6.0).reshape(2, 3).t()  # not contiguous: a copy goes and comes back
    dist.broadcast(nc, src=1) if rank == 1 else dist.broadcast(torch.zeros(3, 2).t().contiguous().t(), src=1)
    b = torch.full((4,), float(rank))
    dist.broadcast(b, src=world - 1)
    assert b.tolist() == [float(world - 1)] * 4

    outs = [torch.empty(2, dtype=torch.int32) for _ in range(world)]
    dist.all_gather(outs, torch.tensor([rank, rank * 10], dtype=torch.int32))
    assert [o.tolist() for o in outs] == [[r, r * 10] for r in range(world)]
    flat = torch.empty(world * 2)
    dist.all_gather_single(flat, torch.tensor([rank, 0.5]))
    assert flat.tolist() == [v for r in range(world) for v in (r, 0.5)]

    out = torch.empty(2)
    dist.reduce_scatter(out, [torch.full((2,), float(r)) for r in range(world)])
    assert out.tolist() == [float(rank * world)] * 2
    dist.reduce_scatter_single(out, torch.arange(2.0 * world), op=dist.ReduceOp.MIN)
    assert out.tolist() == [2.0 * rank, 2.0 * rank + 1]
    dist.barrier()



def train(process_group, rank: int) -> dict:
    torch.manual_seed(1234 + rank)  # different initial weights per rank: DDP broadcasts rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    # a small bucket cap: several buckets, so several allreduce calls per step
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=process_group, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(99 + rank)
    for _ in range(STEPS):
        x = torch.randn(16, 20, generator=g)
        y = torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def check_ddp(rank: int, world: int, gloo) -> None:
    ours = train(None, rank)  # the default group: "aiobrpc"
    theirs = train(gloo, rank)
    for name, p in theirs.items():
        assert torch.allclose(ours[name], p, rtol=1e-5, atol=1e-6), (name, (ours[name] - p).abs().max())
    sums = [None] * world
    dist.all_gather_object(sums, [float(p.sum()) for p in ours.values()])
    assert all(s == sums[0] for s in sums), f"ranks disagree: {sums}"


def check_hook(rank: int, world: int, gloo) -> None:
    hook_group = GroupThread(dist.PrefixStore("hook", dist.distributed_c10d._get_default_store()), rank, world)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=gloo)
    ddp.register_comm_hook(hook_group, allreduce_hook)
    ddp(torch.full((3, 4), float(rank))).sum().backward()
    mean_x = sum(range(world)) / world
    assert torch.allclose(model.weight.grad, torch.full((2, 4), 3 * mean_x)), model.weight.grad
    hook_group.close()


def main() -> None:
    dist.init_process_group("aiobrpc")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == "aiobrpc"
    gloo = dist.new_group(backend="gloo")
    check_ops(rank, world)
    check_ddp(rank, world, gloo)
    check_hook(rank, world, gloo)
    dist.destroy_process_group()
    print("ok", flush=True)


if __name__ == "__main__":
    main()
