"""Under torchrun with init_process_group("aiobrpc"): FSDP2 (`fully_shard`) trains a small
seeded MLP over the aiobrpc group and over a gloo group in the same processes; the losses and
the parameters must agree. argv[1]: "fsdp", "pipeline" (a 2-stage ScheduleGPipe likewise),
"1f1b" (Schedule1F1B), "hsdp" (world 4: fully_shard on a (2, 2) replicate x shard mesh made
of aiobrpc groups, against the same mesh made of gloo groups) or "regroup" (the default group
destroyed and made again in the same processes, as torchrun's elastic restart does; then a rank
sends and destroys its group at once).
Prints "ok" per rank."""

import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.environ.get("AIOBRPC_REPO", "."))
import aiobrpc.training.torch_backend  # noqa: E402,F401

STEPS = 4


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


def batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(STEPS)]


def train_fsdp(group, rank, mesh=None):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    model = mlp()
    mesh = mesh if mesh is not None else DeviceMesh.from_group(group, "cpu")
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x, y in batches(rank):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.full_tensor().detach().clone() for p in model.parameters()]


def check_fsdp(rank, world, gloo):
    before = dist.group.WORLD.group.ops_finished
    ours = train_fsdp(dist.group.WORLD, rank)
    assert dist.group.WORLD.group.ops_finished > before + 2 * STEPS  # FSDP's traffic went over aiobrpc
    theirs = train_fsdp(gloo, rank)
    assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(ours[0], theirs[0])), (ours[0], theirs[0])
    for a, b in zip(ours[1], theirs[1]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), (a - b).abs().max()


def train_pipeline(group, rank, schedule_class="ScheduleGPipe"):
    from torch.distributed import pipelining
    model = mlp()
    part = model[:3] if rank == 0 else model[3:]
    stage = pipelining.PipelineStage(part, rank, 2, torch.device("cpu"), group=group)
    losses = []
    schedule = getattr(pipelining, schedule_class)(stage, n_microbatches=4,
                                                   loss_fn=lambda out, y: torch.nn.functional.mse_loss(out, y))
    opt = torch.optim.SGD(part.parameters(), lr=0.05)
    for x, y in batches(0):
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            step_losses = []
            schedule.step(target=y, losses=step_losses)
            losses.append(sum(l.item() for l in step_losses))
        opt.step()
    return losses, [p.detach().clone() for p in part.parameters()]


def check_pipeline(rank, world, gloo, schedule_class="ScheduleGPipe"):
    ours_group = dist.group.WORLD.group
    p2p = ours_group.messages or ours_group.p2p  # on lanes (the default) or on calls
    sent = sum(p2p._send_seq.values())
    ours = train_pipeline(dist.group.WORLD, rank, schedule_class)
    assert sum(p2p._send_seq.values()) >= sent + STEPS * 4  # activations or gradients
    assert rank == 0 or len(ours[0]) == STEPS and ours[0][0] > 0
    theirs = train_pipeline(gloo, rank, schedule_class)
    assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(ours[0], theirs[0])), (ours[0], theirs[0])
    for a, b in zip(ours[1], theirs[1]):
        assert torch.equal(a, b), (a - b).abs().max()


def check_1f1b(rank, world, gloo):
    check_pipeline(rank, world, gloo, "Schedule1F1B")


def mesh_2x2(backend):
    """A (2, 2) mesh, dims ("replicate", "shard"), whose groups have `backend`: rows {0, 1},
    {2, 3} shard, columns {0, 2}, {1, 3} replicate. Every rank makes every group, as torch wants."""
    from torch.distributed.device_mesh import DeviceMesh
    rank = dist.get_rank()
    layout = torch.arange(4).view(2, 2)
    mine = {}
    for dim, lines in (("replicate", layout.t().tolist()), ("shard", layout.tolist())):
        for ranks in lines:
            group = dist.new_group(ranks, backend=backend)
            if rank in ranks:
                mine[dim] = group
    return DeviceMesh.from_group([mine["replicate"], mine["shard"]], "cpu", mesh=layout,
                                 mesh_dim_names=("replicate", "shard"))


def check_hsdp(rank, world, gloo):
    """HSDP: parameters sharded along "shard", replicated (gradients all-reduced) along
    "replicate"; each rank trains on its own batches."""
    assert world == 4
    ours_mesh = mesh_2x2(None)  # the default backend: aiobrpc
    assert ours_mesh.get_group("shard").name() == "aiobrpc"
    groups = [ours_mesh.get_group(d) for d in ("replicate", "shard")]
    before = [g.group.ops_finished for g in groups]
    ours = train_fsdp(None, rank, ours_mesh)
    assert all(g.group.ops_finished > b + STEPS for g, b in zip(groups, before))  # both dims' traffic
    theirs = train_fsdp(None, rank, mesh_2x2("gloo"))
    assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(ours[0], theirs[0])), (ours[0], theirs[0])
    for a, b in zip(ours[1], theirs[1]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), (a - b).abs().max()


def check_regroup(rank, world, gloo):
    """destroy_process_group, then init_process_group again in the same processes: the new
    group rendezvous on a fresh store prefix and works; the old one is closed."""
    old = dist.group.WORLD
    dist.destroy_process_group()
    assert old.group._closed
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("aiobrpc", store=dist.PrefixStore("again", store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    assert dist.group.WORLD is not old
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world * (world + 1) / 2, t
    out = torch.zeros(1)
    if rank == 0:
        dist.send(torch.tensor([7.0]), 1)
    elif rank == 1:
        dist.recv(out, 0)
        assert out.item() == 7.0
    # A rank that sends and destroys its group at once, no barrier: its messages, written to its
    # kernel when its sends returned, still all reach a receiver that takes them later.
    if rank == 0:
        for i in range(N_LAST_SENDS):
            dist.send(torch.full((4096,), float(i)), 1)
        dist.destroy_process_group()
    elif rank == 1:
        got = torch.empty(4096)
        for i in range(N_LAST_SENDS):
            dist.recv(got, 0)
            assert got[0].item() == got[-1].item() == i, (i, got[0].item())
        dist.destroy_process_group()


N_LAST_SENDS = 3000


def main():
    dist.init_process_group("aiobrpc", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    {"fsdp": check_fsdp, "pipeline": check_pipeline, "1f1b": check_1f1b, "hsdp": check_hsdp,
     "regroup": check_regroup}[sys.argv[1]](rank, world, gloo)
    if dist.is_initialized():  # "regroup" ends with the group destroyed
        dist.barrier()
        dist.destroy_process_group()
    print("ok", flush=True)


if __name__ == "__main__":
    main()
