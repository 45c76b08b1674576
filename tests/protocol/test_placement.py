"""PlacingDecoder: a large attachment received straight into the buffer its receiver chose
(both twins, by the conftest). Whatever the read sizes, it yields the same events as a plain
Decoder; only where the attachment's bytes lie differs."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiobrpc.protocol import baidu_std
from aiobrpc.protocol.placement import MAX_HEAD_BYTES, PlacingDecoder
from tests.fast.test_attachment_memory import message, receive
from tests.helpers.wire import frame

ROLES = [baidu_std.SERVER, baidu_std.CLIENT]
LARGE = 300 * 1024


def pattern(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) & 0xFF for i in range(256)) * (n // 256) + bytes(n % 256)


class Chooser:
    """Places every attachment in a fresh buffer and remembers what it was asked."""

    def __init__(self, make=bytearray) -> None:
        self.make = make
        self.asked: list[tuple[int, bytes]] = []
        self.buffers: list = []

    def __call__(self, meta, data):
        self.asked.append((meta.correlation_id, bytes(data)))
        buf = self.make(meta.attachment_size)
        self.buffers.append(buf)
        return buf


def summary(events) -> list:
    return [(type(e).__name__, e.meta.correlation_id, bytes(e.data), bytes(e.attachment), e.error) for e in events]


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("read", [7, 1000, 64 * 1024, 1 << 20])
def test_a_large_attachment_lands_in_the_chosen_buffer(role, read):
    wire = message(role, 1, b"request", pattern(LARGE, 1)) + message(role, 2, b"small", b"tiny")
    chooser = Chooser()
    events = receive(PlacingDecoder(role, chooser), wire, read=read)
    assert summary(events) == summary(receive(baidu_std.Decoder(role), wire, read=read))
    assert chooser.asked == [(1, b"request")]  # the small one was never considered
    [buf] = chooser.buffers
    assert events[0].attachment.obj is buf and bytes(buf) == pattern(LARGE, 1)


@pytest.mark.parametrize("role", ROLES)
def test_a_numpy_destination_is_filled_in_place(role):
    values = np.arange(LARGE // 4, dtype=np.float32)
    dest = np.zeros_like(values)
    events = receive(PlacingDecoder(role, lambda meta, data: dest), message(role, 1, b"x", values.tobytes()))
    assert np.array_equal(dest, values)
    assert np.frombuffer(events[0].attachment, np.float32).ctypes.data == dest.ctypes.data


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("read", [100, 1 << 20])
def test_many_frames_in_a_row_each_placed(role, read):
    rng = random.Random(5)
    parts = []
    for i in range(6):
        size = rng.choice([LARGE, 70_000, 100, 2 << 20])
        parts.append(message(role, i + 1, bytes(rng.randrange(0, 300)), pattern(size, i)))
    wire = b"".join(parts)
    chooser = Chooser()
    events = receive(PlacingDecoder(role, chooser), wire, read=read)
    assert summary(events) == summary(receive(baidu_std.Decoder(role), wire, read=read))
    placed = [e.meta.correlation_id for e in events if any(e.attachment.obj is b for b in chooser.buffers)]
    over_threshold = [e.meta.correlation_id for e in events if len(e.attachment) > 64 * 1024]
    if read == 100:
        assert placed == over_threshold
    else:  # a frame one read brought whole is in the block already: it is not placed
        assert set(placed) < set(over_threshold) and placed


def refuses(meta, data):
    return None


def raises(meta, data):
    raise RuntimeError("no room")


@pytest.mark.parametrize("place, logged", [
    (refuses, None),
    (raises, "raised RuntimeError('no room')"),
    (lambda meta, data: bytearray(meta.attachment_size - 1), "is 307199 bytes"),
    (lambda meta, data: bytes(meta.attachment_size), "read-only"),
    (lambda meta, data: object(), "unusable"),
])
def test_a_refused_or_unusable_choice_receives_as_usual(place, logged, caplog):
    wire = message(baidu_std.SERVER, 1, b"req", pattern(LARGE, 3))
    with caplog.at_level(logging.ERROR):
        events = receive(PlacingDecoder(baidu_std.SERVER, place), wire)
    assert summary(events) == summary(receive(baidu_std.Decoder(baidu_std.SERVER), wire))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert (errors == []) if logged is None else (len(errors) == 1 and logged in errors[0])


def test_frames_that_are_not_placed():
    """STRM frames, frames without an attachment, heads over MAX_HEAD_BYTES, a lying
    attachment_size: never offered; the events are the plain decoder's, errors included."""
    from tests.helpers.wire import rpc_meta
    strm = b"STRM" + (LARGE + 4).to_bytes(4, "big") + (4).to_bytes(4, "big") + b"\x08\x01\x18\x03" + bytes(LARGE)
    no_att = message(baidu_std.SERVER, 1, bytes(LARGE), b"")
    big_head = message(baidu_std.SERVER, 2, bytes(MAX_HEAD_BYTES + 1), bytes(LARGE))
    lying = frame(rpc_meta(correlation_id=3, attachment_size=LARGE * 2), bytes(LARGE))
    wire = strm + no_att + big_head + lying
    chooser = Chooser()
    placing = PlacingDecoder(baidu_std.SERVER, chooser)
    plain = baidu_std.Decoder(baidu_std.SERVER)
    got, want = receive(placing, wire), receive(plain, wire)
    assert [type(e).__name__ for e in got] == [type(e).__name__ for e in want]
    assert [getattr(e, "error", None) is not None for e in got] == [False, False, False, True]
    assert chooser.asked == []


@pytest.mark.parametrize("role", ROLES)
def test_pending_bytes_counts_a_placed_frame_in_progress(role):
    wire = message(role, 1, b"abc", pattern(LARGE, 2))
    decoder = PlacingDecoder(role, Chooser())
    receive(decoder, wire[:200_000])
    assert decoder.pending_bytes() == 200_000
    receive(decoder, wire[200_000:])
    assert decoder.pending_bytes() == 0


def test_buffer_updated_beyond_the_offered_buffer_is_refused():
    from aiobrpc.errors import LocalProtocolError
    wire = message(baidu_std.SERVER, 1, b"abc", pattern(LARGE, 2))
    decoder = PlacingDecoder(baidu_std.SERVER, Chooser())
    receive(decoder, wire[:100_000])
    buf = decoder.get_buffer(-1)
    with pytest.raises(LocalProtocolError, match="outside"):
        decoder.buffer_updated(len(buf) + 1)


@settings(max_examples=60)
@given(reads=st.lists(st.integers(1, 300_000), min_size=1, max_size=40), seed=st.integers(0, 3))
def test_any_read_sizes_give_the_plain_decoders_events(reads, seed):
    rng = random.Random(seed)
    wire = b"".join(message(baidu_std.SERVER, i + 1, bytes(rng.randrange(0, 50)),
                            pattern(rng.choice([0, 10, 70_000, LARGE]), i)) for i in range(4))

    def run(decoder):
        events, pos, i = [], 0, 0
        while pos < len(wire):
            buf = decoder.get_buffer(-1)
            k = min(len(buf), reads[i % len(reads)], len(wire) - pos)
            buf[:k] = wire[pos:pos + k]
            del buf
            decoder.buffer_updated(k)
            pos += k
            i += 1
            while (ev := decoder.next_event()) is not None:
                events.append(ev)
        return events

    assert summary(run(PlacingDecoder(baidu_std.SERVER, Chooser()))) == summary(run(baidu_std.Decoder(baidu_std.SERVER)))


@pytest.mark.parametrize("role", ROLES)
def test_a_diverted_frame_stops_writing_the_chosen_buffer(role):
    """divert(cid): the receiver gave up on that frame; the rest of it goes elsewhere, and the
    chosen buffer keeps what it had (other frames are not affected)."""
    wire = message(role, 7, b"head", pattern(LARGE, 4)) + message(role, 8, b"next", pattern(LARGE, 5))
    chooser = Chooser()
    decoder = PlacingDecoder(role, chooser)
    assert receive(decoder, wire[:100_000]) == []
    [buf] = chooser.buffers
    before = bytes(buf)
    decoder.divert(8)  # not the frame being placed: nothing changes
    decoder.divert(7)
    events = receive(decoder, wire[100_000:])
    assert bytes(buf) == before and before != bytes(LARGE)
    assert [e.meta.correlation_id for e in events] == [7, 8]
    assert bytes(events[0].attachment)[-1000:] == pattern(LARGE, 4)[-1000:]  # the rest, elsewhere
    assert events[1].attachment.obj is chooser.buffers[1] and bytes(chooser.buffers[1]) == pattern(LARGE, 5)


@pytest.mark.parametrize("role", ROLES)
def test_a_decoder_can_start_placing_midway(role):
    """PlacingDecoder.around(decoder): what the plain decoder holds (a partial frame) goes on."""
    wire = message(role, 1, b"a", pattern(LARGE, 1)) + message(role, 2, b"b", pattern(LARGE, 2))
    plain = baidu_std.Decoder(role)
    got = receive(plain, wire[:50_000])
    chooser = Chooser()
    placing = PlacingDecoder.around(plain, chooser)
    got += receive(placing, wire[50_000:])
    assert summary(got) == summary(receive(baidu_std.Decoder(role), wire))
    assert [cid for cid, _ in chooser.asked] == [2]  # the first had begun as usual


def strm(stream_id: int, payload: bytes, more: bool) -> bytes:
    from aiobrpc.protocol import streaming
    return streaming.data_head(streaming.data_meta(stream_id, 9, more), len(payload)) + payload


@pytest.mark.parametrize("read", [50, 64 * 1024, 1 << 20])
def test_large_stream_segments_land_where_place_stream_says(read):
    segments = [(pattern(LARGE, 1), True), (pattern(100, 2), True), (pattern(2 * LARGE + 3, 3), False)]
    wire = b"".join(strm(5, p, more) for p, more in segments) + message(baidu_std.CLIENT, 1, b"x", pattern(LARGE, 4))
    asked = []
    buffers = []

    def place_stream(meta, size):
        asked.append(size)
        buffers.append(bytearray(size))
        return memoryview(buffers[-1])

    events = receive(PlacingDecoder(baidu_std.CLIENT, None, place_stream=place_stream), wire, read=read)
    plain = receive(baidu_std.Decoder(baidu_std.CLIENT), wire, read=read)
    assert [(type(e).__name__, bytes(getattr(e, "payload", b"")) or bytes(e.attachment)) for e in events] == \
        [(type(e).__name__, bytes(getattr(e, "payload", b"")) or bytes(e.attachment)) for e in plain]
    assert asked == [LARGE, 2 * LARGE + 3]  # the 100-byte segment and the PRPC frame: as usual
    assert [bytes(b) for b in buffers] == [segments[0][0], segments[2][0]]
    assert events[0].payload.obj is buffers[0] and events[2].payload.obj is buffers[1]


def test_reassembly_into_its_place_mixes_placed_and_copied_segments():
    import mmap

    from aiobrpc.errors import RemoteProtocolError
    from aiobrpc.protocol.streaming import Reassembly
    r = Reassembly(1 << 20)
    assert r.add(b"first", True) is None and r.busy
    dest = r.place(300)  # the earlier segment moves into the message's buffer
    dest[:] = b"p" * 300
    assert r.place(10) is None  # one segment at a time
    assert r.add(dest, True) is None
    assert r.add(b"tail", False) == b"first" + b"p" * 300 + b"tail"
    msg = r.add(b"x", True) or r.add(b"y", False)
    assert bytes(msg) == b"xy" and not r.busy
    dest = r.place(200)
    assert type(dest.obj) is mmap.mmap
    dest[:] = b"q" * 200
    out = r.add(dest, False)
    assert bytes(out) == b"q" * 200 and out.obj is dest.obj
    # too large: reported, and the buffer goes back
    dest = r.place(1000)
    assert r.add(dest, True) is None
    assert r.place(1 << 20) is None  # would pass max_size: as usual, where add() reports it
    with pytest.raises(RemoteProtocolError, match="max_body_size"):
        r.add(bytes(1 << 20), True)
    assert not r.busy and r.size == 0


def test_mapped_buffers_are_reused_only_when_nothing_views_them():
    from aiobrpc.protocol.streaming import MappedBuffers
    cache = MappedBuffers(max_buffers=2, max_bytes=1 << 20)
    a, written = cache.take(1 << 16)
    assert written == 0
    view = memoryview(a)
    cache.put(a, 1000)
    first = id(a)
    del a
    b, _ = cache.take(1 << 16)
    assert id(b) != first  # the first is still viewed: a new one
    del b
    view.release()
    c, written = cache.take(1 << 16)
    assert id(c) == first and written == 1000  # nothing views it any more: reused
    cache.put(c, 1000)
    for size in (1 << 12, 1 << 13, 1 << 14):
        m, _ = cache.take(size)
        cache.put(m, size)
    assert len(cache) == 2  # at most max_buffers
    m, _ = cache.take(1 << 21)
    cache.put(m, 1 << 21)  # more written than max_bytes on its own: not kept
    assert len(cache) == 2 and cache.nbytes() <= 1 << 20
    for _ in range(2):
        m, _ = cache.take(1 << 20)
        cache.put(m, 600 << 10)
    assert len(cache) == 1 and cache.nbytes() == 600 << 10  # the written bytes are capped too
