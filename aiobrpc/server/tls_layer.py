"""TLS under a server connection whose first bytes were a TLS handshake.

The connection has already read the ClientHello from its TCP transport when it knows that
it speaks TLS, so asyncio's `start_tls` (which reads the handshake itself) cannot take over.
`TlsLayer` becomes the TCP transport's protocol instead: it feeds what was read, and all that
follows, to an `ssl.SSLObject` through memory BIOs, and gives the connection a `TlsTransport`
whose writes are encrypted. The connection then reads plaintext through its own
`get_buffer`/`buffer_updated` (so large attachments are still decrypted in place) and
detects its protocol again from the first plaintext bytes.
"""

from __future__ import annotations

import asyncio
import logging
import ssl

log = logging.getLogger(__name__)

# Plaintext is encrypted this much at a time, so a large reply never sits twice in memory.
_WRITE_CHUNK = 256 * 1024


class TlsLayer(asyncio.Protocol):
    def __init__(self, raw: asyncio.Transport, context: ssl.SSLContext, app, handshake_timeout: float,
                 on_failure=None) -> None:
        self.raw = raw
        self.app = app  # a BufferedProtocol: the connection carried
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.sslobj = context.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.transport = TlsTransport(self)
        self.handshaken = False
        self.reading_paused = False
        self.closing = False
        self.lost = False
        self.eof = False
        self._on_failure = on_failure  # called with the reason when the handshake fails
        self.loop = asyncio.get_running_loop()
        self._timer = self.loop.call_later(handshake_timeout, self._handshake_timed_out, handshake_timeout)

    def start(self, first: bytes) -> None:
        """Take the TCP transport over; `first` are the bytes the connection read already."""
        self.raw.set_protocol(self)
        self.data_received(first)

    # -- from the TCP transport ------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.lost or self.closing:
            return
        self.incoming.write(data)
        if not self.handshaken:
            self._handshake()
        else:
            self._read()

    def eof_received(self) -> bool:
        self.incoming.write_eof()
        if not self.handshaken:
            self._fail("the peer closed during the handshake")
            return False
        self._read()  # what is left; then the end, without close_notify (SSLEOFError)
        return True  # _at_eof closed the transport unless the connection keeps it open

    def connection_lost(self, exc) -> None:
        if self.lost:
            return
        self.lost = True
        self._cancel_timer()
        self.app.connection_lost(exc)

    def pause_writing(self) -> None:
        self.app.pause_writing()

    def resume_writing(self) -> None:
        self.app.resume_writing()

    # -- handshake ---------------------------------------------------------------------------
    def _handshake(self) -> None:
        try:
            self.sslobj.do_handshake()
        except ssl.SSLWantReadError:
            self._flush()
            return
        except (ssl.SSLError, ssl.CertificateError, OSError) as e:
            self._flush()  # the alert, so the peer knows why
            self._fail(getattr(e, "reason", None) or str(e))
            return
        self.handshaken = True
        self._cancel_timer()
        self._flush()
        self._read()

    def _handshake_timed_out(self, timeout: float) -> None:
        self._timer = None
        if not self.handshaken and not self.lost:
            self._fail(f"no handshake within {timeout} s")

    def _fail(self, reason: str) -> None:
        self._cancel_timer()
        if self._on_failure is not None:
            self._on_failure(reason)
        self.closing = True
        self.raw.abort()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- plaintext in --------------------------------------------------------------------------
    def _read(self) -> None:
        if not self.handshaken:
            return
        app = self.app
        sslobj = self.sslobj
        try:
            while not (self.reading_paused or self.lost or self.closing):
                buf = app.get_buffer(-1)
                n = sslobj.read(len(buf), buf)
                if not n:  # the peer's close_notify: ssl answers 0 rather than raising SSLZeroReturnError
                    self._flush()
                    self._at_eof()
                    return
                app.buffer_updated(n)
        except ssl.SSLWantReadError:
            pass
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):  # the end, with or without close_notify
            self._flush()
            self._at_eof()
            return
        except ssl.SSLError as e:
            log.warning("closing TLS connection from %s: %s", self.transport.get_extra_info("peername"),
                        getattr(e, "reason", None) or e)
            self.raw.abort()
            return
        self._flush()  # TLS 1.3 sends tickets and key updates after the handshake

    def _at_eof(self) -> None:
        if self.eof:
            return
        self.eof = True
        if not self.app.eof_received():
            self.transport.close()

    # -- plaintext out -------------------------------------------------------------------------
    def write_all(self, buffers) -> None:
        if self.lost or self.closing:
            return
        sslobj = self.sslobj
        raw = self.raw
        out = self.outgoing
        try:
            for b in buffers:
                mv = memoryview(b).cast("B")
                for i in range(0, len(mv), _WRITE_CHUNK):
                    sslobj.write(mv[i:i + _WRITE_CHUNK])
                    if out.pending >= _WRITE_CHUNK:
                        raw.write(out.read())
        except ssl.SSLError as e:
            log.warning("closing TLS connection from %s: writing failed: %s",
                        self.transport.get_extra_info("peername"), e)
            self.raw.abort()
            return
        self._flush()

    def _flush(self) -> None:
        if self.outgoing.pending and not self.lost:
            self.raw.write(self.outgoing.read())

    def close(self) -> None:
        if self.closing or self.lost:
            return
        self.closing = True
        if self.handshaken:
            try:
                self.sslobj.unwrap()  # our close_notify; the peer's is not waited for
            except (ssl.SSLError, ValueError):
                pass
            self._flush()
        self.raw.close()


class TlsTransport(asyncio.Transport):
    """What the connection inside TLS writes to and controls reading with."""

    def __init__(self, layer: TlsLayer) -> None:
        super().__init__()
        self._layer = layer

    def get_extra_info(self, name, default=None):
        layer = self._layer
        if name == "ssl_object":
            return layer.sslobj
        if name == "peercert":
            return layer.sslobj.getpeercert() if layer.handshaken else default
        if name == "cipher":
            return layer.sslobj.cipher() if layer.handshaken else default
        if name == "sslcontext":
            return layer.sslobj.context
        return layer.raw.get_extra_info(name, default)

    def write(self, data) -> None:
        self._layer.write_all((data,))

    def writelines(self, list_of_data) -> None:
        self._layer.write_all(list_of_data)

    def can_write_eof(self) -> bool:
        return False

    def close(self) -> None:
        self._layer.close()

    def abort(self) -> None:
        self._layer.closing = True
        self._layer.raw.abort()

    def is_closing(self) -> bool:
        return self._layer.closing or self._layer.raw.is_closing()

    def pause_reading(self) -> None:
        self._layer.reading_paused = True
        self._layer.raw.pause_reading()

    def resume_reading(self) -> None:
        layer = self._layer
        if not layer.reading_paused:
            return
        layer.reading_paused = False
        layer.raw.resume_reading()
        # plaintext already decrypted or buffered in the BIO is not delivered again by the socket
        layer.loop.call_soon(layer._read)

    def is_reading(self) -> bool:
        return not self._layer.reading_paused

    def set_protocol(self, protocol) -> None:
        self._layer.app = protocol

    def get_protocol(self):
        return self._layer.app

    def get_write_buffer_size(self) -> int:
        return self._layer.raw.get_write_buffer_size()

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        self._layer.raw.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self):
        return self._layer.raw.get_write_buffer_limits()
