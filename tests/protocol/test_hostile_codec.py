"""Codec-level rows of docs/hostile_inputs.md (A, B, C, J): no network needed."""

from __future__ import annotations

import gzip
import tracemalloc
import zlib

import cramjam
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiobrpc.errors import EREQUEST, ERESPONSE, RemoteProtocolError
from aiobrpc.protocol import baidu_std, checksum, compress
from aiobrpc.protocol.events import RequestReceived
from tests.helpers.wire import field_varint, frame, rpc_meta

MIB = 1 << 20


def server(max_body_size=MIB):
    return baidu_std.Decoder(baidu_std.SERVER, max_body_size=max_body_size)


def request(payload=b"\x0a\x02hi", **meta):
    return frame(rpc_meta(**meta), payload)


# --- A. framing -------------------------------------------------------------------------------

def test_a1_bad_magic_closes():
    dec = server()
    dec.feed(b"XXXX" + bytes(8))
    with pytest.raises(RemoteProtocolError, match="unknown protocol: first bytes 5858585800") as ei:
        dec.next_event()
    assert ei.value.fatal


@pytest.mark.parametrize("prefix", [b"P", b"PR", b"PRP", b"S", b"ST", b"STR", b"PRPC", b"STRM\0"])
def test_a2_partial_magic_waits(prefix):
    dec = server()
    dec.feed(prefix)
    assert dec.next_event() is None
    assert dec.pending_bytes() == len(prefix)


@pytest.mark.parametrize("prefix", [b"X", b"PX", b"PRX", b"SX", b"STX"])
def test_a1_impossible_prefix_rejected_early(prefix):
    dec = server()
    dec.feed(prefix)
    with pytest.raises(RemoteProtocolError, match="unknown protocol"):
        dec.next_event()


def test_a3_truncated_header_is_pending():
    dec = server()
    dec.feed(b"PRPC\0\0\0\1")
    assert dec.next_event() is None
    assert dec.pending_bytes() == 8


@pytest.mark.parametrize("body_size", [0xFFFFFFFF, MIB + 1, 0x80000000])
def test_a4_a8_huge_body_rejected_without_allocation(body_size):
    dec = server()
    dec.get_buffer(-1)  # the read block (made at the first read) is not the body's allocation
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        dec.feed(frame(b"", b"", body_size=body_size, meta_size=0xFFFFFFFF))
        with pytest.raises(RemoteProtocolError, match=f"body_size={body_size} exceeds max_body_size={MIB}"):
            dec.next_event()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


@pytest.mark.parametrize("delta,ok", [(-1, True), (0, True), (1, False)])
def test_a5_max_body_size_boundary(delta, ok):
    meta = rpc_meta()
    payload = b"\0" * (MIB + delta - len(meta))
    dec = server()
    dec.feed(frame(meta, payload))
    if ok:
        ev = dec.next_event()
        assert isinstance(ev, RequestReceived) and len(ev.data) == len(payload)
    else:
        with pytest.raises(RemoteProtocolError, match="exceeds max_body_size"):
            dec.next_event()


def test_a6_meta_size_larger_than_body_closes():
    meta = rpc_meta()
    dec = server()
    dec.feed(frame(meta, b"xy", meta_size=len(meta) + 3))
    with pytest.raises(RemoteProtocolError, match="meta_size=.* is larger than body_size") as ei:
        dec.next_event()
    assert ei.value.fatal


def test_a7_empty_meta_decodes_without_request():
    dec = server()
    dec.feed(frame(b"", b""))
    ev = dec.next_event()
    assert isinstance(ev, RequestReceived) and not ev.meta.has_request


def test_a9_unparsable_meta_is_fatal():
    dec = server()
    dec.feed(frame(b"\xff" * 10))
    with pytest.raises(RemoteProtocolError, match="RpcMeta does not parse") as ei:
        dec.next_event()
    assert ei.value.fatal


def test_a11_hundred_frames_in_one_chunk_and_one_dribbled():
    frames = [request(correlation_id=i) for i in range(100)]
    dec = server()
    dec.feed(b"".join(frames))
    assert [e.meta.correlation_id for e in dec.events()] == list(range(100))
    one = request(correlation_id=777)
    for i in range(len(one)):
        assert dec.next_event() is None
        dec.feed(one[i:i + 1])
    assert dec.next_event().meta.correlation_id == 777


def test_a12_valid_frame_then_garbage():
    dec = server()
    dec.feed(request(correlation_id=3) + b"GARBAGE!" * 2)
    assert dec.next_event().meta.correlation_id == 3
    with pytest.raises(RemoteProtocolError):
        dec.next_event()


@given(st.lists(st.binary(max_size=600), max_size=8))
@settings(max_examples=300)
def test_a13_arbitrary_bytes_only_raise_remote_protocol_error(chunks):
    dec = server(max_body_size=4096)
    try:
        for c in chunks:
            dec.feed(c)
            for ev in dec.events():
                if isinstance(ev, RequestReceived) and ev.error is None:
                    try:
                        baidu_std.decode_data(ev.meta, ev.data, ev.attachment, 4096)
                    except RemoteProtocolError as e:
                        assert not e.fatal
    except RemoteProtocolError:
        pass
    # memory bounded by the limits: nothing buffered beyond one frame
    assert dec.pending_bytes() <= 12 + 4096 + 600


@given(st.binary(min_size=1, max_size=400))
@settings(max_examples=300)
def test_a13_arbitrary_meta_bytes(meta):
    dec = server()
    dec.feed(frame(meta, b"abc"))
    try:
        dec.events()
    except RemoteProtocolError as e:
        assert e.fatal


# --- B. metadata ------------------------------------------------------------------------------

def test_b7_response_part_is_ignored_by_server_decoder():
    dec = server()
    dec.feed(request(error_code=5, error_text="x"))
    ev = dec.next_event()
    assert isinstance(ev, RequestReceived)
    assert ev.meta.has_request and ev.meta.has_response


# --- C. payload transforms --------------------------------------------------------------------

def _decode(meta_kwargs, payload, cap=MIB, role=baidu_std.SERVER):
    dec = baidu_std.Decoder(role, max_body_size=8 * MIB)
    dec.feed(frame(rpc_meta(**meta_kwargs), payload))
    ev = dec.next_event()
    if ev.error is not None:
        raise ev.error
    return baidu_std.decode_data(ev.meta, ev.data, ev.attachment, cap,
                                 EREQUEST if role == baidu_std.SERVER else ERESPONSE)


@pytest.mark.parametrize("ctype", [4, 5, 99, -1])
def test_c1_unknown_compress_type(ctype):
    with pytest.raises(RemoteProtocolError, match="CompressType=unknown") as ei:
        _decode({"compress_type": ctype}, b"abc")
    assert ei.value.code == EREQUEST and not ei.value.fatal


@pytest.mark.parametrize("ctype,payload", [
    (compress.GZIP, b"notgzip"), (compress.GZIP, gzip.compress(b"x" * 100)[:-5]),
    (compress.ZLIB, b"notzlib"), (compress.ZLIB, zlib.compress(b"x" * 100)[:-3]),
    (compress.SNAPPY, b"\xff\xff\xff\xff\x0f"), (compress.SNAPPY, b"\x10\x00"),
    (compress.GZIP, gzip.compress(b"x") + b"trailing"),
])
def test_c2_corrupt_or_truncated_compressed_data(ctype, payload):
    with pytest.raises(RemoteProtocolError) as ei:
        _decode({"compress_type": ctype}, payload)
    assert ei.value.code == EREQUEST and not ei.value.fatal


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _peak_rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/self/status")


def _bomb(ctype: int, size: int) -> bytes:
    # Streamed in 1 MiB steps: one 64 MiB allocation would move glibc's mmap threshold and
    # make the RSS figures below measure the allocator instead of the decoder.
    c = zlib.compressobj(9, zlib.DEFLATED, 31 if ctype == compress.GZIP else 15)
    step = b"\0" * MIB
    return b"".join([c.compress(step) for _ in range(size // MIB)] + [c.flush()])


@pytest.mark.parametrize("ctype", [compress.GZIP, compress.ZLIB])
def test_c3_c5_decompression_bombs_are_capped(ctype):
    bomb = _bomb(ctype, 64 * MIB)
    assert len(bomb) < 100_000
    cap = 4 * MIB
    dec = server(max_body_size=8 * MIB)
    dec.feed(frame(rpc_meta(compress_type=ctype), bomb))
    ev = dec.next_event()
    before = _rss_kib()
    peak_tracked = _reset_peak_rss()
    with pytest.raises(RemoteProtocolError, match=f"(exceeds|beyond) max_decompressed_size={cap}") as ei:
        baidu_std.decode_data(ev.meta, ev.data, ev.attachment, cap)
    assert ei.value.code == EREQUEST
    grown = (_peak_rss_kib() if peak_tracked else _rss_kib()) - before
    assert grown <= (cap + MIB) // 1024
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError):
            _decode({"compress_type": ctype}, bomb, cap=cap)
        assert tracemalloc.get_traced_memory()[1] <= cap + MIB
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("ctype", [compress.GZIP, compress.ZLIB])
@pytest.mark.parametrize("size", [1, 64 * 1024 - 1, 64 * 1024, 64 * 1024 + 1, MIB - 1, MIB])
def test_inflated_data_is_exact_up_to_the_cap_and_large_output_is_no_python_object(ctype, size):
    raw = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
    packed = compress.compress(ctype, raw)
    tracemalloc.start()
    try:
        out = compress.decompress(ctype, packed, MIB)
        # Past the first 64 KiB step the output is written into a map of its own: pages, not a
        # Python buffer grown (and copied) step by step; a few 64 KiB steps are Python bytes.
        assert tracemalloc.get_traced_memory()[1] < (size if size <= 64 * 1024 else 0) + 4 * 64 * 1024
    finally:
        tracemalloc.stop()
    assert bytes(out) == raw
    # gzip refuses by its declared size before inflating; zlib declares none and stops inflating
    with pytest.raises(RemoteProtocolError, match="(inflates beyond|exceeds) max_decompressed_size"):
        compress.decompress(ctype, packed, size - 1)


def test_c3_gzip_bomb_with_a_lying_size_trailer_is_still_capped():
    bomb = bytearray(gzip.compress(b"\0" * (16 * MIB), 9))
    bomb[-4:] = (100).to_bytes(4, "little")  # claims 100 bytes
    with pytest.raises(RemoteProtocolError, match="inflates beyond max_decompressed_size"):
        _decode({"compress_type": compress.GZIP}, bytes(bomb), cap=MIB)


def test_c5_snappy_declared_size_is_checked_before_allocating():
    bomb = bytes(cramjam.snappy.compress_raw(b"\0" * (8 * MIB)))
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError, match="declares 8388608 bytes, exceeds"):
            _decode({"compress_type": compress.SNAPPY}, bomb, cap=MIB)
        assert tracemalloc.get_traced_memory()[1] < 2 * MIB
    finally:
        tracemalloc.stop()


def test_c5_lz4_is_refused_like_brpc():
    with pytest.raises(RemoteProtocolError, match="CompressType=unknown"):
        _decode({"compress_type": compress.LZ4}, b"\x04\x22\x4d\x18")
    with pytest.raises(ValueError, match="lz4"):
        compress.compress(compress.LZ4, b"abc")


def test_c6_checksum_mismatch():
    data = b"\x0a\x02hi"
    good = checksum.compute(data)
    assert _decode({"checksum_type": 1, "checksum_value": good}, data) == data
    bad = bytes([good[0] ^ 1]) + good[1:]
    with pytest.raises(RemoteProtocolError, match="crc32c checksum mismatch") as ei:
        _decode({"checksum_type": 1, "checksum_value": bad}, data)
    assert ei.value.code == EREQUEST


@pytest.mark.parametrize("value", [b"", b"abc", b"abcde"])
def test_c6_checksum_value_must_be_4_bytes(value):
    with pytest.raises(RemoteProtocolError, match="must be 4 bytes"):
        _decode({"checksum_type": 1, "checksum_value": value}, b"\x0a\x00")


def test_c7_unknown_checksum_type_is_stricter_than_brpc():
    with pytest.raises(RemoteProtocolError, match="ChecksumType=unknown"):
        _decode({"checksum_type": 9, "checksum_value": b"1234"}, b"\x0a\x00")


def test_c8_checksum_with_attachment_detects_corrupt_attachment():
    data, att = b"\x0a\x05hello", b"world"
    value = checksum.compute(data, att)
    assert value.hex() == "3984520a"  # CRC32C of data+attachment 0xB3994B80, masked as brpc masks it
    kw = {"checksum_type": 1, "checksum_value": value, "attachment_size": 5}
    extra = field_varint(13, 1)
    dec = server()
    dec.feed(frame(rpc_meta(raw_extra=extra, **kw), data + b"worle"))
    ev = dec.next_event()
    with pytest.raises(RemoteProtocolError, match="mismatch"):
        baidu_std.decode_data(ev.meta, ev.data, ev.attachment, MIB)
    dec.feed(frame(rpc_meta(raw_extra=extra, **kw), data + att))
    ev = dec.next_event()
    assert bytes(baidu_std.decode_data(ev.meta, ev.data, ev.attachment, MIB)) == data


def test_c9_attachment_size_larger_than_payload():
    with pytest.raises(RemoteProtocolError, match="attachment_size=1000000 is larger than request_size=4") as ei:
        _decode({"attachment_size": 10**6}, b"abcd")
    assert ei.value.code == EREQUEST and not ei.value.fatal
    with pytest.raises(RemoteProtocolError, match="response_size=4") as ei:
        _decode({"attachment_size": 10**6}, b"abcd", role=baidu_std.CLIENT)
    assert ei.value.code == ERESPONSE


def test_c9_negative_attachment_size():
    with pytest.raises(RemoteProtocolError, match="attachment_size=-1"):
        _decode({"attachment_size": -1}, b"abcd")


def test_c11_attachment_is_the_whole_payload():
    dec = server()
    dec.feed(frame(rpc_meta(attachment_size=4), b"abcd"))
    ev = dec.next_event()
    assert bytes(ev.data) == b"" and bytes(ev.attachment) == b"abcd"


# --- J. client parsing a hostile server ------------------------------------------------------

def test_j1_response_body_too_big():
    dec = baidu_std.Decoder(baidu_std.CLIENT, max_body_size=MIB)
    dec.feed(frame(b"", body_size=MIB + 1))
    with pytest.raises(RemoteProtocolError, match="exceeds max_body_size") as ei:
        dec.next_event()
    assert ei.value.fatal


def test_j3_huge_error_text_decodes():
    text = "e" * (3 * MIB)
    dec = baidu_std.Decoder(baidu_std.CLIENT, max_body_size=8 * MIB)
    dec.feed(frame(rpc_meta(service=None, method=None, error_code=1234, error_text=text)))
    ev = dec.next_event()
    assert ev.meta.error_code == 1234 and len(ev.meta.error_text) == len(text)


def test_j6_response_bomb_capped_with_eresponse():
    bomb = gzip.compress(b"\0" * (16 * MIB), 9)
    with pytest.raises(RemoteProtocolError, match="max_decompressed_size") as ei:
        _decode({"compress_type": compress.GZIP}, bomb, cap=MIB, role=baidu_std.CLIENT)
    assert ei.value.code == ERESPONSE


def test_b_user_fields_past_the_limit_are_skipped_unread():
    """100k tiny user_fields: the meta keeps 1025 entries (one past the limit: the server
    refuses the request by it), not 100k (which cost ~29 MiB of Python objects)."""
    from aiobrpc import _fast
    data = request(user_fields={f"k{i}": "v" for i in range(100_000)})
    dec = server(max_body_size=4 * MIB)
    dec.feed(data)
    tracemalloc.start()
    ev = dec.next_event()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(ev.meta.user_fields) == _fast.MAX_USER_FIELDS + 1 == 1025
    assert all(k.startswith("k") and v == "v" for k, v in ev.meta.user_fields)  # the first ones on the wire
    assert peak < 512 * 1024
