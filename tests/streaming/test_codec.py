"""The STRM codec against the C++ captures (streaming*.json) and brpc's own examples: every
frame decodes to the captured fields and re-encodes byte for byte; messages are cut into
segments and put back together within a cap."""

from __future__ import annotations

import pytest

from aiobrpc.errors import LocalProtocolError, RemoteProtocolError
from aiobrpc.protocol import baidu_std, streaming
from aiobrpc.protocol.events import StreamFrameReceived
from tests.helpers.golden import settings_to_dict
from tests.helpers.wire import field_varint, load_golden, vi

CAPTURES = ["streaming", "streaming_multi", "streaming_rejected"]


def _strm_frames(name: str):
    cap = load_golden(name)
    for fr in cap["frames"]:
        if fr["magic"] == "STRM":
            stream = bytes.fromhex(cap[f"{fr['dir']}_hex"])
            yield fr, stream[fr["offset"]:fr["offset"] + fr["length"]]


def _encode(meta: streaming.FrameMeta, payload: bytes) -> bytes:
    t = meta.frame_type
    if t == streaming.DATA:
        return b"".join(bytes(b) for b in streaming.data_frames(
            meta.stream_id, meta.source_stream_id, payload, max(1, len(payload))))
    if t == streaming.FEEDBACK:
        return streaming.feedback_frame(meta.stream_id, meta.source_stream_id, meta.consumed_size)
    if t == streaming.CLOSE:
        return streaming.close_frame(meta.stream_id, meta.source_stream_id)
    assert t == streaming.RST
    return streaming.rst_frame(meta.stream_id)


@pytest.mark.parametrize("name", CAPTURES)
def test_captured_frames_decode_and_reencode_byte_exact(name):
    checked = 0
    for fr, raw in _strm_frames(name):
        dec = baidu_std.Decoder(baidu_std.CLIENT if fr["dir"] == "s2c" else baidu_std.SERVER)
        dec.feed(raw)
        (ev,) = dec.events()
        assert isinstance(ev, StreamFrameReceived)
        meta = streaming.decode_frame_meta(ev.meta)
        want = fr["meta_decoded"]
        assert meta.stream_id == want["stream_id"]
        assert meta.source_stream_id == want.get("source_stream_id")
        assert meta.frame_type == want["frame_type"]
        assert streaming.FRAME_TYPE_NAMES[meta.frame_type] == fr["frame_type_name"]
        assert meta.has_continuation == want.get("has_continuation", False)
        assert meta.consumed_size == want.get("feedback", {}).get("consumed_size")
        assert _encode(meta, bytes(ev.payload)) == raw
        checked += 1
    assert checked


@pytest.mark.parametrize("name", CAPTURES)
def test_wrapped_response_reencodes_byte_exact(name):
    """The server's answer is a whole PRPC frame inside one DATA frame (streaming.wrap)."""
    fr, raw = next((fr, raw) for fr, raw in _strm_frames(name) if "inner_frame" in fr)
    inner = bytes.fromhex(fr["payload_hex"])
    meta = fr["meta_decoded"]
    bufs = streaming.wrap(meta["stream_id"], meta["source_stream_id"], [inner], len(inner))
    assert b"".join(bytes(b) for b in bufs) == raw


@pytest.mark.parametrize("name", CAPTURES)
def test_stream_settings_encode_as_cpp(name):
    cap = load_golden(name)
    metas = [fr for fr in cap["frames"] if fr["magic"] == "PRPC"]
    metas += [fr["inner_frame"] for fr in cap["frames"] if "inner_frame" in fr]
    seen = 0
    for fr in metas:
        settings = fr["meta_decoded"].get("stream_settings")
        if settings is None:
            continue
        raw = bytes.fromhex(fr["meta_hex"])
        encoded = streaming.encode_settings(settings["stream_id"], settings["need_feedback"],
                                            settings["writable"], settings.get("extra_stream_ids", ()))
        assert bytes([0x42, len(encoded)]) + encoded in raw
        assert settings_to_dict(encoded) == settings
        decoded = streaming.decode_settings(encoded)
        assert decoded.stream_ids == [settings["stream_id"], *settings.get("extra_stream_ids", ())]
        seen += 1
    assert seen


def test_the_specs_examples():
    """brpc's streaming examples: client 1, server 7."""
    assert b"".join(bytes(b) for b in streaming.data_frames(7, 1, b"abc")) == bytes.fromhex(
        "5354524d0000000b00000008080710011803200061 6263".replace(" ", ""))
    assert streaming.feedback_frame(1, 7, 3) == bytes.fromhex("5354524d0000000a0000000a0801100718042a020803")
    assert streaming.close_frame(7, 1) == bytes.fromhex("5354524d00000006000000060807100118 02".replace(" ", ""))
    assert streaming.rst_frame(7) == bytes.fromhex("5354524d000000040000000408071801")
    assert streaming.data_meta(1, -1) == bytes.fromhex("080110ffffffffffffffffff0118032000")
    assert streaming.encode_settings(1, True, False) == bytes.fromhex("080110011800")


@pytest.mark.parametrize("meta", [b"\xff" * 10, b"\x10\x01\x18\x03", b"\x08"])
def test_a_bad_frame_meta_is_a_non_fatal_error(meta):
    with pytest.raises(RemoteProtocolError) as ei:
        streaming.decode_frame_meta(meta)
    assert not ei.value.fatal


@pytest.mark.parametrize("ftype", [0, 5, 99])
def test_an_unknown_frame_type_decodes_as_unknown(ftype):
    """Hostile row G7: protobuf keeps an unknown enum value as an unknown field."""
    meta = field_varint(1, 5) + field_varint(2, 9) + field_varint(3, ftype)
    assert streaming.decode_frame_meta(meta).frame_type == streaming.UNKNOWN


def test_a_negative_id_round_trips():
    meta = streaming.decode_frame_meta(streaming.data_meta(-1, 1 << 62))
    assert (meta.stream_id, meta.source_stream_id) == (-1, 1 << 62)
    assert vi(-1) == b"\xff" * 9 + b"\x01"


@pytest.mark.parametrize("size,segment", [(0, 4), (1, 4), (4, 4), (5, 4), (17, 4), (1 << 20, 65536)])
def test_segments_reassemble_to_the_message(size, segment):
    message = bytes(i % 251 for i in range(size))
    bufs = streaming.data_frames(3, 4, message, segment)
    wire = b"".join(bytes(b) for b in bufs)
    dec = baidu_std.Decoder(baidu_std.SERVER)
    dec.feed(wire)
    events = dec.events()
    assert len(events) == max(1, -(-size // segment))
    r = streaming.Reassembly(1 << 30)
    out = []
    for ev in events:
        m = streaming.decode_frame_meta(ev.meta)
        got = r.add(ev.payload, m.has_continuation)
        if got is not None:
            out.append(bytes(got))
    assert out == [message]
    assert [streaming.decode_frame_meta(ev.meta).has_continuation for ev in events] == \
        [True] * (len(events) - 1) + [False]


def test_segments_reference_the_message_without_a_copy():
    message = bytearray(10)
    bufs = streaming.data_frames(3, 4, message, 4)
    message[0] = 7
    assert bytes(bufs[1])[0] == 7


def test_reassembly_is_capped():
    """Hostile row G4: endless continuations stop at the cap, and what was buffered is freed."""
    r = streaming.Reassembly(10)
    assert r.add(b"x" * 6, True) is None
    with pytest.raises(RemoteProtocolError) as ei:
        r.add(b"x" * 6, True)
    assert "max_body_size=10" in str(ei.value) and not ei.value.fatal
    assert r.size == 0 and r.parts == []


def test_tiny_segments_cost_their_bytes():
    r = streaming.Reassembly(1 << 20)
    for _ in range(1000):
        r.add(b"y", True)
    assert len(r.parts) == 1 and r.size == 1000
    assert bytes(r.add(b"z", False)) == b"y" * 1000 + b"z"


@pytest.mark.parametrize("bad,exc", [(object(), TypeError), ("text", TypeError)])
def test_a_message_must_be_a_buffer(bad, exc):
    with pytest.raises(exc, match="buffer"):
        streaming.message_view(bad)


def test_a_strided_message_is_refused():
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match="C-contiguous"):
        streaming.message_view(np.zeros((4, 4))[:, 1])
    assert streaming.message_view(np.zeros((4, 4), dtype=np.float32)).nbytes == 64


def test_segment_size_must_be_positive():
    with pytest.raises(LocalProtocolError):
        streaming.data_frames(1, 2, b"abc", 0)
