"""Clients driven by hand, for the hostile rows: an HTTP/2 peer that writes any frame
(hyperframe) and reads every frame the server sends, an HTTP/1.1 client that writes any bytes,
and one baidu_std call. None of them uses aiobrpc: they see the wire as an attacker would.

RawH2 keeps just enough state to be a correct client when asked to: it answers SETTINGS and
PING, returns the server's DATA to its windows (unless `auto_window` is off), and tracks the
server's flow-control windows so that `send_data_flow` sends only what they allow. Everything
it receives is recorded with the time it came (GOAWAY, RST_STREAM, the headers and data of each
stream, the end of the connection)."""

from __future__ import annotations

import asyncio
import ssl
import struct
import time
from dataclasses import dataclass, field

import hpack
from hyperframe.frame import (ContinuationFrame, DataFrame, Frame, GoAwayFrame, HeadersFrame, PingFrame,
                              RstStreamFrame, SettingsFrame, WindowUpdateFrame)

from aiobrpc._proto import brpc_meta_pb2, grpc_test_pb2

Msg = grpc_test_pb2.GrpcMessage
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SERVICE_NAME = "aiobrpc.test.GrpcTestService"
UNARY = f"/{SERVICE_NAME}/Unary".encode()
SERVER_STREAM = f"/{SERVICE_NAME}/ServerStream".encode()
KEEP_DATA = 4 << 20  # bytes of DATA kept per stream (more is only counted)

# HTTP/2 error codes (RFC 9113 section 7)
ERROR_NAMES = {0: "NO_ERROR", 1: "PROTOCOL_ERROR", 2: "INTERNAL_ERROR", 3: "FLOW_CONTROL_ERROR",
               4: "SETTINGS_TIMEOUT", 5: "STREAM_CLOSED", 6: "FRAME_SIZE_ERROR", 7: "REFUSED_STREAM", 8: "CANCEL",
               9: "COMPRESSION_ERROR", 10: "CONNECT_ERROR", 11: "ENHANCE_YOUR_CALM", 12: "INADEQUATE_SECURITY",
               13: "HTTP_1_1_REQUIRED"}
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3


def now() -> float:
    return time.monotonic()


def grpc_message(payload: bytes, declared: int | None = None) -> bytes:
    """A gRPC length-prefixed message (uncompressed); `declared` overrides its length field."""
    return b"\x00" + struct.pack(">I", len(payload) if declared is None else declared) + payload


def grpc_headers(path: bytes = UNARY, *, auth: bytes | None = None, timeout: bytes | None = None,
                 extra: list | tuple = ()) -> list:
    h = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path), (b":authority", b"127.0.0.1"),
         (b"content-type", b"application/grpc"), (b"te", b"trailers")]
    if timeout is not None:
        h.append((b"grpc-timeout", timeout))
    if auth is not None:
        h.append((b"authorization", auth))
    return h + list(extra)


def client_tls(tls: dict | None, alpn: str) -> ssl.SSLContext | None:
    """A client context that trusts the bench's CA and shows its client certificate."""
    if not tls:
        return None
    ctx = ssl.create_default_context(cafile=tls["ca"])
    ctx.load_cert_chain(tls["client"])
    ctx.set_alpn_protocols([alpn])
    return ctx


@dataclass
class Stream:
    headers: list = field(default_factory=list)  # a dict per header block (response headers, trailers)
    data: bytearray = field(default_factory=bytearray)
    data_len: int = 0
    ended: bool = False
    rst: int | None = None
    rst_at: float | None = None
    first_headers_at: float | None = None
    reset_sent: int | None = None  # the code of our own RST_STREAM on it
    rsts: list = field(default_factory=list)  # the codes of every RST_STREAM the server sent on it

    @property
    def grpc_status(self) -> int | None:
        for h in reversed(self.headers):
            if b"grpc-status" in h:
                try:
                    return int(h[b"grpc-status"])
                except ValueError:
                    return -1
        return None

    @property
    def grpc_message(self) -> str:
        for h in reversed(self.headers):
            if b"grpc-status" in h:
                return h.get(b"grpc-message", b"").decode("latin-1")
        return ""

    def messages(self) -> list[bytes]:
        out, buf = [], bytes(self.data)
        while len(buf) >= 5:
            n = struct.unpack(">I", buf[1:5])[0]
            if len(buf) < 5 + n:
                break
            out.append(buf[5:5 + n])
            buf = buf[5 + n:]
        return out


class RawH2:
    """One HTTP/2 client connection, frame by frame."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, auto_window: bool = True,
                 quiet: bool = False) -> None:
        self.reader, self.writer = reader, writer
        self.auto_window = auto_window
        self.quiet = quiet  # answer nothing: no SETTINGS ACK, no PING ACK, no WINDOW_UPDATE
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder(max_header_list_size=1 << 24)
        self.streams: dict[int, Stream] = {}
        self.next_sid = 1
        self.first_byte_at: float | None = None  # when this peer wrote its first byte
        self.goaway: tuple | None = None  # (time, error code, last stream id, debug data)
        self.closed_at: float | None = None
        self.close_reason = ""
        self.error = ""  # what this peer could not parse
        self.frames_in = 0
        self.server_settings_at: float | None = None
        # the server's windows for what we send
        self.server_initial_window = 65535
        self.conn_window = 65535
        self.stream_windows: dict[int, int] = {}
        self.reading = asyncio.Event()
        self.reading.set()
        self._changed = asyncio.Event()
        self._continuing: tuple | None = None  # (stream id, block so far, end_stream) of an unfinished header block
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def connect(cls, host: str, port: int, *, tls: ssl.SSLContext | None = None, settings: dict | None = None,
                      window_increment: int = 0, auto_window: bool = True, preface: bool = True,
                      quiet: bool = False, timeout: float = 5.0) -> RawH2:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(
            host, port, ssl=tls, server_hostname="127.0.0.1" if tls else None, limit=1 << 20), timeout)
        peer = cls(reader, writer, auto_window=auto_window and not quiet, quiet=quiet)
        if preface:
            out = PREFACE + SettingsFrame(0, settings=settings or {}).serialize()
            if window_increment:
                out += WindowUpdateFrame(0, window_increment=window_increment).serialize()
            peer.send(out)
        return peer

    # -- writing -----------------------------------------------------------------------------
    def send(self, *parts) -> bool:
        """Write frames or bytes; False once the connection is gone."""
        if self.writer.is_closing() or self.closed_at is not None:
            return False
        out = b"".join(p if isinstance(p, (bytes, bytearray, memoryview)) else p.serialize() for p in parts)
        if self.first_byte_at is None:
            self.first_byte_at = now()
        try:
            self.writer.write(out)
        except (ConnectionError, RuntimeError) as e:
            self._ended(f"write failed: {e!r}")
            return False
        return True

    async def drain(self, timeout: float = 5.0) -> bool:
        try:
            await asyncio.wait_for(self.writer.drain(), timeout)
            return True
        except (ConnectionError, asyncio.TimeoutError, RuntimeError):
            return False

    def header_block(self, headers: list) -> bytes:
        return self.encoder.encode(headers)

    def new_stream(self) -> int:
        sid = self.next_sid
        self.next_sid += 2
        self.streams[sid] = Stream()
        self.stream_windows[sid] = self.server_initial_window
        return sid

    def send_headers(self, sid: int, headers: list, end_stream: bool = False) -> bool:
        flags = ["END_HEADERS"] + (["END_STREAM"] if end_stream else [])
        return self.send(HeadersFrame(sid, data=self.header_block(headers), flags=flags))

    def send_data(self, sid: int, data: bytes, end_stream: bool = False, max_frame: int = 16384) -> bool:
        """DATA frames, whatever the windows say (they are counted down all the same)."""
        frames = []
        view = memoryview(data)
        for i in range(0, max(len(data), 1), max_frame):
            chunk = bytes(view[i:i + max_frame])
            last = i + max_frame >= len(data)
            frames.append(DataFrame(sid, data=chunk, flags=["END_STREAM"] if end_stream and last else []))
        self.conn_window -= len(data)
        self.stream_windows[sid] = self.stream_windows.get(sid, self.server_initial_window) - len(data)
        return self.send(*frames)

    async def send_data_flow(self, sid: int, data: bytes, end_stream: bool, until: float,
                             max_frame: int = 16384) -> int:
        """Send `data` on `sid` as the server's windows allow, until it is all sent, the
        connection ends or the monotonic time `until`; the bytes sent."""
        sent = 0
        view = memoryview(data)
        while sent < len(data) or (end_stream and sent == len(data) == 0):
            if self.closed_at is not None or self.goaway is not None or self.streams[sid].rst is not None:
                break
            n = min(len(data) - sent, self.conn_window, self.stream_windows.get(sid, 0), max_frame)
            if n <= 0 and len(data) > 0:
                if now() >= until or not await self.wait(
                        lambda: self.conn_window > 0 and self.stream_windows.get(sid, 0) > 0
                        or self.closed_at is not None, until - now()):
                    break
                continue
            last = sent + n >= len(data)
            self.conn_window -= n
            self.stream_windows[sid] -= n
            if not self.send(DataFrame(sid, data=bytes(view[sent:sent + n]),
                                       flags=["END_STREAM"] if end_stream and last else [])):
                break
            sent += n
            if end_stream and last:
                break
            if self.writer.transport.get_write_buffer_size() > 1 << 20:
                await self.drain(max(0.01, until - now()))
        return sent

    def start_call(self, message: bytes | None = b"", *, path: bytes = UNARY, auth: bytes | None = None,
                   timeout: bytes | None = None, extra: list | tuple = (), end: bool = True) -> int:
        """A gRPC call's HEADERS and (unless `message` is None) its one message."""
        sid = self.new_stream()
        headers = grpc_headers(path, auth=auth, timeout=timeout, extra=extra)
        if message is None:
            self.send_headers(sid, headers, end_stream=end)
        else:
            self.send_headers(sid, headers)
            self.send_data(sid, grpc_message(message), end_stream=end)
        return sid

    def reset(self, sid: int, code: int = 8) -> bool:
        self._stream(sid).reset_sent = code
        return self.send(RstStreamFrame(sid, error_code=code))

    def close(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()
        self._ended(self.close_reason or "closed by us")
        self._task.cancel()

    def abort(self) -> None:
        """Close with a reset (RST), not a FIN."""
        try:
            self.writer.transport.abort()
        except Exception:  # noqa: BLE001
            pass
        self.close()

    # -- reading -----------------------------------------------------------------------------
    @property
    def refused_at(self) -> float | None:
        """When the server ended the connection (GOAWAY or close)."""
        times = [t for t in (self.goaway[0] if self.goaway else None, self.closed_at) if t is not None]
        return min(times) if times else None

    async def wait(self, predicate, timeout: float) -> bool:
        """Until `predicate()` holds (True), or `timeout` seconds or the connection end (its value then)."""
        end = now() + max(0.0, timeout)
        while not predicate():
            if self.closed_at is not None:
                return bool(predicate())
            left = end - now()
            if left <= 0:
                return bool(predicate())
            ev = self._changed
            try:
                await asyncio.wait_for(ev.wait(), left)
            except asyncio.TimeoutError:
                return bool(predicate())
        return True

    def _pulse(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _ended(self, why: str) -> None:
        if self.closed_at is None:
            self.closed_at = now()
            self.close_reason = why
            self._pulse()

    async def _read_loop(self) -> None:
        buf = bytearray()
        try:
            while True:
                await self.reading.wait()
                data = await self.reader.read(1 << 18)
                if not data:
                    self._ended("EOF from the server")
                    return
                buf += data
                pos = 0
                while len(buf) - pos >= 9:
                    frame, length = Frame.parse_frame_header(memoryview(buf)[pos:pos + 9])
                    if len(buf) - pos < 9 + length:
                        break
                    frame.parse_body(memoryview(buf)[pos + 9:pos + 9 + length])
                    pos += 9 + length
                    self._on_frame(frame)
                del buf[:pos]
                self._pulse()
        except asyncio.CancelledError:
            raise
        except (ConnectionError, OSError, ssl.SSLError) as e:
            self._ended(f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - a frame we cannot parse: recorded, the peer stops
            self.error = f"{type(e).__name__}: {e}"
            self._ended(f"client parse error: {self.error}")

    def _stream(self, sid: int) -> Stream:
        s = self.streams.get(sid)
        if s is None:
            s = self.streams[sid] = Stream()
        return s

    def _on_frame(self, frame) -> None:
        self.frames_in += 1
        t = type(frame)
        if t is DataFrame:
            s = self._stream(frame.stream_id)
            n = len(frame.data)
            s.data_len += n
            if len(s.data) < KEEP_DATA:
                s.data += frame.data
            if "END_STREAM" in frame.flags:
                s.ended = True
            if self.auto_window and frame.flow_controlled_length:
                self.send(WindowUpdateFrame(0, window_increment=frame.flow_controlled_length),
                          WindowUpdateFrame(frame.stream_id, window_increment=frame.flow_controlled_length))
        elif t is HeadersFrame:
            if "END_HEADERS" in frame.flags:
                self._headers(frame.stream_id, bytes(frame.data), "END_STREAM" in frame.flags)
            else:
                self._continuing = (frame.stream_id, bytearray(frame.data), "END_STREAM" in frame.flags)
        elif t is ContinuationFrame and self._continuing is not None:
            sid, block, end = self._continuing
            block += frame.data
            if "END_HEADERS" in frame.flags:
                self._continuing = None
                self._headers(sid, bytes(block), end)
        elif t is SettingsFrame:
            if "ACK" not in frame.flags:
                self.server_settings_at = now()
                if SETTINGS_INITIAL_WINDOW_SIZE in frame.settings:
                    new = frame.settings[SETTINGS_INITIAL_WINDOW_SIZE]
                    delta = new - self.server_initial_window
                    self.server_initial_window = new
                    for sid in self.stream_windows:
                        self.stream_windows[sid] += delta
                if not self.quiet:
                    self.send(SettingsFrame(0, flags=["ACK"]))
        elif t is PingFrame:
            if "ACK" not in frame.flags and not self.quiet:
                self.send(PingFrame(0, opaque_data=frame.opaque_data, flags=["ACK"]))
        elif t is WindowUpdateFrame:
            if frame.stream_id == 0:
                self.conn_window += frame.window_increment
            else:
                self.stream_windows[frame.stream_id] = self.stream_windows.get(frame.stream_id, 0) \
                    + frame.window_increment
        elif t is RstStreamFrame:
            s = self._stream(frame.stream_id)
            s.rsts.append(frame.error_code)
            if s.rst is None:  # the first one is the answer; a later one answers frames sent meanwhile
                s.rst, s.rst_at = frame.error_code, now()
        elif t is GoAwayFrame:
            if self.goaway is None:
                self.goaway = (now(), frame.error_code, frame.last_stream_id, bytes(frame.additional_data))

    def _headers(self, sid: int, block: bytes, end_stream: bool) -> None:
        s = self._stream(sid)
        s.headers.append(dict(self.decoder.decode(block, raw=True)))
        if s.first_headers_at is None:
            s.first_headers_at = now()
        if end_stream:
            s.ended = True

    # -- summaries ---------------------------------------------------------------------------
    def describe(self) -> str:
        if self.goaway is not None:
            text = f"GOAWAY {ERROR_NAMES.get(self.goaway[1], self.goaway[1])}"
            if self.goaway[3]:
                text += f" ({self.goaway[3][:60].decode('latin-1')!r})"
            return text
        if self.closed_at is not None:
            return f"closed ({self.close_reason})"
        return "open"


# -- HTTP/1.1 ------------------------------------------------------------------------------------
@dataclass
class HttpReply:
    status: int | None  # None: the connection ended first
    headers: dict
    body: bytes
    elapsed: float
    why: str = ""


class Http1:
    """HTTP/1.1 requests of any bytes, on one keep-alive connection."""

    def __init__(self, reader, writer) -> None:
        self.reader, self.writer = reader, writer
        self.first_byte_at: float | None = None

    @classmethod
    async def connect(cls, host: str, port: int, tls: ssl.SSLContext | None = None, timeout: float = 5.0) -> Http1:
        r, w = await asyncio.wait_for(asyncio.open_connection(
            host, port, ssl=tls, server_hostname="127.0.0.1" if tls else None, limit=1 << 20), timeout)
        return cls(r, w)

    def write(self, raw: bytes) -> None:
        if self.first_byte_at is None:
            self.first_byte_at = now()
        self.writer.write(raw)

    @staticmethod
    def build(method: str, target: bytes | str, headers: list | tuple = (), body: bytes = b"") -> bytes:
        target = target.encode("latin-1") if isinstance(target, str) else target
        head = [method.encode() + b" " + target + b" HTTP/1.1", b"Host: 127.0.0.1"]
        for name, value in headers:
            head.append((name.encode() if isinstance(name, str) else name) + b": "
                        + (value.encode("latin-1") if isinstance(value, str) else value))
        if body or method in ("POST", "PUT"):
            head.append(b"Content-Length: " + str(len(body)).encode())
        return b"\r\n".join(head) + b"\r\n\r\n" + body

    async def request(self, method: str, target, headers=(), body: bytes = b"", timeout: float = 5.0,
                      raw: bytes | None = None) -> HttpReply:
        t0 = now()
        try:
            self.write(raw if raw is not None else self.build(method, target, headers, body))
            return await asyncio.wait_for(self.read_reply(t0), timeout)
        except asyncio.TimeoutError:
            return HttpReply(None, {}, b"", now() - t0, f"no reply within {timeout} s")
        except (ConnectionError, OSError, asyncio.IncompleteReadError, ssl.SSLError) as e:
            return HttpReply(None, {}, b"", now() - t0, f"{type(e).__name__}: {e}".strip())

    async def read_reply(self, t0: float) -> HttpReply:
        while True:
            try:
                head = await self.reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as e:
                return HttpReply(None, {}, e.partial, now() - t0, "closed before a reply" if not e.partial
                                 else "closed within a reply head")
            lines = head.decode("latin-1").split("\r\n")
            parts = lines[0].split(" ", 2)
            status = int(parts[1])
            headers = {}
            for line in lines[1:]:
                if ":" in line:
                    k, _, v = line.partition(":")
                    headers[k.strip().lower()] = v.strip()
            if 100 <= status < 200:
                continue
            n = int(headers.get("content-length", "0") or 0)
            body = await self.reader.readexactly(n) if n else b""
            return HttpReply(status, headers, body, now() - t0)

    async def closed_within(self, timeout: float) -> bool:
        """Whether the server closes the connection within `timeout` (what it sends meanwhile is read)."""
        try:
            while True:
                if not await asyncio.wait_for(self.reader.read(65536), timeout):
                    return True
        except asyncio.TimeoutError:
            return False
        except (ConnectionError, OSError, ssl.SSLError):
            return True

    def close(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()


# -- baidu_std -----------------------------------------------------------------------------------
def baidu_request(method: str, payload: bytes, correlation_id: int = 1, auth: bytes | None = None) -> bytes:
    meta = brpc_meta_pb2.RpcMeta()
    meta.request.service_name = SERVICE_NAME
    meta.request.method_name = method
    meta.correlation_id = correlation_id
    if auth is not None:
        meta.authentication_data = auth
    m = meta.SerializeToString()
    return b"PRPC" + struct.pack(">II", len(m) + len(payload), len(m)) + m + payload


async def baidu_call(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes,
                     auth: bytes | None = None, timeout: float = 5.0) -> tuple[int | None, bytes, str]:
    """(error code, response payload, why) of one Unary call; (None, b"", why) if the
    connection ended or nothing came within `timeout`."""
    writer.write(baidu_request("Unary", payload, auth=auth))
    try:
        head = await asyncio.wait_for(reader.readexactly(12), timeout)
        if head[:4] != b"PRPC":
            return None, head, f"not a baidu_std reply: {head!r}"
        body_size, meta_size = struct.unpack(">II", head[4:])
        body = await asyncio.wait_for(reader.readexactly(body_size), timeout)
    except asyncio.IncompleteReadError as e:
        return None, b"", "closed" + (f" after {len(e.partial)} bytes" if e.partial else "")
    except asyncio.TimeoutError:
        return None, b"", f"no reply within {timeout} s"
    except (ConnectionError, OSError) as e:
        return None, b"", f"{type(e).__name__}"
    meta = brpc_meta_pb2.RpcMeta.FromString(body[:meta_size])
    return meta.response.error_code, body[meta_size:], meta.response.error_text
