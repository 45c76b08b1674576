"""The torch.distributed backend "aiobrpc" beyond DDP, under torchrun at world 2, 3 and 4:
send/recv (every dtype gloo takes, from a rank and from any), isend/irecv, batch_isend_irecv,
reduce with every ReduceOp, gather, scatter, all_to_all (uneven), all_gather_into_tensor /
reduce_scatter_tensor (plain and coalesced), the object collectives, new_group, new_subgroups
and a 2 x 2 DeviceMesh at world 4; each against gloo in the same processes
(scripts/torch_mixed.py). FSDP2, 2-stage pipelines (GPipe, 1F1B) and a group made again at
world 2, HSDP at world 4 (scripts/torch_fsdp.py).
Runs in the parent test's twin (the children inherit it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.training.procs import SCRIPTS, child_env

torch = pytest.importorskip("torch", reason="torch (the 'train' extra) is installed for Python 3.11 only")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_mixed_parallel_ops_match_gloo(world):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(SCRIPTS / "torch_mixed.py"), "p2p,colls,mesh"]
    run = subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    assert run.stdout.count("ok") == world and not run.stdout.replace("ok", "").strip(), run.stdout


@pytest.mark.parametrize("part, world", [("fsdp", 2), ("pipeline", 2), ("1f1b", 2), ("hsdp", 4), ("regroup", 2)])
def test_fsdp2_hsdp_pipelines_and_a_new_group_train_like_gloo(part, world):
    """FSDP2 (`fully_shard`), ScheduleGPipe and Schedule1F1B on 2 stages (world 2), HSDP on a
    (2, 2) mesh (world 4): the same losses and parameters over aiobrpc as over gloo; and the
    default group destroyed and made again in the same processes (scripts/torch_fsdp.py)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(SCRIPTS / "torch_fsdp.py"), part]
    run = subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    assert run.stdout.count("ok") == world and not run.stdout.replace("ok", "").strip(), run.stdout
