"""What every harness shares: the event loop, a fake transport, the per-input deadline, the
checks that turn a hang, a leak or an unexpected exception into a finding, and the digests of
what a peer was sent (the outcome string each harness returns, compared between twins).

Nothing here imports aiobrpc at module import time: a harness imports aiobrpc inside
`instrumented()`, so that atheris instruments the library when the harness runs as a fuzzer.
Atheris is optional: without it the harnesses still import and run (corpus replay, CI).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import logging
import os
import struct
import sys
import time

# -- limits ------------------------------------------------------------------------------------
INPUT_LOOP_SECONDS = float(os.environ.get("FUZZ_INPUT_SECONDS", "2.0"))  # loop time per input: past it, a hang
# An input not done within this much loop time (wall time: 5/3 of it) is a hang. The corpus
# replay of the test suite raises it: a busy machine stretches inputs that wait on real timers.
HANG_SECONDS = float(os.environ.get("FUZZ_HANG_SECONDS", str(INPUT_LOOP_SECONDS * 3)))
MAX_SETTLE_ITERATIONS = 20000  # loop iterations while settling: past them, a busy loop (a hang)
RSS_LIMIT_MB = int(os.environ.get("FUZZ_RSS_LIMIT_MB", "1536"))
RSS_EVERY = 1000  # inputs between two RSS checks
MAX_INPUT = 1 << 20  # bytes of one input used (libFuzzer's -max_len is usually far below)


class Finding(Exception):
    """A defect: a crash, a hang, a leak, or an exception the library does not document."""


# -- atheris -------------------------------------------------------------------------------------
try:  # optional: CI replays the corpus on every Python without it
    import atheris  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the environment
    atheris = None


def fuzzing() -> bool:
    """Whether this process runs a harness as a fuzzer (`python -m fuzz.<name>`)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", "") or ""
    return atheris is not None and name.startswith("fuzz.") and name not in ("fuzz.replay", "fuzz.make_corpus")


def instrumented():
    """Around a harness's aiobrpc imports: atheris instruments them when fuzzing."""
    if fuzzing() and os.environ.get("FUZZ_NO_INSTRUMENT", "") in ("", "0"):
        return atheris.instrument_imports(include=["aiobrpc", "h2", "hpack", "h11"])
    return contextlib.nullcontext()


def main(one_input, seeds) -> None:
    """A harness's command line: `--seeds DIR` (re)writes its seed corpus (`seeds()`: name ->
    input) into DIR; anything else fuzzes `one_input` (fuzz_main)."""
    if sys.argv[1:2] == ["--seeds"]:
        os.makedirs(sys.argv[2], exist_ok=True)
        for name, blob in seeds().items():
            with open(os.path.join(sys.argv[2], name), "wb") as f:
                f.write(blob)
    else:
        fuzz_main(one_input)


def fuzz_main(one_input) -> None:
    """`python -m fuzz.<name> [libFuzzer args]`: fuzz `one_input`."""
    if atheris is None:
        sys.exit("atheris is not installed here (pip install -e '.[fuzz]', Python >= 3.11)")

    def test_one(data: bytes) -> None:
        one_input(data)

    atheris.Setup(sys.argv, test_one)
    atheris.Fuzz()


# -- the event loop and what it reports -----------------------------------------------------------
_loop: asyncio.AbstractEventLoop | None = None
loop_errors: list = []
bad_logs: list = []


class _Capture(logging.Handler):
    """aiobrpc's log records: a traceback logged (a bug the library caught: "handling its bytes
    raised ...") is a finding; the rest is dropped (hostile input logs warnings by design)."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[0] is not None:
            bad_logs.append(f"{record.name}: {record.getMessage()} "
                            f"[{record.exc_info[0].__name__}: {record.exc_info[1]}]")


def _setup_logging() -> None:
    for name in ("aiobrpc", "asyncio", "h2", "hpack", "h11"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [_Capture()]
        lg.propagate = False
        lg.setLevel(logging.WARNING)


def loop() -> asyncio.AbstractEventLoop:
    """The process's event loop (plain asyncio: its ready queue tells when nothing is left to run)."""
    global _loop
    if _loop is None:
        _setup_logging()
        _loop = asyncio.new_event_loop()
        asyncio.set_event_loop(_loop)
        _loop.set_exception_handler(lambda lp, ctx: loop_errors.append(_context_text(ctx)))
    return _loop


def _context_text(ctx: dict) -> str:
    exc = ctx.get("exception")
    return f"{ctx.get('message')}: {exc!r}" if exc is not None else str(ctx.get("message"))


_inputs = 0


def plain(fn, data: bytes) -> str:
    """A sans-IO harness's `fn(data)` with the same checks as `run` (logged tracebacks, RSS)."""
    global _inputs
    if _loop is None:
        loop()
    bad_logs.clear()
    outcome = fn(data[:MAX_INPUT])
    if bad_logs:
        raise Finding("the library logged a traceback: " + " | ".join(bad_logs[:3]))
    _inputs += 1
    if _inputs % RSS_EVERY == 0:
        check_rss()
    return outcome


def run(coro_fn, data: bytes) -> str:
    """Run `coro_fn(data)` on the loop within the per-input deadline; raise Finding for whatever
    went wrong beside it (loop exception handler, logged tracebacks, RSS)."""
    global _inputs
    lp = loop()
    loop_errors.clear()
    bad_logs.clear()
    t0 = time.monotonic()
    try:
        outcome = lp.run_until_complete(asyncio.wait_for(coro_fn(data[:MAX_INPUT]), HANG_SECONDS))
    except asyncio.TimeoutError:
        raise Finding(f"hang: the input did not settle within {HANG_SECONDS:g} s of loop time") from None
    # callbacks the input left behind (a close's connection_lost, done callbacks) run now
    for _ in range(3):
        lp.run_until_complete(asyncio.sleep(0))
    if loop_errors:
        raise Finding("the loop's exception handler got: " + " | ".join(loop_errors[:3]))
    if bad_logs:
        raise Finding("the library logged a traceback: " + " | ".join(bad_logs[:3]))
    if time.monotonic() - t0 > HANG_SECONDS * 5 / 3:
        raise Finding(f"slow input: {time.monotonic() - t0:.1f} s of wall time")
    _inputs += 1
    if _inputs % RSS_EVERY == 0:
        check_rss()
    return outcome


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def check_rss() -> None:
    gc.collect()
    rss = rss_mb()
    if rss > RSS_LIMIT_MB:
        raise Finding(f"RSS {rss:.0f} MiB after {_inputs} inputs is over FUZZ_RSS_LIMIT_MB={RSS_LIMIT_MB}")


async def settle(cond=lambda: True, seconds: float = INPUT_LOOP_SECONDS) -> bool:
    """Run the loop until nothing is ready to run and `cond()` holds: True; False when that did not
    happen within `seconds` of loop time or MAX_SETTLE_ITERATIONS iterations."""
    lp = asyncio.get_running_loop()
    end = lp.time() + seconds
    for _ in range(MAX_SETTLE_ITERATIONS):
        await asyncio.sleep(0)
        if lp._ready:  # type: ignore[attr-defined] - plain asyncio's ready queue
            continue
        if cond():
            return True
        if lp.time() > end:
            return False
        await asyncio.sleep(0.001)  # something waits on a timer or a thread
    return False


# -- a transport that records -------------------------------------------------------------------
class FakeTransport(asyncio.Transport):
    """Records what the protocol writes and whether it closed or aborted; delivers
    connection_lost on the next iteration, as asyncio's transports do."""

    def __init__(self, protocol, peer=("10.0.0.7", 40000), local=("10.0.0.1", 8000)) -> None:
        super().__init__({"peername": peer, "sockname": local, "socket": None})
        self.protocol = protocol
        self.out: list[bytes] = []
        self.out_bytes = 0
        self.closed = False
        self.aborted = False
        self.lost = False
        self.reading_paused = False
        self.high = 64 * 1024
        self.low = 16 * 1024
        self.eof_written = False

    # writing
    def write(self, data) -> None:
        if self.closed:
            return
        b = bytes(data)
        self.out.append(b)
        self.out_bytes += len(b)

    def writelines(self, list_of_data) -> None:
        for d in list_of_data:
            self.write(d)

    def write_eof(self) -> None:
        self.eof_written = True

    def can_write_eof(self) -> bool:
        return True

    def get_write_buffer_size(self) -> int:
        return 0  # the peer reads everything at once

    def get_write_buffer_limits(self):
        return (self.low, self.high)

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        self.high = high if high is not None else self.high
        self.low = low if low is not None else self.low

    # reading
    def pause_reading(self) -> None:
        self.reading_paused = True

    def resume_reading(self) -> None:
        self.reading_paused = False

    def is_reading(self) -> bool:
        return not self.reading_paused and not self.closed

    # closing
    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        asyncio.get_running_loop().call_soon(self._lose, None)

    def abort(self) -> None:
        if self.closed and self.aborted:
            return
        was_closed, self.closed, self.aborted = self.closed, True, True
        if not was_closed:
            asyncio.get_running_loop().call_soon(self._lose, None)

    def peer_reset(self) -> None:
        """The peer reset the connection."""
        if not self.closed:
            self.closed = True
            self._lose(ConnectionResetError(104, "Connection reset by peer"))

    def _lose(self, exc) -> None:
        if self.lost:
            return
        self.lost = True
        self.protocol.connection_lost(exc)

    def set_protocol(self, protocol) -> None:
        self.protocol = protocol

    def get_protocol(self):
        return self.protocol

    def sent(self) -> bytes:
        return b"".join(self.out)


async def feed(protocol, transport: FakeTransport, data: bytes, chunk: int) -> None:
    """`data` into `protocol` the way a transport reads it: through get_buffer/buffer_updated
    (a BufferedProtocol) or data_received, `chunk` bytes per read (0: as much as fits), a loop
    iteration between reads; stops while reading is paused (it waits for a resume up to the
    settle deadline) and once the transport closed."""
    buffered = hasattr(protocol, "get_buffer")
    pos = 0
    while pos < len(data) and not transport.closed:
        if transport.reading_paused:
            if not await settle(lambda: not transport.reading_paused or transport.closed, 0.2):
                return  # still paused: the peer's bytes wait in the kernel
            continue
        step = chunk if 0 < chunk and pos < DRIBBLE_BYTES else 0 if chunk <= 0 else 65536
        want = len(data) - pos if step <= 0 else min(step, len(data) - pos)
        if buffered:
            buf = protocol.get_buffer(want)
            n = min(len(buf), want)
            if n <= 0:
                raise Finding(f"get_buffer({want}) returned an empty buffer")
            buf[:n] = data[pos:pos + n]
            pos += n
            protocol.buffer_updated(n)
        else:
            n = want
            protocol.data_received(data[pos:pos + n])
            pos += n
        await asyncio.sleep(0)


CHUNKS = (0, 1, 7, 64, 1000, 3, 16, 0)
DRIBBLE_BYTES = 4096  # small reads for the first bytes only, then 64 KiB: a long dribble is slow, not deeper


def control(data: bytes) -> tuple[int, bool, bytes]:
    """The first byte of a raw input: bits 0-2 the chunk size (CHUNKS), bit 3 EOF after the bytes,
    bit 4 the harness's own switch; the rest is the bytes."""
    if not data:
        return 0, False, b""
    c = data[0]
    return CHUNKS[c & 7], bool(c & 8), data[1:]


# -- digests of what a peer was sent --------------------------------------------------------------
def short(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()[:10]


def baidu_frames(out: bytes, stream_ids: dict | None = None) -> list[str]:
    """PRPC / STRM frames in `out`, each as a short deterministic description (decoded with plain
    protobuf, not with the library's codec). Stream ids are renumbered in order of appearance
    (they are process-wide counters)."""
    from aiobrpc._proto import brpc_meta_pb2, brpc_streaming_pb2

    ids = stream_ids if stream_ids is not None else {}

    def sid(v: int) -> int:
        return ids.setdefault(v, len(ids) + 1)

    res = []
    pos = 0
    while pos + 12 <= len(out):
        magic = out[pos:pos + 4]
        body, meta_size = struct.unpack(">II", out[pos + 4:pos + 12])
        if magic not in (b"PRPC", b"STRM") or meta_size > body or pos + 12 + body > len(out):
            res.append(f"junk:{short(out[pos:])}")
            return res
        meta = out[pos + 12:pos + 12 + meta_size]
        payload = out[pos + 12 + meta_size:pos + 12 + body]
        pos += 12 + body
        if magic == b"PRPC":
            m = brpc_meta_pb2.RpcMeta.FromString(meta)
            desc = f"PRPC cid={m.correlation_id} code={m.response.error_code}"
            if m.attachment_size:
                desc += f" att={m.attachment_size}"
            if m.compress_type:
                desc += f" z={m.compress_type}"
            if m.HasField("stream_settings"):
                desc += f" stream={sid(m.stream_settings.stream_id)}"
            desc += f" data={short(payload) if not m.response.error_code else len(payload)}"
        else:
            m = brpc_streaming_pb2.StreamFrameMeta.FromString(meta)
            desc = (f"STRM to={sid(m.stream_id)} type={m.frame_type} cont={int(m.has_continuation)}"
                    f" n={len(payload)}")
            if payload[:4] == b"PRPC":  # a reply inside the offered stream
                desc += " [" + "; ".join(baidu_frames(payload, ids)) + "]"
            if m.HasField("feedback"):
                desc += f" fb={m.feedback.consumed_size}"
        res.append(desc)
    if pos < len(out):
        res.append(f"tail:{len(out) - pos}")
    return res


def http_statuses(out: bytes) -> list[str]:
    import re
    return [m.group(1).decode() for m in re.finditer(rb"HTTP/1\.[01] (\d{3}) ", out)]


def h2_frames(out: bytes) -> list[str]:
    """HTTP/2 frames in `out` (after the server's bytes start): type, stream, and for headers the
    :status / grpc-status decoded with hpack; for RST_STREAM and GOAWAY the error code."""
    import hpack

    dec = hpack.Decoder()
    dec.max_allowed_table_size = 1 << 20
    res = []
    pos = 0
    block = b""
    while pos + 9 <= len(out):
        n = int.from_bytes(out[pos:pos + 3], "big")
        typ, flags = out[pos + 3], out[pos + 4]
        stream = int.from_bytes(out[pos + 5:pos + 9], "big") & 0x7FFFFFFF
        payload = out[pos + 9:pos + 9 + n]
        pos += 9 + n
        if typ in (1, 9):  # HEADERS, CONTINUATION
            if typ == 1:
                p = payload
                if flags & 0x8:  # PADDED
                    p = p[1:len(p) - p[0]] if p else p
                if flags & 0x20:  # PRIORITY
                    p = p[5:]
                block = p
            else:
                block += payload
            if flags & 0x4:  # END_HEADERS
                try:
                    hs = dict((k.decode() if isinstance(k, bytes) else k, v.decode() if isinstance(v, bytes) else v)
                              for k, v in dec.decode(block))
                    what = ",".join(f"{k}={hs[k]}" for k in (":status", "grpc-status") if k in hs)
                except Exception as e:  # noqa: BLE001 - a digest, not a check
                    what = f"hpack:{type(e).__name__}"
                res.append(f"H{stream}[{what}]{'E' if flags & 1 else ''}")
        elif typ == 0:
            res.append(f"D{stream}:{n}{'E' if flags & 1 else ''}")
        elif typ == 3:
            res.append(f"RST{stream}:{int.from_bytes(payload[:4], 'big')}")
        elif typ == 7:
            res.append(f"GOAWAY:{int.from_bytes(payload[4:8], 'big')}")
        elif typ == 4:
            res.append("S" + ("A" if flags & 1 else ""))
        elif typ == 6:
            res.append("PING" + ("A" if flags & 1 else ""))
        elif typ == 8:
            res.append(f"W{stream}")
        else:
            res.append(f"T{typ}")
    # WINDOW_UPDATE / SETTINGS-ack timing may differ with chunking, not between twins: kept.
    return res


def fdp(data: bytes):
    """atheris.FuzzedDataProvider, or a minimal stand-in with the same methods where atheris is
    not installed (the corpus replays the same on every Python)."""
    return _Provider(data)


class _Provider:
    """The subset of atheris.FuzzedDataProvider the harnesses use, defined here so a structured
    input decodes the same with or without atheris (and on every atheris version)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def remaining(self) -> int:
        return len(self.data) - self.pos

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1]

    def int_in(self, lo: int, hi: int) -> int:
        span = hi - lo
        if span <= 0:
            return lo
        nbytes = (span.bit_length() + 7) // 8
        v = 0
        for _ in range(nbytes):
            v = (v << 8) | self.byte()
        return lo + v % (span + 1)

    def bool(self) -> bool:
        return bool(self.byte() & 1)

    def pick(self, seq):
        return seq[self.int_in(0, len(seq) - 1)]

    def bytes(self, n: int) -> bytes:
        b = self.data[self.pos:self.pos + n]
        self.pos += len(b)
        return b

    def blob(self, max_len: int = 255) -> bytes:
        """A length byte (or two, past 255) then that many bytes."""
        n = self.int_in(0, max_len)
        return self.bytes(n)

    def rest(self) -> bytes:
        b = self.data[self.pos:]
        self.pos = len(self.data)
        return b
