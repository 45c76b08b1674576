"""Under torchrun with init_process_group("aiobrpc"): FSDP2 (`fully_shard`) trains a small
seeded MLP over the aiobrpc group and over a gloo group in the same processes; the losses and
the parameters must agree. argv[1]: "fsdp" or "pipeline" (a 2-stage ScheduleGPipe likewise).
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


def train_fsdp(group, rank):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    model = mlp()
    mesh = DeviceMesh.from_group(group, "cpu")
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


def train_pipeline(group, rank):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    model = mlp()
    part = model[:3] if rank == 0 else model[3:]
    stage = PipelineStage(part, rank, 2, torch.device("cpu"), group=group)
    losses = []
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda out, y: torch.nn.functional.mse_loss(out, y))
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


def check_pipeline(rank, world, gloo):
    ours = train_pipeline(dist.group.WORLD, rank)
    assert sum(dist.group.WORLD.group.p2p._send_seq.values()) >= STEPS * 4  # activations or gradients sent
    assert rank == 0 or len(ours[0]) == STEPS and ours[0][0] > 0
    theirs = train_pipeline(gloo, rank)
    assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(ours[0], theirs[0])), (ours[0], theirs[0])
    for a, b in zip(ours[1], theirs[1]):
        assert torch.equal(a, b), (a - b).abs().max()


def main():
    dist.init_process_group("aiobrpc", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    {"fsdp": check_fsdp, "pipeline": check_pipeline}[sys.argv[1]](rank, world, gloo)
    dist.barrier()
    dist.destroy_process_group()
    print("ok", flush=True)


if __name__ == "__main__":
    main()
