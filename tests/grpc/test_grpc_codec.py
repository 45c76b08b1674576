"""aiobrpc.protocol.grpc: the sans-IO gRPC pieces (framing, compression, grpc-timeout, status
codes, grpc-message, metadata), tested without a network or an event loop."""

from __future__ import annotations

import doctest
import gzip
import struct
import tracemalloc
import zlib

import grpc as grpcio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiobrpc import errors
from aiobrpc.errors import LocalProtocolError, RemoteProtocolError
from aiobrpc.protocol import grpc

MIB = 1 << 20


def frame(payload: bytes, compressed: bool = False) -> bytes:
    return b"".join(grpc.encode_message(payload, compressed))


def decode_all(data: bytes, pieces, max_message_size: int = MIB):
    """Feed `data` cut at the offsets `pieces` and collect every message."""
    d = grpc.MessageDecoder(max_message_size)
    got = []
    start = 0
    for cut in [*pieces, len(data)]:
        d.feed(data[start:cut])
        got.extend((c, bytes(p)) for c, p in d)
        start = cut
    d.finish()
    return got


def test_doc_examples_run():
    assert doctest.testmod(grpc).failed == 0


# --- framing ------------------------------------------------------------------------------------

def test_encode_message_is_prefix_then_the_callers_object():
    data = memoryview(bytearray(b"abc"))
    out = grpc.encode_message(data, True)
    assert out[0] == b"\x01\x00\x00\x00\x03"
    assert out[1] is data
    assert grpc.encode_message(b"", False) == [b"\x00\x00\x00\x00\x00", b""]
    # The same prefix as the usual struct packing every gRPC implementation uses.
    assert grpc.encode_message(b"x" * 70000, False)[0] == struct.pack(">?I", False, 70000)


def test_encode_message_counts_bytes_of_a_wide_view():
    import array
    out = grpc.encode_message(memoryview(array.array("i", [1, 2, 3])), False)
    assert out[0] == b"\x00\x00\x00\x00\x0c"


messages = st.lists(st.tuples(st.booleans(), st.binary(max_size=40)), max_size=6)


@given(messages, st.data())
def test_decoder_round_trip_at_any_cuts(msgs, data):
    wire = b"".join(frame(p, c) for c, p in msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=10)))
    assert decode_all(wire, cuts) == msgs


def test_decoder_one_byte_at_a_time():
    msgs = [(False, b"hello"), (True, b""), (False, b"x" * 300), (True, b"\x00\x01")]
    wire = b"".join(frame(p, c) for c, p in msgs)
    assert decode_all(wire, range(1, len(wire))) == msgs


def test_a_message_in_one_piece_is_a_view_of_what_was_fed():
    chunk = frame(b"abc") + frame(b"de", True)
    d = grpc.MessageDecoder(100)
    d.feed(chunk)
    (c1, p1), (c2, p2) = list(d)
    assert isinstance(p1, memoryview) and p1.obj is chunk
    assert (c1, bytes(p1), c2, bytes(p2)) == (False, b"abc", True, b"de")
    assert list(d) == []


def test_max_message_size_is_checked_at_the_prefix():
    d = grpc.MessageDecoder(10)
    d.feed(frame(b"x" * 10))
    assert [bytes(p) for _, p in d] == [b"x" * 10]
    with pytest.raises(grpc.GrpcProtocolError, match="11 bytes exceeds max_message_size=10") as e:
        d.feed(b"\x00\x00\x00\x00\x0b")  # nothing of the payload needed
    assert e.value.grpc_status == grpc.RESOURCE_EXHAUSTED
    assert e.value.code == errors.ELIMIT and not e.value.fatal
    assert isinstance(e.value, RemoteProtocolError)
    with pytest.raises(grpc.GrpcProtocolError):  # the decoder stays failed
        d.feed(frame(b"ok"))
    with pytest.raises(grpc.GrpcProtocolError):
        d.finish()


def test_a_4_gib_declaration_keeps_nothing():
    d = grpc.MessageDecoder(MIB)
    with pytest.raises(grpc.GrpcProtocolError, match="4294967295 bytes"):
        d.feed(b"\x00\xff\xff")
        d.feed(b"\xff\xff")


@pytest.mark.parametrize("flag", [2, 0x80, 0xFF])
def test_a_flag_other_than_0_or_1_is_refused(flag):
    d = grpc.MessageDecoder(MIB)
    with pytest.raises(grpc.GrpcProtocolError, match=f"flag byte 0x{flag:02x}") as e:
        d.feed(bytes([flag]) + b"\x00\x00\x00\x01a")
    assert e.value.grpc_status == grpc.INTERNAL


@pytest.mark.parametrize("tail, what", [(b"\x00\x00", "message prefix \\(2 of 5 bytes\\)"),
                                        (b"\x00\x00\x00\x00\x04ab", "message \\(2 of 4 bytes\\)"),
                                        (b"\x01\x00\x00\x00\x04", "message \\(0 of 4 bytes\\)")])
def test_finish_inside_a_message_raises(tail, what):
    d = grpc.MessageDecoder(MIB)
    d.feed(frame(b"whole") + tail)
    assert [bytes(p) for _, p in d] == [b"whole"]
    with pytest.raises(grpc.GrpcProtocolError, match=f"stream ended inside a gRPC {what}"):
        d.finish()


def test_memory_held_is_one_message_and_one_prefix():
    d = grpc.MessageDecoder(MIB)
    d.feed(frame(b"y" * 1000)[:700])
    assert len(d._body) == 695 and d._need == 305 and not d._prefix
    d.feed(frame(b"y" * 1000)[700:] + b"\x00\x00\x00")
    assert d._body is None and bytes(d._prefix) == b"\x00\x00\x00"


# --- compression --------------------------------------------------------------------------------

@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compress_round_trip(encoding):
    data = b"brpc " * 1000
    packed = grpc.compress_message(encoding, data)
    assert len(packed) < len(data)
    assert bytes(grpc.decompress_message(encoding, packed, MIB)) == data
    # The containers grpc-go and C-core use: gzip is RFC 1952, deflate is zlib's RFC 1950.
    if encoding == "gzip":
        assert gzip.decompress(packed) == data
    else:
        assert zlib.decompress(packed) == data


def test_identity():
    data = memoryview(b"abc")
    assert grpc.compress_message("identity", data) is data
    with pytest.raises(grpc.GrpcProtocolError, match="flagged compressed but grpc-encoding is identity"):
        grpc.decompress_message("identity", b"abc", MIB)
    with pytest.raises(LocalProtocolError, match="'br' is not supported"):
        grpc.compress_message("br", data)


@pytest.mark.parametrize("encoding, pack", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_a_bomb_is_refused_without_inflating_it(encoding, pack):
    bomb = pack(b"\x00" * (64 * MIB))
    if encoding == "gzip":
        # A trailer that lies about the size: the bound must hold while inflating too.
        bomb = bomb[:-4] + (100).to_bytes(4, "little")
    tracemalloc.start()
    try:
        with pytest.raises(grpc.GrpcProtocolError, match="beyond max_message_size=1048576") as e:
            grpc.decompress_message(encoding, bomb, MIB)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.grpc_status == grpc.RESOURCE_EXHAUSTED
    assert peak < 2 * MIB


def test_a_gzip_declaring_too_much_is_refused_first():
    with pytest.raises(grpc.GrpcProtocolError, match="declares 2000 bytes") as e:
        grpc.decompress_message("gzip", gzip.compress(b"a" * 2000), 1000)
    assert e.value.grpc_status == grpc.RESOURCE_EXHAUSTED


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_corrupt_compressed_data_is_internal(encoding):
    with pytest.raises(grpc.GrpcProtocolError, match=f"grpc-encoding {encoding}: .*corrupt") as e:
        # Short of gzip's 18-byte minimum, so no trailer is read as a declared size.
        grpc.decompress_message(encoding, b"\x1f\x8b\x08garbage", MIB)
    assert e.value.grpc_status == grpc.INTERNAL


def test_parse_encoding():
    assert grpc.parse_encoding(None) == "identity"
    assert grpc.parse_encoding(b"gzip") == "gzip"
    assert grpc.parse_encoding(" Deflate ") == "deflate"
    with pytest.raises(grpc.GrpcProtocolError, match="'snappy' is not supported") as e:
        grpc.parse_encoding("snappy")
    assert e.value.grpc_status == grpc.UNIMPLEMENTED and e.value.code == errors.ENOMETHOD
    with pytest.raises(grpc.GrpcProtocolError, match="not supported"):
        grpc.decompress_message("snappy", b"", MIB)


def test_parse_accept_encoding():
    assert grpc.parse_accept_encoding(None) == ()
    assert grpc.parse_accept_encoding(b"identity,deflate,gzip") == ("identity", "deflate", "gzip")
    assert grpc.parse_accept_encoding(" GZIP , ,br,") == ("gzip", "br")
    assert grpc.ACCEPT_ENCODING == "identity,gzip,deflate"


# --- grpc-timeout -------------------------------------------------------------------------------

@pytest.mark.parametrize("value, ns", [
    ("1H", 3600 * 10**9), ("3M", 180 * 10**9), ("1S", 10**9), ("100m", 10**8), ("5u", 5000),
    ("2n", 2), (b"0S", 0), ("99999999n", 99999999), ("00000007m", 7 * 10**6), (b"12345678H", 12345678 * 3600 * 10**9),
])
def test_parse_every_unit(value, ns):
    assert grpc.parse_timeout_ns(value) == ns
    assert grpc.parse_timeout(value) == ns / 1e9


@pytest.mark.parametrize("value", [
    "", "S", "1", "123456789S", "1s", "1h", "1x", "1SS", " 1S", "1S ", "-1S", "+1S", "1.5S", "1 S",
    "١S", "1\u2009S", b"\xff1S", "0x1S",
])
def test_bad_timeouts_raise(value):
    with pytest.raises(grpc.GrpcProtocolError, match="is not 1-8 digits and a unit"):
        grpc.parse_timeout_ns(value)


def test_parse_timeout_ms_rounds_up():
    assert grpc.parse_timeout_ms("2n") == 1
    assert grpc.parse_timeout_ms("0n") == 1
    assert grpc.parse_timeout_ms("1001u") == 2
    assert grpc.parse_timeout_ms("1S") == 1000


@pytest.mark.parametrize("ns, text", [
    (0, "0n"), (-5, "0n"), (1, "1n"), (99999999, "99999999n"), (100000000, "100000u"),
    (100000001, "100001u"), (99999999000, "99999999u"), (99999999001, "100000m"),
    (10**9 * 99999999, "99999999S"), (10**9 * 99999999 + 1, "1666667M"),
    (60 * 10**9 * 99999999 + 1, "1666667H"), (3600 * 10**9 * 10**9, "99999999H"),
])
def test_format_timeout_like_grpc_go(ns, text):
    assert grpc.format_timeout_ns(ns) == text


@given(st.integers(1, 3600 * 10**9 * 99999999))
def test_formatted_timeout_is_never_shorter(ns):
    text = grpc.format_timeout_ns(ns)
    back = grpc.parse_timeout_ns(text)
    assert back >= ns
    assert len(text) <= 9


def test_format_timeout_seconds():
    assert grpc.format_timeout(0.25) == "250000u"
    assert grpc.format_timeout(0.0) == "0n"
    assert grpc.format_timeout(-1.0) == "0n"
    assert grpc.parse_timeout(grpc.format_timeout(2.000000001)) >= 2.000000001


# --- status codes -------------------------------------------------------------------------------

# Transcribed from brpc's src/brpc/grpc.cpp, ErrorCodeToGrpcStatus and GrpcStatusToErrorCode.
BRPC_ERROR_CODE_TO_GRPC_STATUS = {
    0: 0, 1001: 12, 1002: 12, 1004: 16, 1003: 3, 22: 3, 2004: 8, 2003: 14, 1: 7, 1008: 4,
    110: 13, 125: 1,
}
BRPC_GRPC_STATUS_TO_ERROR_CODE = {
    0: 0, 1: 125, 2: 2001, 3: 22, 4: 1008, 5: 2001, 6: 17, 7: 1, 8: 2004, 9: 2001, 10: 2001,
    11: 2001, 12: 1002, 13: 2001, 14: 2001, 15: 2001, 16: 1004,
}


def test_status_numbers_are_grpcs():
    assert {name: number for number, name in grpc.STATUS_NAMES.items()} == {
        s.name: s.value[0] for s in grpcio.StatusCode}
    for number, name in grpc.STATUS_NAMES.items():
        assert getattr(grpc, name) == number


def test_grpc_status_of_every_brpc_code():
    codes = {v for k, v in vars(errors).items() if k.isupper() and isinstance(v, int)}
    codes |= {0, 17, 5000, -1}
    assert set(BRPC_ERROR_CODE_TO_GRPC_STATUS) <= codes
    for code in codes:
        assert grpc.grpc_status_of(code) == BRPC_ERROR_CODE_TO_GRPC_STATUS.get(code, 13), code


def test_brpc_code_of_every_grpc_status():
    for status in range(-1, 20):
        assert grpc.brpc_code_of(status) == BRPC_GRPC_STATUS_TO_ERROR_CODE.get(status, 2001), status
    assert grpc.brpc_code_of(grpc.ALREADY_EXISTS) == grpc.EEXIST == 17


# --- grpc-message -------------------------------------------------------------------------------

# grpc-go's internal/transport http_util_test.go vectors.
@pytest.mark.parametrize("text, wire", [
    ("", ""), ("Hello", "Hello"), ("\u0000", "%00"), ("%", "%25"), ("\u7cfb\u7edf", "%E7%B3%BB%E7%BB%9F"),
    ("a\tb\nc\x7f", "a%09b%0Ac%7F"), ("~ !$&'", "~ !$&'"), ("\U0001F600", "%F0%9F%98%80"),
])
def test_percent_encode(text, wire):
    assert grpc.encode_grpc_message(text) == wire
    assert grpc.decode_grpc_message(wire) == text
    assert grpc.decode_grpc_message(wire.encode()) == text


@pytest.mark.parametrize("wire, text", [
    ("H%61o", "Hao"), ("H%6", "H%6"), ("%G0", "%G0"), ("%", "%"), ("%%41", "%A"), ("100%", "100%"),
    ("%e7%b3%bb", "\u7cfb"), ("%FF%FE", "\ufffd\ufffd"), ("%zz%4", "%zz%4"),
])
def test_percent_decode_is_tolerant(wire, text):
    assert grpc.decode_grpc_message(wire) == text


@given(st.text())
def test_percent_round_trip(text):
    wire = grpc.encode_grpc_message(text)
    assert all(0x20 <= ord(c) <= 0x7E for c in wire)
    assert grpc.decode_grpc_message(wire) == text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


@given(st.binary())
def test_percent_decode_never_raises(raw):
    grpc.decode_grpc_message(raw)
    grpc.decode_grpc_message(raw.decode("latin-1"))


# --- metadata -----------------------------------------------------------------------------------

def test_user_fields_of_headers_skips_reserved():
    headers = [
        (b":method", b"POST"), (b":path", b"/a.B/C"), (b":authority", b"x"), (b":scheme", b"http"),
        (b"content-type", b"application/grpc"), (b"te", b"trailers"), (b"user-agent", b"grpc-go"),
        (b"grpc-timeout", b"1S"), (b"grpc-encoding", b"gzip"), (b"grpc-accept-encoding", b"gzip"),
        (b"grpc-status-details-bin", b"AAAA"), (b"tenant", b"a"), ("X-Mixed-Case", "v"),
    ]
    assert grpc.user_fields_of_headers(headers) == {"tenant": "a", "x-mixed-case": "v"}


@pytest.mark.parametrize("value", [b"AAEC/w", b"AAEC/w==", "AAEC/w"])
def test_bin_values_padded_or_not(value):
    assert grpc.user_fields_of_headers([(b"trace-bin", value)]) == {"trace-bin": b"\x00\x01\x02\xff"}


def test_repeated_names():
    fields = grpc.user_fields_of_headers([(b"k", b"1"), (b"k", b"2"), (b"x-bin", b"AQ"), (b"x-bin", b"Ag,Aw")])
    assert fields == {"k": "1,2", "x-bin": b"\x03"}


def test_non_ascii_text_values_read_as_latin1():
    assert grpc.user_fields_of_headers([(b"k", b"caf\xc3\xa9")]) == {"k": "caf\xc3\xa9"}


@pytest.mark.parametrize("value", [b"A", b"!!!!", b"AAE*"])
def test_bad_base64_names_the_header(value):
    with pytest.raises(grpc.GrpcProtocolError, match="metadata 'k-bin'"):
        grpc.user_fields_of_headers([(b"k-bin", value)])


def test_headers_of_user_fields():
    headers = grpc.headers_of_user_fields({
        "Tenant": "a", "empty": "", "blob-bin": b"\x00\x01\x02\xff", "text-bin": "\u00e9", "view-bin": memoryview(b"ab"),
    })
    assert headers == [("tenant", "a"), ("empty", ""), ("blob-bin", "AAEC/w"), ("text-bin", "w6k"),
                       ("view-bin", "YWI")]
    assert grpc.user_fields_of_headers(headers) == {
        "tenant": "a", "empty": "", "blob-bin": b"\x00\x01\x02\xff", "text-bin": "\u00e9".encode(), "view-bin": b"ab"}


@pytest.mark.parametrize("fields, what", [
    ({"": "v"}, "name ''"), ({"a b": "v"}, "name 'a b'"), ({"caf\u00e9": "v"}, "name 'caf\u00e9'"),
    ({"a:b": "v"}, "name 'a:b'"), ({":path": "/x"}, "name ':path'"), ({"grpc-timeout": "1S"}, "'grpc-timeout' is reserved"),
    ({"Content-Type": "x"}, "'Content-Type' is reserved"), ({"te": "x"}, "'te' is reserved"),
    ({"connection": "x"}, "'connection' is reserved"), ({"k": b"raw"}, "'k': a bytes value needs a name ending in -bin"),
    ({"k": "a\nb"}, "'k': value 'a\\\\nb'"), ({"k": "\u00e9"}, "'k': value"), ({"k": " v"}, "'k': value ' v'"),
    ({"k": 5}, "'k': a int value"), ({"k-bin": 5}, "'k-bin': value must be str or bytes"), ({1: "v"}, "name 1"),
])
def test_headers_of_user_fields_refuses_bad_ones(fields, what):
    with pytest.raises(ValueError, match=what):
        grpc.headers_of_user_fields(fields)


@given(st.dictionaries(st.from_regex(r"[0-9a-z_.\-]{1,12}", fullmatch=True).filter(
    lambda k: not k.startswith("grpc-") and k not in grpc.RESERVED_HEADERS and not k.endswith("-bin")),
    st.from_regex(r"[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?", fullmatch=True) | st.just("")))
def test_metadata_round_trip(fields):
    assert grpc.user_fields_of_headers(grpc.headers_of_user_fields(fields)) == fields


@given(st.binary())
def test_bin_round_trip(blob):
    assert grpc.user_fields_of_headers(grpc.headers_of_user_fields({"b-bin": blob})) == {"b-bin": blob}


def test_only_the_grpc_server_and_client_import_it():
    from tests.test_layers import _imports, _modules
    modules = _modules()
    users = [name for name, path in modules.items() if "aiobrpc.protocol.grpc" in _imports(name, path, modules)]
    assert users and all(u.startswith(("aiobrpc.server.grpc.", "aiobrpc.client.")) for u in users), users
