"""The compiled builds of aiobrpc._fast's kernels agree with their Python builds: same bytes, same values, same
exceptions (type, message, code, fatal), same frames, same buffer decisions (copied_bytes and
the size of every buffer offered to the kernel).

The modules are imported directly and used side by side, so the conftest's twin selection
does not apply here.
"""

from __future__ import annotations

import array
import copy
import enum
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiobrpc import _compiled
from aiobrpc.errors import ProtocolError
from tests.helpers.wire import vi

if not _compiled.compiled()["aiobrpc._fast.iobuf"]:  # the other kernels are built with it
    pytest.skip("the compiled kernels are not built, or not chosen (AIOBRPC_NO_EXTENSIONS)",
                allow_module_level=True)
meta_c = pytest.importorskip("aiobrpc._fast.meta")
framing_c = pytest.importorskip("aiobrpc._fast.framing")
iobuf_c = pytest.importorskip("aiobrpc._fast.iobuf")
# The same sources run as Python (framing's with iobuf's).
meta_py = _compiled.load_source("aiobrpc._fast.meta")
framing_py = _compiled.load_source("aiobrpc._fast.framing")
iobuf_py = _compiled.load_source("aiobrpc._fast.iobuf")

FIELDS = meta_py.RpcMeta.__slots__
HEADER = iobuf_py.HEADER_SIZE
LARGE_ALIGN = iobuf_py.LARGE_ALIGN


@pytest.fixture
def twin():
    """Overrides the conftest's autouse selection: both twins are used side by side here."""


def outcome(fn, *args):
    """What a call did, in a form that compares across twins."""
    try:
        return ("ok", fn(*args))
    except Exception as e:  # noqa: BLE001 - any exception must match across twins
        extra = (e.code, getattr(e, "fatal", None)) if isinstance(e, ProtocolError) else ()
        return ("raised", type(e), str(e), extra)


def fields_of(m) -> list[str]:
    # repr tells True from 1, str from bytes and a list from a tuple, where == would not
    return [repr(getattr(m, k)) for k in FIELDS]


def same_meta_outcome(a, b) -> None:
    assert a[0] == b[0], (a, b)
    if a[0] == "raised":
        assert a == b
    else:
        assert type(a[1]) is meta_c.RpcMeta and type(b[1]) is meta_py.RpcMeta
        assert fields_of(a[1]) == fields_of(b[1])
        assert a[1] == b[1] and b[1] == a[1] and not (a[1] != b[1])
        assert repr(a[1]) == repr(b[1])


# --- meta: encode ------------------------------------------------------------------------------

I64_EDGES = [0, 1, -1, 127, 128, (1 << 63) - 1, -(1 << 63), (1 << 64) - 1, 1 << 63]
I32_EDGES = [0, -1, 1, (1 << 31) - 1, -(1 << 31), 300]


class Code(enum.IntEnum):  # an int subclass, formatted by its own __format__ in messages
    SMALL = 3
    HUGE = 1 << 40


BAD_INTS = [1 << 64, -(1 << 63) - 1, 1 << 31, -(1 << 31) - 1, 1 << 100, 2.0, "7", b"7", True,
            Code.SMALL, Code.HUGE]

int64s = st.none() | st.sampled_from(I64_EDGES + BAD_INTS) | st.integers(-(1 << 63), (1 << 64) - 1)
int32s = st.none() | st.sampled_from(I32_EDGES + BAD_INTS) | st.integers(-(1 << 31), (1 << 31) - 1)
texts = st.text(max_size=12) | st.sampled_from(["", "é", "中文", "\U0001f600", "\ud800", "a\0b"])
blobs = (texts | st.binary(max_size=12) | st.binary(max_size=12).map(bytearray)
         | st.binary(max_size=12).map(memoryview)
         | st.sampled_from([memoryview(b"abcdef")[1:4], memoryview(b"abcdef")[::2], 5, None]))
long_blobs = st.sampled_from(["x" * 127, "y" * 128, b"z" * 300, "é" * 70, b"w" * 20000])
pairs = st.tuples(texts | st.binary(max_size=4), texts | st.binary(max_size=4))
user_fields = (
    st.none()
    | st.lists(pairs, max_size=4).map(lambda items: items + items[:1])  # a duplicate entry
    | st.lists(pairs, max_size=3).map(tuple)
    # shapes only the pure twin's `for key, value in ...` defines: handed to it
    | st.sampled_from([[["k", "v"]], ["ab"], [("a",)], [("a", "b", "c")], [1], 5, {"k": "v"},
                       [("k", 1)]]))
truth = st.none() | st.booleans() | st.sampled_from([0, 1, 2, "", "x"])


@st.composite
def meta_fields(draw) -> dict:
    f = {k: None for k in FIELDS}
    f["has_request"] = draw(st.booleans() | st.sampled_from([0, 1, None, "yes"]))
    f["has_response"] = draw(st.booleans() | st.sampled_from([0, "x"]))
    for k in ("service_name", "method_name"):
        f[k] = draw(st.sampled_from(["example.EchoService", "Echo"]) | blobs | long_blobs)
    for k in ("log_id", "trace_id", "span_id", "parent_span_id", "correlation_id"):
        f[k] = draw(int64s)
    for k in ("timeout_ms", "error_code", "compress_type", "attachment_size", "content_type",
              "checksum_type"):
        f[k] = draw(int32s)
    for k in ("request_id", "error_text", "chunk_info", "authentication_data",
              "stream_settings", "checksum_value"):
        f[k] = draw(blobs | long_blobs)
    f["user_fields"] = draw(user_fields)
    f["checksum_with_attachment"] = draw(truth)
    return f


def build(cls, fields: dict):
    m = cls()
    for k, v in fields.items():
        setattr(m, k, v)
    return m


@given(meta_fields(), st.sampled_from([b"PRPC", b"STRM", b"PR", b"PRPCX", bytearray(b"PRPC"), 4]),
       st.sampled_from([0, 1, 5, -1, -4, (1 << 32) - 1, 1 << 32, 1 << 70, True, 2.5]))
@settings(max_examples=400)
def test_encode_and_pack_head_agree(fields, magic, payload_size):
    mc, mp = build(meta_c.RpcMeta, fields), build(meta_py.RpcMeta, fields)
    assert mc == mp and mp == mc
    assert repr(mc) == repr(mp)
    enc = outcome(meta_c.encode_meta, mc)
    assert enc == outcome(meta_py.encode_meta, mp)
    # both encoders take either twin's RpcMeta (the pure codec duck-types)
    assert outcome(meta_c.encode_meta, mp) == enc == outcome(meta_py.encode_meta, mc)
    head = outcome(meta_c.pack_head, magic, mc, payload_size)
    assert head == outcome(meta_py.pack_head, magic, mp, payload_size)
    if enc[0] == "ok":
        raw = enc[1]
        for buf in (raw, bytearray(raw), memoryview(b"pad" + raw)[3:]):
            same_meta_outcome(outcome(meta_c.decode_meta, buf), outcome(meta_py.decode_meta, buf))


def test_typical_request_meta_is_byte_identical():
    f = {k: None for k in FIELDS}
    f.update(has_request=True, service_name="example.EchoService", method_name="Echo", log_id=7,
             correlation_id=12345, compress_type=0, content_type=0, checksum_type=0,
             checksum_value=b"", has_response=False)
    raw = meta_c.encode_meta(build(meta_c.RpcMeta, f))
    assert raw == meta_py.encode_meta(build(meta_py.RpcMeta, f))
    assert meta_c.pack_head(b"PRPC", build(meta_c.RpcMeta, f), 99) == \
        meta_py.pack_head(b"PRPC", build(meta_py.RpcMeta, f), 99)
    assert meta_c.decode_meta(raw) == meta_py.decode_meta(raw) == build(meta_py.RpcMeta, f)


def test_meta_object_protocol():
    mc, mp = meta_c.RpcMeta(), meta_py.RpcMeta()
    assert fields_of(mc) == fields_of(mp) and repr(mc) == repr(mp) == "RpcMeta()"
    assert mc == mp and mp == mc
    assert (mc == 5) is False and mc != 5
    mc.log_id = 1
    assert mc != mp and mp != mc
    with pytest.raises(TypeError):
        hash(mc)
    with pytest.raises(AttributeError):
        mc.no_such_field = 1
    mc.user_fields = [("k", "v")]
    for clone in (pickle.loads(pickle.dumps(mc)), copy.copy(mc), copy.deepcopy(mc)):
        assert type(clone) is meta_c.RpcMeta and fields_of(clone) == fields_of(mc)


def test_deleted_field_behaves_like_a_deleted_slot():
    metas = [meta_c.RpcMeta(), meta_py.RpcMeta()]
    for m in metas:
        m.has_request, m.service_name, m.method_name = True, "s", "m"
        del m.log_id
    for fn in (meta_c.encode_meta, meta_py.encode_meta, lambda m: meta_c.pack_head(b"PRPC", m, 1)):
        for m in metas:  # log_id is read: AttributeError (whose message names the class)
            with pytest.raises(AttributeError, match="has no attribute 'log_id'"):
                fn(m)
    for m in metas:
        m.has_request = False  # now log_id is not read
    assert meta_c.encode_meta(metas[0]) == meta_py.encode_meta(metas[1]) == b""
    for fn in (repr, lambda m: m == meta_py.RpcMeta(), lambda m: m.log_id):
        with pytest.raises(AttributeError):
            fn(metas[0])


# --- meta: decode ------------------------------------------------------------------------------

field_numbers = st.sampled_from(list(range(15)) + [99, 1 << 28, 1 << 60])
varint_values = (st.sampled_from([0, 1, 127, 128, 1 << 31, (1 << 32) - 1, 1 << 63, (1 << 64) - 1])
                 | st.integers(0, (1 << 64) - 1))
raw_varints = st.sampled_from([b"\xff" * 9 + b"\x01", b"\xff" * 9 + b"\x02", b"\xff" * 10 + b"\x00",
                               b"\x80" * 9 + b"\x80", b"\x80", b"", b"\xff" * 3])


@st.composite
def message(draw, depth: int = 0) -> bytes:
    """Protobuf-shaped bytes: mostly well-formed fields of every wire type, nested messages
    and groups, with some wrong lengths, odd varints and truncation mixed in."""
    out = bytearray()
    for _ in range(draw(st.integers(0, 5))):
        num = draw(field_numbers)
        wt = draw(st.sampled_from([0, 0, 1, 2, 2, 2, 3, 4, 5, 6, 7]))
        out += vi(num << 3 | wt)
        if wt == 0:
            out += draw(st.builds(vi, varint_values) | raw_varints)
        elif wt == 1:
            out += draw(st.binary(min_size=0, max_size=9))
        elif wt == 5:
            out += draw(st.binary(min_size=0, max_size=5))
        elif wt == 2:
            if depth < 3 and draw(st.booleans()):
                body = draw(message(depth + 1))
            else:  # bytes, and text that is not UTF-8 (a lone surrogate, a stray byte)
                body = draw(st.binary(max_size=8)
                            | st.sampled_from([b"\xff\xfe", "é".encode(), b"\xed\xa0\x80"]))
            n = len(body) + draw(st.sampled_from([0, 0, 0, 0, 1, -1, 1 << 40, (1 << 64) - 1]))
            out += vi(n) + body
        elif wt == 3:
            if depth < 3:
                out += draw(message(depth + 1))
            end = draw(st.sampled_from([num, num, num + 1, 0]))
            out += vi(end << 3 | 4)
    if draw(st.integers(0, 9)) == 0:
        del out[draw(st.integers(0, len(out))):]
    return bytes(out)


@given(message() | st.binary(max_size=64))
@settings(max_examples=700)
def test_decode_agrees_on_arbitrary_bytes(raw):
    for buf in (raw, bytearray(raw), memoryview(b"x" + raw)[1:]):
        same_meta_outcome(outcome(meta_c.decode_meta, buf), outcome(meta_py.decode_meta, buf))


@pytest.mark.parametrize("depth", [1, 31, 32, 33, 200])
def test_group_depth_limit_agrees(depth):
    raw = vi(14 << 3 | 3) * depth + vi(14 << 3 | 4) * depth
    same_meta_outcome(outcome(meta_c.decode_meta, raw), outcome(meta_py.decode_meta, raw))


@pytest.mark.parametrize("buf", [5, "text", None, [1, 2], array.array("B", b"\x18\x01"),
                                 memoryview(b"\x20\x05\x20\x06")[::2]])
def test_decode_odd_inputs_agree(buf):
    a, b = outcome(meta_c.decode_meta, buf), outcome(meta_py.decode_meta, buf)
    if a[0] == "ok":
        assert fields_of(a[1]) == fields_of(b[1])
    else:
        assert a == b


# --- framing -----------------------------------------------------------------------------------

@given(st.binary(max_size=14) | st.lists(st.integers(0, 255), max_size=14)
       | st.sampled_from([b"PRPC", b"STRM", b"PRP", b"STX", b"PRPC" + bytes(8),
                          b"STRM\xff" + bytes(7)]))
def test_header_helpers_agree(buf):
    for fn in ("parse_header", "magic_prefix_ok"):
        assert outcome(getattr(framing_c, fn), buf) == outcome(getattr(framing_py, fn), buf)
    if not isinstance(buf, list):
        view = memoryview(b"_" + bytes(buf))[1:]
        assert outcome(framing_c.parse_header, view) == outcome(framing_py.parse_header, view)


@given(st.sampled_from([b"PRPC", b"STRM", b"", b"LONGMAGIC", bytearray(b"PRPC")]),
       st.sampled_from([0, 5, 0xFFFFFFFF, 1 << 32, -1, 1 << 80, 3.0]),
       st.sampled_from([0, 5, 0xFFFFFFFF, -1, 1 << 70]))
def test_pack_header_agrees(magic, body, meta):
    assert outcome(framing_c.pack_header, magic, body, meta) == \
        outcome(framing_py.pack_header, magic, body, meta)


def frame_bytes(kind: bytes, meta: bytes, payload_size: int, seed: int) -> bytes:
    payload = (bytes(range(256)) * (payload_size // 256 + 2))[seed % 256:seed % 256 + payload_size]
    sizes = (len(meta) + payload_size).to_bytes(4, "big") + len(meta).to_bytes(4, "big")
    return kind + sizes + meta + payload


@st.composite
def frame_stream(draw, max_payload: int) -> bytes:
    """Frames in a row, sometimes ended by a bad header or junk."""
    out = bytearray()
    for i in range(draw(st.integers(1, 10))):
        if draw(st.integers(0, 9)) == 0:
            out += draw(st.sampled_from([b"PRPX" + bytes(8), b"X", b"STRM\0\0\0\x01\0\0\0\x05x",
                                         b"PRPC\xff\xff\xff\xff\0\0\0\0",
                                         b"PRPC\0\0\x10\0\0\0\0\0"]))
            break
        out += frame_bytes(draw(st.sampled_from([b"PRPC", b"STRM"])), draw(st.binary(max_size=20)),
                           draw(st.integers(0, max_payload) | st.sampled_from([0, 1])), i)
    return bytes(out)


def view_shape(v: memoryview) -> tuple:
    """Everything about a view but its address (the compiled twin narrows views in C)."""
    return (v.format, v.itemsize, v.ndim, v.shape, v.strides, v.readonly, v.c_contiguous,
            v.nbytes, len(v), v.tolist()[:3], type(v.obj).__name__, len(v.obj), bytes(v[1:-1]))


class Run:
    """One twin's FrameReader driven the same way as the other's, with everything it did."""

    def __init__(self, framing, keep_every: int, **options) -> None:
        self.reader = framing.FrameReader(**options)
        self.split_payload = framing.split_payload
        self.keep_every = keep_every
        self.kept = []  # (views, bytes they showed when handed out)
        self.log = []

    def drain(self) -> bool:
        while True:
            got = outcome(self.reader.next_frame)
            if got[0] == "raised":
                self.log.append(got)
                return False
            if got[1] is None:
                reader = self.reader
                self.log.append(("state", reader.pending_bytes(), reader.rbuf.copied_bytes))
                return True
            kind, meta, payload = got[1]
            seen = (kind, bytes(meta), bytes(payload))
            self.log.append(seen + (view_shape(meta), view_shape(payload)))
            n = payload.nbytes
            for att in (0, 1, n // 4, n // 4 + 1, n // 2, n):  # copied out or a view: same choice
                data, attachment = self.split_payload(payload, min(att, n))
                self.log.append((view_shape(data), view_shape(attachment)))
                del data, attachment
            if self.reader.frames % self.keep_every == 0:
                # hold some frames' views: the buffer must neither reuse nor rewrite their block
                self.kept.append(((meta, payload), seen[1:]))

    def kernel_read(self, data: bytes, pos: int, limit: int) -> int:
        buf = self.reader.get_buffer(-1)
        k = min(len(buf), limit, len(data) - pos)
        self.log.append(("offered", len(buf)))
        buf[:k] = data[pos:pos + k]
        del buf
        self.reader.buffer_updated(k)
        return k

    def views_intact(self) -> bool:
        return all((bytes(m), bytes(p)) == seen for (m, p), seen in self.kept)


reader_options = st.fixed_dictionaries({
    "block_size": st.sampled_from([256, 300, 1024]),
    "large_threshold": st.sampled_from([12, 40, 100, 128]),
    "max_body_size": st.sampled_from([1, 200, 5000, 64 << 20]),
})


@given(frame_stream(max_payload=700), st.lists(st.integers(1, 400), min_size=1, max_size=30),
       reader_options, st.integers(1, 3))
@settings(max_examples=250)
def test_frame_reader_kernel_path_agrees(stream, reads, options, keep_every):
    runs = [Run(framing_c, keep_every, **options), Run(framing_py, keep_every, **options)]
    for run in runs:
        pos, i = 0, 0
        while pos < len(stream):
            pos += run.kernel_read(stream, pos, reads[i % len(reads)])
            i += 1
            if not run.drain():
                break
    assert runs[0].log == runs[1].log
    assert runs[0].reader.frames == runs[1].reader.frames
    assert runs[0].views_intact() and runs[1].views_intact()


@given(frame_stream(max_payload=400), st.lists(st.integers(1, 600), min_size=1, max_size=30),
       st.integers(1, 3), st.booleans())
@settings(max_examples=200)
def test_frame_reader_feed_path_agrees(stream, cuts, keep_every, drain_between):
    # Fed without draining, the block grows to hold every frame and a complete large frame is
    # parked until it is taken.
    options = {"block_size": 256, "large_threshold": 100}
    runs = [Run(framing_c, keep_every, **options), Run(framing_py, keep_every, **options)]
    for run in runs:
        pos, i = 0, 0
        while pos < len(stream):
            chunk = stream[pos:pos + cuts[i % len(cuts)]]
            run.reader.feed(chunk if i % 2 else bytearray(chunk))
            run.log.append(("fed", run.reader.pending_bytes(), run.reader.rbuf.copied_bytes))
            pos += len(chunk)
            i += 1
            if drain_between and not run.drain():
                break
        run.drain()
    assert runs[0].log == runs[1].log
    assert runs[0].views_intact() and runs[1].views_intact()


BLOCK = bytearray(range(256)) * 4


def released() -> memoryview:
    view = memoryview(bytearray(100))
    view.release()  # its bytearray is gone: the compiled twin must not look at it
    return view


@pytest.mark.parametrize("payload", [
    memoryview(BLOCK)[100:400], memoryview(BLOCK), memoryview(BLOCK)[5:5], memoryview(BLOCK)[::2],
    memoryview(BLOCK).cast("c")[10:50], memoryview(BLOCK).cast("B", (32, 32)),
    memoryview(bytes(BLOCK))[1:9], memoryview(array.array("h", [1, 2, 3, 4])), b"abcd",
    bytearray(b"abcd"), None, released()], ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("att", [0, 1, 2, 75, 76, 100, 300, 301, -1, 1 << 70, True, 2.0, "1",
                                 Code.SMALL])
def test_split_payload_agrees(payload, att):
    def split(fn):
        got = outcome(fn, payload, att)
        if got[0] == "ok":
            got = ("ok", [view_shape(v) if isinstance(v, memoryview) else v for v in got[1]])
        return got
    assert split(framing_c.split_payload) == split(framing_py.split_payload)


# --- large frames: no copy -----------------------------------------------------------------------

@pytest.mark.parametrize("size", [1 << 20, 16 << 20])
@pytest.mark.parametrize("framing", [framing_c, framing_py], ids=["compiled", "pure"])
def test_large_frame_after_large_frame_is_not_copied(framing, size):
    first, second = frame_bytes(b"PRPC", b"meta", 300_000, 1), frame_bytes(b"PRPC", b"m2", size, 2)
    stream = first + second
    reader = framing.FrameReader(max_body_size=64 << 20)
    frames, copied_before = [], []
    pos = 0
    while pos < len(stream):  # a kernel that reads at most 64 KiB per call
        buf = reader.get_buffer(-1)
        k = min(len(buf), 65536, len(stream) - pos)
        buf[:k] = stream[pos:pos + k]
        del buf
        reader.buffer_updated(k)
        pos += k
        while (f := reader.next_frame()) is not None:
            frames.append(f)
            copied_before.append(reader.rbuf.copied_bytes)
    assert len(frames) == 2
    _, meta, payload = frames[1]
    assert bytes(meta) == b"m2" and payload.nbytes == size and bytes(payload[-5:]) == second[-5:]
    # The body goes straight from the kernel into the frame's own buffer. Only its 12-byte
    # header, read with the end of the first large frame (or on its own), is moved.
    assert reader.rbuf.copied_bytes - copied_before[0] <= HEADER
    assert type(payload.obj) is bytearray and len(payload.obj) == HEADER + 2 + size + HEADER + LARGE_ALIGN
    assert payload.obj is meta.obj


# --- ReadBuffer and IOBuf ----------------------------------------------------------------------

@given(st.lists(st.tuples(st.sampled_from(["feed", "take", "peek", "large", "clear", "hold"]),
                          st.integers(0, 300)), max_size=40))
@settings(max_examples=200)
def test_read_buffer_agrees(ops):
    rbs = [iobuf_c.ReadBuffer(512, 128), iobuf_py.ReadBuffer(512, 128)]
    logs = [[], []]
    for rb, log in zip(rbs, logs):
        held = []
        for op, n in ops:
            if op == "feed":
                rb.feed(bytes((n + i) & 0xFF for i in range(n)))
            elif op == "take":
                n = min(n, rb.available())
                log.append(bytes(rb.take(n)))
            elif op == "peek":
                log.append(bytes(rb.peek(min(n, rb.available()))))
            elif op == "large" and not rb.large_pending() and n >= rb.available():
                rb.begin_large(n)
            elif op == "clear":
                rb.clear()
            elif op == "hold":
                held.append(rb.peek(rb.available()))
            log.append((rb.pending_bytes(), rb.large_pending()))
            got = rb.take_large()
            log.append((None if got is None else bytes(got), rb.available(), rb.pending_bytes(),
                        rb.large_pending(), rb.copied_bytes, len(rb.get_buffer())))
    assert logs[0] == logs[1]


@given(st.lists(st.one_of(
    st.tuples(st.just("append"),
              st.binary(max_size=20) | st.binary(max_size=20).map(bytearray)
              | st.sampled_from([array.array("i", [1, 2, 3]), memoryview(b"abcdef")[::2], 5, "s"])),
    st.tuples(st.just("cut"), st.integers(-2, 40)),
    st.tuples(st.just("cut_all"), st.none())), max_size=25))
def test_iobuf_agrees(ops):
    logs = []
    for mod in (iobuf_c, iobuf_py):
        buf, log = mod.IOBuf(), []
        for op, arg in ops:
            got = outcome(getattr(buf, op), *(() if arg is None else (arg,)))
            if got[0] == "ok" and isinstance(got[1], list):
                got = ("ok", [(type(x).__name__, bytes(x)) for x in got[1]])
            log.append((got, len(buf)))
        logs.append(log)
    assert logs[0] == logs[1]


@pytest.mark.parametrize("obj", [b"ab", bytearray(b"ab"), array.array("h", [1, 2]), 5,
                                 memoryview(b"abcd")[::2], memoryview(bytes(6)).cast("B", (2, 3))])
def test_byte_view_agrees(obj):
    a, b = outcome(iobuf_c.byte_view, obj), outcome(iobuf_py.byte_view, obj)
    assert a[0] == b[0]
    if a[0] == "ok":
        assert (a[1].format, a[1].shape, bytes(a[1])) == (b[1].format, b[1].shape, bytes(b[1]))
    else:
        assert a == b
