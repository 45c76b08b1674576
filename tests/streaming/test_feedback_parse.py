"""The FEEDBACK fast path of transport/streams.py (consumed_size read by hand, without protobuf)
reads what protobuf reads, and leaves every other encoding to protobuf."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from aiobrpc._proto import brpc_streaming_pb2
from aiobrpc.protocol import streaming
from aiobrpc.transport import streams as streams_mod

_Meta = brpc_streaming_pb2.StreamFrameMeta
_PREFIX = streaming.feedback_meta_prefix(7, 300)


def _vi(n: int) -> bytes:
    return streaming._varint(n)


def _protobuf(meta: bytes):
    try:
        m = _Meta.FromString(meta)
    except Exception:
        return "error"
    return m.feedback.consumed_size if m.HasField("feedback") else None


class _Stream:
    id = 7

    def __init__(self) -> None:
        self.got: list = []

    def _on_feedback(self, consumed: int) -> None:
        self.got.append(consumed)


def _table():
    conn = SimpleNamespace(pace_writes=lambda n: None, peer="test", write=lambda bufs: None)
    stats = SimpleNamespace(stream_frames_dropped=0)
    table = streams_mod.StreamTable(conn, stats)
    stream = _Stream()
    table.add(stream)
    # The first FEEDBACK is decoded by protobuf and registers the prefix's fast route.
    table.frame_received(SimpleNamespace(meta=streaming.feedback_meta(7, 300, 0), payload=b""))
    assert stream.got == [0] and _PREFIX in table._feedback_routes
    stream.got.clear()
    return table, stream, stats


def _values():
    rng = random.Random(10)
    values = [0, 1, 127, 128, 300, (1 << 20), (1 << 31) - 1, 1 << 31, (1 << 32) + 5, (1 << 56) - 1, 1 << 56,
              (1 << 63) - 1, -1, -2, -(1 << 63), -(1 << 31)]
    values += [rng.randrange(0, 1 << rng.randrange(1, 64)) for _ in range(200)]
    values += [-rng.randrange(1, 1 << rng.randrange(1, 64)) for _ in range(50)]  # 10-byte varints
    return values


@pytest.mark.parametrize("value", _values())
def test_canonical_feedback_is_read_by_hand_as_protobuf_reads_it(value):
    meta = streaming.feedback_meta(7, 300, value)
    assert meta == _Meta(stream_id=7, source_stream_id=300, frame_type=streaming.FEEDBACK,
                         feedback=brpc_streaming_pb2.Feedback(consumed_size=value)).SerializeToString()
    cut = len(_PREFIX)
    assert meta[:cut] == _PREFIX
    expected = _protobuf(meta)
    assert expected == value
    assert streams_mod._feedback_value(meta, cut) == expected  # the fast path takes it
    table, stream, stats = _table()
    table.frame_received(SimpleNamespace(meta=meta, payload=b""))
    assert stream.got == [expected] and stats.stream_frames_dropped == 0


def _odd_metas():
    """FEEDBACK metas that are not protobuf's canonical encoding: the hand parser must read them as
    protobuf does or leave them to protobuf."""
    rng = random.Random(11)
    out = []
    for value in [0, 1, 5, 300, (1 << 40) + 3, (1 << 63) - 1]:
        v = _vi(value)
        # consumed_size as a non-minimal varint (padded with 0x80 bytes then 0x00), up to 10 bytes
        for pad in range(1, 11 - len(v)):
            padded = bytes(b | 0x80 for b in v) + b"\x80" * (pad - 1) + b"\x00"
            out.append(_PREFIX + _vi(1 + len(padded)) + b"\x08" + padded)
        fb = b"\x08" + v
        out.append(_PREFIX + bytes([len(fb) | 0x80, 0]) + fb)  # the length as a non-minimal varint
        out.append(_PREFIX + _vi(len(fb) + 2) + fb + b"\x10\x07")  # an unknown field after it
        out.append(_PREFIX + _vi(len(fb) + 2) + b"\x10\x07" + fb)  # an unknown field before it
        out.append(_PREFIX + _vi(len(fb) * 2) + fb + b"\x08" + _vi(value + 1))  # consumed_size twice
        out.append(_PREFIX + _vi(len(fb)) + fb + b"\x2a\x02\x08\x09")  # feedback twice (merged)
        out.append(_PREFIX + _vi(len(fb)) + fb + b"\x78\x01")  # an unknown field of the frame meta
        out.append(_PREFIX + _vi(len(fb)) + fb + b"\x18\x04")  # frame_type again, after
        out.append(_PREFIX + b"\x00")  # an empty Feedback: consumed_size 0 by default
    # 10-byte varints with high bits past 64 (protobuf drops them) and an 11-byte one (corrupt)
    for last in (0x01, 0x02, 0x7F):
        out.append(_PREFIX + b"\x0b\x08" + b"\xff" * 9 + bytes([last]))
    out.append(_PREFIX + b"\x0c\x08" + b"\xff" * 10 + b"\x00")
    # truncated or over-long
    out.append(_PREFIX + b"\x03\x08\x80")
    out.append(_PREFIX + b"\x02\x08")
    out.append(_PREFIX + b"\x05\x08\x01")
    for _ in range(100):  # random bytes after the prefix
        out.append(_PREFIX + bytes(rng.randrange(256) for _ in range(rng.randrange(0, 14))))
    return out


@pytest.mark.parametrize("meta", _odd_metas(), ids=lambda m: m[len(_PREFIX):].hex() or "empty")
def test_other_encodings_read_as_protobuf_reads_them(meta):
    expected = _protobuf(meta)
    by_hand = streams_mod._feedback_value(meta, len(_PREFIX))
    if by_hand is not None:
        assert by_hand == expected
    table, stream, stats = _table()
    table.frame_received(SimpleNamespace(meta=meta, payload=b""))
    if expected == "error":
        assert stream.got == [] and stats.stream_frames_dropped == 1
    elif expected is None:
        assert stream.got == []
    else:
        assert stream.got == [expected]
