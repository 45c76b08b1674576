"""Replay the client side of the streaming golden captures against an aiobrpc server, frame by
frame, and compare what it sends with what the C++ server sent.

The client's frames are sent in capture order; before each, the replay waits for the server's
frames that preceded it in the capture (not counting FEEDBACK, see below), as the C++ client
did. What legitimately differs, and how it is compared:

* Server stream ids: C++ chose 8589934592 (then 2, 3), aiobrpc's are its own. The replay reads
  ours from the wrapped response's `stream_settings` and maps them both ways: the client's
  frames are re-addressed to our ids, and our frames are compared after mapping ours back.
  Every other byte of a STRM frame must be equal (header, meta field order, payload).
* `calls_served` in the wrapped response: 2 in the capture (the C++ server ran the exchange
  once before, uncaptured, so that its ids differ from the client's), 1 here. Every other
  field of the inner PRPC response is compared as in test_replay_server.py.
* FEEDBACK: one per consumed batch (spec §5). C++ consumed the three messages that arrived in
  one segment one by one (12, 1012, 1015); aiobrpc reads every message that arrived in one
  loop turn as one batch, so it may send fewer. Each FEEDBACK of ours must be, byte for byte,
  one the capture has for its stream, in the same order, and the last one must be the
  capture's last (the same cumulative consumed_size). Their place between DATA frames races
  in C++ too; every other frame is compared in order.
"""

from __future__ import annotations

import asyncio
import struct

import pytest

import aiobrpc
from aiobrpc._proto import brpc_streaming_pb2
from aiobrpc.protocol import baidu_std
from tests.helpers.golden import meta_to_dict
from tests.helpers.interop_server import InteropEcho
from tests.helpers.waiting import wait_until
from tests.helpers.wire import load_golden
from tests.interop.test_replay_server import STREAMING, _compare

FEEDBACK = 4
_Meta = brpc_streaming_pb2.StreamFrameMeta


def _frames(buf: bytes) -> list:
    """(magic, meta bytes, payload bytes) of each frame in `buf` (whole frames only)."""
    out, pos = [], 0
    while pos + 12 <= len(buf):
        body, meta_size = struct.unpack(">II", buf[pos + 4:pos + 12])
        if pos + 12 + body > len(buf):
            break
        start = pos + 12
        out.append((buf[pos:pos + 4], buf[start:start + meta_size], buf[start + meta_size:start + body]))
        pos = start + body
    return out


def _reframe(meta: _Meta, payload: bytes) -> bytes:
    m = meta.SerializeToString()
    return b"STRM" + struct.pack(">II", len(m) + len(payload), len(m)) + m + payload


def _remap(meta_bytes: bytes, payload: bytes, ids: dict) -> bytes:
    """The STRM frame with its stream ids mapped through `ids` (unmapped ids stay)."""
    meta = _Meta.FromString(meta_bytes)
    # Ours must already be protobuf's canonical encoding (C++'s), or re-encoding would hide a difference.
    assert meta.SerializeToString() == meta_bytes, meta_bytes.hex()
    for field in ("stream_id", "source_stream_id"):
        if meta.HasField(field):
            setattr(meta, field, ids.get(getattr(meta, field), getattr(meta, field)))
    return _reframe(meta, payload)


class _Peer:
    """The replaying client: a raw connection and every frame the server sent so far."""

    def __init__(self, reader, writer) -> None:
        self.reader, self.writer = reader, writer
        self.buf = b""
        self.frames: list = []

    async def until(self, count, timeout: float = 5.0) -> None:
        """Read until `count(self.frames)` is true."""
        async def loop():
            while not count(self.frames):
                chunk = await self.reader.read(65536)
                assert chunk, f"the server closed early; frames so far: {self.frames}"
                self.buf += chunk
                self.frames = _frames(self.buf)
        await asyncio.wait_for(loop(), timeout)

    async def rest(self, timeout: float = 5.0) -> None:
        """Everything until the server closes."""
        async def loop():
            while chunk := await self.reader.read(65536):
                self.buf += chunk
        await asyncio.wait_for(loop(), timeout)
        self.frames = _frames(self.buf)
        assert sum(len(m) + len(p) + 12 for _, m, p in self.frames) == len(self.buf), "a truncated frame"


def _not_feedback(frames) -> int:
    return sum(1 for f in frames if _Meta.FromString(f[1]).frame_type != FEEDBACK)


def _inner(payload: bytes):
    """Our wrapped response decoded as a PRPC frame."""
    dec = baidu_std.Decoder(baidu_std.CLIENT)
    dec.feed(payload)
    (ev,) = dec.events()
    return ev


@pytest.mark.parametrize("name", STREAMING)
async def test_replay_streaming_against_our_server(name):
    cap = load_golden(name)
    servicer = InteropEcho()
    server = aiobrpc.Server(aiobrpc.ServerOptions(server_tag="127.0.0.1:9110"))
    server.add_service(servicer)
    await server.start("127.0.0.1:0")
    try:
        peer = _Peer(*await asyncio.open_connection("127.0.0.1", server.port))
        try:
            await _replay(cap, peer)
        finally:
            peer.writer.close()
        await asyncio.sleep(0.05)
        await wait_until(lambda: server.stream_count() == 0)
        assert server.stream_count() == 0
    finally:
        await server.stop()
        await server.join(timeout=2)


async def _replay(cap: dict, peer: _Peer) -> None:
    c2s = bytes.fromhex(cap["c2s_hex"])
    theirs = [f for f in cap["frames"] if f["dir"] == "s2c"]
    wrapped = theirs[0]["inner_frame"]
    their_ids = _offered(wrapped["meta_decoded"])
    ours_to_theirs: dict = {}
    theirs_to_ours: dict = {}
    seen_s2c = 0
    for i, f in enumerate(cap["frames"]):
        if f["dir"] == "s2c":
            seen_s2c += f["frame_type_name"] != "FEEDBACK"
            continue
        await peer.until(lambda frames, n=seen_s2c: _not_feedback(frames) >= n)
        if seen_s2c and not theirs_to_ours and their_ids:
            our_ids = _offered(meta_to_dict(_inner(peer.frames[0][2]).meta))
            assert len(our_ids) == len(their_ids)
            theirs_to_ours = dict(zip(their_ids, our_ids))
            ours_to_theirs = dict(zip(our_ids, their_ids))
        raw = c2s[f["offset"]:f["offset"] + f["length"]]
        if f["magic"] == "STRM":
            (_, meta, payload), = _frames(raw)
            raw = _remap(meta, payload, theirs_to_ours)
        peer.writer.write(raw)
    peer.writer.write_eof()  # the capture's client closed first; the server then closes
    await peer.rest()
    _check(peer.frames, theirs, ours_to_theirs, cap)



def _offered(meta: dict) -> list:
    s = meta.get("stream_settings")
    return [s["stream_id"], *s.get("extra_stream_ids", [])] if s else []


def _check(ours: list, theirs: list, ours_to_theirs: dict, cap: dict) -> None:
    s2c = bytes.fromhex(cap["s2c_hex"])
    their_bytes = [s2c[f["offset"]:f["offset"] + f["length"]] for f in theirs]
    mapped = [_remap(m, p, ours_to_theirs) for _, m, p in ours]
    assert all(magic == b"STRM" for magic, _, _ in ours)

    # The wrapped response: the STRM frame around it byte for byte, the PRPC inside as data.
    first_meta = _Meta.FromString(ours[0][1])
    assert first_meta.frame_type == 3 and not first_meta.has_continuation
    their_meta = bytes.fromhex(theirs[0]["meta_hex"])
    assert _remap(ours[0][1], b"", ours_to_theirs)[12:] == their_meta

    def fix(mine: dict) -> None:
        s = mine.get("stream_settings")
        if s:
            s["stream_id"] = ours_to_theirs[s["stream_id"]]
            if "extra_stream_ids" in s:
                s["extra_stream_ids"] = [ours_to_theirs[i] for i in s["extra_stream_ids"]]
    _compare(_inner(ours[0][2]), theirs[0]["inner_frame"], ignore=("calls_served",), fix_meta=fix)

    # Every other frame but FEEDBACK: the same bytes in the same order.
    is_fb = [_Meta.FromString(m).frame_type == FEEDBACK for _, m, _ in ours]
    their_fb = [f["frame_type_name"] == "FEEDBACK" for f in theirs]
    assert [b for b, fb in zip(mapped[1:], is_fb[1:]) if not fb] == \
        [b for b, fb in zip(their_bytes[1:], their_fb[1:]) if not fb]

    # FEEDBACK: per stream, a subsequence of the capture's, ending with its last one.
    def per_stream(frames: list, fb: list) -> dict:
        out: dict = {}
        for b, is_feedback in zip(frames, fb):
            if is_feedback:
                out.setdefault(_Meta.FromString(b[12:12 + struct.unpack(">I", b[8:12])[0]]).stream_id,
                               []).append(b)
        return out
    mine, want = per_stream(mapped, is_fb), per_stream(their_bytes, their_fb)
    assert mine.keys() == want.keys()
    for sid, frames in mine.items():
        it = iter(want[sid])
        assert all(any(b == w for w in it) for b in frames), (sid, frames, want[sid])
        assert frames[-1] == want[sid][-1]
