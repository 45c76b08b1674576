"""A client connection: many calls in flight, matched to replies by correlation id."""

from __future__ import annotations

import logging

from .._proto import brpc_streaming_pb2
from ..errors import EEOF, EFAILEDSOCKET, RemoteProtocolError, RpcError
from ..protocol.baidu_std import CLIENT, pack_header
from ..protocol.events import StreamFrameReceived
from ..transport.tcp import FramedConnection, RateLimitedLog

log = logging.getLogger(__name__)
_unknown_log = RateLimitedLog()


class ClientStats:
    """Counters a channel keeps; plain integers updated on the hot path."""

    __slots__ = ("late_or_unknown_responses", "timeouts", "connections_made", "connections_lost",
                 "stream_frames_dropped")

    def __init__(self) -> None:
        self.late_or_unknown_responses = 0
        self.timeouts = 0
        self.connections_made = 0
        self.connections_lost = 0
        self.stream_frames_dropped = 0


class ClientConnection(FramedConnection):
    """One TCP connection of a channel. `pending` maps correlation id -> Future of the reply."""

    def __init__(self, stats: ClientStats, max_body_size: int, max_unwritten_bytes: int,
                 on_closed=None) -> None:
        super().__init__(CLIENT, max_body_size, max_unwritten_bytes)
        self.pending: dict = {}
        self.stats = stats
        self.needs_credential = True
        self._next_cid = 1
        self._on_closed = on_closed

    def connection_made_hook(self) -> None:
        self.stats.connections_made += 1

    def event_received(self, ev) -> None:
        if type(ev) is StreamFrameReceived:
            # Streams are not opened by this client yet: nothing can be addressed to us.
            self.stats.stream_frames_dropped += 1
            return
        if ev.meta.stream_settings is not None:
            # No call of this client opens streams, so streams offered in a response are
            # refused with an RST each, as brpc does for a stream it did not ask for.
            self._reset_offered_streams(ev.meta.stream_settings)
        fut = self.pending.pop(ev.meta.correlation_id, None)
        if fut is None or fut.done():
            self.stats.late_or_unknown_responses += 1
            _unknown_log(logging.DEBUG, "dropped a response with unknown or late correlation_id=%s from %s",
                         ev.meta.correlation_id, self.peer)
            return
        fut.set_result(ev)

    def _reset_offered_streams(self, raw_settings) -> None:
        try:
            settings = brpc_streaming_pb2.StreamSettings.FromString(bytes(raw_settings))
        except Exception:  # protobuf's DecodeError; a bad offer is only ignored
            return
        for stream_id in (settings.stream_id, *settings.extra_stream_ids):
            meta = brpc_streaming_pb2.StreamFrameMeta(
                stream_id=stream_id, frame_type=brpc_streaming_pb2.FRAME_TYPE_RST).SerializeToString()
            self.write([pack_header(b"STRM", len(meta), len(meta)) + meta])

    def closed(self, exc: BaseException | None) -> None:
        self.stats.connections_lost += 1
        pending, self.pending = self.pending, {}
        if pending:
            if exc is None:
                err = RpcError(EEOF, f"Got EOF of {self.peer}")
            elif isinstance(exc, RemoteProtocolError):
                err = RpcError(EFAILEDSOCKET, f"Broken connection to {self.peer}: {exc}")
            elif isinstance(exc, RpcError):
                err = exc
            else:
                err = RpcError(EFAILEDSOCKET, f"Broken connection to {self.peer}: {exc!r}")
            for fut in pending.values():
                if not fut.done():
                    fut.set_exception(RpcError(err.code, err.text))
        if self._on_closed is not None:
            self._on_closed(self)
