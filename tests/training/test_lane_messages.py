"""send/recv on a group's message lanes (lane_messages.py): matching in order per tag and from
any rank, in place, eager on credit or announced then granted; what a peer can make a rank
hold is bounded (credit, max_messages slots), and an honest sender past them waits for the
receiver's recvs; a recv that does not fit fails (and its sender where it still waits); a
hostile peer's notes break its lane and the group, naming it, logged; a peer that stops
mid-message or dies fails what waits on it within the group's timeout."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time

import numpy as np
import pytest

from aiobrpc.protocol import streaming
from aiobrpc.training import CollectiveError, CollectiveTimeout
from aiobrpc.training import lane_messages as M
from aiobrpc.training import lanes as L
from tests.helpers.waiting import wait_until
from tests.training.inloop import close_groups as _close, make_groups as _groups

BOUND = 20


def _wait(aw, t=BOUND):
    return asyncio.wait_for(aw, t)


# -- sans-IO -----------------------------------------------------------------------------------

def test_notes_round_trip_and_malformed_ones_are_refused():
    raw = M.pack_note(M.EAGER, -5, 7, 3, 12, "bfloat16")
    assert len(raw) == M.NOTE
    assert M.parse_note(raw) == (M.EAGER, -5, 7, 3, 12, "bfloat16")
    assert M.parse_note(M.pack_note(M.CREDIT, 0, 0, 0, 1 << 20))[4] == 1 << 20
    with pytest.raises(ValueError):
        M.pack_note(M.EAGER, 0, 1, 1, 1, "x" * 65)
    bad = {
        "unknown kind": M.pack_note(M.EAGER, 0, 1, 1, 1, "uint8").replace(b"\x01", b"\x09", 1),
        "name past its field": raw[:1] + bytes([200]) + raw[2:],
        "not ascii": raw[:34] + b"\xff" + raw[35:],
        "numbered 0": M.pack_note(M.ANNOUNCE, 0, 0, 1, 1, "uint8"),
        "negative elements": M.pack_note(M.GRANT, 0, 1, -1, 1, "uint8"),
        "short": raw[:-1],
    }
    for name, note in bad.items():
        with pytest.raises(L.LaneError):
            M.parse_note(note)
        assert name


# -- one rank's LaneMessages against peers played by hand ------------------------------------

class _Rank0:
    """Rank 0's LaneMessages whose lanes to ranks 1.. are socket pairs; the tests write the
    peers' frames on the other ends."""

    def __init__(self, world=3, **options):
        lanes, self.ends, self.peer_lanes = [None], [None], [None]
        for p in range(1, world):
            a, b = socket.socketpair()
            lanes.append(L.Lane(p, f"peer{p}", a, L.stream_id(0), L.stream_id(p)))
            self.peer_lanes.append(L.Lane(0, "rank0", b, L.stream_id(p), L.stream_id(0)))
            self.ends.append(b)
        self.reports = []
        opts = dict(timeout=5.0, eager_bytes=64, buffer_bytes=256, max_messages=4)
        opts.update(options)
        self.m = M.LaneMessages(0, world, lanes, ["rank0"] + [f"peer{p}" for p in range(1, world)],
                                report=lambda e, fatal: self.reports.append((e, fatal)), **opts)
        self.m.start()

    def write(self, p, kind, tag=0, seq=1, numel=0, nbytes=0, dtype="", data=b""):
        bufs = []
        L.frames(bufs, self.peer_lanes[p], M.pack_note(kind, tag, seq, numel, nbytes, dtype), memoryview(data))
        self.ends[p].sendall(b"".join(bytes(b) for b in bufs))

    def notes(self, p, timeout=5.0):
        """The notes rank 0 wrote to peer p so far (kind, tag, seq, numel, nbytes, dtype), data skipped."""
        out, sock = [], self.ends[p]
        sock.settimeout(0.3)
        end = time.monotonic() + timeout
        buf = b""
        while time.monotonic() < end:
            try:
                chunk = sock.recv(1 << 20)
            except (TimeoutError, BlockingIOError):
                break
            if not chunk:
                break
            buf += chunk
        at = 0
        while at + 12 <= len(buf):
            body, meta = L.parse_header(buf[at:at + 12], b"STRM", 1 << 31)
            out.append(M.parse_note(buf[at + 12 + meta:at + 12 + meta + M.NOTE]))
            at += 12 + body
        return out

    def close(self):
        self.m.fail_all(CollectiveError("test over"))
        for p in range(1, len(self.ends)):
            with contextlib.suppress(OSError):
                self.m._peers[p].lane.sock.shutdown(socket.SHUT_RDWR)
        self.m.join()
        for p in range(1, len(self.ends)):
            self.ends[p].close()
            self.m._peers[p].lane.sock.close()


def test_credit_is_given_at_start_and_eager_messages_land_in_place_or_are_held():
    r0 = _Rank0()
    try:
        assert (M.CREDIT, 0, 0, 4, 256, "") in r0.notes(1, 1.0)  # 4 slots (max_messages), 256 bytes
        out = np.zeros(4, np.float32)
        got = r0.m.recv(out, 1, 0)
        data = np.arange(4, dtype=np.float32).tobytes()
        r0.write(1, M.EAGER, 0, 1, 4, 16, "float32", data)
        assert got.result(5) == 1 and out.tolist() == [0, 1, 2, 3]
        r0.write(1, M.EAGER, 0, 2, 4, 16, "float32", data[::-1])  # before its recv: held
        wait_until_sync(lambda: r0.m.held_bytes()[1] == 16)
        later = np.zeros(4, np.float32)
        assert r0.m.recv(later, 1, 0).result(5) == 1
        assert later.tobytes() == data[::-1] and r0.m.held_bytes()[1] == 0 and r0.m.unmatched_count()[1] == 0
    finally:
        r0.close()


def test_a_large_recv_grants_at_once_and_its_data_lands_in_place():
    r0 = _Rank0()
    try:
        r0.notes(1, 0.5)
        out = np.zeros(100, np.float32)  # 400 bytes > eager_bytes: granted when posted
        got = r0.m.recv(out, 1, 3)
        assert (M.GRANT, 3, 1, 100, 400, "float32") in r0.notes(1, 1.0)
        r0.write(1, M.DATA, 3, 1, 100, 400, "float32", np.full(100, 2, np.float32).tobytes())
        assert got.result(5) == 1 and out.tolist() == [2] * 100 and r0.m.placed == 1
    finally:
        r0.close()


def test_a_send_waits_for_a_slot_is_announced_without_credit_and_goes_when_granted():
    r0 = _Rank0()
    try:
        r0.notes(1, 0.5)
        sent = r0.m.send(np.arange(8, dtype=np.int64), 1, 0)  # no CREDIT from peer 1 yet: it waits here
        assert r0.notes(1, 0.5) == [] and not sent.done()
        r0.write(1, M.CREDIT, numel=1)  # a slot, no bytes: announced
        assert (M.ANNOUNCE, 0, 1, 8, 64, "int64") in r0.notes(1, 1.0) and not sent.done()
        r0.write(1, M.GRANT, 0, 1, 8, 64, "int64")
        assert sent.result(5) is None
        r0.write(1, M.CREDIT, numel=1, nbytes=1000)  # its slot back, and bytes
        wait_until_sync(lambda: r0.m.credit(1) == 1000)
        assert r0.m.send(np.zeros(8, np.int64), 1, 0).result(5) is None  # eager now
        assert r0.m.credit(1) == 1000 - 64
    finally:
        r0.close()


def wait_until_sync(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def _eager(r0, seq, tag=0, n=8):
    r0.write(1, M.EAGER, tag, seq, n, n, "uint8", bytes(n))


HOSTILE = {
    "DATA never granted": lambda r0: r0.write(1, M.DATA, 0, 1, 2, 8, "float32", bytes(8)),
    "EAGER past the credit": lambda r0: r0.write(1, M.EAGER, 0, 1, 300, 300, "uint8", bytes(300)),
    "a message numbered twice": lambda r0: (_eager(r0, 1), _eager(r0, 1)),
    "messages past max_messages": lambda r0: [_eager(r0, 1, tag=t) for t in range(5)],
    "announces past the slots given": lambda r0: [r0.write(1, M.ANNOUNCE, t, 1, 100, 100, "uint8") for t in range(5)],
    "grants past max_messages": lambda r0: [r0.write(1, M.GRANT, t, 1, 1, 1, "uint8") for t in range(5)],
    "a grant given twice": lambda r0: [r0.write(1, M.GRANT, 0, 1, 1, 1, "uint8") for _ in range(2)],
    "a DECLINE of nothing granted": lambda r0: r0.write(1, M.DECLINE, 0, 1, 1, 1, "uint8"),
    "a note with data": lambda r0: r0.write(1, M.GRANT, 0, 1, 1, 1, "uint8", b"x"),
    "an unknown kind": lambda r0: r0.ends[1].sendall(
        L.frame_head(2, 1, M.NOTE, False) + bytes([9]) + M.pack_note(M.CREDIT, 0, 0)[1:]),
    "a meta of another size": lambda r0: r0.ends[1].sendall(
        b"STRM" + (M.NOTE + 9).to_bytes(4, "big") + (9).to_bytes(4, "big") + bytes(9 + M.NOTE)),
    "bad magic": lambda r0: r0.ends[1].sendall(b"PRPC" + bytes(8 + 8 + M.NOTE)),
    "a close frame": lambda r0: r0.ends[1].sendall(streaming.close_frame(1, 2) + bytes(2 * M.NOTE)),
    "more bytes than the note says": lambda r0: (r0.m.recv(np.zeros(2, np.uint8), 1, 0),
                                                  r0.write(1, M.EAGER, 0, 1, 2, 2, "uint8", bytes(3))),
    "a BYE of a closed group with data": lambda r0: r0.write(1, M.BYE, 0, 0, 0, 4, "", bytes(4)),
    "a BYE's reason past MAX_REASON": lambda r0: _bye(r0, bytes(M.MAX_REASON + 1)),
    "a BYE's reason naming a rank past the world": lambda r0: _bye(r0, M._REASON.pack(0, 1) + (3).to_bytes(4, "little")),
    "a BYE's reason naming more ranks than it holds": lambda r0: _bye(r0, M._REASON.pack(0, 2) + bytes(4)),
    "a BYE's reason whose text is not UTF-8": lambda r0: _bye(r0, M._REASON.pack(1, 0) + b"\xff\xfe"),
    "a BYE's reason too short": lambda r0: _bye(r0, b"\x01"),
    "a BYE whose note says more reason than it carries": lambda r0: r0.write(1, M.BYE, 0, 0, 1, 5, ""),
}


def _bye(r0, reason: bytes) -> None:
    r0.write(1, M.BYE, 0, 0, 1, len(reason), "", reason)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_peer_breaks_its_own_lane_logged_and_named(case, caplog):
    caplog.set_level(logging.WARNING, "aiobrpc.training")
    r0 = _Rank0()
    try:
        other = np.zeros(2, np.uint8)
        waits = r0.m.recv(other, 2, 0)  # a recv from the honest peer 2
        HOSTILE[case](r0)
        wait_until_sync(lambda: r0.reports)
        err, fatal = r0.reports[0]
        assert fatal and err.ranks == (1,) and "rank 1" in str(err) and "broke the message lane protocol" in str(err)
        assert any("message lane from rank 1" in r.getMessage() for r in caplog.records)
        assert r0.m.held_bytes()[1] <= 256 and r0.m.unmatched_count()[1] <= 4 and r0.m._peers[1].grants <= 4
        with pytest.raises(CollectiveError, match="rank 1"):  # its lane is not used again
            r0.m.send(np.zeros(1), 1, 0)
        r0.write(2, M.EAGER, 0, 1, 2, 2, "uint8", b"ok")  # peer 2 is untouched
        assert waits.result(5) == 2 and bytes(other) == b"ok"
    finally:
        r0.close()


def _first_frame_of(r0, p, kind, tag, seq, numel, nbytes, dtype, part: bytes) -> bytes:
    """The first frame of a message of `nbytes`, of which `part` is all that is written."""
    note = M.pack_note(kind, tag, seq, numel, nbytes, dtype)
    return L._head(r0.peer_lanes[p].out_meta[0], M.NOTE + nbytes) + note + part


def test_a_recv_posted_while_a_held_message_is_read_waits_for_all_of_it():
    # fuzz/lane_messages.py's regress_recv_takes_held_eager_mid_read
    r0 = _Rank0()
    try:
        data = np.arange(4, dtype=np.float32).tobytes()
        r0.ends[1].sendall(_first_frame_of(r0, 1, M.EAGER, 0, 1, 4, 16, "float32", data[:6]))
        wait_until_sync(lambda: r0.m.held_bytes()[1] == 16)  # being read, held for no recv
        out = np.zeros(4, np.float32)
        got = r0.m.recv(out, None, 0)
        time.sleep(0.1)
        assert not got.done()  # not bound to a message not yet whole
        r0.ends[1].sendall(data[6:])
        assert got.result(5) == 1 and out.tobytes() == data
        assert r0.m.held_bytes()[1] == 0 and r0.m.unmatched_count()[1] == 0
    finally:
        r0.close()


def test_a_held_message_cut_by_a_refusal_is_never_taken():
    # fuzz/lane_messages.py's regress_any_takes_held_eager_cut_by_a_refusal
    r0 = _Rank0()
    try:
        note = M.pack_note(M.EAGER, 0, 1, 16, 16, "uint8")
        # a first frame of 6 of its 16 bytes that says more follow ...
        r0.ends[1].sendall(L._head(r0.peer_lanes[1].out_meta[1], M.NOTE + 6) + note + bytes(6))
        wait_until_sync(lambda: r0.m.held_bytes()[1] == 16)
        r0.ends[1].sendall(b"PRPC" + bytes(200))  # ... and what follows is not a frame
        wait_until_sync(lambda: r0.reports)
        assert r0.m.held_bytes()[1] == 0 and r0.m.unmatched_count()[1] == 0 and not r0.m._unmatched
        got = r0.m.recv(np.zeros(16, np.uint8), None, 0)  # from any rank: rank 1's half message is not it
        time.sleep(0.1)
        assert not got.done()
    finally:
        r0.close()


def test_data_that_does_not_fit_its_grant_leaves_the_recv_to_the_groups_failure():
    # fuzz/lane_messages.py's regress_data_unfit_for_its_grant
    r0 = _Rank0()
    try:
        got = r0.m.recv(np.zeros(30, np.float32), 1, 0)  # granted at once
        r0.write(1, M.DATA, 0, 1, 31, 124, "float32", bytes(124))
        wait_until_sync(lambda: r0.reports)
        assert r0.reports[0][1] and "granted as 30 float32" in str(r0.reports[0][0])
        assert not got.done()
        r0.m.fail_all(CollectiveError("the group broke"))
        with pytest.raises(CollectiveError, match="the group broke"):
            got.result(5)
    finally:
        r0.close()


def test_an_eager_message_past_the_credit_given_is_refused_before_anything_changes():
    # fuzz/lane_messages.py's regress_credit_owed_overflow
    r0 = _Rank0()
    try:
        got = r0.m.recv(np.zeros(4, np.float32), 1, 0)
        anyone = r0.m.recv(np.zeros(4, np.float32), None, 1)
        r0.write(1, M.EAGER, 0, 1, 4, 16, "float32", bytes(16))
        assert got.result(5) == 1
        note = M.pack_note(M.EAGER, 1, 1, 4, (1 << 64) - 1, "float32")  # a size past any credit
        r0.ends[1].sendall(L._head(r0.peer_lanes[1].out_meta[0], M.NOTE) + note)
        wait_until_sync(lambda: r0.reports)
        err, fatal = r0.reports[0]
        assert fatal and "past the credit given" in str(err) and "reader failed" not in str(err)
        assert not anyone.done() and r0.m._any[1][0].future is anyone  # still posted, for the failure to settle
    finally:
        r0.close()


def test_a_peer_that_stops_mid_message_fails_the_recv_at_the_timeout_and_its_lane_is_shut(caplog):
    caplog.set_level(logging.WARNING, "aiobrpc.training")
    r0 = _Rank0(timeout=0.5)
    try:
        out = np.zeros(100, np.float32)
        got = r0.m.recv(out, 1, 0)
        note = M.pack_note(M.DATA, 0, 1, 100, 400, "float32")
        # a frame that says 400 bytes follow, and ten come
        r0.ends[1].sendall(L._head(r0.peer_lanes[1].out_meta[0], M.NOTE + 400) + note + bytes(10))
        wait_until_sync(lambda: r0.m._peers[1].filling is not None)
        time.sleep(0.6)
        expired = r0.m.expire()
        assert len(expired) == 1 and expired[0].src == 1 and expired[0].future is got
        wait_until_sync(lambda: r0.reports)  # the shut lane is reported lost
        assert r0.reports[0][0].ranks == (1,) and not r0.reports[0][1]
        assert any("stopped coming" in r.getMessage() for r in caplog.records)
        assert not got.done()  # the group's diagnosis fails it (its own test below)
    finally:
        r0.close()


def test_an_announced_send_with_no_recv_times_out_naming_the_receiver():
    r0 = _Rank0(timeout=0.3)
    try:
        r0.write(1, M.CREDIT, numel=4)
        wait_until_sync(lambda: r0.m._peers[1].slots == 4)
        sent = r0.m.send(np.zeros(100, np.float32), 1, 0)  # past eager_bytes: announced
        time.sleep(0.4)
        assert r0.m.expire() == []
        with pytest.raises(CollectiveTimeout, match="rank 1 .*posted no recv") as info:
            sent.result(1)
        assert info.value.ranks == (1,)
    finally:
        r0.close()


def test_a_refused_or_declined_message_fails_both_ends_saying_why():
    r0 = _Rank0()
    try:
        r0.write(1, M.CREDIT, numel=4)
        wait_until_sync(lambda: r0.m._peers[1].slots == 4)
        sent = r0.m.send(np.zeros(100, np.float32), 1, 0)  # announced
        r0.write(1, M.REFUSE, 0, 1, 100, 800, "float64")
        with pytest.raises(CollectiveError, match="does not fit.*float64"):
            sent.result(5)
        got = r0.m.recv(np.zeros(100, np.float32), 1, 0)  # granted at once
        r0.write(1, M.DECLINE, 0, 1, 100, 800, "float64")
        with pytest.raises(CollectiveError, match="does not fit.*float64"):
            got.result(5)
        assert not r0.reports
    finally:
        r0.close()


def test_the_tables_a_peer_fills_are_bounded_and_emptied_by_the_recvs():
    r0 = _Rank0(max_messages=4, buffer_bytes=256)
    try:
        for t in range(4):
            _eager(r0, 1, tag=t, n=64)
        wait_until_sync(lambda: r0.m.unmatched_count()[1] == 4)
        assert r0.m.held_bytes()[1] == 256
        for t in range(4):
            assert r0.m.recv(np.zeros(64, np.uint8), 1, t).result(5) == 1
        assert r0.m.held_bytes()[1] == 0 and r0.m.unmatched_count()[1] == 0 and not r0.m._unmatched
        given = [n[4] for n in r0.notes(1, 1.0) if n[0] == M.CREDIT]
        assert given[0] == 256 and sum(given[1:]) == 256  # given at start, then given back
        assert not r0.reports
    finally:
        r0.close()


# -- groups on one loop ------------------------------------------------------------------------

async def test_messages_match_in_order_per_tag_from_a_rank_or_any(tmp_path):
    g0, g1 = groups = await _groups(tmp_path, segment_bytes=1 << 20)
    try:
        assert g0.messages is not None
        big = np.arange(3 << 20, dtype=np.uint8)
        out = np.zeros_like(big)
        got = g1.recv(out, 0, tag=7)  # granted at once: the send goes in one hop
        await _wait(g0.send(big, 1, tag=7))
        assert await _wait(got) == 0 and np.array_equal(out, big)
        sends = [g0.send(np.full(3, k, np.int64), 1, tag=k % 2) for k in range(4)]
        await _wait(asyncio.gather(*sends))
        outs = [np.zeros(3, np.int64) for _ in range(4)]
        for k in (1, 3, 0, 2):
            assert await _wait(g1.recv(outs[k], 0, tag=k % 2)) == 0
        assert [int(o[0]) for o in outs] == [0, 1, 2, 3]
        assert g1.messages.held_bytes() == [0, 0] and g1.messages.unmatched_count() == [0, 0]
        for tag, n in ((9, 2), (10, 1 << 20)):  # from any rank: eager, then announced
            a = np.zeros(n, np.float32)
            sent = g0.send(np.ones(n, np.float32), 1, tag=tag)
            await asyncio.sleep(0.05)
            assert await _wait(g1.recv(a, None, tag=tag)) == 0 and a.min() == 1
            await _wait(sent)
        assert not g0.broken and not g1.broken
    finally:
        await _close(groups)


async def test_held_bytes_never_pass_the_cap_and_the_sender_falls_back_to_announcing(tmp_path):
    cap = 10_000
    g0, g1 = groups = await _groups(tmp_path, p2p_buffer_bytes=cap)
    try:
        await wait_until(lambda: g0.messages.credit(1) == cap)
        msgs = [np.full(3000, k, np.uint8) for k in range(5)]  # 15 000 bytes: 3 fit, 2 wait
        sends = [g0.send(m, 1) for m in msgs]
        await wait_until(lambda: g1.messages.held_bytes()[0] == 9000 and g1.messages.unmatched_count()[0] == 5)
        await wait_until(lambda: sum(s.done() for s in sends) == 3)  # the eager ones, written
        await asyncio.sleep(0.2)
        assert sum(s.done() for s in sends) == 3 and g1.messages.held_bytes()[0] == 9000
        outs = [np.zeros(3000, np.uint8) for _ in msgs]
        for o in outs:
            await _wait(g1.recv(o, 0))
        await _wait(asyncio.gather(*sends))
        assert [int(o[0]) for o in outs] == list(range(5))
        assert g1.messages.held_bytes() == [0, 0]
    finally:
        await _close(groups)


async def test_a_sender_past_max_messages_waits_for_the_receivers_recvs_and_goes_on(tmp_path):
    g0, g1 = groups = await _groups(tmp_path, p2p_max_messages=4)
    try:
        await wait_until(lambda: g0.messages.credit(1) > 0)
        # More sends than the receiver holds before its recvs come (a loop of sends, or
        # isend of every tensor of a model): the fifth on waits here, none breaks anything.
        sends = [g0.send(np.full(3, t, np.int8), 1, tag=t % 3) for t in range(40)]
        await wait_until(lambda: g1.messages.unmatched_count()[0] == 4 and g0.messages.stalled_count() == 36)
        await asyncio.sleep(0.1)
        assert g0.broken is None and g1.broken is None and sum(s.done() for s in sends) <= 4
        outs = [np.zeros(3, np.int8) for _ in range(40)]
        got = [g1.recv(outs[t], 0, tag=t % 3) for t in range(40)]
        await _wait(asyncio.gather(*sends, *got))
        assert [int(o[0]) for o in outs] == list(range(40))
        assert g1.messages.unmatched_count() == [0, 0] and not g0.messages.stalled_count()
        await _still_talk(g1, g0)
    finally:
        await _close(groups)


async def test_a_send_that_waits_for_a_slot_times_out_naming_the_receiver(tmp_path):
    g0, g1 = groups = await _groups(tmp_path, timeout=0.5, p2p_max_messages=2)
    try:
        await wait_until(lambda: g0.messages.credit(1) > 0)
        first = [g0.send(np.zeros(1, np.int8), 1, tag=t) for t in range(2)]  # held by rank 1
        late = g0.send(np.zeros(1, np.int8), 1, tag=2)  # no slot: waits here
        await _wait(asyncio.gather(*first))
        with pytest.raises(CollectiveTimeout, match=r"rank 1 .*took none of the 2 messages waiting there") as info:
            await _wait(late)
        assert info.value.ranks == (1,) and g0.broken is None and not g0.messages.stalled_count()
    finally:
        await _close(groups)


def _gate_reader(monkeypatch, group, peer: int) -> threading.Event:
    """`group`'s reader takes the bytes of `peer`'s messages only once the event is set: they
    stay in the kernels meanwhile."""
    gate, gated = threading.Event(), group._lanes.mail[peer].sock
    real = M._read_into

    def gated_read(sock, view):
        if sock is gated:
            gate.wait(BOUND)
        real(sock, view)

    monkeypatch.setattr(M, "_read_into", gated_read)
    return gate


@pytest.mark.parametrize("size", [16 << 10, 1 << 20])  # eager, or announced
async def test_what_a_rank_sent_before_it_closed_reaches_a_peer_that_reads_it_later(tmp_path, monkeypatch, size):
    """A rank that sends and closes its group at once: what its sends wrote is still in its
    kernel while the peer reads slowly. Its close waits (bounded) for the peer to take it, as
    a socket closed with unread bytes in it resets and drops what it still held to send."""
    g0, g1 = groups = await _groups(tmp_path)
    gate = _gate_reader(monkeypatch, g0, 1)
    try:
        n = (12 << 20) // size  # past the kernels' buffers; fewer than the 1024 slots
        outs = [np.zeros(size, np.uint8) for _ in range(n)]
        got = [g0.recv(outs[i], 1, tag=i) for i in range(n)]
        await wait_until(lambda: g1.messages.credit(0) > 0)
        sends = [g1.send(np.full(size, i % 251, np.uint8), 0, tag=i) for i in range(n)]
        await wait_until(lambda: sum(s.done() for s in sends) >= 2)
        closing = asyncio.ensure_future(g1.close())
        await asyncio.sleep(0.3)
        gate.set()
        await _wait(closing)
        sent = [i for i, s in enumerate(sends) if s.done() and s.exception() is None]
        await _wait(asyncio.gather(*(got[i] for i in sent)))
        assert all(int(outs[i][0]) == int(outs[i][-1]) == i % 251 for i in sent)
        assert len(sent) == n  # the close waited for the writes its sends had begun
    finally:
        gate.set()
        await _close(groups)


async def test_a_close_waits_for_a_peer_that_does_not_read_only_so_long_and_says_so(tmp_path, monkeypatch, caplog):
    g0, g1 = groups = await _groups(tmp_path, timeout=0.5)
    gate = _gate_reader(monkeypatch, g0, 1)  # not opened until the test ends
    try:
        await wait_until(lambda: g1.messages.credit(0) > 0)
        for i in range(16):
            g1.send(np.full(64 << 10, i, np.uint8), 0, tag=i)  # eager: written, then held in the kernels
        await wait_until(lambda: g1.messages.unsent() > 0)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="aiobrpc.training.group"):
            await _wait(g1.close())
        assert time.monotonic() - t0 < BOUND
        assert "did not take within 0.5 s; they are dropped" in caplog.text
    finally:
        gate.set()
        await _close(groups)


async def test_the_messages_of_a_rank_that_closed_its_group_are_still_received(tmp_path):
    """Its sends were done: what it sent whole before its BYE stays for the recvs, from it or
    from any rank; a recv past them, or one posted before and never matched, fails naming it."""
    g0, g1, g2 = groups = await _groups(tmp_path, world=3)
    try:
        waiting = g1.recv(np.zeros(2, np.int8), 0, tag=9)  # never sent: fails once rank 0 left
        await _wait(asyncio.gather(*(g0.send(np.full(2, i, np.int8), 1, tag=i % 2) for i in range(4))))
        await wait_until(lambda: g1.messages.unmatched_count()[0] == 4)
        await g0.close()
        with pytest.raises(M.PeerClosed, match="rank 0 .* closed its group"):
            await _wait(waiting)
        await wait_until(lambda: g1.messages.left(0) is not None)
        outs = [np.zeros(2, np.int8) for _ in range(4)]
        assert await _wait(g1.recv(outs[0], 0, tag=0)) == 0
        assert await _wait(g1.recv(outs[1], None, tag=1)) == 0  # from any rank
        assert await _wait(g1.recv(outs[2], 0, tag=0)) == 0
        assert await _wait(g1.recv(outs[3], 0, tag=1)) == 0
        assert [int(o[0]) for o in outs] == [0, 1, 2, 3]
        assert g1.messages.held_bytes()[0] == 0 and g1.messages.unmatched_count()[0] == 0
        with pytest.raises(M.PeerClosed, match="rank 0 .* closed its group"):
            g1.recv(np.zeros(2, np.int8), 0, tag=0)
        assert g1.broken is None
        await _still_talk(g1, g2)
    finally:
        await _close(groups)


async def _still_talk(sender, receiver) -> None:
    """A message from `sender` reaches `receiver`: their lane works."""
    out = np.zeros(2, np.int8)
    got = receiver.recv(out, sender.rank)
    await _wait(sender.send(np.ones(2, np.int8), receiver.rank))
    assert await _wait(got) == sender.rank and out.tolist() == [1, 1]


@pytest.mark.parametrize("size", [10, 100_000])  # eager, or announced
@pytest.mark.parametrize("recv_first", [True, False])
async def test_a_message_that_does_not_fit_its_recv_fails_the_recv_and_a_waiting_sender(
        tmp_path, caplog, size, recv_first):
    g0, g1 = groups = await _groups(tmp_path)
    try:
        await wait_until(lambda: g0.messages.credit(1) > 0)
        out = np.zeros(size, np.int64)
        if recv_first:
            got = g1.recv(out, 0)
            await asyncio.sleep(0.05)
            sent = g0.send(np.ones(size, np.float64), 1)
        else:
            sent = g0.send(np.ones(size, np.float64), 1)
            await asyncio.sleep(0.2)
            got = g1.recv(out, 0)
        with pytest.raises(CollectiveError, match="does not fit.*float64.*int64|does not fit.*int64.*float64"):
            await _wait(got)
        if size == 10:  # eager: written (and done) before the receiver saw it
            await _wait(sent)
        else:
            with pytest.raises(CollectiveError, match="does not fit"):
                await _wait(sent)
        assert "does not fit" in caplog.text
        assert g0.broken is None and g1.broken is None  # only the messages fail
        await _still_talk(g0, g1)
    finally:
        await _close(groups)


async def test_a_dead_source_fails_the_pending_recvs_and_breaks_the_group_naming_it(tmp_path):
    g0, g1 = await _groups(tmp_path, timeout=5)
    try:
        got = g0.recv(np.zeros(4, np.float32), 1)
        anyone = g0.recv(np.zeros(4, np.float32), None, tag=5)
        await g1._server.stop()  # what a killed process looks like: no Status answer, its lanes closed
        g1._lanes.abort(CollectiveError("killed"))
        for fut in (got, anyone):
            with pytest.raises(CollectiveError, match="rank 1 .*closed its message lane or is gone") as info:
                await _wait(fut, 10)
            assert info.value.ranks == (1,)
        assert g0.broken is not None and g0.broken.ranks == (1,)
    finally:
        await _close([g0, g1])


async def test_a_peer_that_closes_its_group_fails_what_waits_on_it_and_the_group_goes_on(tmp_path):
    groups = await _groups(tmp_path, world=3, timeout=5)
    g0, g1, g2 = groups
    try:
        got = g0.recv(np.zeros(4, np.float32), 1)
        await g1.close()
        with pytest.raises(CollectiveError, match="rank 1") as info:
            await _wait(got, 10)
        assert info.value.ranks == (1,)
        with pytest.raises(CollectiveError):  # later ones at once
            g0.recv(np.zeros(4, np.float32), 1)
        assert g0.broken is None  # rank 2 is still there to talk to
        await _still_talk(g2, g0)
    finally:
        await _close(groups)


async def test_a_peer_whose_group_broke_gives_its_reason_to_the_recvs_waiting_on_it(tmp_path):
    g0, g1 = groups = await _groups(tmp_path, timeout=5)
    try:
        got = g0.recv(np.zeros(4, np.float32), 1)
        g1._fail(CollectiveError("rank 1 found something wrong", (1,)), tell_peers=False)
        with pytest.raises(CollectiveError, match="something wrong.*reported to rank 0 by rank 1"):
            await _wait(got, 10)
    finally:
        await _close(groups)


async def test_a_peer_whose_group_broke_and_that_left_at_once_is_not_taken_for_dead(tmp_path):
    """Its group broken (a timeout is not told), a rank exits at once: it said BYE as its group
    broke, so its peers fail what waits on it and go on (before, finding it gone, an idle peer
    broke its group blaming it, and told every rank so)."""
    groups = await _groups(tmp_path, world=3, timeout=5)
    g0, g1, g2 = groups
    try:
        got = g0.recv(np.zeros(4, np.float32), 1)
        g1._fail(CollectiveTimeout("rank 1 found rank 2 hung", (2,)), tell_peers=False)
        await g1.close()
        with pytest.raises(CollectiveError, match="rank 1") as info:
            await _wait(got, 10)
        assert info.value.ranks == (2,) and isinstance(info.value, CollectiveTimeout), info.value  # its reason
        assert "rank 1 found rank 2 hung (reported to rank 0 by rank 1)" in str(info.value)
        await asyncio.sleep(0.3)  # what the lane's loss set off has run
        assert g0.broken is None and g2.broken is None
        await _still_talk(g2, g0)
    finally:
        await _close(groups)


def test_a_bye_says_closed_or_broke_and_nothing_else():
    assert M.parse_note(M.pack_note(M.BYE, 0, 0, 1))[3] == 1
    with pytest.raises(M.LaneError, match="BYE note of 2 elements"):
        M.parse_note(M.pack_note(M.BYE, 0, 0, 2))


def test_a_bye_carries_the_broken_groups_reason_whole_or_cut_to_fit():
    err = CollectiveTimeout("all_reduce #3 timed out on rank 2: rank 1 did not answer", (1,))
    assert M.parse_reason(M.pack_reason(err, 3), 3) == (True, (1,), str(err))
    long = CollectiveError("é" * 5000, (0, 2, 7))  # a rank not of the group is left out
    timed_out, ranks, text = M.parse_reason(M.pack_reason(long, 3), 3)
    assert (timed_out, ranks) == (False, (0, 2)) and len(M.pack_reason(long, 3)) <= M.MAX_REASON
    assert text and set(text) == {"é"}  # cut on a character, not inside one


def test_a_peer_that_says_its_group_broke_makes_what_is_tried_with_it_raise_its_reason():
    """Its reason is in its BYE: a send or recv tried with it afterwards names the culprit it
    found, not the peer (which its Abort, still on its way, would say too late)."""
    r0 = _Rank0()
    try:
        waiting = r0.m.recv(np.zeros(2, np.uint8), 1, 0)
        _bye(r0, M.pack_reason(CollectiveError("rank 1 found rank 2 dead", (2,)), 3))
        wait_until_sync(lambda: r0.reports)
        bye, fatal = r0.reports[0]
        assert not fatal and isinstance(bye, M.PeerBroke) and bye.ranks == (1,)
        assert bye.reason.ranks == (2,) and r0.m.left(1) is bye
        with pytest.raises(CollectiveError, match=r"rank 1 found rank 2 dead \(reported to rank 0 by rank 1\)") as info:
            r0.m.send(np.zeros(1), 1, 0)
        assert info.value.ranks == (2,)
        assert not waiting.done()  # what waits fails once the group has heard it (fail_peer)
    finally:
        r0.close()


async def test_a_recv_with_no_send_times_out_without_breaking_the_group(tmp_path):
    g0, g1 = groups = await _groups(tmp_path, timeout=1)
    try:
        for src in (1, None):
            with pytest.raises(CollectiveTimeout, match="no matching send"):
                await _wait(g0.recv(np.zeros(1, np.int8), src, tag=3), 10)
        assert g0.broken is None
        out = np.zeros(1, np.int8)
        got = g0.recv(out, 1)
        await _wait(g1.send(np.ones(1, np.int8), 0))
        await _wait(got)
        late = g1.send(np.ones(1, np.int8), 0, tag=3)  # the timed-out recv's message: dropped
        await _wait(late)
        await asyncio.sleep(0.1)
        assert g0.broken is None and g0.messages.held_bytes() == [0, 0]
    finally:
        await _close(groups)


async def test_world_3_any_source_takes_each_sender_once(tmp_path):
    groups = await _groups(tmp_path, world=3)
    try:
        outs = [np.zeros(5, np.int32) for _ in range(4)]
        recvs = [groups[0].recv(o, None, tag=1) for o in outs]
        sends = [groups[r].send(np.full(5, r * 10 + k, np.int32), 0, tag=1) for r in (1, 2) for k in range(2)]
        srcs = await _wait(asyncio.gather(*recvs))
        await _wait(asyncio.gather(*sends))
        assert sorted(srcs) == [1, 1, 2, 2]
        got = {r: [int(o[0]) for o, s in zip(outs, srcs) if s == r] for r in (1, 2)}
        assert got == {1: [10, 11], 2: [20, 21]}  # per sender, in the order sent
    finally:
        await _close(groups)

