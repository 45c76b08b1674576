"""The HTTP/2 connection policy of aiobrpc's gRPC server and client, on top of `h2`.

`H2Connection` is h2's connection with the rules both sides keep (framing, HPACK and flow
control stay h2's and hyperframe's, which also reads the 9-byte header of a frame still
arriving; h2's FrameBuffer is looked into for what it holds):

* A graceful GOAWAY (NO_ERROR) from the peer ends nothing by itself. h2 would move the
  connection to CLOSED, refusing every later frame, and drop the frames it had queued; here
  the streams already open carry on: the server answers every call it took (a client's GOAWAY
  speaks of pushed streams only, RFC 9113 §6.8), the client reads the replies of the streams
  the server took. The owner opens no stream after it.
* A frame longer than our SETTINGS_MAX_FRAME_SIZE is refused from its 9-byte header
  (FRAME_SIZE_ERROR), before its body is buffered; h2 checks the length once all of it came.
* A header block (HEADERS or PUSH_PROMISE and its CONTINUATION frames) is bounded in bytes,
  `max_header_block`, twice SETTINGS_MAX_HEADER_LIST_SIZE: refused (ENHANCE_YOUR_CALM) as soon
  as the bytes received and announced for it pass that; h2 bounds a block only by counting
  its frames (64, of up to MAX_FRAME_SIZE each).
* Server: a stream past SETTINGS_MAX_CONCURRENT_STREAMS is refused alone, RST_STREAM
  REFUSED_STREAM (RFC 9113 §5.1.2), and reported as a `StreamRefused` event; h2 would end the
  connection with PROTOCOL_ERROR, and every call on it with it.
* Server: request header blocks are checked against RFC 9113 §8.2 and §8.3 by `RequestDecoder`
  (h2's own check runs in Python per character, on every block, and ends the connection,
  where a malformed request is an error of its stream only). It sits under hpack_memo's memo,
  so a block a client repeats is checked once, and the fields found good are remembered per
  connection, so a block new by one field (a grpc-timeout) has that field's bytes checked; a
  malformed block reaches the owner with `(MALFORMED_REQUEST, why)` as its first field, for it
  to reset that stream.
* Server: the receive windows are given back level by level (`acknowledge_stream`,
  `release`, `lend`): a stream's as its bytes arrive, so a message larger than the stream's
  window can be assembled, the connection's only as held bytes are released, so that what a
  peer makes the server hold is bounded by the connection's window (plus what was lent).
"""

from __future__ import annotations

import re

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import hpack
from h2.errors import ErrorCodes
from hyperframe.exceptions import InvalidDataError, InvalidFrameError
from hyperframe.frame import ContinuationFrame, Frame, HeadersFrame, PushPromiseFrame, WindowUpdateFrame

from . import h2_frames, hpack_memo  # noqa: F401  (h2_frames: h2's DATA frame repr made cheap)

MALFORMED_REQUEST = b":malformed-request"  # first field of a request header block that breaks RFC 9113 §8.2/§8.3
HEADER_BLOCK_PER_HEADER_LIST = 2  # a header block may be this many times SETTINGS_MAX_HEADER_LIST_SIZE (coded)

_HEADER_BLOCK_FRAMES = (HeadersFrame, ContinuationFrame, PushPromiseFrame)
_H2_DEFAULT_WINDOW = 65535


class StreamRefused(h2.events.Event):
    """The peer opened a stream past SETTINGS_MAX_CONCURRENT_STREAMS: it was reset with
    REFUSED_STREAM and never reached the owner (RFC 9113 §5.1.2: the peer may retry it)."""

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id

    def __repr__(self) -> str:
        return f"<StreamRefused stream_id:{self.stream_id}>"


class H2Connection(h2.connection.H2Connection):
    """h2's H2Connection with aiobrpc's policy (the module's docstring)."""

    def __init__(self, config: h2.config.H2Configuration | None = None) -> None:
        super().__init__(config)
        self.max_header_block = HEADER_BLOCK_PER_HEADER_LIST * hpack.hpack.DEFAULT_MAX_HEADER_LIST_SIZE
        self.refuse_excess_streams = False  # the server's: refuse a stream past the limit, not the connection
        self._admitting_refused = False
        self.connection_window = _H2_DEFAULT_WINDOW  # the connection's receive window when nothing is held
        self.lent = 0  # connection window opened past connection_window, repaid by releases
        self._released = 0  # bytes released and not yet given back to the peer

    # -- bytes in --------------------------------------------------------------------------------
    def receive_data(self, data) -> list:
        events = super().receive_data(data)
        buffer = self.incoming_buffer
        if buffer._headers_buffer or len(buffer._data) >= 9:
            try:
                self._check_unfinished(buffer)
            except h2.exceptions.ProtocolError as e:
                self._terminate_connection(e.error_code)
                raise
        return events

    def _check_unfinished(self, buffer) -> None:
        """The frame still arriving (its header is in) and the header block still open, by
        what they announce: h2 would buffer all of them before looking."""
        block = 0
        for f in buffer._headers_buffer:
            block += len(f.data)
        pending = buffer._data
        if len(pending) >= 9:
            try:
                frame, length = Frame.parse_frame_header(memoryview(pending[:9]))
            except (InvalidDataError, InvalidFrameError) as e:
                raise h2.exceptions.ProtocolError(f"Received frame with invalid header: {e}") from e
            if length > buffer.max_frame_size:
                raise h2.exceptions.FrameTooLargeError(
                    f"a frame of {length} bytes announced (SETTINGS_MAX_FRAME_SIZE is {buffer.max_frame_size})")
            if isinstance(frame, _HEADER_BLOCK_FRAMES):
                block += length
        if block > self.max_header_block:
            raise h2.exceptions.DenialOfServiceError(
                f"a header block of {block} bytes or more (more than {self.max_header_block}: a CONTINUATION flood)")

    def unfinished_header_block(self):
        """The first frame of the header block still open (no END_HEADERS yet), or None."""
        frames = self.incoming_buffer._headers_buffer
        return frames[0] if frames else None

    def _receive_headers_frame(self, frame):
        if len(frame.data) > self.max_header_block:
            raise h2.exceptions.DenialOfServiceError(
                f"a header block of {len(frame.data)} bytes (more than {self.max_header_block})")
        if not self.refuse_excess_streams:
            return super()._receive_headers_frame(frame)
        try:
            return super()._receive_headers_frame(frame)
        except h2.exceptions.TooManyStreamsError:
            pass
        # h2 refused it before decoding its block: decode it now (HPACK's table must stay in
        # step with the peer's), and open the stream only to reset it.
        self._admitting_refused = True
        try:
            frames, _ = super()._receive_headers_frame(frame)
        finally:
            self._admitting_refused = False
        self.reset_stream(frame.stream_id, ErrorCodes.REFUSED_STREAM)
        return frames, [StreamRefused(frame.stream_id)]

    @property
    def open_inbound_streams(self) -> int:
        if self._admitting_refused:
            return 0
        return super().open_inbound_streams

    def _receive_goaway_frame(self, frame):
        if frame.error_code:
            return super()._receive_goaway_frame(frame)
        state = self.state_machine.state
        unsent = self._data_to_send
        frames, events = super()._receive_goaway_frame(frame)
        self.state_machine.state = state
        self._data_to_send = unsent
        return frames, events

    # -- bytes out -------------------------------------------------------------------------------
    @property
    def unsent_bytes(self) -> int:
        """Bytes queued in h2 and not yet taken by data_to_send()."""
        return len(self._data_to_send)

    # -- receive windows, each level by itself ----------------------------------------------------
    def acknowledge_stream(self, size: int, stream_id: int) -> bool:
        """Give `size` bytes of `stream_id`'s window back, not the connection's (h2's
        acknowledge_received_data gives both); whether a WINDOW_UPDATE was queued."""
        stream = self.streams.get(stream_id)
        if stream is None or not stream.open:
            return False
        frames = stream.acknowledge_received_data(size)
        if frames:
            self._prepare_for_sending(frames)
            return True
        return False

    def release(self, size: int) -> bool:
        """`size` received bytes are held no more: the connection's window gets them back,
        after repaying what was lent, in one WINDOW_UPDATE once the window is below half of
        connection_window; whether one was queued."""
        lent = self.lent
        if lent:
            repaid = size if size < lent else lent
            self.lent = lent - repaid
            size -= repaid
        self._released += size
        if self._released and self._inbound_flow_control_window_manager.current_window_size < \
                self.connection_window // 2:
            return self.give_back()
        return False

    def give_back(self) -> bool:
        """Give the peer the bytes released so far (one WINDOW_UPDATE); whether one was queued."""
        size = self._released
        if not size or self.state_machine.state == h2.connection.ConnectionState.CLOSED:
            return False
        self._released = 0
        self._inbound_flow_control_window_manager.window_opened(size)
        self._prepare_for_sending([WindowUpdateFrame(0, window_increment=size)])
        return True

    def lend(self, size: int) -> None:
        """Open the connection's window `size` bytes past connection_window: a message larger
        than what is left of it must still arrive. Releases repay it first."""
        if self.state_machine.state == h2.connection.ConnectionState.CLOSED:
            return
        self.lent += size
        self._inbound_flow_control_window_manager.window_opened(size)
        self._prepare_for_sending([WindowUpdateFrame(0, window_increment=size)])


# -- request header blocks (RFC 9113 §8.2, §8.3) ------------------------------------------------
# A field name: no 0x00-0x20, no uppercase 0x41-0x5a, no 0x7f-0xff, and a colon only as the
# first byte of a pseudo-header. A field value: no NUL, CR or LF, no SP or HTAB at either end.
_FIELD_NAME = re.compile(rb":?[\x21-\x39\x3b-\x40\x5b-\x7e]+")
_BAD_FIELD_VALUE = re.compile(rb"[\x00\r\n]|\A[ \t]|[ \t]\Z")
_CONNECTION_SPECIFIC = frozenset((b"connection", b"proxy-connection", b"keep-alive", b"transfer-encoding",
                                  b"upgrade"))
_CHECKED_FIELDS = _CONNECTION_SPECIFIC | {b"te", b"content-length"}
_REQUEST_PSEUDO = frozenset((b":method", b":scheme", b":authority", b":path"))
# Fields whose bytes were found good, per connection: a client repeats most of its fields call
# after call (one new grpc-timeout makes a block new, not its other fields).
KNOWN_FIELDS = 256
KNOWN_FIELD_BYTES = 256  # a longer field is checked each time it comes


def malformed_request(headers, known: set | None = None) -> str | None:
    """Why `headers` (a request's, or trailers') are malformed in RFC 9113's terms, or None.
    `known`: fields already found good (their bytes), added to."""
    if not headers:
        return "an empty header block"
    pseudo = None
    regular = False
    for field in headers:
        name, value = field
        if known is None or field not in known:
            if _FIELD_NAME.fullmatch(name) is None:
                return f"field name {name[:64]!r} is not a lowercase token"
            if _BAD_FIELD_VALUE.search(value) is not None:
                return f"the value of {name[:64]!r} has CR, LF or NUL, or whitespace at an end"
            if known is not None and len(known) < KNOWN_FIELDS and len(name) + len(value) <= KNOWN_FIELD_BYTES:
                known.add(field)
        if name[0] == 58:  # b":"
            if regular:
                return f"pseudo-header {name!r} after a regular field"
            if name not in _REQUEST_PSEUDO:
                return f"pseudo-header {name[:64]!r} is no request's"
            if pseudo is None:
                pseudo = {}
            elif name in pseudo:
                return f"pseudo-header {name!r} twice"
            pseudo[name] = value
            continue
        regular = True
        if name in _CHECKED_FIELDS:
            if name in _CONNECTION_SPECIFIC:
                return f"connection-specific field {name!r}"
            if name == b"te" and value != b"trailers":
                return f"te: {value[:64]!r} (only \"trailers\" is allowed)"
            if name == b"content-length" and not value.isdigit():
                return f"content-length: {value[:64]!r}"
    if pseudo is None:
        return None  # trailers, which have no pseudo-header (a request without any is answered 4xx)
    if pseudo.get(b":method") == b"CONNECT":
        if b":scheme" in pseudo or b":path" in pseudo or b":authority" not in pseudo:
            return "a CONNECT request needs :authority alone"
        return None
    for required in (b":method", b":scheme", b":path"):
        if not pseudo.get(required):
            return f"no {required.decode()} pseudo-header"
    return None


class _CheckedDecoder(hpack.Decoder):
    def __init__(self, max_header_list_size: int = hpack.hpack.DEFAULT_MAX_HEADER_LIST_SIZE) -> None:
        super().__init__(max_header_list_size)
        self.known_fields: set = set()  # malformed_request's `known`, for this connection

    def decode(self, data, raw: bool = False):
        headers = super().decode(data, raw)
        why = malformed_request(headers, self.known_fields)
        if why is None:
            return headers
        # A malformed content-length is left out: h2 would end the connection for it.
        return [(MALFORMED_REQUEST, why.encode()), *(h for h in headers if h[0] != b"content-length")]


class RequestDecoder(hpack_memo.MemoDecoder, _CheckedDecoder):
    """hpack_memo's MemoDecoder checking each block it decodes (a repeated one is answered from
    the memo, checked): MemoDecoder.decode's hpack decode is _CheckedDecoder.decode."""


# -- the two sides -------------------------------------------------------------------------------
def server_connection(*, max_concurrent_streams: int, max_header_list_size: int, stream_window: int,
                      max_frame_size: int, connection_window: int) -> H2Connection:
    """The server side of one connection, its SETTINGS and connection window queued."""
    config = h2.config.H2Configuration(client_side=False, header_encoding=None,
                                       validate_outbound_headers=False, normalize_outbound_headers=False,
                                       validate_inbound_headers=False, normalize_inbound_headers=False)
    conn = H2Connection(config)
    decoder = RequestDecoder(max_header_list_size)
    decoder.max_allowed_table_size = conn.decoder.max_allowed_table_size
    conn.decoder = decoder
    conn.encoder = hpack_memo.MemoEncoder()
    conn.refuse_excess_streams = True
    conn.max_header_block = HEADER_BLOCK_PER_HEADER_LIST * max_header_list_size
    conn.local_settings = h2.settings.Settings(client=False, initial_values={
        h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max_concurrent_streams,
        h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: max_header_list_size,
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: stream_window,
        h2.settings.SettingCodes.MAX_FRAME_SIZE: max_frame_size,
        h2.settings.SettingCodes.ENABLE_PUSH: 0,
    })
    # In force at once, not when the peer acknowledges them: h2 reads a frame by the limit of
    # the read's start, and a peer may send its ACK and a large frame in one read.
    conn.max_inbound_frame_size = max_frame_size
    conn.initiate_connection()
    conn.connection_window = connection_window
    conn.increment_flow_control_window(connection_window - _H2_DEFAULT_WINDOW)
    return conn
