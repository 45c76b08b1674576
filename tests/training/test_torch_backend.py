"""The torch.distributed backend "aiobrpc" under torchrun: its ops, DDP over it against DDP
over gloo (same parameters after the same steps), and the comm hook.

torch is installed for Python 3.11 only (the "train" extra); elsewhere this skips. It runs once,
with the compiled twin and uvloop (the backend's default loop): torch's start-up makes each run
cost seconds, and the twins and loops are covered by test_collectives.py below the backend.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.twins import pure_run_of_parent
from tests.training.procs import SCRIPTS, child_env

torch = pytest.importorskip("torch", reason="torch (the 'train' extra) is installed for Python 3.11 only")


def test_torchrun_world_of_three_over_aiobrpc(twin):
    if pure_run_of_parent():
        pytest.skip("runs once, with the compiled twin, in the parent process (see the module docstring)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
           str(SCRIPTS / "torch_world.py")]
    run = subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    # Three processes print "ok\n" to one pipe: their writes may interleave ("okok\n\n").
    assert run.stdout.count("ok") == 3 and not run.stdout.replace("ok", "").strip(), run.stdout
