"""An announced message waiting for its recv when the group breaks (fuzz/collective.py's finding
`regress_announced_message_refused_by_a_broken_group`): its sender's call gets the group's error
as an Ack, not a handler failure (EINTERNAL and a logged traceback)."""

from __future__ import annotations

import asyncio
import logging

from aiobrpc._proto import collective_pb2 as pb
from aiobrpc.controller import Controller
from aiobrpc.training import FileStore, Group
from aiobrpc.training.p2p import DATA, HEADER
from tests.helpers.waiting import wait_until


async def test_an_announced_message_gets_the_error_of_the_group_that_broke_under_it(tmp_path, caplog):
    store = FileStore(str(tmp_path), timeout=10)
    g0, g1 = await asyncio.gather(*(Group.create(store, r, 2, timeout=5.0, lanes=False) for r in range(2)))
    try:
        stub = g0._stub(1)  # rank 0's channel to rank 1, used by hand as a hostile rank would
        header = pb.SendRequest(group=g1.id, src=0, coll=0, tag=0, seq=1, dtype="uint8", numel=1 << 20,
                                nbytes=1 << 20, phase=HEADER)
        waiting = asyncio.ensure_future(stub.Send(header, Controller(timeout_ms=10_000)))
        for _ in range(200):  # until rank 1 holds the announcement, waiting for a recv
            if g1.p2p.unmatched_count[0]:
                break
            await asyncio.sleep(0.01)
        await wait_until(lambda: g1.p2p.unmatched_count[0] == 1)
        assert g1.p2p.unmatched_count[0] == 1
        piece = pb.SendRequest(group=g1.id, src=0, coll=0, tag=5, seq=1, dtype="uint8", numel=4, nbytes=4,
                               phase=DATA, offset=0)
        cntl = Controller(timeout_ms=10_000)
        cntl.request_attachment = b"abcd"
        with caplog.at_level(logging.WARNING, logger="aiobrpc"):
            refused = await stub.Send(piece, cntl)  # a piece of nothing announced: fatal, the group breaks
            assert "was not announced" in refused.error
            ack = await asyncio.wait_for(waiting, 10)
        assert "was not announced" in ack.error and list(ack.ranks) == [0]
        assert not [r for r in caplog.records if r.exc_info], "a handler failed instead of refusing"
        assert g1._broken is not None and g1.p2p.unmatched_count == [0, 0]
    finally:
        await asyncio.gather(g0.close(), g1.close())
