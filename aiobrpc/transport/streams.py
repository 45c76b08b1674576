"""The streams of one connection: STRM frames routed by the receiver's stream id.

A frame for an id this connection does not know (never existed, or closed: ids are never
reused) is dropped and counted; DATA and CLOSE are answered with an RST to their source, as
brpc does, so the peer's stream ends too. The exception is the late response of a call that
ended first (a timeout, a cancel): it comes in a DATA frame to the call's first stream, which is
gone, and every stream it offers is reset, not only the first (brpc's "RST to the offered ids"). FEEDBACK for an unknown id is ignored and an RST is
never answered, so two peers cannot bounce frames forever. A frame whose meta does not parse
is dropped with a log line: the framing around it held, so nothing else has to close.
"""

from __future__ import annotations

import logging

from ..errors import RemoteProtocolError
from ..protocol import streaming
from .tcp import RateLimitedLog

log = logging.getLogger(__name__)
_drop_log = RateLimitedLog()

_DATA, _FEEDBACK, _CLOSE, _RST = streaming.DATA, streaming.FEEDBACK, streaming.CLOSE, streaming.RST
_decode_frame_meta = streaming.decode_frame_meta
_MAX_AWAITING_GONE = 1024
_MAX_ROUTES = 64


class StreamTable:
    """`streams` maps local stream id -> endpoint (an aiobrpc.Stream); `stats` is the owner's
    counters (ClientStats or ServerStats: `stream_frames_dropped`)."""

    __slots__ = ("conn", "streams", "stats", "awaiting_gone", "_data_routes", "_feedback_routes", "placing")

    def __init__(self, conn, stats) -> None:
        self.conn = conn
        self.streams: dict = {}
        self.stats = stats
        self.placing = False  # segments are received into their message's place (_place_segments)
        # Client: first streams of calls that ended before their response came (id -> None),
        # oldest first, at most _MAX_AWAITING_GONE: a late response to one is read, not just reset.
        self.awaiting_gone: dict = {}
        # DATA metas seen -> (stream, has_continuation): a stream's DATA frames all carry one of
        # two metas, so most frames are routed without decoding protobuf. Cleared whenever a
        # stream leaves, so it never routes to an ended stream; at most _MAX_ROUTES entries.
        self._data_routes: dict = {}
        # FEEDBACK meta prefixes (feedback_meta_prefix as the peer writes it to us) -> stream: a
        # FEEDBACK in protobuf's canonical encoding is read without decoding protobuf. Cleared
        # with the DATA routes.
        self._feedback_routes: dict = {}
        # Segments of a long message are written while at most one segment is queued before them.
        conn.pace_writes(streaming.DEFAULT_MAX_SEGMENT_SIZE)

    def __len__(self) -> int:
        return len(self.streams)

    def add(self, stream) -> None:
        self.streams[stream.id] = stream

    def remove(self, stream_id: int) -> None:
        self.streams.pop(stream_id, None)
        self._data_routes.clear()
        self._feedback_routes.clear()

    def response_abandoned(self, stream_id: int) -> None:
        """Client: the call of first stream `stream_id` ended before its response came."""
        gone = self.awaiting_gone
        gone[stream_id] = None
        if len(gone) > _MAX_AWAITING_GONE:
            del gone[next(iter(gone))]

    def _place_segments(self) -> None:
        # A message in segments came: from now on the connection receives the segments of
        # long messages straight into the message's place (protocol/placement.py). Only then:
        # that decoder costs a Python call per read, which small messages need not pay.
        self.placing = True
        self.conn.placing_decoder().place_stream = self.segment_destination

    def segment_destination(self, meta, size: int):
        """For the connection's decoder: where a large STRM frame's payload (`size` bytes) is
        to be received, given its meta's bytes; None for the usual way."""
        key = bytes(meta)
        route = self._data_routes.get(key)
        if route is not None:
            return route[0]._segment_destination(size, route[1])
        try:
            fm = _decode_frame_meta(key)
        except RemoteProtocolError:
            return None  # frame_received reports it
        stream = self.streams.get(fm.stream_id) if fm.frame_type == _DATA else None
        return None if stream is None else stream._segment_destination(size, fm.has_continuation)

    def frame_received(self, ev) -> None:
        key = bytes(ev.meta)
        route = self._data_routes.get(key)
        if route is not None:
            if route[1] and not self.placing:
                self._place_segments()
            route[0]._on_data(ev.payload, route[1])
            return
        # A FEEDBACK: prefix, then field 5 {1: consumed_size} as `L 08 varint` (L <= 11). The
        # bytes 18 04 2a (type FEEDBACK, field 5) cannot occur after the prefix: of a varint's
        # bytes only the last has its high bit clear, and L and 08 differ from 18.
        cut = key.rfind(b"\x18\x04\x2a") + 3
        if cut > 3 and not len(ev.payload):
            stream = self._feedback_routes.get(key[:cut])
            if stream is not None:
                consumed = _feedback_value(key, cut)
                if consumed is not None:
                    stream._on_feedback(consumed)
                    return
        try:
            meta = _decode_frame_meta(key)
        except RemoteProtocolError as e:
            self._dropped("%s: dropped a STRM frame: %s", e)
            return
        stream = self.streams.get(meta.stream_id)
        ftype = meta.frame_type
        if stream is None:
            gone = self.awaiting_gone
            if ftype == _DATA and meta.stream_id in gone and not meta.has_continuation:
                del gone[meta.stream_id]
                self.conn.response_in_stream(ev.payload)  # no call waits for it: its offer is reset
                return
            self._unknown(meta)
            return
        if ftype == _DATA:
            routes = self._data_routes
            if len(routes) >= _MAX_ROUTES:
                routes.clear()
            routes[key] = (stream, meta.has_continuation)
            if meta.has_continuation and not self.placing:
                self._place_segments()
            stream._on_data(ev.payload, meta.has_continuation)
        elif ftype == _FEEDBACK:
            if len(ev.payload):
                self._dropped("%s: ignored the %s-byte payload of a FEEDBACK frame for stream %s",
                              len(ev.payload), meta.stream_id)
            if meta.consumed_size is not None:
                if meta.source_stream_id is not None:
                    routes = self._feedback_routes
                    if len(routes) >= _MAX_ROUTES:
                        routes.clear()
                    routes[streaming.feedback_meta_prefix(meta.stream_id, meta.source_stream_id)] = stream
                stream._on_feedback(meta.consumed_size)
        elif ftype == _CLOSE:
            stream._on_close()
        elif ftype == _RST:
            stream._on_rst()
        else:
            self._dropped("%s: dropped a STRM frame of unknown type for stream %s", meta.stream_id)

    def _unknown(self, meta) -> None:
        self.stats.stream_frames_dropped += 1
        source = meta.source_stream_id
        if meta.frame_type in (_DATA, _CLOSE) and source is not None and source != streaming.INVALID_STREAM_ID:
            self.conn.write([streaming.rst_frame(source)])

    def _dropped(self, msg: str, *args) -> None:
        self.stats.stream_frames_dropped += 1
        _drop_log(logging.WARNING, msg, self.conn.peer, *args)

    def connection_lost(self, code: int, text: str) -> None:
        """The connection is gone: every stream on it ends with `code` (nothing is sent)."""
        streams, self.streams = self.streams, {}
        self._data_routes.clear()
        self._feedback_routes.clear()
        for stream in list(streams.values()):
            stream._end(code, text)


def _feedback_value(meta: bytes, cut: int):
    """consumed_size of a FEEDBACK meta whose `L 08 varint` starts at `cut`, when those bytes
    are exactly that (the varint int64, as protobuf reads it), else None."""
    n = len(meta) - cut
    if n < 3 or n > 12 or meta[cut] != n - 1 or meta[cut + 1] != 0x08:
        return None
    value = shift = 0
    last = len(meta) - 1
    for i in range(cut + 2, last):
        b = meta[i]
        if b < 0x80:
            return None
        value |= (b & 0x7F) << shift
        shift += 7
    b = meta[last]
    if b >= 0x80:
        return None
    value = (value | (b << shift)) & _U64
    return value - (1 << 64) if value >> 63 else value


_U64 = (1 << 64) - 1
