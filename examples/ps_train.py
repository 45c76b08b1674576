"""A toy model trained by 2 worker processes through a parameter server of 2 shard processes.

    python examples/ps_train.py [--mode sync|async|bounded] [--steps 60]

The model is a linear regression y = x . w + b + emb[category]: `w` and `b` are pushed and
pulled whole, the embedding `emb` by the rows of the categories in each batch. Each shard is
`python -m aiobrpc.training.ps` (keys placed by crc32c of their name); each worker is this file with
`--worker`, a plain training loop over `SyncPsWorker`. The server takes the SGD step. The
workers print their loss every 10 steps; this program prints the curves side by side.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

try:
    import numpy as np
except ModuleNotFoundError:
    sys.exit("numpy is not installed: pip install numpy")

DIM, CATEGORIES, BATCH = 8, 16, 64
TRUE_W = (np.arange(DIM, dtype=np.float32) - 3) / 4
TRUE_EMB = np.linspace(-1, 1, CATEGORIES, dtype=np.float32)


def batch(rng: np.random.Generator):
    x = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    cat = rng.integers(0, CATEGORIES, BATCH)
    return x, cat, x @ TRUE_W + 0.5 + TRUE_EMB[cat]


def worker(rank: int, servers: list[str], steps: int) -> None:
    from aiobrpc.training.ps import SyncPsWorker

    rng = np.random.default_rng(rank)
    with SyncPsWorker(servers, rank, timeout_s=10) as ps:
        ps.init({"w": np.zeros(DIM, np.float32), "b": np.zeros((), np.float32),
                 "emb": np.zeros(CATEGORIES, np.float32)})
        for step in range(steps):
            x, cat, y = batch(rng)
            ids = np.unique(cat)
            p = ps.pull(["w", "b"], rows={"emb": ids})
            emb = np.zeros(CATEGORIES, np.float32)
            emb[ids] = p["emb"]
            err = x @ p["w"] + p["b"] + emb[cat] - y
            g_emb = np.zeros(CATEGORIES, np.float32)
            np.add.at(g_emb, cat, 2 * err / BATCH)
            ps.push({"w": (2 * x.T @ err / BATCH).astype(np.float32), "b": np.float32(2 * err.mean()),
                     "emb": g_emb[ids]}, rows={"emb": ids})
            if step % 10 == 0 or step == steps - 1:
                print(f"step {step} loss {float(np.mean(err ** 2)):.5f}", flush=True)


def start_shard(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "aiobrpc.training.ps", "--port", "0", "--workers", str(args.workers),
           "--mode", args.mode, "--optimizer", "sgd", "--lr", "0.3"]
    if args.mode == "bounded":
        cmd += ["--staleness", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    m = re.fullmatch(r"listening on (\S+)\n", line)
    if not m:
        proc.kill()
        raise SystemExit(f"the parameter server did not start: {line!r}")
    return proc, m.group(1)


def main() -> None:
    p = argparse.ArgumentParser(description="train a toy model through a parameter server")
    p.add_argument("--mode", choices=("sync", "async", "bounded"), default="sync")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # run as worker N
    p.add_argument("--servers", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        return worker(args.worker, args.servers.split(","), args.steps)

    shards = [start_shard(args) for _ in range(args.shards)]
    try:
        servers = ",".join(address for _, address in shards)
        workers = [subprocess.Popen([sys.executable, __file__, "--worker", str(rank), "--servers", servers,
                                     "--steps", str(args.steps)], stdout=subprocess.PIPE, text=True)
                   for rank in range(args.workers)]
        outputs = [w.communicate(timeout=120)[0] for w in workers]
        if any(w.returncode for w in workers):
            raise SystemExit(f"a worker failed: {[w.returncode for w in workers]}")
    finally:
        for proc, _ in shards:
            proc.terminate()
            proc.communicate(timeout=10)
    curves = [dict(re.findall(r"step (\d+) loss (\S+)", out)) for out in outputs]
    print(f"mode {args.mode}, {args.workers} workers, {args.shards} shards")
    print("step " + " ".join(f"{f'worker{r}':>10}" for r in range(args.workers)))
    for step in curves[0]:
        print(f"{step:>4} " + " ".join(f"{float(c[step]):10.5f}" for c in curves))


if __name__ == "__main__":
    main()
