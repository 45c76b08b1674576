"""The point-to-point layer of a Group on calls (p2p.py, `lanes=False`) and the collectives made
of it, ranks in one loop: matching, in-place receipt, the caps on what a peer can make a rank
hold, hostile and mismatched messages, a peer that dies. Every wait is bounded by the group's
timeout. On lanes (the default): test_lane_messages.py; the tests parametrized on `lanes` hold
on both."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aiobrpc.client.channel import Channel
from aiobrpc.controller import Controller
from aiobrpc.options import ChannelOptions
from aiobrpc.stub import Stub
from aiobrpc._proto import collective_pb2 as pb
from aiobrpc.training import CollectiveError, CollectiveTimeout, Group
from aiobrpc.training.group import SERVICE
from aiobrpc.training import p2p as p2p_module
from aiobrpc.training.p2p import DATA, EAGER, HEADER
from tests.helpers.waiting import wait_until
from tests.training.inloop import close_groups as _close, make_groups


def _groups(tmp_path, **options):
    return make_groups(tmp_path, lanes=False, **options)


BOUND = 20  # seconds: no test waits longer for anything


def test_dtype_names_are_numpy_s_and_their_cache_is_bounded():
    for dtype in (np.float32, np.int64, np.bool_, np.complex64, ">f4", "S5"):
        a = np.zeros(3, dtype)
        assert p2p_module.byte_view(a)[0] == a.dtype.name
    for i in range(p2p_module._MAX_DTYPE_NAMES + 50):  # structured dtypes: one name each, endless
        a = np.zeros(2, [(f"f{i}", np.int32)])
        assert p2p_module.byte_view(a)[0] == a.dtype.name
    assert len(p2p_module._DTYPE_NAMES) == p2p_module._MAX_DTYPE_NAMES


def _wait(aw, t=BOUND):
    return asyncio.wait_for(aw, t)


async def test_messages_match_in_order_per_tag_and_large_ones_land_in_place(tmp_path):
    g0, g1 = groups = await _groups(tmp_path, segment_bytes=1 << 20)
    try:
        big = np.arange(3 << 20, dtype=np.uint8)  # announced, then 3 pieces into the posted recv
        out = np.zeros_like(big)
        got = g1.recv(out, 0, tag=7)
        await _wait(g0.send(big, 1, tag=7))
        assert await _wait(got) == 0 and np.array_equal(out, big)
        assert g1.p2p.placed >= 3
        # sent before their recvs, two tags: held, then matched in order per tag
        sends = [g0.send(np.full(3, k, np.int64), 1, tag=k % 2) for k in range(4)]
        await _wait(asyncio.gather(*sends))
        outs = [np.zeros(3, np.int64) for _ in range(4)]
        for k in (1, 3, 0, 2):
            assert await _wait(g1.recv(outs[k], 0, tag=k % 2)) == 0
        assert [int(o[0]) for o in outs] == [0, 1, 2, 3]
        assert g1.p2p.held_bytes == [0, 0] and g1.p2p.unmatched_count == [0, 0]
        # from any rank
        anyout = np.zeros(2, np.float32)
        got = g1.recv(anyout, None, tag=9)
        await _wait(g0.send(np.ones(2, np.float32), 1, tag=9))
        assert await _wait(got) == 0 and anyout.tolist() == [1, 1]
    finally:
        await _close(groups)


async def test_held_bytes_never_pass_the_cap_and_the_sender_falls_back_to_waiting(tmp_path):
    cap = 10_000
    g0, g1 = groups = await _groups(tmp_path, p2p_buffer_bytes=cap)
    try:
        msgs = [np.full(3000, k, np.uint8) for k in range(5)]  # 15 000 bytes: 3 fit, 2 wait
        sends = [g0.send(m, 1) for m in msgs]
        await asyncio.sleep(0.3)
        await wait_until(lambda: g1.p2p.held_bytes[0] <= cap and g1.p2p.held_bytes[0] == 9000)
        assert g1.p2p.held_bytes[0] <= cap and g1.p2p.held_bytes[0] == 9000
        assert sum(s.done() for s in sends) == 3
        outs = [np.zeros(3000, np.uint8) for _ in msgs]
        for o in outs:
            await _wait(g1.recv(o, 0))
        await _wait(asyncio.gather(*sends))
        assert [int(o[0]) for o in outs] == list(range(5))
        assert g1.p2p.held_bytes == [0, 0]
    finally:
        await _close(groups)


@pytest.mark.parametrize("size", [1, 64])  # eager (held, then busy), or announced from the first
async def test_a_sender_past_max_messages_waits_for_the_receivers_recvs_and_goes_on(tmp_path, size):
    """More sends than the receiver holds before its recvs (a loop of isends): past the cap an
    eager one is answered busy and announced, announcements wait there for room, and the
    sender keeps at most max_messages calls in flight: none breaks anything."""
    g0, g1 = groups = await _groups(tmp_path, p2p_max_messages=4, p2p_eager_bytes=32)
    try:
        sends = [g0.send(np.full(size, t, np.int8), 1, tag=t % 3) for t in range(40)]
        # eager: 4 held (their sends done), then 4 announced waiting for room; announced: the 4
        # in the table are the sender's whole window
        parked = 4 if size == 1 else 0
        await wait_until(lambda: g1.p2p.unmatched_count[0] == 4 and len(g1.p2p._parked[0]) == parked)
        await asyncio.sleep(0.1)
        assert g0.broken is None and g1.broken is None and sum(s.done() for s in sends) == parked
        assert g1.p2p.unmatched_count[0] == 4 and len(g1.p2p._parked[0]) == parked
        outs = [np.zeros(size, np.int8) for _ in range(40)]
        got = [g1.recv(outs[t], 0, tag=t % 3) for t in range(40)]
        await _wait(asyncio.gather(*sends, *got))
        assert [int(o[0]) for o in outs] == list(range(40))
        assert g1.p2p.unmatched_count == [0, 0] and not g1.p2p._parked[0]
    finally:
        await _close(groups)


async def test_an_announcement_waiting_for_room_times_out_naming_the_receiver(tmp_path):
    g0, g1 = groups = await _groups(tmp_path, timeout=0.5, p2p_max_messages=2)
    try:
        first = [g0.send(np.zeros(1, np.int8), 1, tag=t) for t in range(2)]  # held by rank 1
        await _wait(asyncio.gather(*first))
        late = g0.send(np.zeros(1, np.int8), 1, tag=2)  # busy, then announced: waits for room there
        with pytest.raises(CollectiveTimeout, match=r"rank 1 posted no recv .* within 0.5 s; it holds 2 messages"):
            await _wait(late)
        assert g0.broken is None and g1.broken is None and not g1.p2p._parked[0]
        out = np.zeros(1, np.int8)
        got = g1.recv(out, 0, tag=0)
        await _wait(got)
    finally:
        await _close(groups)


async def test_too_many_announcements_waiting_for_room_break_the_group_with_a_clear_error(tmp_path, caplog):
    """A peer past its window (an honest sender keeps max_messages calls in flight): refused."""
    g0, g1 = groups = await _groups(tmp_path, p2p_max_messages=2)
    try:
        stub = g0._stub(1)  # by hand, as a hostile rank would: no window
        calls = [stub.Send(pb.SendRequest(group=g1.id, src=0, coll=0, tag=t, seq=1, dtype="int8", numel=1,
                                          nbytes=1, phase=HEADER), Controller(timeout_ms=10_000))
                 for t in range(5)]
        acks = await _wait(asyncio.gather(*calls))
        errors = [a.error for a in acks if a.error]
        assert errors and any("max_messages" in e for e in errors)
        assert g1.broken is not None and "messages waiting for room" in str(g1.broken)
        assert "max_messages" in caplog.text
        assert g1.p2p.unmatched_count[0] == 0 and not g1.p2p._parked[0] and not g1.p2p._unmatched
        with pytest.raises(CollectiveError):
            g1.recv(np.zeros(1, np.int8), 0)
    finally:
        await _close(groups)


@pytest.mark.parametrize("size", [10, 100_000])  # held first, or announced
@pytest.mark.parametrize("recv_first", [True, False])
async def test_a_message_that_does_not_fit_its_recv_fails_both_sides(tmp_path, caplog, size, recv_first):
    g0, g1 = groups = await _groups(tmp_path)
    try:
        out = np.zeros(size, np.int64)
        if recv_first:
            got = g1.recv(out, 0)
            await asyncio.sleep(0.05)
            sent = g0.send(np.ones(size, np.float64), 1)
        else:
            sent = g0.send(np.ones(size, np.float64), 1)
            await asyncio.sleep(0.2)
            got = g1.recv(out, 0)
        for fut in (got, sent):
            if fut is sent and size == 10 and not recv_first:
                await _wait(fut)  # held before the recv came: the sender was already done
                continue
            with pytest.raises(CollectiveError, match="int64.*|float64"):
                await _wait(fut)
        assert "does not fit" in caplog.text and "float64" in caplog.text
    finally:
        await _close(groups)


async def _raw(group: Group, to: Group, req: pb.SendRequest, data: bytes = b"") -> pb.Ack:
    ch = Channel(to.addresses[to.rank], ChannelOptions(timeout_ms=5000, max_retry=0))
    try:
        cntl = Controller(request_attachment=data) if data else Controller()
        return await Stub(ch, SERVICE).Send(req, cntl)
    finally:
        await ch.close()


@pytest.mark.parametrize("case", ["foreign group", "piece of nothing", "size lie", "bad src", "finished",
                                  "header with data", "replayed", "long dtype"])
async def test_hostile_messages_are_refused_and_logged(tmp_path, caplog, case):
    g0, g1 = groups = await _groups(tmp_path)
    try:
        base = dict(group=g1.id, src=0, coll=0, tag=0, seq=1, dtype="float32", numel=2, nbytes=8, phase=EAGER)
        data = b"\0" * 8
        if case == "foreign group":
            base["group"] = "0123456789abcdef"
        elif case == "piece of nothing":
            base.update(phase=DATA, offset=0)
        elif case == "size lie":
            base["nbytes"] = 1 << 40
        elif case == "bad src":
            base["src"] = 1
        elif case == "finished":
            await _wait(asyncio.gather(g0.barrier(), g1.barrier()))
            base["coll"] = 1
        elif case == "long dtype":
            base.update(phase=HEADER, dtype="x" * 100_000)
            data = b""
        elif case == "header with data":
            base["phase"] = HEADER
        elif case == "replayed":
            out = np.zeros(2, np.float32)
            got = g1.recv(out, 0)
            await _wait(g0.send(np.ones(2, np.float32), 1))
            await _wait(got)
        ack = await _wait(_raw(g0, g1, pb.SendRequest(**base), data))
        assert ack.error, case
        assert "refused a message from rank" in caplog.text or "was already received" in ack.error
        assert g1.p2p.held_bytes == [0, 0]
    finally:
        await _close(groups)


async def test_a_dead_source_fails_the_pending_recv_naming_it(tmp_path):
    g0, g1 = await _groups(tmp_path, timeout=1.5)
    try:
        got = g0.recv(np.zeros(4, np.float32), 1)
        await g1.close()
        with pytest.raises(CollectiveTimeout) as info:
            await _wait(got, 10)
        assert info.value.ranks == (1,) and "did not answer" in str(info.value)
        assert g0.broken is not None
    finally:
        await _close([g0, g1])


@pytest.mark.parametrize("lanes", [False, True])
async def test_a_dead_destination_fails_the_pending_send_naming_it(tmp_path, lanes):
    g0, g1 = await make_groups(tmp_path, timeout=3, lanes=lanes)
    try:
        sent = g0.send(np.zeros(1 << 20, np.uint8), 1)  # announced: waits for a recv that never comes
        await asyncio.sleep(0.2)
        await g1.close()
        with pytest.raises(CollectiveError) as info:
            await _wait(sent, 10)
        assert 1 in info.value.ranks
    finally:
        await _close([g0, g1])


async def test_a_recv_with_no_send_times_out_without_breaking_the_group(tmp_path):
    g0, g1 = groups = await _groups(tmp_path, timeout=1)
    try:
        with pytest.raises(CollectiveTimeout, match="no matching send"):
            await _wait(g0.recv(np.zeros(1, np.int8), 1, tag=3), 10)
        assert g0.broken is None
        out = np.zeros(1, np.int8)
        got = g0.recv(out, 1)
        await _wait(g1.send(np.ones(1, np.int8), 0))
        await _wait(got)
    finally:
        await _close(groups)


@pytest.mark.parametrize("lanes", [False, True])
async def test_callers_mistakes_raise_at_once(tmp_path, lanes):
    g0, g1 = groups = await make_groups(tmp_path, lanes=lanes)
    try:
        for dst in (0, 2, -1, "1"):
            with pytest.raises(ValueError, match="dst must be another rank"):
                g0.send(np.zeros(1), dst)
        with pytest.raises(ValueError, match="src must be another rank"):
            g0.recv(np.zeros(1), 0)
        for call in (g0.send, g0.recv):
            with pytest.raises(ValueError, match="not C-contiguous"):
                call(np.zeros((4, 4))[:, 1], 1)
        with pytest.raises(ValueError, match="tag"):
            g0.send(np.zeros(1), 1, tag=1.5)
        with pytest.raises(ValueError, match="2 output tensors"):
            g0.gather(np.zeros(1), [np.zeros(1)], root=0)
        assert g0.broken is None
    finally:
        await _close(groups)


@pytest.mark.parametrize("world", [2, 3])
async def test_collectives_made_of_messages(tmp_path, world):
    groups = await _groups(tmp_path, world=world)
    try:
        ins = {r: [np.arange(r + j + 1, dtype=np.int32) * (r + 1) for j in range(world)] for r in range(world)}
        outs = {r: [np.zeros(j + r + 1, np.int32) for j in range(world)] for r in range(world)}
        await _wait(asyncio.gather(*(g.all_to_all(outs[g.rank], ins[g.rank]) for g in groups)))
        for r in range(world):
            for j in range(world):
                assert np.array_equal(outs[r][j], ins[j][r])
        gathered = [np.zeros(3) for _ in range(world)]
        await _wait(asyncio.gather(*(g.gather(np.full(3, g.rank + 0.5), gathered if g.rank == 1 else None, 1)
                                     for g in groups)))
        assert [a[0] for a in gathered] == [r + 0.5 for r in range(world)]
        scattered = {r: np.zeros(2, np.int64) for r in range(world)}
        parts = [np.full(2, 10 * r, np.int64) for r in range(world)]
        await _wait(asyncio.gather(*(g.scatter(scattered[g.rank], parts if g.rank == 0 else None, 0)
                                     for g in groups)))
        assert [int(scattered[r][0]) for r in range(world)] == [10 * r for r in range(world)]
        for g in groups:  # nothing is left keyed by the collectives that ended
            assert not g.p2p._next_match and not g.p2p._send_seq and not g.p2p._unmatched
        # ring collectives still line up after them
        t = {r: np.full(4, float(r)) for r in range(world)}
        await _wait(asyncio.gather(*(g.all_reduce(t[g.rank]) for g in groups)))
        assert t[0].tolist() == [sum(range(world))] * 4
    finally:
        await _close(groups)

