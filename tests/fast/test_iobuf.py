"""IOBuf (send side) and ReadBuffer / FrameReader (receive side), through `aiobrpc._fast`.

The conftest runs every test against both twins. The properties pinned here are the ones the
zero-copy design rests on: what goes into an IOBuf comes out as the caller's object or a view
of it; a view handed out by the receive side never sees its bytes change, however much more is
received; and a large frame is read by the kernel straight into one exact-size buffer.
"""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest

from aiobrpc import _fast
from aiobrpc.errors import LocalProtocolError

HEADER = 12
LARGE_ALIGN = 64  # a large frame's buffer has room to place the frame so that it ends aligned
KERNEL_READ = 64 * 1024  # what one recv_into() of a busy socket typically returns


def frame(meta: bytes, payload: bytes, magic: bytes = b"PRPC") -> bytes:
    """A frame built with struct, independent of the codec under test."""
    return struct.pack(">4sII", magic, len(meta) + len(payload), len(meta)) + meta + payload


def pattern(n: int, seed: int) -> bytes:
    """`n` bytes that differ from frame to frame (an overwrite cannot go unnoticed)."""
    return (bytes((seed + i) & 0xFF for i in range(251)) * (n // 251 + 1))[:n]


def kernel(reader, stream, read_sizes=None, on_frame=None) -> list:
    """Deliver `stream` as asyncio does: get_buffer, copy at most one read, buffer_updated.

    The protocol takes every complete frame after each read, as aiobrpc's does, and passes it
    to `on_frame` (default: keep them all, returned). `read_sizes` yields the size of each
    read (default: 64 KiB).
    """
    src = memoryview(stream)
    frames = []
    on_frame = on_frame or frames.append
    pos = 0
    while pos < len(src):
        buf = reader.get_buffer(-1)
        want = next(read_sizes) if read_sizes is not None else KERNEL_READ
        k = min(len(buf), want, len(src) - pos)
        assert k > 0, "get_buffer offered no room"
        buf[:k] = src[pos:pos + k]
        del buf  # asyncio keeps no reference to the buffer once recv_into has filled it
        reader.buffer_updated(k)
        pos += k
        while (f := reader.next_frame()) is not None:
            on_frame(f)
    return frames


def owner(piece):
    """The object whose memory a cut piece is: the piece itself for bytes, else the view's."""
    return piece if type(piece) is bytes else piece.obj


# --- IOBuf ----------------------------------------------------------------------------------------

def test_append_keeps_bytes_object():
    data = b"x" * 10
    iobuf = _fast.IOBuf()
    iobuf.append(data)
    assert len(iobuf) == 10
    out = iobuf.cut(10)
    assert len(out) == 1 and out[0] is data
    assert len(iobuf) == 0


def test_cut_of_bytearray_is_a_view_of_it():
    data = bytearray(b"abcdefgh")
    iobuf = _fast.IOBuf()
    iobuf.append(data)
    [head] = iobuf.cut(3)
    [tail] = iobuf.cut_all()
    assert head.obj is data and tail.obj is data
    data[0] = ord("Z")  # no copy was made: the views see the caller's buffer
    data[7] = ord("Y")
    assert bytes(head) == b"Zbc" and bytes(tail) == b"defgY"


def test_cut_across_chunk_boundaries():
    a, b, c, d = b"abc", bytearray(b"defg"), memoryview(b"hijkl"), b"mn"
    iobuf = _fast.IOBuf()
    iobuf.extend([a, b, c, d])
    assert len(iobuf) == 14
    # cut 2 | 3 | 5 | 4: every cut but the first starts or ends inside a chunk
    p1 = iobuf.cut(2)
    assert [bytes(p) for p in p1] == [b"ab"] and owner(p1[0]) is a
    p2 = iobuf.cut(3)
    assert [bytes(p) for p in p2] == [b"c", b"de"]
    assert owner(p2[0]) is a and owner(p2[1]) is b
    p3 = iobuf.cut(5)
    assert [bytes(p) for p in p3] == [b"fg", b"hij"]
    assert owner(p3[0]) is b and owner(p3[1]) is c.obj
    assert len(iobuf) == 4
    p4 = iobuf.cut(4)
    assert [bytes(p) for p in p4] == [b"kl", b"mn"]
    assert owner(p4[0]) is c.obj and p4[1] is d
    assert len(iobuf) == 0 and iobuf.cut(0) == [] and iobuf.cut_all() == []


def test_cut_at_every_offset():
    chunks = [b"abc", bytearray(b"defg"), b"h", memoryview(b"ijklmn")]
    whole = b"".join(bytes(c) for c in chunks)
    for n in range(len(whole) + 1):
        iobuf = _fast.IOBuf()
        iobuf.extend(chunks)
        head = iobuf.cut(n)
        assert len(iobuf) == len(whole) - n
        tail = iobuf.cut_all()
        assert b"".join(bytes(p) for p in head) == whole[:n]
        assert b"".join(bytes(p) for p in tail) == whole[n:]


@pytest.mark.parametrize("n", [-1, 11, 1 << 40])
def test_cut_out_of_range_fails_and_keeps_the_chain(n):
    iobuf = _fast.IOBuf()
    iobuf.extend([b"01234", b"56789"])
    with pytest.raises(LocalProtocolError, match=rf"^cannot cut {n} bytes from an IOBuf of 10$"):
        iobuf.cut(n)
    assert len(iobuf) == 10
    assert b"".join(bytes(p) for p in iobuf.cut_all()) == b"0123456789"


def test_cut_from_empty_iobuf_fails():
    with pytest.raises(LocalProtocolError, match="cannot cut 1 bytes from an IOBuf of 0"):
        _fast.IOBuf().cut(1)


@pytest.mark.parametrize("obj", ["text", 5, None, [b"a"]], ids=["str", "int", "None", "list"])
def test_append_rejects_what_has_no_buffer(obj):
    iobuf = _fast.IOBuf()
    with pytest.raises(LocalProtocolError,
                       match=rf"expected a bytes-like object \(buffer protocol\), got {type(obj).__name__}"):
        iobuf.append(obj)
    assert len(iobuf) == 0


@pytest.mark.parametrize("empty", [
    b"", bytearray(), memoryview(b""), np.empty(0, dtype=np.float32),
    np.empty((0, 4), dtype=np.float32),
], ids=["bytes", "bytearray", "memoryview", "numpy-1d", "numpy-2d"])
def test_empty_buffers_are_not_kept(empty):
    iobuf = _fast.IOBuf()
    iobuf.append(empty)
    assert len(iobuf) == 0 and iobuf.cut_all() == []
    assert _fast.byte_view(empty).nbytes == 0


def test_numpy_2d_float32_is_appended_without_copy():
    arr = np.arange(24, dtype=np.float32).reshape(4, 6)
    assert arr.flags.c_contiguous
    iobuf = _fast.IOBuf()
    iobuf.append(arr)
    assert len(iobuf) == arr.nbytes == 96
    pieces = iobuf.cut(10) + iobuf.cut(50) + iobuf.cut_all()
    assert all(type(p) is memoryview and p.obj is arr for p in pieces)
    assert all(p.format == "B" and p.ndim == 1 for p in pieces)
    assert b"".join(bytes(p) for p in pieces) == arr.tobytes()
    arr[0, 0] = 1.5  # the pieces are the array's memory
    assert np.frombuffer(bytes(pieces[0][:4]), dtype=np.float32)[0] == 1.5


def test_byte_view_of_numpy_is_flat_and_shares_memory():
    arr = np.ones((3, 5), dtype=np.float32)
    view = _fast.byte_view(arr)
    assert view.obj is arr and view.nbytes == 60 and view.format == "B" and view.ndim == 1


@pytest.mark.parametrize("make", [
    lambda: np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2],
    lambda: np.asfortranarray(np.arange(24, dtype=np.float32).reshape(4, 6)),
    lambda: np.arange(24, dtype=np.float32).reshape(4, 6).T,
    lambda: memoryview(b"abcdef")[::2],
], ids=["strided-columns", "fortran-order", "transposed", "strided-memoryview"])
def test_non_contiguous_buffer_is_rejected(make):
    iobuf = _fast.IOBuf()
    iobuf.append(b"kept")
    with pytest.raises(LocalProtocolError, match="must be C-contiguous"):
        iobuf.append(make())
    with pytest.raises(LocalProtocolError, match="must be C-contiguous"):
        _fast.byte_view(make())
    assert len(iobuf) == 4 and iobuf.cut_all() == [b"kept"]


# --- ReadBuffer: the block under live views --------------------------------------------------------

def test_block_rewinds_when_no_view_is_alive():
    rb = _fast.ReadBuffer()
    size = len(rb.get_buffer())
    msg = frame(b"m", pattern(100, 1))
    rb.feed(msg)
    view = rb.take(len(msg))
    assert bytes(view) == msg
    del view
    buf = rb.get_buffer()
    # The whole block is offered again, and it is the same block: the old bytes are still there
    # (a fresh block would be zeros).
    assert len(buf) == size
    assert bytes(buf[:len(msg)]) == msg
    assert rb.copied_bytes == 0


def test_block_is_not_rewound_under_a_live_view():
    rb = _fast.ReadBuffer()
    size = len(rb.get_buffer())
    first, second = frame(b"m", pattern(100, 1)), frame(b"m", pattern(100, 2))
    rb.feed(first)
    view = rb.take(len(first))
    buf = rb.get_buffer()
    assert len(buf) == size - len(first) and buf.obj is view.obj  # appends after the view
    del buf
    rb.feed(second)
    assert bytes(view) == first
    assert bytes(rb.take(len(second))) == second
    assert rb.copied_bytes == 0


def test_full_block_moves_the_partial_frame_to_a_fresh_block_under_a_live_view():
    rb = _fast.ReadBuffer(1024, 256)
    data = pattern(900, 3)
    rb.feed(data)
    view = rb.take(850)  # 50 bytes of a partial frame stay; 124 free < large_threshold
    buf = rb.get_buffer()
    assert buf.obj is not view.obj
    assert len(buf) == 1024 - 50 and rb.copied_bytes == 50
    buf[:len(buf)] = b"\xee" * len(buf)  # the kernel fills the new block
    del buf
    rb.buffer_updated(1024 - 50)
    assert bytes(view) == data[:850]
    assert bytes(rb.take(50)) == data[850:]


def test_full_block_without_views_is_reused_in_place():
    rb = _fast.ReadBuffer(1024, 256)
    data = pattern(900, 4)
    rb.feed(data)
    rb.skip(850)
    buf = rb.get_buffer()
    assert len(buf) == 1024 - 50 and rb.copied_bytes == 50
    # same block: the tail was moved to its front, and what follows is the old data
    assert bytes(buf.obj[:50]) == data[850:] and bytes(buf.obj[50:100]) == data[50:100]


@pytest.mark.parametrize("seed", [1, 2])
def test_views_stay_unchanged_while_much_more_is_received(seed):
    # A small block, so that the stream runs through many blocks; reads of random sizes, so
    # frames straddle block ends; a few frames held the whole time, others released.
    rng = random.Random(seed)
    reader = _fast.FrameReader(block_size=4096, large_threshold=1024)
    sizes = [rng.randrange(0, 900) for _ in range(1500)]
    frames = [frame(b"meta%d" % i, pattern(n, i)) for i, n in enumerate(sizes)]
    stream = b"".join(frames)
    reads = iter(lambda: rng.choice([1, 7, 12, 100, 333, 1000, 4096]), None)
    held = {}
    got = 0

    def on_frame(f):
        nonlocal got
        kind, meta, payload = f
        assert (kind, bytes(meta), bytes(payload)) == (1, b"meta%d" % got, pattern(sizes[got], got))
        if got < 20 or got % 97 == 0:
            held[got] = f
        got += 1

    kernel(reader, stream, reads, on_frame)
    assert got == len(frames) and reader.pending_bytes() == 0
    for i, (kind, meta, payload) in held.items():
        assert bytes(meta) == b"meta%d" % i and bytes(payload) == pattern(sizes[i], i), i
    # Only partial frames at block ends were ever moved: far less than the stream.
    assert reader.rbuf.copied_bytes < len(stream) // 4


def test_views_stay_unchanged_with_feed():
    reader = _fast.FrameReader(block_size=2048, large_threshold=512)
    held = []
    for i in range(400):
        msg = frame(b"", pattern(i % 300, i))
        reader.feed(msg)
        f = reader.next_frame()
        assert f is not None and reader.next_frame() is None
        if i % 10 == 0:
            held.append((i, f))
    for i, (_, _, payload) in held:
        assert bytes(payload) == pattern(i % 300, i)


def test_no_views_alive_keeps_one_block():
    # Every frame is released before the next read: the block is rewound, never replaced or
    # grown, and nothing is copied.
    reader = _fast.FrameReader(block_size=4096, large_threshold=1024)
    msg = frame(b"meta", pattern(500, 9))
    for _ in range(300):
        buf = reader.get_buffer(-1)
        assert len(buf.obj) == 4096 and len(buf) == 4096
        buf[:len(msg)] = msg
        del buf
        reader.buffer_updated(len(msg))
        kind, meta, payload = reader.next_frame()
        assert bytes(payload) == msg[16:]
        del kind, meta, payload
    assert reader.rbuf.copied_bytes == 0


# --- large frames -----------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [1 << 20, 16 << 20], ids=["1MiB", "16MiB"])
def test_large_frames_are_received_into_exact_size_buffers(size):
    meta = b"attachment-meta"
    first = frame(meta, pattern(size - len(meta), 1))
    second = frame(meta, pattern(size - len(meta), 2))
    reader = _fast.FrameReader()
    rbuf = reader.rbuf

    [f1] = kernel(reader, first)
    copied_first = rbuf.copied_bytes
    [f2] = kernel(reader, second)
    copied_second = rbuf.copied_bytes - copied_first

    for (kind, m, payload), wire in ((f1, first), (f2, second)):
        assert kind == _fast.KIND_PRPC and bytes(m) == meta
        # the frame's own buffer, with room for the next header at its end
        assert type(payload.obj) is bytearray and len(payload.obj) == HEADER + size + HEADER + LARGE_ALIGN
        assert payload.obj is m.obj
        assert payload.nbytes == size - len(meta) and bytes(payload) == wire[HEADER + len(meta):]
    assert f1[2].obj is not f2[2].obj
    # The first frame's first read landed in the shared block and was moved once.
    assert 0 < copied_first <= KERNEL_READ
    # The read that completes a large frame brings the next header (into the frame's spare
    # bytes), so the second body goes from the kernel straight into its own buffer; at most
    # the 12 header bytes are moved.
    assert copied_second <= HEADER
    assert reader.pending_bytes() == 0


def test_a_read_that_completes_a_large_frame_brings_the_next_header():
    # A kernel with everything ready fills whatever it is offered. Once a large frame has its
    # own buffer, the read that completes it brings the next frame's header in the spare bytes
    # at the end of that buffer: one read per large frame. Each header is moved twice (to the
    # block, then into its frame's buffer): 24 bytes per frame.
    size, n = 300_000, 5
    wire = b"".join(frame(b"m", pattern(size, i)) for i in range(n)) + frame(b"s", b"tiny")
    reader = _fast.FrameReader()
    got, reads = [], []
    pos = 0
    while pos < len(wire):
        buf = reader.get_buffer(-1)
        k = min(len(buf), len(wire) - pos)
        reads.append(k)
        buf[:k] = wire[pos:pos + k]
        del buf
        reader.buffer_updated(k)
        pos += k
        while (f := reader.next_frame()) is not None:
            got.append(bytes(f[2]))
    assert got == [pattern(size, i) for i in range(n)] + [b"tiny"]
    # the block's first read, then one read per large frame, then the small frame's rest
    assert len(reads) == 1 + n + 1, reads
    assert reader.rbuf.copied_bytes == reads[0] + (n - 1) * 2 * HEADER + HEADER


@pytest.fixture
def cache():
    """The twin's per-process large-buffer cache, empty for the test."""
    _fast.large_buffers.clear()
    yield _fast.large_buffers
    _fast.large_buffers.clear()


def test_large_buffer_is_reused_once_no_view_of_it_is_alive(cache):
    size = 300_000
    reader = _fast.FrameReader()
    [f1] = kernel(reader, frame(b"m", pattern(size, 1)))
    first_buffer_id = id(f1[2].obj)
    del f1  # the user dropped the attachment: its buffer may take the next frame of that size
    [f2] = kernel(reader, frame(b"m", pattern(size, 2)))
    assert id(f2[2].obj) == first_buffer_id and reader.rbuf.reused_large_buffers == 1
    assert bytes(f2[2]) == pattern(size, 2)
    # Another connection's reader reuses it too once it is free again.
    del f2
    other = _fast.FrameReader()
    [f3] = kernel(other, frame(b"m", pattern(size, 3)))
    assert id(f3[2].obj) == first_buffer_id and other.rbuf.reused_large_buffers == 1


def test_large_buffer_under_a_live_view_is_never_reused(cache):
    size = 300_000
    reader = _fast.FrameReader()
    [f1] = kernel(reader, frame(b"m", pattern(size, 1)))
    kept = np.frombuffer(f1[2], dtype=np.uint8)  # the user keeps the attachment (via numpy)
    del f1
    [f2] = kernel(reader, frame(b"m", pattern(size, 2)))
    assert reader.rbuf.reused_large_buffers == 0
    assert kept.tobytes() == pattern(size, 1) and bytes(f2[2]) == pattern(size, 2)
    del f2
    [f3] = kernel(reader, frame(b"m", pattern(size + 1, 3)))  # another size: a new buffer
    assert reader.rbuf.reused_large_buffers == 0 and bytes(f3[2]) == pattern(size + 1, 3)
    assert kept.tobytes() == pattern(size, 1)


def test_large_buffer_cache_is_bounded():
    cache = _fast.LargeBufferCache(max_bytes=1000, max_buffers=3)
    for n in (400, 400, 400):  # 1200 bytes: the oldest leaves
        cache.put(bytearray(n))
    assert len(cache) == 2 and cache.nbytes == 800
    for _ in range(5):
        cache.put(bytearray(10))
    assert len(cache) == 3 and cache.nbytes == 30
    cache.put(bytearray(1001))  # larger than the whole cache: not kept
    assert len(cache) == 3 and cache.nbytes == 30
    assert cache.take(10) is not None and cache.take(999) is None and cache.nbytes == 20
    held = cache.take(10)
    cache.put(held)
    assert cache.take(10) is not None  # the other free one
    assert cache.take(10) is None  # `held` is referenced here, so it is not free


def test_small_frame_after_large_frame_lands_in_the_block():
    reader = _fast.FrameReader()
    big, small = frame(b"m", pattern(300_000, 1)), frame(b"s", b"tiny")
    frames = kernel(reader, big + small + small)
    assert [bytes(p[:4]) for _, _, p in frames] == [pattern(300_000, 1)[:4], b"tiny", b"tiny"]
    assert type(frames[1][2].obj) is bytearray and len(frames[1][2].obj) > len(small)
    assert bytes(frames[0][2]) == pattern(300_000, 1)


def test_complete_large_frame_leaves_room_for_the_next_read():
    # asyncio's BufferedProtocol fails on an empty buffer from get_buffer, and feed() of a chunk
    # that ends one large frame and starts the next loops on it.
    reader = _fast.FrameReader(block_size=1024, large_threshold=256)
    big = frame(b"m", pattern(1000, 5))
    reader.feed(big[:100])
    assert reader.next_frame() is None
    buf = reader.get_buffer(-1)
    assert len(buf) == len(big) - 100 + HEADER  # the rest, and room for the next header
    buf[:len(big) - 100] = big[100:]
    del buf
    reader.buffer_updated(len(big) - 100)
    assert len(reader.get_buffer(-1)) > 0


# --- memory bounds --------------------------------------------------------------------------------

def test_pending_bytes_counts_a_partial_small_frame_and_clear_drops_it():
    reader = _fast.FrameReader()
    msg = frame(b"meta", pattern(1000, 6))
    reader.feed(msg[:700])
    assert reader.next_frame() is None
    assert reader.pending_bytes() == 700
    reader.rbuf.clear()
    assert reader.pending_bytes() == 0
    reader.feed(msg)
    kind, meta, payload = reader.next_frame()
    assert bytes(meta) == b"meta" and bytes(payload) == msg[16:]
    assert reader.pending_bytes() == 0


def test_pending_bytes_counts_a_partial_large_frame_and_clear_drops_it():
    reader = _fast.FrameReader()
    size = 1 << 20
    msg = frame(b"m", pattern(size - 1, 7))
    block_room = len(reader.get_buffer(-1))
    kernel(reader, msg[:3 * KERNEL_READ])
    assert reader.pending_bytes() == 3 * KERNEL_READ
    assert len(reader.get_buffer(-1)) == HEADER + size - 3 * KERNEL_READ + HEADER  # the frame's own buffer
    reader.rbuf.clear()
    assert reader.pending_bytes() == 0
    assert len(reader.get_buffer(-1)) == block_room  # back to the shared block
    [(_, _, payload)] = kernel(reader, msg)
    assert bytes(payload) == msg[13:]


def test_clear_keeps_live_views_intact():
    reader = _fast.FrameReader()
    msg = frame(b"meta", pattern(200, 8))
    reader.feed(msg)
    _, _, payload = reader.next_frame()
    reader.feed(msg[:50])
    reader.rbuf.clear()
    other = frame(b"meta", pattern(200, 9))
    reader.feed(other)
    _, _, payload2 = reader.next_frame()
    assert bytes(payload) == msg[16:] and bytes(payload2) == other[16:]


# --- idle connections hold no block -------------------------------------------------------------
def test_the_block_is_made_at_the_first_read_and_released_when_empty():
    reader = _fast.FrameReader(block_size=4096, large_threshold=1024)
    rb = reader.rbuf
    assert rb.release() is False  # nothing to release yet: no block was made
    msg = frame(b"meta", pattern(300, 3))
    reader.feed(msg)
    kind, meta, payload = reader.next_frame()
    assert rb.release() is False  # views of the block are alive
    assert bytes(payload) == msg[16:]
    del kind, meta, payload
    assert rb.release() is True and rb.release() is False
    reader.feed(msg)  # the next read makes a block again
    _, _, payload = reader.next_frame()
    assert bytes(payload) == msg[16:] and len(reader.get_buffer(-1).obj) == 4096


def test_a_partial_frame_keeps_its_block():
    reader = _fast.FrameReader(block_size=4096, large_threshold=1024)
    msg = frame(b"meta", pattern(300, 4))
    reader.feed(msg[:100])
    assert reader.rbuf.release() is False and reader.rbuf.pending_bytes() == 100
    reader.feed(msg[100:])
    _, _, payload = reader.next_frame()
    assert bytes(payload) == msg[16:]


def test_a_large_frame_in_progress_keeps_its_buffer():
    reader = _fast.FrameReader(block_size=4096, large_threshold=1024)
    msg = frame(b"meta", pattern(5000, 5))
    kernel_reads = [msg[:2000]]
    for part in kernel_reads:
        buf = reader.get_buffer(-1)
        buf[:len(part)] = part
        del buf
        reader.buffer_updated(len(part))
    assert reader.next_frame() is None and reader.rbuf.release() is False
    rest = msg[2000:]
    while rest:
        buf = reader.get_buffer(-1)
        k = min(len(buf), len(rest))
        buf[:k] = rest[:k]
        del buf
        reader.buffer_updated(k)
        rest = rest[k:]
    _, _, payload = reader.next_frame()
    assert bytes(payload) == msg[16:]
