"""Collectives among real processes on loopback: results equal numpy's; a dead or hung rank
fails the others within the timeout, named.

Each rank is a child process running this test's twin (AIOBRPC_NO_EXTENSIONS) on the loop the
test names (asyncio or uvloop). On uvloop every segment is taken on the group's reduce thread
(thread_bytes=0), on asyncio on the loop: both paths meet numpy and the failure tests.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.training.procs import child_env as _child_env
from tests.training.procs import finish, start_ranks


def child_env(loop: str, **extra: str) -> dict[str, str]:
    return _child_env(loop, AIOBRPC_TEST_THREAD_BYTES="0" if loop == "uvloop" else str(1 << 40), **extra)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_equal_numpy_across_processes(world, loop, tmp_path):
    results = finish(start_ranks("check", world, str(tmp_path), child_env(loop)), timeout=120)
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0 and out.strip() == "ok", f"rank {rank} (rc {rc}):\n{out}\n{err}"


def _wait_ready(procs) -> None:
    for p in procs:
        line = p.stdout.readline()
        assert line.strip() == "ready", line + p.stderr.read()


# One loop each: what is tested is the group's failure handling, not the loop's.
@pytest.mark.parametrize("how, loop", [("kill", "uvloop"), ("stop", "asyncio")])
def test_a_dead_or_hung_rank_fails_every_other_rank_within_the_timeout(how, loop, tmp_path):
    timeout = 2.5
    procs = start_ranks("loop", 3, str(tmp_path), child_env(loop, AIOBRPC_TEST_TIMEOUT=str(timeout)))
    try:
        _wait_ready(procs)
        victim = procs[1]
        time.sleep(0.2)
        os.kill(victim.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        results = finish([procs[0], procs[2]], timeout=timeout + 20)
        elapsed = time.monotonic() - t0
    finally:
        if how == "stop":
            os.kill(procs[1].pid, signal.SIGKILL)
        finish([procs[1]], timeout=5)
    for rank, (rc, out, err) in zip((0, 2), results):
        assert rc == 0, f"rank {rank}: {out}\n{err}"
        report = json.loads(out.strip().splitlines()[-1])
        assert 1 in report["ranks"], report
        assert "rank 1" in report["error"], report
        assert report["after_s"] <= timeout + 0.5, report
        if how == "stop":
            assert report["type"] == "CollectiveTimeout" and "did not answer" in report["error"], report
        else:  # found at once: the left neighbour's call broke, and it told the others
            assert report["after_s"] < 1.0 and report["ranks"] == [1], report
    assert elapsed < timeout + 10


def test_a_rank_killed_mid_exchange_fails_the_others_pending_send_recv_and_all_to_all(tmp_path):
    timeout = 2.5
    procs = start_ranks("p2p_loop", 3, str(tmp_path), child_env("uvloop", AIOBRPC_TEST_TIMEOUT=str(timeout)))
    try:
        _wait_ready(procs)
        time.sleep(0.2)
        os.kill(procs[1].pid, signal.SIGKILL)
        results = finish([procs[0], procs[2]], timeout=timeout + 20)
    finally:
        finish([procs[1]], timeout=5)
    for rank, (rc, out, err) in zip((0, 2), results):
        assert rc == 0, f"rank {rank}: {out}\n{err}"
        report = json.loads(out.strip().splitlines()[-1])
        assert 1 in report["ranks"] and "rank 1" in report["error"], report
        assert report["after_s"] <= timeout + 0.5, report
