"""Stricter than h11 on a request head: line ends must be CRLF and no header line may be folded.

h11 accepts a bare LF as a line end and joins an obs-fold line (one starting with a space or
a tab) to the header before it, as RFC 7230 lets a recipient do. A proxy in front of the server
may read such a head differently (`Transfer-Encoding:\\r\\n chunked` is the request-smuggling
classic), so, as brpc's http_parser does, the server refuses both with 400.

HeadScanner sees the bytes of each request head before h11 does, incrementally (a head that
arrives a byte at a time is scanned once, not once per byte), and stops at the empty line that
ends the head: bodies are never scanned.
"""

from __future__ import annotations

_LF, _CR, _SP, _HT = 0x0A, 0x0D, 0x20, 0x09


class HeadScanner:
    __slots__ = ("active", "prev", "line_start", "line_len", "lines")

    def __init__(self) -> None:
        self.start(b"")

    def start(self, pending: bytes) -> str | None:
        """Begin a new head whose first bytes are `pending`; the reason to refuse it, or None."""
        self.active = True
        self.prev = -1          # the last byte scanned
        self.line_start = False  # the last byte scanned ended a line
        self.line_len = 0       # bytes of the current line scanned so far
        self.lines = 0          # non-empty lines of this head so far (the request line is the first)
        return self.feed(pending)

    def feed(self, data: bytes) -> str | None:
        """Scan the next bytes of the stream; the reason to refuse the head, or None."""
        if not self.active:
            return None
        n = len(data)
        pos = 0
        while True:
            if self.line_start:
                if pos >= n:
                    return None
                if self.lines and data[pos] in (_SP, _HT):
                    return "a folded header line (obs-fold)"
                self.line_start = False
            j = data.find(b"\n", pos)
            if j < 0:
                if pos < n:
                    self.prev = data[n - 1]
                    self.line_len += n - pos
                return None
            if (data[j - 1] if j > 0 else self.prev) != _CR:
                return "a line ending in a bare LF"
            length = self.line_len + (j - pos)  # the line's bytes, its CR included
            self.line_len = 0
            self.prev = _LF
            pos = j + 1
            if length == 1:  # CR LF alone: the empty line
                if self.lines:
                    self.active = False  # the head is complete; what follows is a body
                    return None
                continue  # an empty line before the request line, which RFC 7230 lets a server skip
            self.lines += 1
            self.line_start = True
