"""A group's lanes (lanes.py): all_to_all carried on a connection per pair of ranks, read and
written by blocking threads. The same results as the message path; a peer that dies, stalls,
sends what does not fit or breaks the framing fails the exchange naming it, within the group's
timeout; the lane port refuses what is not a lane of this group and is closed once the lanes
are open."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time

import numpy as np
import pytest

from aiobrpc.controller import Controller
from aiobrpc.protocol import streaming
from aiobrpc.training import CollectiveError, CollectiveTimeout
from aiobrpc.training import lanes as L
from aiobrpc._proto import collective_pb2 as pb
from tests.helpers.waiting import wait_until
from tests.training.inloop import close_groups as _close, make_groups as _groups

BOUND = 20


def _parts(world, sizes, dtype):
    ins = {r: [(np.arange(sizes(r, j)) % 1000 + 100 * r + 10 * j).astype(dtype) for j in range(world)]
           for r in range(world)}
    outs = {r: [np.zeros(sizes(j, r), dtype) for j in range(world)] for r in range(world)}
    return ins, outs


@pytest.mark.parametrize("world", [2, 3, 4])
async def test_all_to_all_on_lanes_gives_the_message_paths_result(tmp_path, world):
    sizes = lambda i, j: (i * 7 + j * 3) % 5 * 40_000  # uneven, zero for some pairs, past socket buffers
    results = {}
    for lanes in (True, False):
        groups = await _groups(tmp_path / str(lanes), world=world, lanes=lanes)
        try:
            assert all((g._lanes is not None) == lanes for g in groups)
            for dtype in (np.float16, np.int64, np.uint8):
                ins, outs = _parts(world, sizes, dtype)
                await asyncio.wait_for(asyncio.gather(*(g.all_to_all(outs[g.rank], ins[g.rank]) for g in groups)),
                                       BOUND)
                for r in range(world):
                    for j in range(world):
                        assert np.array_equal(outs[r][j], ins[j][r])
                results[lanes, np.dtype(dtype).name] = [[a.tobytes() for a in outs[r]] for r in range(world)]
            if lanes:  # the bytes came on the lanes, straight into the outputs
                assert sum(g._lanes.bytes_received for g in groups) > 0
            # ring collectives and messages still line up after lane exchanges
            t = {r: np.full(4, float(r)) for r in range(world)}
            await asyncio.wait_for(asyncio.gather(*(g.all_reduce(t[g.rank]) for g in groups)), BOUND)
            assert t[0].tolist() == [sum(range(world))] * 4
        finally:
            await _close(groups)
    assert {k[1]: v for k, v in results.items() if k[0]} == {k[1]: v for k, v in results.items() if not k[0]}


async def test_lanes_carry_torch_dtypes_bitwise(tmp_path):
    torch = pytest.importorskip("torch")
    groups = await _groups(tmp_path)
    try:
        for dtype in (torch.bfloat16, torch.int64, torch.bool, torch.complex64):
            ins = {r: [(torch.arange(6) * (r + 1) + j).to(dtype) for j in range(2)] for r in range(2)}
            outs = {r: [torch.zeros(6, dtype=dtype) for _ in range(2)] for r in range(2)}
            await asyncio.wait_for(asyncio.gather(*(g.all_to_all(outs[g.rank], ins[g.rank]) for g in groups)), BOUND)
            for r in range(2):
                for j in range(2):
                    assert torch.equal(outs[r][j], ins[j][r])
    finally:
        await _close(groups)


async def test_a_size_mismatch_fails_the_receiver_naming_the_peer_and_breaks_the_group(tmp_path):
    groups = await _groups(tmp_path)
    try:
        ins = {0: [np.zeros(4, np.float32), np.ones(5, np.float32)], 1: [np.ones(6, np.float32), np.zeros(4, np.float32)]}
        outs = {0: [np.zeros(4, np.float32), np.zeros(5, np.float32)],  # rank 1 sends 6
                1: [np.zeros(5, np.float32), np.zeros(4, np.float32)]}
        got = await asyncio.wait_for(asyncio.gather(*(g.all_to_all(outs[g.rank], ins[g.rank]) for g in groups),
                                                    return_exceptions=True), BOUND)
        assert isinstance(got[0], CollectiveError), got
        assert "rank 1 sent exchange #1's part 0, 6 float32" in str(got[0]) and "receives part 0, 5 float32" in str(got[0])
        # rank 1 got what it expected (or lost its lane as rank 0 shut it); rank 0's Abort breaks
        # its group too
        await wait_until(lambda: groups[1].broken is not None, timeout=BOUND)
        assert "rank 1 sent exchange #1's part 0, 6 float32" in str(groups[1].broken) or "rank 0" in str(groups[1].broken)
        with pytest.raises(CollectiveError):
            groups[0].all_to_all(outs[0], ins[0])
    finally:
        await _close(groups)


async def test_a_rank_that_never_comes_times_out_naming_it(tmp_path):
    groups = await _groups(tmp_path, world=3, timeout=1.0)
    try:
        ins = {r: [np.ones(1000, np.int32) for _ in range(3)] for r in range(3)}
        outs = {r: [np.zeros(1000, np.int32) for _ in range(3)] for r in range(3)}
        t0 = time.monotonic()
        got = await asyncio.wait_for(asyncio.gather(*(groups[r].all_to_all(outs[r], ins[r]) for r in (0, 1)),
                                                    return_exceptions=True), BOUND)
        assert time.monotonic() - t0 < 1.0 + 5.0
        assert all(isinstance(e, CollectiveError) for e in got), got
        assert any(isinstance(e, CollectiveTimeout) and 2 in e.ranks for e in got), got
    finally:
        await _close(groups)


async def test_a_rank_that_dies_mid_exchange_fails_its_peers_naming_it(tmp_path):
    groups = await _groups(tmp_path, world=3, timeout=30.0)
    try:
        n = 4 << 20  # more than the sockets hold: the senders are mid-message when rank 2 goes
        ins = {r: [np.ones(n, np.uint8) for _ in range(3)] for r in range(3)}
        outs = {r: [np.zeros(n, np.uint8) for _ in range(3)] for r in range(3)}
        runs = [groups[r].all_to_all(outs[r], ins[r]) for r in (0, 1)]
        await asyncio.sleep(0.2)
        for lane in groups[2]._lanes._lanes:  # rank 2's process is gone: its sockets close
            if lane is not None:
                lane.sock.close()
        t0 = time.monotonic()
        got = await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), BOUND)
        assert time.monotonic() - t0 < 10  # at once, not at the 30 s timeout
        assert all(isinstance(e, CollectiveError) and not isinstance(e, CollectiveTimeout) for e in got), got
        assert any(2 in e.ranks and "rank 2" in str(e) for e in got), got
    finally:
        await _close(groups)


def _lane_pair(timeout=5.0):
    """Two ends of a lane, opened by the real code in threads: (rank 0's Lanes, rank 1's)."""
    a, b = L.Lanes(0, 2, "127.0.0.1"), L.Lanes(1, 2, "127.0.0.1")
    a.group_id = b.group_id = "g"
    addresses = [a.address, b.address]
    errs = []
    t = threading.Thread(target=lambda: _catch(errs, b.open, addresses, timeout))
    t.start()
    a.open(addresses, timeout)
    t.join()
    assert not errs, errs
    return a, b


def _catch(errs, fn, *args):
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001
        errs.append(e)


def _recv_with(frames: bytes, numel=3, dtype="float32", seq=1):
    """Rank 0 receives exchange #seq from rank 1, whose lane writes `frames`: what it raised or got."""
    a, b = _lane_pair()
    try:
        b._lanes[0].sock.sendall(frames)
        out = np.zeros(numel, np.float32 if dtype == "float32" else np.uint8)
        try:
            a.recv_message(a._lanes[1], seq, 0, (dtype, numel, out.view(np.uint8)), L.Deadline(time.monotonic() + 1.0, "t"))
        except CollectiveError as e:
            return e
        return out
    finally:
        a.close()
        b.close()


def _msg(payload: bytes, seq=1, part=0, numel=3, nbytes=12, dtype="float32", mine=2, theirs=1, continues=False) -> bytes:
    desc = L.pack_descriptor(seq, part, numel, nbytes, dtype)
    return L.frame_head(mine, theirs, len(desc) + len(payload), continues) + desc + payload


def _with_byte(b: bytes, at: int, value: int) -> bytes:
    return b[:at] + bytes([value]) + b[at + 1:]


DATA = np.arange(3, dtype=np.float32).tobytes()
HOSTILE = {
    "bad magic": b"PRPC" + _msg(DATA)[4:],
    "meta larger than body": b"STRM" + (4).to_bytes(4, "big") + (9).to_bytes(4, "big") + b"x" * 9,
    "a huge frame": b"STRM" + (0xFFFFFFFF).to_bytes(4, "big") + (6).to_bytes(4, "big") + b"\0" * 6,
    "a close frame": streaming.close_frame(1, 2),
    "an rst frame": streaming.rst_frame(1),
    "a feedback frame": streaming.feedback_frame(1, 2, 10),
    "another stream": _msg(DATA, mine=3),
    "another exchange": _msg(DATA, seq=2),
    "another part": _msg(DATA, part=1),
    "another dtype": _msg(DATA, dtype="int32"),
    "more bytes than announced": _msg(DATA + b"\0" * 4, nbytes=12),
    "a continuation past the message": _msg(DATA, continues=True) + L.frame_head(2, 1, 4, False) + b"\0" * 4,
    "a message that ends short": _msg(DATA[:8]),
    "empty frames that continue": _msg(b"", continues=True) + L.frame_head(2, 1, 0, True) * 3,
    "a dtype name past its field": _with_byte(_msg(DATA), 12 + len(streaming.data_meta(1, 2)) + 28, 200),
    "silence": b"",
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_frames_on_a_lane_fail_the_exchange_naming_the_peer(case, caplog):
    caplog.set_level(logging.WARNING, "aiobrpc.training.lanes")
    got = _recv_with(HOSTILE[case])
    assert isinstance(got, CollectiveError), got
    assert "rank 1" in str(got)
    # a peer that breaks the protocol is blamed (and not told); a mismatch blames no one
    assert got.ranks == (() if case in ("another exchange", "another part", "another dtype") else (1,))
    if case == "silence":
        assert isinstance(got, CollectiveTimeout)
    elif case in ("another exchange", "another part", "another dtype"):
        assert "every rank must call the same collectives" in str(got)
    else:
        assert "broke the lane protocol" in str(got)
        assert any("lane from rank 1" in r.getMessage() for r in caplog.records)


def test_a_message_in_several_frames_lands_whole():
    frames = (_msg(DATA[:4], continues=True) + L.frame_head(2, 1, 4, True) + DATA[4:8]
              + L.frame_head(2, 1, 4, False) + DATA[8:])
    got = _recv_with(frames)
    assert not isinstance(got, Exception), got
    assert got.tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("nbytes", [0, 1, L.SEND_CHUNK, L.SEND_CHUNK + 1, 3 * L.SEND_CHUNK + 4])
def test_a_large_buffer_is_written_in_pieces_that_make_it_whole(nbytes):
    data = (np.arange(nbytes // 4 + 1, dtype=np.float32) * 3)[: nbytes // 4]  # a typed buffer, not bytes
    raw = data.tobytes()
    got = L.pieces(data)
    assert all(0 < memoryview(p).nbytes <= L.SEND_CHUNK for p in got) or not raw
    assert b"".join(bytes(p) for p in got) == raw
    assert len(got) == max(1, -(-len(raw) // L.SEND_CHUNK))


HANDSHAKES = {
    "garbage": b"GET / HTTP/1.1\r\n\r\n",
    "another group": L.open_request("other", 0, 1),
    "another rank": L.open_request("g", 0, 0),
    "a rank not below": L.open_request("g", 1, 1),
    "another method": L.open_request("g", 0, 1).replace(b"Lane", b"Send"),
    "too long": b"PRPC" + (L.HANDSHAKE_MAX + 1).to_bytes(4, "big") + (4).to_bytes(4, "big"),
    "silence": b"",
}


def _rank_1_opening(timeout: float):
    """Lanes of ranks 0 and 1 of group "g"; rank 1 opening its (accepting its port) on a thread."""
    b = L.Lanes(1, 2, "127.0.0.1")
    b.group_id = "g"
    a = L.Lanes(0, 2, "127.0.0.1")
    a.group_id = "g"
    addresses = [a.address, b.address]
    errs: list = []
    t = threading.Thread(target=lambda: _catch(errs, b.open, addresses, timeout))
    t.start()
    return a, b, addresses, errs, t


def test_the_lane_port_refuses_strangers_then_opens_the_real_lane(caplog, monkeypatch):
    caplog.set_level(logging.WARNING, "aiobrpc.training.lanes")
    monkeypatch.setattr(L, "HANDSHAKE_TIMEOUT_S", 0.3)
    a, b, addresses, errs, t = _rank_1_opening(10.0)
    answers = {}
    host, port = b.address.rsplit(":", 1)
    for name, data in HANDSHAKES.items():
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(data)
            s.settimeout(5)
            got = b""
            try:
                while chunk := s.recv(4096):  # answered (or not) and closed, never kept
                    got += chunk
            except ConnectionResetError:  # closed with some of what was sent unread
                pass
            answers[name] = got
    a.open(addresses, 10.0)
    t.join()
    try:
        assert not errs, errs
        assert b._lanes[0] is not None and a._lanes[1] is not None
        for name in ("another group", "another rank", "a rank not below", "another method"):
            assert b"PRPC" in answers[name][:4], name  # a refusal the opener can read
        assert sum("refused a connection" in r.getMessage() for r in caplog.records) == len(HANDSHAKES)
        with pytest.raises(OSError):  # the port is closed once the lanes are open
            socket.create_connection((host, int(port)), timeout=2).close()
    finally:
        a.close()
        b.close()


def test_a_flood_of_strangers_on_the_lane_port_logs_a_bounded_number_of_lines(caplog, monkeypatch):
    from aiobrpc.transport import tcp
    caplog.set_level(logging.WARNING, "aiobrpc.training.lanes")
    monkeypatch.setattr(L, "REFUSALS_LOGGED_PER_S", 3)
    monkeypatch.setattr(tcp, "_LOG_INTERVAL", 3600.0)  # one window for the whole test
    a, b, addresses, errs, t = _rank_1_opening(30.0)
    host, port = b.address.rsplit(":", 1)
    for _ in range(30):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(HANDSHAKES["garbage"])
            s.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                while s.recv(4096):  # refused and closed
                    pass
    a.open(addresses, 10.0)
    t.join()
    try:
        assert not errs, errs
        assert b._lanes[0] is not None  # the real lane opened after the flood
        assert sum("refused a connection" in r.getMessage() for r in caplog.records) == 3
        assert b._refusal_log.suppressed == 27
    finally:
        a.close()
        b.close()


def test_an_opener_refused_says_why():
    b = L.Lanes(1, 2, "127.0.0.1")
    b.group_id = "the real group"
    a = L.Lanes(0, 2, "127.0.0.1")
    a.group_id = "a stale group"
    addresses = [a.address, b.address]
    t = threading.Thread(target=lambda: _catch([], b.open, addresses, 1.5))
    t.start()
    try:
        with pytest.raises(CollectiveError, match="refused.*not this group"):
            a.open(addresses, 5.0)
    finally:
        t.join()
        a.close()
        b.close()


async def test_the_servers_lane_method_refuses(tmp_path):
    groups = await _groups(tmp_path)
    try:
        ack = await groups[0]._stub(1).Lane(pb.LaneRequest(group=groups[0].id, src=0, dst=1), Controller(timeout_ms=2000))
        assert "lane port" in ack.error
    finally:
        await _close(groups)


def test_sans_io_round_trips():
    assert L.parse_open_request(*_split(L.open_request("grp", 2, 5))) == ("grp", 2, 5, 3, L.EXCHANGES)
    assert L.parse_open_request(*_split(L.open_request("grp", 2, 5, L.MESSAGES))) == ("grp", 2, 5, 3, L.MESSAGES)
    with pytest.raises(L.LaneError, match="kind 7"):
        L.parse_open_request(*_split(L.open_request("grp", 2, 5, 7)))
    assert L.parse_open_response(*_split(L.open_response(5))) == 6
    with pytest.raises(L.LaneError, match="refused: \\[E1003\\]no"):
        L.parse_open_response(*_split(L.open_response(5, "no")))
    assert L.parse_descriptor(L.pack_descriptor(7, 2, -1, 0, "bfloat16")) == (7, 2, -1, 0, "bfloat16")
    with pytest.raises(ValueError):
        L.pack_descriptor(1, 0, 1, 1, "x" * 65)
    assert L.check_data_meta(streaming.data_meta(4, 9, True), 4, 9) is True


def _split(frame: bytes):
    body, meta = L.parse_header(frame[:12], b"PRPC", L.HANDSHAKE_MAX)
    return frame[12:12 + meta], frame[12 + meta:12 + body]


@pytest.mark.parametrize("world", [2, 3, 4])
async def test_ring_collectives_on_lanes_equal_those_on_calls(tmp_path, world):
    """Bitwise the same results either way: every reduce op, half precision summed wide,
    sizes that leave some ranks empty chunks, segments smaller than a chunk."""
    rng = np.random.default_rng(world)
    data = {r: {"f32": rng.standard_normal(1001).astype(np.float32),
                "f16": rng.standard_normal(37).astype(np.float16),
                "i64": rng.integers(-50, 50, 3).astype(np.int64)} for r in range(world)}
    results = {}
    for lanes in (True, False):
        groups = await _groups(tmp_path / str(lanes), world=world, lanes=lanes, segment_bytes=256)
        out = results[lanes] = []
        try:
            async def each(fn):
                return await asyncio.wait_for(asyncio.gather(*(fn(g) for g in groups)), BOUND)
            for op in ("sum", "avg", "max", "min", "product"):
                t = {r: data[r]["f32"].copy() for r in range(world)}
                await each(lambda g: g.all_reduce(t[g.rank], op))
                out.append([t[r].tobytes() for r in range(world)])
            for op in ("sum", "band", "bxor"):
                t = {r: data[r]["i64"].copy() for r in range(world)}
                await each(lambda g: g.all_reduce(t[g.rank], op))
                out.append([t[r].tobytes() for r in range(world)])
            t = {r: data[r]["f16"].copy() for r in range(world)}
            await each(lambda g: g.all_reduce(t[g.rank]))
            out.append([t[r].tobytes() for r in range(world)])
            parts = await each(lambda g: g.reduce_scatter(data[g.rank]["f32"].copy()))
            out.append([p.tobytes() for p in parts])
            gathered = await each(lambda g: g.all_gather(data[g.rank]["i64"]))
            out.append([np.asarray(a).tobytes() for a in gathered])
            t = {r: data[r]["f16"].copy() for r in range(world)}
            await each(lambda g: g.broadcast(t[g.rank], root=world - 1))
            out.append([t[r].tobytes() for r in range(world)])
            await each(lambda g: g.barrier())
            if lanes:
                assert all(g.segments_placed > 0 for g in groups)
        finally:
            await _close(groups)
    assert results[True] == results[False]
    assert results[True][0][0] == results[True][0][-1]  # every rank has the same sum


async def test_a_callers_mistake_raises_at_once_and_leaves_the_group_usable(tmp_path):
    groups = await _groups(tmp_path)
    try:
        g = groups[0]
        with pytest.raises(ValueError, match="cannot go into"):
            g.all_to_all([np.zeros(3, np.int32), np.zeros(2)], [np.zeros(4, np.int32), np.zeros(2)])
        with pytest.raises(ValueError, match="not C-contiguous"):
            g.all_to_all([np.zeros(3), np.zeros((4, 4))[:, 0]], [np.zeros(3), np.zeros(4)])
        with pytest.raises(TypeError, match="numpy array or a torch CPU tensor"):
            g.all_to_all([np.zeros(3), [1, 2]], [np.zeros(3), np.zeros(2)])
        assert g.broken is None
        ins = {r: [np.full(2, 10.0 * r + j) for j in range(2)] for r in range(2)}
        outs = {r: [np.zeros(2) for _ in range(2)] for r in range(2)}
        await asyncio.wait_for(asyncio.gather(*(x.all_to_all(outs[x.rank], ins[x.rank]) for x in groups)), BOUND)
        assert outs[0][1].tolist() == [10.0, 10.0] and outs[1][0].tolist() == [1.0, 1.0]
    finally:
        await _close(groups)


@pytest.mark.parametrize("world", [2, 3, 4])
async def test_gather_and_scatter_on_lanes_equal_those_on_calls(tmp_path, world):
    results = {}
    for lanes in (True, False):
        groups = await _groups(tmp_path / str(lanes), world=world, lanes=lanes)
        try:
            root = world - 1
            outs = [np.zeros(50_000 + r, np.int32) for r in range(world)]  # uneven, past socket buffers
            await asyncio.wait_for(asyncio.gather(*(
                g.gather(np.arange(50_000 + g.rank, dtype=np.int32) * (g.rank + 1), outs if g.rank == root else None, root)
                for g in groups)), BOUND)
            got = {r: np.zeros(3 + r, np.float64) for r in range(world)}
            ins = [np.full(3 + r, r + 0.25) for r in range(world)]
            await asyncio.wait_for(asyncio.gather(*(
                g.scatter(got[g.rank], ins if g.rank == 0 else None, 0) for g in groups)), BOUND)
            results[lanes] = ([o.tobytes() for o in outs], [got[r].tobytes() for r in range(world)])
            assert results[lanes][1] == [a.tobytes() for a in ins]
        finally:
            await _close(groups)
    assert results[True] == results[False]


async def test_a_gather_of_another_size_fails_the_root_naming_the_rank(tmp_path):
    groups = await _groups(tmp_path, world=3)
    try:
        outs = [np.zeros(4) for _ in range(3)]
        got = await asyncio.wait_for(asyncio.gather(*(
            g.gather(np.zeros(5 if g.rank == 2 else 4), outs if g.rank == 0 else None, 0) for g in groups),
            return_exceptions=True), BOUND)
        assert isinstance(got[0], CollectiveError) and "rank 2 sent" in str(got[0]) and "5 float64" in str(got[0])
        await wait_until(lambda: all(g.broken is not None for g in groups), timeout=BOUND)
    finally:
        await _close(groups)


def test_the_torch_backend_takes_lanes_from_the_environment(monkeypatch):
    pytest.importorskip("torch")
    from aiobrpc.training.torch_backend import lanes_wanted
    monkeypatch.delenv("AIOBRPC_LANES", raising=False)
    assert lanes_wanted() is True
    monkeypatch.setenv("AIOBRPC_LANES", "0")
    assert lanes_wanted() is False
    monkeypatch.setenv("AIOBRPC_LANES", "off")
    with pytest.raises(ValueError, match="AIOBRPC_LANES must be 0 or 1, got 'off'"):
        lanes_wanted()


def test_an_opener_not_answered_in_time_says_so():
    """A lane port that accepts but never answers (here: a bare listening socket)."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        a = L.Lanes(0, 2, "127.0.0.1")
        a.group_id = "g"
        try:
            with pytest.raises(CollectiveTimeout, match="could not open its lane to rank 1 .*no answer in time"):
                a.open([a.address, f"127.0.0.1:{silent.getsockname()[1]}"], 0.5)
        finally:
            a.close()


def test_an_opener_reset_says_so():
    """A lane port that closes the connection at once."""
    with socket.create_server(("127.0.0.1", 0)) as rude:
        def reset():
            conn, _ = rude.accept()
            conn.close()
        t = threading.Thread(target=reset)
        t.start()
        a = L.Lanes(0, 2, "127.0.0.1")
        a.group_id = "g"
        try:
            with pytest.raises(CollectiveError, match="could not open its lane to rank 1") as info:
                a.open([a.address, f"127.0.0.1:{rude.getsockname()[1]}"], 5.0)
            assert not isinstance(info.value, CollectiveTimeout) and info.value.ranks == (1,)
        finally:
            t.join()
            a.close()
