"""Every RpcMeta field 1-13 round-trips, with proto2 presence and protobuf's semantics."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiobrpc import _fast
from aiobrpc._proto import brpc_meta_pb2
from aiobrpc.errors import LocalProtocolError, RemoteProtocolError
from tests.helpers.wire import field_ld, field_varint, rpc_meta, vi

INT64 = st.integers(-(1 << 63), (1 << 63) - 1)
INT32 = st.integers(-(1 << 31), (1 << 31) - 1)
TEXT = st.text(max_size=20)
BLOB = st.binary(max_size=20)


def _full_meta(**kw):
    m = _fast.RpcMeta()
    for k, v in kw.items():
        setattr(m, k, v)
    return m


@given(service=TEXT, method=TEXT, log_id=st.none() | INT64, trace_id=st.none() | INT64,
       span_id=st.none() | INT64, parent=st.none() | INT64, request_id=st.none() | TEXT,
       timeout=st.none() | INT32, compress_type=st.none() | INT32, cid=st.none() | INT64,
       att=st.none() | INT32, auth=st.none() | BLOB,
       user=st.none() | st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=4),
       content=st.none() | st.integers(0, 3), ck=st.none() | INT32, ckv=st.none() | BLOB,
       ckwa=st.none() | st.booleans())
@settings(max_examples=150, deadline=None)
def test_request_meta_roundtrip_matches_protobuf(service, method, log_id, trace_id, span_id, parent,
                                                 request_id, timeout, compress_type, cid, att, auth,
                                                 user, content, ck, ckv, ckwa):
    m = _full_meta(has_request=True, service_name=service, method_name=method, log_id=log_id,
                   trace_id=trace_id, span_id=span_id, parent_span_id=parent, request_id=request_id,
                   timeout_ms=timeout, compress_type=compress_type, correlation_id=cid,
                   attachment_size=att, authentication_data=auth, user_fields=user,
                   content_type=content, checksum_type=ck, checksum_value=ckv,
                   checksum_with_attachment=ckwa)
    raw = _fast.encode_meta(m)
    back = _fast.decode_meta(raw)
    assert back == m
    # protobuf reads the same values and re-serializes to the same bytes when the map has
    # at most one entry (map order is unspecified otherwise)
    pb = brpc_meta_pb2.RpcMeta.FromString(raw)
    assert pb.request.service_name == service and pb.request.method_name == method
    assert pb.HasField("correlation_id") == (cid is not None)
    if cid is not None:
        assert pb.correlation_id == cid
    if log_id is not None:
        assert pb.request.log_id == log_id
    if user is not None and len({k for k, _ in user}) <= 1:
        assert pb.SerializeToString() == raw or len(user) > 1


@given(code=st.none() | INT32, text=st.none() | TEXT, cid=INT64)
def test_response_meta_roundtrip(code, text, cid):
    m = _full_meta(has_response=True, error_code=code, error_text=text, correlation_id=cid)
    raw = _fast.encode_meta(m)
    assert _fast.decode_meta(raw) == m
    pb = brpc_meta_pb2.RpcMeta.FromString(raw)
    assert pb.HasField("response")
    assert pb.response.HasField("error_code") == (code is not None)


def test_uint64_log_id_is_negative_on_the_wire():
    m = _full_meta(has_request=True, service_name="s.S", method_name="M", log_id=(1 << 64) - 1)
    raw = _fast.encode_meta(m)
    assert raw.endswith(b"\x18" + b"\xff" * 9 + b"\x01")
    assert _fast.decode_meta(raw).log_id == -1


@pytest.mark.parametrize("field,value", [("log_id", 1 << 64), ("timeout_ms", 1 << 31),
                                         ("correlation_id", -(1 << 63) - 1), ("error_code", "x")])
def test_out_of_range_values_are_local_errors(field, value):
    m = _full_meta(has_request=True, has_response=True, service_name="s.S", method_name="M")
    setattr(m, field, value)
    with pytest.raises(LocalProtocolError, match=field):
        _fast.encode_meta(m)


def test_unknown_fields_and_wire_types_are_skipped():
    raw = (rpc_meta(correlation_id=5)
           + field_varint(100, 7) + field_ld(101, b"sofa")       # hulu/sofa extensions
           + vi(14 << 3 | 1) + b"12345678" + vi(15 << 3 | 5) + b"1234"
           + vi(16 << 3 | 3) + field_varint(1, 1) + vi(16 << 3 | 4)  # a group
           + field_ld(4, b"not a varint"))                       # correlation_id as LEN: unknown
    m = _fast.decode_meta(raw)
    assert m.correlation_id == 5 and m.service_name == "example.EchoService"


def test_last_scalar_wins_and_submessages_merge():
    raw = (field_ld(1, field_ld(1, b"a.S") + field_varint(3, 9)) + field_varint(4, 1)
           + field_ld(1, field_ld(2, b"M")) + field_varint(4, 2))
    m = _fast.decode_meta(raw)
    assert (m.service_name, m.method_name, m.log_id, m.correlation_id) == ("a.S", "M", 9, 2)


@pytest.mark.parametrize("raw,needle", [
    (field_ld(1, field_ld(1, b"a.S")), "method_name"),
    (field_ld(1, b""), "service_name"),
    (b"\xff" * 10, "varint"),
    (b"\x0a\x05abc", "past the end"),
    (b"\x20", "truncated"),
    (b"\x00\x01", "field number 0"),
    (vi(16 << 3 | 4), "wire type"),
    (vi(16 << 3 | 7), "wire type"),
    (vi(16 << 3 | 3) + vi(17 << 3 | 4), "mismatched"),
    (field_ld(1, field_ld(1, b"\xff\xfe") + field_ld(2, b"M")), "UTF-8"),
    ((vi(16 << 3 | 3)) * 40, "nested"),
])
def test_malformed_meta_raises_remote_error(raw, needle):
    with pytest.raises(RemoteProtocolError, match=needle) as ei:
        _fast.decode_meta(raw)
    assert ei.value.fatal


def test_user_fields_keep_wire_order_and_duplicates():
    raw = rpc_meta() + field_ld(9, field_ld(1, b"b") + field_ld(2, b"2")) + \
        field_ld(9, field_ld(1, b"a") + field_ld(2, b"1")) + field_ld(9, field_ld(2, b"nokey"))
    m = _fast.decode_meta(raw)
    assert m.user_fields == [("b", "2"), ("a", "1"), ("", "nokey")]
    assert _fast.decode_meta(_fast.encode_meta(m)).user_fields == m.user_fields


@pytest.mark.parametrize("entry, says", [(("k", "v", "x"), "got a tuple of length 3"), (["k"], "got a list of length 1"),
                                         ("kv", "got str"), (7, "got int"), (None, "got NoneType")])
def test_user_fields_that_are_not_pairs_are_local_errors(entry, says):
    # each entry makes the compiled build take its Python path, which must then say what is wrong
    m = _full_meta(has_request=True, service_name="s", method_name="m", user_fields=[("a", "b"), entry])
    for encode in (_fast.encode_meta, lambda meta: _fast.pack_head(b"PRPC", meta, 0)):
        with pytest.raises(LocalProtocolError, match=f"user_fields must hold \\(key, value\\) pairs, {says}"):
            encode(m)


def test_a_magic_whose_len_lies_is_refused():
    class Lying(bytes):
        def __len__(self):
            return 4
    with pytest.raises(LocalProtocolError, match="magic must be 4 bytes"):
        _fast.pack_head(Lying(b"PR"), _fast.RpcMeta(), 0)


def test_pack_head_layout():
    m = _full_meta(has_request=True, service_name="a.S", method_name="M", correlation_id=1)
    head = _fast.pack_head(b"PRPC", m, 10)
    meta = _fast.encode_meta(m)
    assert head[:4] == b"PRPC"
    assert int.from_bytes(head[4:8], "big") == len(meta) + 10
    assert int.from_bytes(head[8:12], "big") == len(meta)
    assert head[12:] == meta
    assert _fast.parse_header(head) == (_fast.KIND_PRPC, len(meta) + 10, len(meta))
