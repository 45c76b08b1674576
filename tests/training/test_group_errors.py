"""A rank that learns of a failure from another rank raises the same type of error: a timeout
found on one rank is a CollectiveTimeout on every rank, whichever way the news reached it.

Two ranks in one loop, so which rank fails first is chosen, not raced (the process tests in
test_collectives.py race them)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aiobrpc.training import CollectiveError, CollectiveTimeout, FileStore, Group


async def _pair(tmp_path) -> list[Group]:
    store = FileStore(str(tmp_path), timeout=10)
    return list(await asyncio.gather(*(Group.create(store, r, 2, timeout=5) for r in range(2))))


async def _close(groups: list[Group]) -> None:
    await asyncio.gather(*(g.close() for g in groups))


@pytest.mark.parametrize("error_type", [CollectiveTimeout, CollectiveError])
async def test_a_segment_refused_by_a_broken_rank_raises_its_error_type(error_type, tmp_path):
    groups = await _pair(tmp_path)
    try:
        groups[1]._fail(error_type("rank 1 found rank 7 hung", (7,)), tell_peers=False)
        with pytest.raises(CollectiveError) as info:
            await groups[0].all_reduce(np.ones(1000, np.float32))
        assert type(info.value) is error_type
        assert info.value.ranks == (7,) and "rank 7 hung" in str(info.value)
    finally:
        await _close(groups)


@pytest.mark.parametrize("error_type", [CollectiveTimeout, CollectiveError])
async def test_an_abort_from_another_rank_raises_its_error_type(error_type, tmp_path):
    groups = await _pair(tmp_path)
    try:
        groups[1]._fail(error_type("rank 1 found rank 7 hung", (7,)))  # tells rank 0
        for _ in range(100):
            if groups[0].broken is not None:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(CollectiveError) as info:
            await groups[0].all_reduce(np.ones(10, np.float32))
        assert type(info.value) is error_type
        assert "reported to rank 0 by rank 1" in str(info.value) and info.value.ranks == (7,)
    finally:
        await _close(groups)


async def test_a_peer_that_timed_out_and_left_first_is_not_blamed_for_the_timeout(tmp_path):
    """Ranks 0 and 2 wait on rank 1, which never starts the all_reduce. Rank 2 times out first and
    closes (a timeout is not told, and a broken group says no BYE): its lanes, message lanes too,
    close shortly before rank 0's own diagnosis. Rank 0 must blame rank 1, as rank 2 did, not the
    rank that merely left first (once seen in a fresh clone: the message lane's loss won)."""
    from tests.training.inloop import close_groups, make_groups

    timeout = 2.0
    groups = await make_groups(tmp_path, world=3, timeout=timeout)
    try:
        pending = [asyncio.ensure_future(groups[r].all_reduce(np.ones(1000, np.float32))) for r in (0, 2)]
        await asyncio.sleep(timeout * 0.6)  # within the quarter before rank 0's diagnosis is due
        groups[2]._fail(CollectiveTimeout("rank 2 found rank 1 had not started it", (1,)), tell_peers=False)
        await groups[2].close()
        with pytest.raises(CollectiveTimeout) as info:
            await pending[0]
        assert info.value.ranks == (1,) and "rank 1 has not started it" in str(info.value), info.value
        assert groups[0].broken is info.value and groups[1].broken is None  # nobody blamed rank 2
        with pytest.raises(CollectiveError):
            await pending[1]
    finally:
        await close_groups(groups)
