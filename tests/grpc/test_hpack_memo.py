"""aiobrpc.protocol.hpack_memo: the memo coders code every block as hpack's own coders do, across
table additions, evictions and resizes, and keep a bounded memo that is actually used."""

from __future__ import annotations

import h2.config
import h2.connection
import hpack
import pytest
from hpack import HeaderTuple, NeverIndexedHeaderTuple
from hpack.exceptions import InvalidTableSizeError
from hypothesis import given
from hypothesis import strategies as st

from aiobrpc.protocol import hpack_memo
from aiobrpc.protocol.hpack_memo import MEMO_BLOCK_BYTES, MEMO_ENTRIES, MemoDecoder, MemoEncoder

GRPC_REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/pkg.S/M"), (b":authority", b"h"),
                (b"te", b"trailers"), (b"content-type", b"application/grpc")]

_names = st.sampled_from([b"a", b"grpc-status", b"x-user", b":status", b"content-type", b"x-" + b"n" * 40])
_values = st.sampled_from([b"0", b"1", b"application/grpc", b"v" * 100, b"w" * 1500, b""])
_header = st.tuples(_names, _values)
# a step: a block of headers to code, or a table size to set (the peer's SETTINGS_HEADER_TABLE_SIZE)
_step = st.one_of(st.lists(_header, max_size=6), st.sampled_from([0, 64, 256, 4096]))


@given(st.lists(_step, max_size=40))
def test_memo_coders_code_as_hpack_does(steps):
    plain_enc, memo_enc = hpack.Encoder(), MemoEncoder()
    plain_dec, memo_dec = hpack.Decoder(), MemoDecoder()
    for step in steps * 2:  # twice: the second pass repeats blocks the memos have seen
        if isinstance(step, int):
            if step != plain_enc.header_table_size:  # hpack forgets a pending resize when set twice to one size
                plain_enc.header_table_size = memo_enc.header_table_size = step
            continue
        block = plain_enc.encode(list(step))
        assert memo_enc.encode(list(step)) == block
        assert memo_dec.decode(block, raw=True) == plain_dec.decode(block, raw=True) == step
        assert len(memo_enc._memo) <= MEMO_ENTRIES and len(memo_dec._memo) <= MEMO_ENTRIES


def test_a_repeated_indexed_block_is_decoded_by_hpack_once(monkeypatch):
    enc, dec = hpack.Encoder(), MemoDecoder()
    dec.decode(enc.encode(GRPC_REQUEST), raw=True)  # literals: fill the table
    block = enc.encode(GRPC_REQUEST)
    decoded = []
    plain = hpack.Decoder.decode

    def counted(self, data, raw=False):
        decoded.append(data)
        return plain(self, data, raw)
    monkeypatch.setattr(hpack.Decoder, "decode", counted)
    for _ in range(5):
        assert dec.decode(block, raw=True) == GRPC_REQUEST
    assert decoded == [block]


def test_a_decoded_list_is_the_callers_own():
    enc, dec = hpack.Encoder(), MemoDecoder()
    block = enc.encode([(b":status", b"200")])
    dec.decode(block, raw=True).append((b"x", b"y"))
    assert dec.decode(block, raw=True) == [(b":status", b"200")]


def test_the_same_bytes_after_a_table_change_mean_the_new_entry():
    dec = MemoDecoder()
    newest = bytes([0x80 | 62])  # indexed: the newest dynamic entry
    dec.decode(hpack.Encoder().encode([(b"x-a", b"1")]), raw=True)
    assert dec.decode(newest, raw=True) == [(b"x-a", b"1")]
    enc = hpack.Encoder()
    enc.encode([(b"x-a", b"1")])
    dec.decode(enc.encode([(b"x-b", b"2")]), raw=True)  # adds x-b: now index 62
    assert dec.decode(newest, raw=True) == [(b"x-b", b"2")]


def test_a_remembered_block_still_checks_a_shrunk_table_limit():
    enc, dec = hpack.Encoder(), MemoDecoder()
    dec.decode(enc.encode([(b"x-a", b"v" * 200)]), raw=True)
    block = enc.encode([(b"x-a", b"v" * 200)])
    assert dec.decode(block, raw=True) == [(b"x-a", b"v" * 200)]
    dec.max_allowed_table_size = 64  # we acknowledged a smaller table; the peer did not shrink its own
    with pytest.raises(InvalidTableSizeError):
        dec.decode(block, raw=True)


def test_a_remembered_block_still_checks_a_lowered_header_list_limit():
    enc, dec = hpack.Encoder(), MemoDecoder()
    dec.decode(enc.encode([(b"x-a", b"v" * 200)]), raw=True)
    block = enc.encode([(b"x-a", b"v" * 200)])
    dec.decode(block, raw=True)
    dec.max_header_list_size = 100
    with pytest.raises(hpack.OversizedHeaderListError):
        dec.decode(block, raw=True)


def test_memos_are_bounded():
    enc, dec = MemoEncoder(), MemoDecoder()
    for i in range(3 * MEMO_ENTRIES):
        block = enc.encode([(b":status", b"200"), (b"grpc-status", str(i % 17).encode())])
        dec.decode(block, raw=True)
        assert len(enc._memo) <= MEMO_ENTRIES and len(dec._memo) <= MEMO_ENTRIES
    # table-neutral but long: coded afresh, never kept
    long_block = bytes([0x80 | 2]) * (MEMO_BLOCK_BYTES + 1)  # :method GET, many times
    dec._memo.clear()
    assert len(dec.decode(long_block, raw=True)) == MEMO_BLOCK_BYTES + 1
    assert not dec._memo
    enc._memo.clear()
    enc.encode([(b"x-big", b"v" * 2000)])  # a literal added to the table: not table-neutral
    enc.encode([(b"x-big", b"v" * 2000)])  # indexed now, but its key is larger than a memo keeps
    assert not enc._memo


def test_never_indexed_headers_are_not_confused_with_plain_ones():
    plain, memo = hpack.Encoder(), MemoEncoder()
    for headers in ([(b"x-secret", b"s")], [NeverIndexedHeaderTuple(b"x-secret", b"s")],
                    [HeaderTuple(b"x-secret", b"s")], [(b"x-secret", b"s", True)], [(b"x-secret", b"s")]):
        assert memo.encode(headers) == plain.encode(headers)


def test_installed_on_an_h2_connection_pair():
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    for conn in (client, server):
        hpack_memo.install(conn)
        conn.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    for sid in range(1, 40, 2):
        client.send_headers(sid, GRPC_REQUEST, end_stream=True)
        (received,) = [e for e in server.receive_data(client.data_to_send()) if hasattr(e, "headers")]
        assert received.headers == GRPC_REQUEST
        server.send_headers(sid, [(b":status", b"200"), (b"grpc-status", b"0")], end_stream=True)
        events = client.receive_data(server.data_to_send())
        assert [e.headers for e in events if hasattr(e, "headers")] == [[(b":status", b"200"), (b"grpc-status", b"0")]]
    assert isinstance(server.decoder, MemoDecoder) and server.decoder._memo
    assert isinstance(server.encoder, MemoEncoder) and server.encoder._memo
