"""Receiving a large message's attachment straight into a buffer its receiver chooses.

A `Decoder` receives a large frame into a buffer of its own and hands the attachment out as a
view of it: no copy after the kernel's, but the bytes land where the decoder put them, and a
receiver that wants them in its own array (a tensor's slice, a model's parameters) copies them
once more. A `PlacingDecoder` asks first. When the head of a large PRPC frame (header, meta and
the serialized request or response before the attachment) has arrived, it calls
`place(meta, data)`; a writable buffer of exactly `meta.attachment_size` bytes returned there
receives the attachment from the kernel directly, and the event's `attachment` is a view of
that buffer. None, an unusable buffer or an exception: the frame is received as usual.
Likewise for a large STRM frame: once its meta has arrived, `place_stream(meta, size)` may
give a buffer of `size` bytes for its payload (a segment of a long stream message, received
straight into the place of the whole message).

What it costs: the head of a placed frame is read on its own (one or two reads of a few
bytes), and a frame's last read stops at its end. Only frames over the reader's
`large_threshold` (64 KiB) are considered, so small messages take the usual path unchanged,
and a connection whose owner places nothing uses a plain `Decoder`.
"""

from __future__ import annotations

import logging
from typing import Callable

from .. import _fast
from ..errors import LocalProtocolError
from .baidu_std import DEFAULT_MAX_BODY_SIZE, Decoder
from .events import StreamFrameReceived

log = logging.getLogger(__name__)

HEADER = 12
# A head larger than this (a big meta, or a big serialized message before the attachment) is
# not worth reading on its own: such a frame is received as usual.
MAX_HEAD_BYTES = 64 * 1024

Place = Callable[[object, memoryview], object]
PlaceStream = Callable[[memoryview, int], object]


class _Placed:
    """A frame whose attachment is being received into the buffer its receiver chose."""

    __slots__ = ("meta", "data", "attachment", "filled", "head_bytes")

    def __init__(self, meta, data: memoryview | None, attachment: memoryview, filled: int, head_bytes: int) -> None:
        self.meta = meta  # RpcMeta; for a STRM frame (data None) the meta's bytes
        self.data = data
        self.attachment = attachment
        self.filled = filled
        self.head_bytes = head_bytes


class PlacingDecoder(Decoder):
    """A `Decoder` that receives large attachments where `place(meta, data)` says."""

    __slots__ = ("place", "place_stream", "_placing", "_done", "_max_body", "_header_next")

    def __init__(self, role: str, place: Place | None, max_body_size: int = DEFAULT_MAX_BODY_SIZE,
                 place_stream: PlaceStream | None = None, **buffer_options) -> None:
        super().__init__(role, max_body_size, **buffer_options)
        self._start_placing(place, place_stream)

    @classmethod
    def around(cls, decoder: Decoder, place: Place | None = None,
               place_stream: PlaceStream | None = None) -> PlacingDecoder:
        """A PlacingDecoder that goes on with `decoder`'s reader and what it holds (a
        connection that starts placing after bytes have arrived)."""
        new = cls.__new__(cls)
        for name in Decoder.__slots__:
            setattr(new, name, getattr(decoder, name))
        new._start_placing(place, place_stream)
        return new

    def _start_placing(self, place: Place | None, place_stream: PlaceStream | None) -> None:
        self.place = place
        self.place_stream = place_stream
        self._header_next = False
        self._placing: _Placed | None = None
        self._done: _Placed | None = None
        self._max_body = self._reader.max_body_size
        # The plain Decoder binds the reader's methods for speed; these wrap them.
        self.get_buffer = self._get_buffer
        self.buffer_updated = self._buffer_updated
        self.next_frame = self._next_frame
        self.pending_bytes = self._pending_bytes

    def divert(self, correlation_id: int) -> None:
        """The frame of `correlation_id`, if it is being placed, goes on into a buffer of its
        own: its receiver gave up on it (a call that ended first), and must find its buffer
        unwritten from now on."""
        placing = self._placing
        if placing is not None and placing.data is not None and placing.meta.correlation_id == correlation_id:
            # Its reply is dropped when complete (no caller is waiting for it): what came so
            # far need not follow.
            placing.attachment = memoryview(bytearray(placing.attachment.nbytes))

    # -- kernel side ---------------------------------------------------------------------------
    def _get_buffer(self, sizehint: int = -1) -> memoryview:
        placing = self._placing
        if placing is not None:
            return placing.attachment[placing.filled:]
        need = self._consider()
        if need > 0:
            return self._reader.rbuf.get_buffer(need)[:need]  # just the rest of the head
        placing = self._placing
        if placing is not None:
            return placing.attachment[placing.filled:]
        if self._header_next:
            # After a placed frame: read the next header alone, so that a following large frame
            # is placed from its first byte, not copied out of the block for a read's worth.
            rbuf = self._reader.rbuf
            need = HEADER - rbuf.available()
            if need > 0 and not rbuf.large_pending():
                return rbuf.get_buffer(need)[:need]
            self._header_next = False
        return self._reader.get_buffer(sizehint)

    def _buffer_updated(self, nbytes: int) -> None:
        placing = self._placing
        if placing is None:
            self._reader.buffer_updated(nbytes)
            return
        room = placing.attachment.nbytes - placing.filled
        if nbytes < 0 or nbytes > room:
            raise LocalProtocolError(f"buffer_updated({nbytes}) is outside the {room} bytes that get_buffer offered")
        placing.filled += nbytes
        if placing.filled == placing.attachment.nbytes:
            self._placing = None
            self._done = placing
            self._header_next = True

    def _pending_bytes(self) -> int:
        placing = self._placing
        n = self._reader.pending_bytes()
        return n if placing is None else n + placing.head_bytes + placing.filled

    # -- parser side ---------------------------------------------------------------------------
    def _next_frame(self):
        done = self._done
        if done is not None:
            self._done = None
            return done
        if self._placing is not None or self._consider() > 0:
            return None
        done = self._done  # placed at once: its attachment had all arrived with its head
        if done is not None:
            self._done = None
            return done
        if self._placing is not None:
            return None
        return self._reader.next_frame()

    def next_event(self):
        frame = self._next_frame()
        return None if frame is None else self.event(frame)

    def event(self, frame):
        if type(frame) is _Placed:
            if frame.data is None:
                return StreamFrameReceived(frame.meta, frame.attachment)
            return self._event(frame.meta, frame.data, frame.attachment)
        return Decoder.event(self, frame)

    # -- deciding ------------------------------------------------------------------------------
    def _consider(self) -> int:
        """For the frame at the read position: > 0, bytes of its head still to read first;
        0 once decided (placed, or to be received as usual by the reader)."""
        if self._placing is not None or self._done is not None:
            return 0
        rbuf = self._reader.rbuf
        if rbuf.large_pending():
            return 0
        have = rbuf.available()
        if have < HEADER:
            return 0
        need = self._head_need(rbuf, have)
        if need > 0:
            return need
        if need == 0:
            self._begin_placing(rbuf, have)
        return 0

    def _head_need(self, rbuf, have: int) -> int:
        """Bytes of the head of the frame at the read position still to read: > 0; 0 when the
        head is here and the frame may be placed; -1 when it is not a frame to place."""
        kind, body_size, meta_size = _fast.parse_header(rbuf.peek(HEADER))
        total = HEADER + body_size
        if (meta_size > body_size or body_size > self._max_body or total <= rbuf.large_threshold
                or have >= total or meta_size > MAX_HEAD_BYTES):
            return -1
        if kind == _fast.KIND_STRM:
            if self.place_stream is None:
                return -1
        elif kind != _fast.KIND_PRPC or self.place is None:
            return -1
        meta_end = HEADER + meta_size
        if have < meta_end:
            return meta_end - have
        if kind == _fast.KIND_STRM:
            return 0
        head_end, _ = self._head(rbuf, body_size, meta_size)
        if head_end < 0:
            return -1
        return max(0, head_end - have)

    def _head(self, rbuf, body_size: int, meta_size: int) -> tuple:
        """(where the PRPC frame's head ends, its meta); (-1, None): not a frame to place."""
        try:
            meta = self._decode_meta(rbuf.peek(HEADER + meta_size)[HEADER:])
        except Exception:  # noqa: BLE001 - the usual path reports a bad meta
            return -1, None
        att = meta.attachment_size or 0
        data_size = body_size - meta_size - att
        if att <= 0 or data_size < 0 or data_size > MAX_HEAD_BYTES:
            return -1, None
        return HEADER + meta_size + data_size, meta

    def _begin_placing(self, rbuf, have: int) -> bool:
        kind, body_size, meta_size = _fast.parse_header(rbuf.peek(HEADER))
        if kind == _fast.KIND_STRM:
            return self._begin_placing_segment(rbuf, have, body_size, meta_size)
        head_end, meta = self._head(rbuf, body_size, meta_size)
        data = rbuf.peek(head_end)[HEADER + meta_size:]
        att = meta.attachment_size
        try:
            dest = self.place(meta, data)
        except Exception as e:  # a fault of the receiver's choice never breaks the connection
            log.error("choosing where to receive a %d-byte attachment raised %r; received as usual",
                      att, e, exc_info=e)
            return False
        if dest is None:
            return False
        try:
            view = _fast.byte_view(dest)
        except LocalProtocolError as e:
            log.error("the buffer chosen for a %d-byte attachment is unusable (%s); received as usual", att, e)
            return False
        if view.readonly or view.nbytes != att:
            log.error("the buffer chosen for a %d-byte attachment is %s%d bytes; received as usual",
                      att, "read-only, " if view.readonly else "", view.nbytes)
            return False
        # The head is consumed from the shared block: its views stay valid (the block is never
        # rewritten while a view of it lives). Bytes of the attachment a read already brought
        # into the block are moved to the buffer, as a large frame's would be to its own.
        data = rbuf.take(head_end)[HEADER + meta_size:]
        early = min(have - head_end, att)
        if early > 0:
            view[:early] = rbuf.take(early)
        return self._start(_Placed(meta, data, view, max(early, 0), head_end), att)

    def _begin_placing_segment(self, rbuf, have: int, body_size: int, meta_size: int) -> bool:
        head_end = HEADER + meta_size
        size = body_size - meta_size
        try:
            dest = self.place_stream(rbuf.peek(head_end)[HEADER:], size)
        except Exception as e:  # a bug of ours: received as usual, named
            log.error("choosing where to receive a %d-byte stream segment raised %r; received as usual",
                      size, e, exc_info=e)
            return False
        if dest is None:
            return False
        view = memoryview(dest)
        if view.readonly or view.nbytes != size or view.format != "B" or view.ndim != 1:
            log.error("the buffer chosen for a %d-byte stream segment does not fit; received as usual", size)
            return False
        meta = rbuf.take(head_end)[HEADER:]
        early = min(have - head_end, size)
        if early > 0:
            view[:early] = rbuf.take(early)
        return self._start(_Placed(meta, None, view, max(early, 0), head_end), size)

    def _start(self, placing: _Placed, size: int) -> bool:
        if placing.filled == size:
            self._done = placing
            return False
        self._placing = placing
        return True

