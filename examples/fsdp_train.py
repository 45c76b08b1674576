"""FSDP2 over aiobrpc, and torchrun's elastic restart: a rank killed mid-training comes back and
training resumes from the last checkpoint, ending exactly where an uninterrupted run ends.

    python examples/fsdp_train.py [--nproc 2] [--steps 12] [--kill-at 6] [--no-compare]

Run plainly, this program launches itself under torchrun twice:

1. `python -m torch.distributed.run --standalone --nproc-per-node N --max-restarts 1 ...` with
   `--kill-at K`: in step K the last rank of the first attempt exits abruptly (`os._exit`, as a
   crashed or preempted worker does). Its peers' pending collective fails, naming it; torchrun
   stops the group and starts every rank again (restart 1). The new ranks make a new aiobrpc
   group, load the checkpoint of step K - 1 and train on from step K.
2. The same without the kill (skipped with --no-compare).

Each rank: `dist.init_process_group("aiobrpc")` (after `import aiobrpc.training.torch_backend`),
an MLP `fully_shard`-ed (FSDP2) over the group, SGD with momentum. After every step the sharded
model and the optimizer state are saved with `torch.distributed.checkpoint`, whose planning
(gathers and broadcasts of objects) runs over aiobrpc too. Each step's batch comes from the
step's number, so the two runs see the same data and must end with the same parameters, bit for
bit: the program checks it and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
IN, HIDDEN, OUT = 16, 64, 4
BATCH, LR, MOMENTUM = 32, 0.05, 0.9


# ---- a rank, under torchrun ----

def make_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))


def batch(rank: int, step: int):
    """This rank's batch of `step`: the same in every run and every attempt."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, IN, generator=g)
    return x, torch.sin(x[:, :OUT] * 2) + x[:, OUT:2 * OUT]


def latest_step(ckpt: pathlib.Path) -> int:
    """The last step whose checkpoint is complete (-1: none)."""
    try:
        return int((ckpt / "latest").read_text())
    except FileNotFoundError:
        return -1


def rank_main(args) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(HERE.parent))
    import aiobrpc.training.torch_backend  # noqa: F401  (registers the "aiobrpc" backend)

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("aiobrpc", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    ckpt = pathlib.Path(args.checkpoint_dir)
    start = latest_step(ckpt) + 1
    if start > 0:
        model_sd, opt_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": opt_sd}
        dcp.load(state, checkpoint_id=str(ckpt / f"step-{start - 1}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if rank == 0:
            print(f"attempt {attempt}: resumed from the checkpoint of step {start - 1}", flush=True)

    losses = {}
    for step in range(start, args.steps):
        if step == args.kill_at and attempt == 0 and rank == world - 1:
            print(f"attempt {attempt}: rank {rank} exits in step {step}", flush=True)
            os._exit(1)
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses[step] = mean.item() / world
        model_sd, opt_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=str(ckpt / f"step-{step}"))
        if rank == 0:
            (ckpt / "latest.tmp").write_text(str(step))
            (ckpt / "latest.tmp").replace(ckpt / "latest")  # only a complete checkpoint is named
            print(f"attempt {attempt}: step {step} loss {losses[step]:.6f}", flush=True)

    params = [p.full_tensor().detach().flatten() for p in model.parameters()]
    if rank == 0:
        flat = torch.cat(params)
        with open(args.out, "a") as f:
            f.write(json.dumps({"attempt": attempt, "losses": losses, "params": flat.tolist()}) + "\n")
    dist.destroy_process_group()


# ---- the launcher ----

def launch(args, workdir: pathlib.Path, name: str, kill_at: int) -> dict:
    ckpt, out = workdir / f"{name}-checkpoints", workdir / f"{name}.jsonl"
    ckpt.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "--max-restarts=1", "--monitor-interval=0.5", str(pathlib.Path(__file__).resolve()), "--rank-main",
           "--steps", str(args.steps), "--kill-at", str(kill_at), "--checkpoint-dir", str(ckpt), "--out", str(out)]
    print(f"== {name}: {args.nproc} ranks, {args.steps} steps" +
          (f", the last rank killed in step {kill_at}" if kill_at >= 0 else ""), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    done = subprocess.run(cmd, env=env)
    if done.returncode != 0:
        raise SystemExit(f"torchrun failed ({name}, exit {done.returncode})")
    finished = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(finished) == 1, finished
    return finished[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks (processes)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-at", type=int, default=6, help="the step in which the last rank dies (-1: none)")
    p.add_argument("--no-compare", action="store_true", help="skip the uninterrupted run")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint-dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("torch is not installed: pip install torch (the 'train' extra pins it for Python 3.11)")
    if args.rank_main:
        rank_main(args)
        return
    if not 0 <= args.kill_at < args.steps and args.kill_at != -1:
        p.error(f"--kill-at must be -1 or a step in 0..{args.steps - 1}")
    with tempfile.TemporaryDirectory(prefix="fsdp_train-") as tmp:
        workdir = pathlib.Path(tmp)
        restarted = launch(args, workdir, "restarted", args.kill_at)
        print(f"finished by attempt {restarted['attempt']}: final loss {restarted['losses'][str(args.steps - 1)]:.6f}")
        if args.no_compare:
            return
        straight = launch(args, workdir, "uninterrupted", -1)
        same = restarted["params"] == straight["params"]
        print(f"uninterrupted run: final loss {straight['losses'][str(args.steps - 1)]:.6f}")
        print("the restarted run ends with the same parameters as the uninterrupted one, bit for bit" if same
              else "the restarted run's parameters differ from the uninterrupted one's")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
