"""`file://path`: servers listed in a file, one `addr[ tag]` entry per line, read again whenever
the file changes (brpc's FileNamingService).

Lines use list://'s entry syntax: blank lines and `#` comments are skipped, the tag is what
follows the address up to `#`. `file:///etc/servers` is an absolute path, `file://servers`
one relative to the working directory.

The file's identity and stamp (device, inode, size, mtime, ctime) are polled every
`POLL_S` seconds (0.1, as brpc); a change reads it again. A line that does not parse is skipped
and logged. The last good list is kept, with the fault logged once, while the file is missing,
unreadable, not UTF-8, larger than `MAX_FILE_BYTES`, or has lines and none of them parses.
Before the first good read such a fault raises out of `watch()` instead (a Channel then fails
the calls waiting for a first list with ENODATA naming it, and watches again after its
backoff). An existing file with no entry is an empty list.

>>> FileNamingService("/etc/servers.txt").path
'/etc/servers.txt'
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator

from .base import NamingService, ServerNode, parse_entry, split_entry, unique_servers
from .fault_log import FaultLog

log = logging.getLogger("aiobrpc.client.naming")

# Seconds between two looks at the file, unless a service is given its own `poll_s`.
POLL_S = 0.1
# A longer file is a fault: bounded memory, and a list no one means to have.
MAX_FILE_BYTES = 4 << 20
# At most this many unparsable lines are quoted in the log per read.
BAD_LINES_LOGGED = 5


class FileNamingService(NamingService):
    """Servers from the lines of a file, followed as the file changes."""

    def __init__(self, rest: str, *, poll_s: float | None = None) -> None:
        if not isinstance(rest, str):
            raise TypeError(f"FileNamingService needs a str, got {type(rest).__name__}")
        path = rest[len("file://"):] if rest.startswith("file://") else rest
        if not path:
            raise ValueError("file:// needs a path, like file:///etc/servers.txt")
        if poll_s is not None and not poll_s > 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s!r}")
        self.path = path
        self.poll_s = poll_s
        self.faults = FaultLog(f"naming service file://{path}")
        self._closed = False

    async def watch(self) -> AsyncIterator[list[ServerNode]]:
        last: list[ServerNode] | None = None
        seen: object = None  # the stamp of the version of the file last read
        while not self._closed:
            stamp = _stamp(self.path)
            if stamp != seen:
                seen = stamp
                try:
                    servers = self._read()
                except (OSError, ValueError) as e:
                    if last is None:
                        raise
                    self.faults.fault(str(e), f"keeping the last list ({len(last)} servers)")
                else:
                    self.faults.recovered()
                    if servers != last:
                        last = servers
                        yield list(servers)
            await asyncio.sleep(POLL_S if self.poll_s is None else self.poll_s)

    async def close(self) -> None:
        self._closed = True

    def _read(self) -> list[ServerNode]:
        """The servers the file lists now; OSError or ValueError when it cannot give a list."""
        with open(self.path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise ValueError(f"{self.path} is larger than {MAX_FILE_BYTES} bytes")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.path} is not UTF-8 text: {e}") from None
        nodes: list[ServerNode] = []
        bad: list[str] = []
        for number, line in enumerate(text.splitlines(), 1):
            if split_entry(line) is None:
                continue
            try:
                nodes.append(parse_entry(line))
            except ValueError as e:
                bad.append(f"line {number}: {e}")
        if bad and not nodes:
            raise ValueError(f"no line of {self.path} parses ({len(bad)} bad lines; "
                             f"{'; '.join(bad[:BAD_LINES_LOGGED])})")
        if bad:
            log.warning("naming service file://%s: skipped %d lines that do not parse: %s",
                        self.path, len(bad), "; ".join(bad[:BAD_LINES_LOGGED]))
        servers, dropped = unique_servers(nodes)
        if dropped:
            log.warning("naming service file://%s: %d servers past the cap of %d dropped",
                        self.path, dropped, len(servers))
        return servers

    def __repr__(self) -> str:
        return f"<FileNamingService {self.path}>"


def _stamp(path: str) -> object:
    """What changes when the file does: its identity and times, or the error looking at it."""
    try:
        st = os.stat(path)
    except OSError as e:
        return type(e).__name__, e.errno
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns
