"""One small model trained by N processes three ways: DDP over gloo, DDP over aiobrpc, and a
parameter server; the loss curves plotted side by side.

    python examples/train_three_ways.py [--world 4] [--steps 150] [--plot PATH] [--quick]

The model is an MLP (16 -> 64 -> 4) learning the classes a fixed random "teacher" network gives
to synthetic points. Every way starts from the same weights (seed 0) and takes, at each step,
the same global batch split over the ranks, with plain SGD at the same learning rate:

1. `dist.init_process_group("gloo")`, then DistributedDataParallel;
2. `import aiobrpc.training.torch_backend`, then `dist.init_process_group("aiobrpc")` and the
   same DistributedDataParallel: only the backend's name changes;
3. `SyncPsWorker`: pull the weights into the model, push its gradients; the server (one
   `python -m aiobrpc.training.ps` process per shard, sync mode) averages them and takes the
   SGD step.

So the three are the same arithmetic: DDP over gloo and over aiobrpc must reach the same
parameters (the sums are rounded in a different order, nothing more), and so does the
parameter server. The ranks are processes forked by torch.multiprocessing (after torch is
imported once, here), meeting through a `torch.distributed.FileStore` in a temporary
directory; everything listens on 127.0.0.1, on ports the system picks. This program prints, for
each way, the final loss (the mean over the ranks of the last step's loss, i.e. the loss of the
global batch) and the wall time of the training loop (the slowest rank), checks that DDP over
aiobrpc ended where DDP over gloo did, and plots the curves with matplotlib into `--plot`.
`--quick`: 2 processes, 20 steps, 1 shard.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

WAYS = ("ddp/gloo", "ddp/aiobrpc", "ps")
IN, HIDDEN, CLASSES = 16, 64, 4
SAMPLES, BATCH, LR = 4096, 32, 0.2  # BATCH: per rank and step
SAME_PARAMS_ATOL = 1e-4  # gloo against aiobrpc: float32 sums in another order, over all the steps


# ---- a rank: trains the three ways in turn ----

def dataset():
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, IN, generator=g)
    teacher = (torch.randn(IN, 32, generator=g), torch.randn(32, CLASSES, generator=g))
    y = (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(1)
    return x, y


def make_model():
    import torch

    torch.manual_seed(0)  # the same initial weights on every rank, for every way
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))


def batch(data, rank: int, world: int, step: int):
    """This rank's share of the step's global batch: the same for every way."""
    import torch

    x, y = data
    idx = torch.randint(0, SAMPLES, (world * BATCH,), generator=torch.Generator().manual_seed(step))
    mine = idx[rank * BATCH:(rank + 1) * BATCH]
    return x[mine], y[mine]


def train_ddp(backend: str, store_path: str, data, rank: int, world: int, steps: int):
    """Losses, times, and the DistributedDataParallel (the caller keeps it: see rank_main)."""
    import torch
    import torch.distributed as dist

    store = dist.FileStore(store_path, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    try:
        dist.barrier()  # the clock starts when every rank is here
        start = time.perf_counter()
        model = make_model()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        losses, times = [], []
        for step in range(steps):
            x, y = batch(data, rank, world, step)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()  # DDP averages the gradients over the ranks here
            opt.step()
            losses.append(loss.item())
            times.append(time.perf_counter() - start)
    finally:
        dist.destroy_process_group()
    return losses, times, ddp


def train_ps(servers: list[str], data, rank: int, world: int, steps: int):
    import torch

    from aiobrpc.training.ps import SyncPsWorker

    model = make_model()
    params = dict(model.named_parameters())
    with SyncPsWorker(servers, rank, timeout_s=60) as ps:
        ps.init({n: p.detach() for n, p in params.items()})  # the first worker's values win
        start = time.perf_counter()
        losses, times = [], []
        for step in range(steps):
            # The weights of this step (every worker's pushes of the steps before it), copied into
            # the parameters' own memory; the server took the SGD step.
            ps.pull(out={n: p.data for n, p in params.items()})
            x, y = batch(data, rank, world, step)
            model.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            ps.push({n: p.grad for n, p in params.items()})
            losses.append(loss.item())
            times.append(time.perf_counter() - start)
        ps.pull(out={n: p.data for n, p in params.items()})  # the weights after the last step
    return losses, times, model


def max_difference(a, b) -> float:
    """The largest difference between the parameters of two models."""
    import torch

    with torch.no_grad():
        return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def rank_main(rank: int, world: int, steps: int, workdir: str, servers: list[str]) -> None:
    """One process of the training: the three ways in turn; its losses and times go to a JSON file."""
    # Loopback only: gloo binds the interface named here, aiobrpc's backend the address here.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    os.environ.setdefault("AIOBRPC_HOST", "127.0.0.1")
    import torch
    import torch._dynamo  # noqa: F401  the first DistributedDataParallel imports it (seconds): not on its clock

    import aiobrpc.training.torch_backend  # noqa: F401  registers the backend "aiobrpc"

    torch.set_num_threads(1)  # N processes share the cores
    data = dataset()
    warm = make_model()  # torch's first forward and backward are slow: on no way's clock
    torch.nn.functional.cross_entropy(warm(data[0][:BATCH]), data[1][:BATCH]).backward()
    # The DDP models stay referenced until the process ends: freeing gloo's right after its last
    # allreduce can deadlock in torch 2.13 (~ProcessGroupGloo, called with the GIL held, waits for
    # its worker thread, which waits for the GIL to free that allreduce's work).
    out, models = {}, {}
    for way in WAYS[:2]:
        backend = way.split("/")[1]
        losses, times, models[way] = train_ddp(backend, os.path.join(workdir, backend), data, rank, world, steps)
        out[way] = {"losses": losses, "times": times}
    losses, times, models["ps"] = train_ps(servers, data, rank, world, steps)
    out["ps"] = {"losses": losses, "times": times}
    out["max_difference"] = {way: max_difference(models[way], models["ddp/gloo"]) for way in WAYS[1:]}
    with open(os.path.join(workdir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


# ---- the launcher: shards, ranks, table, plot ----

def start_shard(workers: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "aiobrpc.training.ps", "--host", "127.0.0.1", "--port", "0",
                             "--workers", str(workers), "--mode", "sync", "--optimizer", "sgd", "--lr", str(LR)],
                            stdout=subprocess.PIPE, text=True)


def address_of(shard: subprocess.Popen) -> str:
    line = shard.stdout.readline()
    m = re.fullmatch(r"listening on (\S+)\n", line)
    if not m:
        raise SystemExit(f"the parameter server did not start: {line!r}")
    return m.group(1)


def train(args, workdir: str) -> list[dict]:
    """Start the shards and the ranks; each rank's results."""
    shards = [start_shard(args.world) for _ in range(args.shards)]
    try:
        # Imported once here, then forked into every rank: torch and torch._dynamo take seconds
        # of CPU each, which every rank would spend again.
        import torch._dynamo  # noqa: F401
        import torch.multiprocessing as mp

        import aiobrpc.training.torch_backend  # noqa: F401  registers the backend "aiobrpc"

        servers = [address_of(shard) for shard in shards]
        method = "fork" if sys.platform == "linux" else "spawn"  # spawn: each rank imports torch
        ranks = mp.start_processes(rank_main, (args.world, args.steps, workdir, servers), nprocs=args.world,
                                   join=False, start_method=method)
        deadline = time.monotonic() + 300
        while not ranks.join(timeout=1):  # raises the error of a rank that failed, ending the others
            if time.monotonic() > deadline:
                for p in ranks.processes:
                    p.kill()
                raise SystemExit("the ranks did not finish in 300 s")
    finally:
        for shard in shards:
            shard.terminate()
            shard.communicate(timeout=10)
    results = []
    for r in range(args.world):
        with open(os.path.join(workdir, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results


def curves(results: list[dict]) -> dict:
    """Per way: each rank's losses, their mean (the loss of the global batch) and, per step, the
    time the slowest rank had finished it."""
    out = {}
    for way in WAYS:
        ranks = [r[way]["losses"] for r in results]
        out[way] = {"ranks": ranks, "mean": [sum(v) / len(v) for v in zip(*ranks)],
                    "times": [max(t) for t in zip(*(r[way]["times"] for r in results))]}
    return out


def plot(path: str, curves: dict, world: int) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: a file
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8), sharey=True, layout="constrained")
    for ax, way in zip(axes, WAYS):
        for r, losses in enumerate(curves[way]["ranks"]):
            ax.plot(losses, lw=0.6, alpha=0.45, label=f"rank {r}")
        ax.plot(curves[way]["mean"], color="black", lw=1.4, label="mean")
        ax.set_title(f"{way}: {curves[way]['times'][-1]:.2f} s")
        ax.set_xlabel("step")
    axes[0].set_ylabel("cross-entropy loss")
    axes[0].legend(fontsize="small")
    for way in WAYS:
        axes[3].plot(curves[way]["times"], curves[way]["mean"], label=way)
    axes[3].set_title("mean loss against wall time")
    axes[3].set_xlabel("seconds")
    axes[3].legend(fontsize="small")
    fig.suptitle(f"the same MLP, {world} processes: DDP over gloo, DDP over aiobrpc, a parameter server")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description="one model trained three ways: DDP/gloo, DDP/aiobrpc, parameter server")
    p.add_argument("--world", type=int, default=4, help="number of processes (ranks)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--shards", type=int, default=2, help="parameter-server processes")
    p.add_argument("--plot", default=os.path.join(tempfile.gettempdir(), "train_three_ways.png"),
                   help="where the PNG goes (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="2 processes, 20 steps, 1 shard")
    args = p.parse_args()
    if args.quick:
        args.world, args.steps, args.shards = 2, 20, 1
    try:
        import torch  # noqa: F401  each rank imports it (forked: already loaded)
    except ModuleNotFoundError:
        sys.exit("torch is not installed: pip install torch (the 'train' extra pins it for Python 3.11)")

    with tempfile.TemporaryDirectory(prefix="train_three_ways-") as workdir:
        results = train(args, workdir)
    c = curves(results)
    print(f"{args.world} processes, {args.steps} steps, batch {BATCH} per rank, SGD lr {LR}")
    print(f"{'way':<12} {'final loss':>10} {'wall s':>7}")
    for way in WAYS:
        print(f"{way:<12} {c[way]['mean'][-1]:10.4f} {c[way]['times'][-1]:7.2f}")
    difference = results[0]["max_difference"]  # every rank has the same parameters
    for way in WAYS[1:]:
        print(f"max |{way} - ddp/gloo| over the parameters: {difference[way]:.2e}")
    try:
        plot(args.plot, c, args.world)
        print(f"plot: {args.plot}")
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    if difference["ddp/aiobrpc"] > SAME_PARAMS_ATOL:
        raise SystemExit(f"DDP over aiobrpc ended {difference['ddp/aiobrpc']:.2e} away from DDP over gloo "
                         f"(more than {SAME_PARAMS_ATOL})")


if __name__ == "__main__":
    main()
