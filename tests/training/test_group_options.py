"""Group options: the reduce thread is used by default only where a core is left for it."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from aiobrpc.training import FileStore, Group
from aiobrpc.training.group import AUTO_THREAD_BYTES, NEVER, auto_thread_bytes

ADDRS = ["10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2:8000", "10.0.0.2:8001", "10.0.0.2:8002"]


@pytest.mark.parametrize("rank, cores, expected", [
    (0, 2, NEVER),              # 2 ranks on this host, 2 cores: the ranks fill them
    (0, 3, AUTO_THREAD_BYTES),  # a core to spare
    (2, 3, NEVER),              # 3 ranks on 10.0.0.2
    (4, 4, AUTO_THREAD_BYTES),
    (1, 1, NEVER),
])
def test_the_reduce_thread_is_used_where_a_core_is_spare(rank, cores, expected):
    assert auto_thread_bytes(ADDRS, rank, cores) == expected


def test_a_rank_alone_on_its_host_counts_only_itself():
    assert auto_thread_bytes(["[::1]:1", "10.0.0.9:2"], 0, 2) == AUTO_THREAD_BYTES


@pytest.mark.parametrize("bad", [-1, 1.5, "4M"])
def test_a_bad_thread_bytes_is_refused(bad):
    with pytest.raises(ValueError, match="thread_bytes must be None or an int >= 0"):
        Group(0, 2, thread_bytes=bad)


async def test_a_group_resolves_the_default_from_its_ranks_and_cores(tmp_path):
    store = FileStore(str(tmp_path), timeout=10)
    groups = await asyncio.gather(*(Group.create(store, r, 2, timeout=5) for r in range(2)))
    try:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        expected = AUTO_THREAD_BYTES if cores > 2 else NEVER  # both ranks are on 127.0.0.1
        assert [g.thread_bytes for g in groups] == [expected, expected]
        x = [np.arange(1000, dtype=np.float32) + r for r in range(2)]
        await asyncio.gather(*(g.all_reduce(t) for g, t in zip(groups, x)))
        assert np.array_equal(x[0], 2 * np.arange(1000, dtype=np.float32) + 1)
        assert np.array_equal(x[0], x[1])
        assert Group(0, 2, thread_bytes=0).thread_bytes == 0  # an explicit value is kept
    finally:
        await asyncio.gather(*(g.close() for g in groups))
