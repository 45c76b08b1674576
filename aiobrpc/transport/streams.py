"""The streams of one connection: STRM frames routed by the receiver's stream id.

A frame for an id this connection does not know (never existed, or closed: ids are never
reused) is dropped and counted; DATA and CLOSE are answered with an RST to their source, as
brpc does, so the peer's stream ends too. FEEDBACK for an unknown id is ignored and an RST is
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


class StreamTable:
    """`streams` maps local stream id -> endpoint (an aiobrpc.Stream); `stats` is the owner's
    counters (ClientStats or ServerStats: `stream_frames_dropped`)."""

    __slots__ = ("conn", "streams", "stats")

    def __init__(self, conn, stats) -> None:
        self.conn = conn
        self.streams: dict = {}
        self.stats = stats

    def __len__(self) -> int:
        return len(self.streams)

    def add(self, stream) -> None:
        self.streams[stream.id] = stream

    def remove(self, stream_id: int) -> None:
        self.streams.pop(stream_id, None)

    def frame_received(self, ev) -> None:
        try:
            meta = _decode_frame_meta(ev.meta)
        except RemoteProtocolError as e:
            self._dropped("%s: dropped a STRM frame: %s", e)
            return
        stream = self.streams.get(meta.stream_id)
        ftype = meta.frame_type
        if stream is None:
            self._unknown(meta)
            return
        if ftype == _DATA:
            stream._on_data(ev.payload, meta.has_continuation)
        elif ftype == _FEEDBACK:
            if len(ev.payload):
                self._dropped("%s: ignored the %s-byte payload of a FEEDBACK frame for stream %s",
                              len(ev.payload), meta.stream_id)
            if meta.consumed_size is not None:
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
        for stream in list(streams.values()):
            stream._end(code, text)
