"""A client connection: many calls in flight, matched to replies by correlation id."""

from __future__ import annotations

import logging
import socket
import ssl

from ..errors import EEOF, EFAILEDSOCKET, ESSL, RemoteProtocolError, RpcError
from ..protocol import streaming
from ..protocol.baidu_std import CLIENT, Decoder
from ..protocol.events import ResponseReceived, StreamFrameReceived
from ..protocol.placement import PlacingDecoder
from ..transport.streams import StreamTable
from ..transport.tcp import FramedConnection, RateLimitedLog

log = logging.getLogger(__name__)
_unknown_log = RateLimitedLog()
_SHOWN_BYTES = 32  # of a peer that does not speak baidu_std
_TEXT = frozenset(range(0x20, 0x7f)) | {0x09, 0x0a, 0x0d}


class ClientStats:
    """Counters a channel keeps (`channel.stats`); plain integers updated on the hot path.

    `as_dict()` returns them all; `repr()` is one line, `ClientStats(timeouts=0, ...)`.

    Attributes:
        late_or_unknown_responses: Replies that matched no call waiting (its call had ended:
            deadline, cancel, the other attempt of a backup won), dropped.
        timeouts: Calls ended by their deadline (ERPCTIMEDOUT).
        connections_made: Connections opened, of every type.
        connections_lost: Connections closed, by either side or by a failure.
        stream_frames_dropped: Stream frames received and dropped: for a stream id unknown here
            (closed, or never opened), unparsable, or of an unknown type.
        retries: Attempts retried after a failure.
        backup_requests: Backup requests sent.
        backup_losers: Attempts abandoned because the other one (backup or original) won.
        servers_marked_down: Times a server was marked down (connection failure, ELOGOFF, a
            tripped circuit breaker).
        servers_revived: Times a down server's health check succeeded.
        health_checks: Health-check connects made.
        breaker_trips: Times a circuit breaker isolated a server.
        retries_throttled: Retries not made because the retry throttle had no tokens.
        cancelled: Calls ended by cancelling their task (ECANCELED).
    """

    __slots__ = ("late_or_unknown_responses", "timeouts", "connections_made", "connections_lost",
                 "stream_frames_dropped", "retries", "backup_requests", "backup_losers",
                 "servers_marked_down", "servers_revived", "health_checks", "breaker_trips",
                 "retries_throttled", "cancelled")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}

    def __repr__(self) -> str:
        return f"ClientStats({', '.join(f'{name}={getattr(self, name)}' for name in self.__slots__)})"


class SharedStats:
    """The counters of what several channels share (a server's connections and health check,
    client/socket_map.py): `shared.name += n` adds n to that counter in the `ClientStats` of
    every channel sharing it, so each channel's stats tell what its servers did. A counter read
    here is 0: the sums are the channels'."""

    __slots__ = ("holders",)

    def __init__(self) -> None:
        self.holders: list[ClientStats] = []


def _shared_counter(name: str) -> property:
    def add(self: SharedStats, value: int) -> None:  # value is 0 + n: `+= n` read 0 first
        for stats in self.holders:
            setattr(stats, name, getattr(stats, name) + value)
    return property(lambda self: 0, add)


for _name in ClientStats.__slots__:
    setattr(SharedStats, _name, _shared_counter(_name))


class ClientConnection(FramedConnection):
    """One TCP connection of a channel.

    `pending` maps correlation id -> the attempt waiting for that reply; an attempt has
    `on_response(event)` and `on_failed(RpcError)`, called exactly once by this connection
    unless the attempt removed itself first.
    """

    def __init__(self, stats: ClientStats | SharedStats, max_body_size: int, max_unwritten_bytes: int,
                 on_closed=None, ctype: str = "single") -> None:
        super().__init__(CLIENT, max_body_size, max_unwritten_bytes)
        self.pending: dict = {}
        self.stats = stats
        self.ctype = ctype
        self.credential: bytes | None = None  # sent with the first request (auth)
        self.failure_counted = False  # the retry throttle counted this connection's failure
        self.needs_credential = True
        self._next_cid = 1
        self._on_closed = on_closed

    def connection_made_hook(self) -> None:
        self.stats.connections_made += 1

    # -- responses received into the caller's buffer (Controller.response_attachment_into) ----
    def place_responses(self) -> None:
        """From now on, offer large response attachments to the calls waiting for them."""
        decoder = self.placing_decoder()
        if decoder.place is None:
            decoder.place = self._attachment_destination

    def _attachment_destination(self, meta, data):
        attempt = self.pending.get(meta.correlation_id)
        if attempt is None or attempt.done or meta.error_code or meta.checksum_type:
            return None
        call = attempt.call
        dest = call.cntl.response_attachment_into
        if dest is None or call.finished or dest.nbytes != meta.attachment_size:
            return None
        placer = call.placer
        if placer is not None and not placer.done:
            return None  # another attempt of the call (a backup) is being received into it
        call.placer = attempt
        return dest

    def forget(self, correlation_id: int) -> None:
        """An attempt stopped waiting for its reply: it is dropped when it comes, and not
        received into the caller's buffer any more."""
        self.pending.pop(correlation_id, None)
        decoder = self.decoder
        if type(decoder) is PlacingDecoder:
            decoder.divert(correlation_id)

    def event_received(self, ev) -> None:
        if type(ev) is StreamFrameReceived:
            self.stream_table().frame_received(ev)
            return
        attempt = self.pending.pop(ev.meta.correlation_id, None)
        if attempt is None:
            if ev.meta.stream_settings is not None:
                self.reset_offered_streams(ev.meta.stream_settings)  # a call of ours that ended
            self.stats.late_or_unknown_responses += 1
            _unknown_log(logging.DEBUG, "dropped a response with unknown or late correlation_id=%s from %s",
                         ev.meta.correlation_id, self.peer)
            return
        attempt.on_response(ev)

    def response_in_stream(self, message) -> None:
        """The first message of a call's first stream: the call's response, a whole PRPC frame."""
        decoder = Decoder(CLIENT, self.max_body_size)
        try:
            decoder.feed(message)
            ev = decoder.next_event()
            if type(ev) is not ResponseReceived or decoder.pending_bytes():
                raise RemoteProtocolError(f"the first message of a stream ({len(message)} bytes) is not "
                                          "one PRPC response frame")
        except RemoteProtocolError as e:
            self.protocol_error(e)
            return
        self.event_received(ev)

    def stream_table(self) -> StreamTable:
        if self.streams is None:
            self.streams = StreamTable(self, self.stats)
        return self.streams

    def reset_offered_streams(self, raw_settings) -> None:
        """RST each stream of these StreamSettings: the server offered them to no call of ours
        (brpc does the same for a stream it did not ask for)."""
        try:
            settings = streaming.decode_settings(raw_settings)
        except RemoteProtocolError:  # a bad offer is only ignored
            return
        for stream_id in settings.stream_ids:
            self.write([streaming.rst_frame(stream_id)])

    def protocol_error(self, e: RemoteProtocolError) -> None:
        if str(e).startswith("unknown protocol"):
            # Name what the peer sent in words: an HTTP or TLS server is told by its first bytes.
            rbuf = self.decoder.reader.rbuf
            have = rbuf.available()
            head = bytes(rbuf.peek(min(have, _SHOWN_BYTES)))
            e = RemoteProtocolError(f"unknown protocol (not a brpc server?): first bytes "
                                    f"{show_bytes(head, have > len(head))}", e.code)
        super().protocol_error(e)

    def closed(self, exc: BaseException | None) -> None:
        self.stats.connections_lost += 1
        # The owner learns first (it marks the server failed), so that attempts retried from
        # the failures below already see the server down.
        if self._on_closed is not None:
            self._on_closed(self, exc)
        pending, self.pending = self.pending, {}
        table = self.streams
        if not pending and not table:
            return
        err = connection_lost_error(exc, self.peer)
        for attempt in pending.values():
            attempt.on_failed(RpcError(err.code, err.text))
        if table:
            table.connection_lost(err.code, err.text)

    def drop(self) -> None:
        """Its event loop ended (the channel moved to a new one): forget the connection without
        that loop. The server is told at once; the socket itself closes with the transport when
        the loop is closed (asyncio's transports cannot close without their loop)."""
        transport, self.transport = self.transport, None
        if transport is None:
            return
        self.is_closed = True
        self.pending = {}  # the calls of that loop ended with it
        self.streams = None  # and so did its streams
        self.stats.connections_lost += 1
        try:
            transport.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
        except (AttributeError, OSError, TypeError):  # gone already; uvloop's socket has no shutdown()
            pass
        try:
            transport.abort()
        except RuntimeError:  # "Event loop is closed"
            pass


def show_bytes(head: bytes, more: bool = False) -> str:
    r"""`head` quoted as text when it is printable ASCII, else in hex; `...` when `more` follow.

    >>> print(show_bytes(b"HTTP/1.1 400 Bad Request\r\n", more=True))
    "HTTP/1.1 400 Bad Request\r\n"...
    >>> print(show_bytes(bytes([22, 3, 1])))
    160301 (hex)
    """
    tail = "..." if more else ""
    if head and _TEXT.issuperset(head):
        text = head.decode("ascii").replace("\\", "\\\\").replace('"', '\\"')
        text = text.replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t")
        return f'"{text}"{tail}'
    return f"{head.hex()}{tail} (hex)"


def connection_lost_error(exc: BaseException | None, peer: str) -> RpcError:
    """What the calls on a connection to `peer` lost with `exc` (None: EOF) fail with."""
    if exc is None:
        return RpcError(EEOF, f"Got EOF of {peer}")
    if isinstance(exc, RemoteProtocolError):
        return RpcError(EFAILEDSOCKET, f"Broken connection to {peer}: {exc}")
    if isinstance(exc, RpcError):
        return exc
    if isinstance(exc, ssl.SSLError):  # e.g. TLS 1.3: the server refused our certificate after the handshake
        return RpcError(ESSL, f"TLS connection to {peer} failed: {exc.reason or exc}")
    return RpcError(EFAILEDSOCKET, f"Broken connection to {peer}: {exc!r}")
