"""Pipeline parallelism over aiobrpc: a model cut into stages, one per process, trained with
torch.distributed.pipelining's schedules, activations and gradients sent between the stages by
aiobrpc's point-to-point messages.

    python examples/pipeline_parallel.py [--stages 2] [--schedule 1f1b|gpipe] [--steps 20]

Run plainly, this program launches itself under torchrun (`python -m torch.distributed.run
--standalone --nproc-per-node STAGES`). Each rank: `dist.init_process_group("aiobrpc")` (after
`import aiobrpc.training.torch_backend`), its slice of a 4-layer MLP as a `PipelineStage`, and
the schedule (Schedule1F1B or ScheduleGPipe, 4 micro-batches per step), plain SGD. The last
stage prints each step's loss.

At the end every rank trains the whole model in one process the same way (the same batches,
the gradient of each micro-batch's loss divided by their number, as the schedules do) and
checks that its stage ended with the same parameters, up to float rounding: the pipeline
computes what plain training does, only spread over processes.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
WIDTH, LAYERS, MICROBATCHES, BATCH, LR = 32, 4, 4, 16, 0.1
TOLERANCE = 1e-5  # float32 sums of the same terms in another order, over every step


def make_model():
    import torch

    torch.manual_seed(0)
    layers = []
    for i in range(LAYERS):
        layers.append(torch.nn.Linear(WIDTH, WIDTH if i < LAYERS - 1 else 4))
        if i < LAYERS - 1:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def stage_slice(rank: int, stages: int) -> slice:
    """The modules of stage `rank`: whole (Linear, Tanh) pairs, as evenly as they split."""
    pairs = [(2 * i, 2 * i + 2) for i in range(LAYERS)]
    per = [LAYERS // stages + (1 if s < LAYERS % stages else 0) for s in range(stages)]
    first = sum(per[:rank])
    return slice(pairs[first][0], pairs[first + per[rank] - 1][1])


def batch(step: int):
    import torch

    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, WIDTH, generator=g)
    return x, torch.sin(x[:, :4]) + 0.5 * x[:, 4:8]


def loss_fn(out, target):
    import torch

    return torch.nn.functional.mse_loss(out, target)


def reference(steps: int):
    """The whole model trained in one process, micro-batch by micro-batch."""
    import torch

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step)
        for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
            (loss_fn(model(xm), ym) / MICROBATCHES).backward()
        opt.step()
    return model


def rank_main(args) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    sys.path.insert(0, str(HERE.parent))
    import aiobrpc.training.torch_backend  # noqa: F401  (registers the "aiobrpc" backend)

    dist.init_process_group("aiobrpc", timeout=datetime.timedelta(seconds=60))
    rank, stages = dist.get_rank(), dist.get_world_size()
    part = make_model()[stage_slice(rank, stages)]
    stage = pipelining.PipelineStage(part, rank, stages, torch.device("cpu"))
    schedule_class = {"1f1b": pipelining.Schedule1F1B, "gpipe": pipelining.ScheduleGPipe}[args.schedule]
    schedule = schedule_class(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    opt = torch.optim.SGD(part.parameters(), lr=LR)
    last = rank == stages - 1
    for step in range(args.steps):
        opt.zero_grad()
        x, y = batch(step)
        if rank == 0:
            schedule.step(x, target=y if last else None)
        elif last:
            losses = []
            schedule.step(target=y, losses=losses)
            print(f"step {step:2d} loss {sum(l.item() for l in losses) / len(losses):.6f}", flush=True)
        else:
            schedule.step()
        opt.step()

    def largest_difference(other):
        return max((a - b).abs().max().item() for a, b in zip(part.parameters(), other.parameters()))

    mine = (largest_difference(reference(args.steps)[stage_slice(rank, stages)]),
            largest_difference(make_model()[stage_slice(rank, stages)]))
    verdicts = [None] * stages
    dist.all_gather_object(verdicts, mine)
    worst, moved = max(v[0] for v in verdicts), min(v[1] for v in verdicts)
    if rank == 0:
        print(f"{stages} stages, {args.schedule}: every stage moved (at least {moved:.1e} from its initial "
              f"weights); the largest difference from the model trained in one process is {worst:.1e}"
              + (" (within float rounding)" if worst <= TOLERANCE else ""))
    dist.destroy_process_group()
    if worst > TOLERANCE or moved == 0:
        raise SystemExit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=2, help=f"processes, one stage each (1..{LAYERS})")
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("torch is not installed: pip install torch (the 'train' extra pins it for Python 3.11)")
    if args.rank_main:
        rank_main(args)
        return
    if not 1 <= args.stages <= LAYERS:
        p.error(f"--stages must be in 1..{LAYERS}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.stages}",
           str(pathlib.Path(__file__).resolve()), "--rank-main", "--schedule", args.schedule,
           "--steps", str(args.steps)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    raise SystemExit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
