"""The hostile rows of bench/hostile_server.py (issue 29's R1-R14, and the floods F1-F5 that
are handled already, as regression checks).

Each row is a coroutine `row(ctx) -> Outcome` run against a fresh server process whose options
are the row's `server` config; `ctx` opens the hostile connections (closed by the runner after
the row, whatever happens), asks the server process for its counts, and keeps notes. A row
says whether its own expectation held (`expect_ok`) and when the server refused it; the runner
adds what holds for every row (RSS, a normal call afterwards, every call ended, no CLOSE_WAIT).
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from hyperframe.frame import ContinuationFrame, GoAwayFrame, HeadersFrame, PingFrame, SettingsFrame, WindowUpdateFrame

from .peers import (ERROR_NAMES, SERVER_STREAM, SETTINGS_INITIAL_WINDOW_SIZE, UNARY, Http1, Msg, RawH2, baidu_call,
                    grpc_headers, grpc_message, now)

MIB = 1 << 20
NA = "-"  # a row that expects no refusal
HTTP_UNARY = "/aiobrpc.test.GrpcTestService/Unary"
JSON = [("Content-Type", "application/json")]


@dataclass
class Outcome:
    refusal_s: float | None | str  # seconds from the first hostile byte to the refusal; None: never; NA
    expect_ok: bool
    note: str


@dataclass
class Row:
    name: str
    title: str
    fn: Callable[["Ctx"], Awaitable[Outcome]]
    server: dict = field(default_factory=dict)  # ServerOptions of the row's server (serve.py's config)
    rss_limit_mib: float = 64.0
    rss_measure: str = "held"  # "held": RSS after the row; "peak": the most RSS during the row


class Ctx:
    """What a row works with; `runner` is bench/hostile_server.py's RowRunner."""

    def __init__(self, runner, quick: bool, deadline: float) -> None:
        self.runner = runner
        self.host, self.port = "127.0.0.1", runner.port
        self.quick = quick
        self.deadline = deadline
        self.cred: bytes | None = runner.credential
        self.peers: list = []
        self.notes: list[str] = []

    def left(self) -> float:
        return self.deadline - now()

    def note(self, text: str) -> None:
        self.notes.append(text)

    async def h2(self, **kw) -> RawH2:
        peer = await RawH2.connect(self.host, self.port, **kw)
        self.peers.append(peer)
        return peer

    async def http(self) -> Http1:
        peer = await Http1.connect(self.host, self.port)
        self.peers.append(peer)
        return peer

    async def raw(self):
        reader, writer = await asyncio.open_connection(self.host, self.port)
        self.peers.append(writer)
        return reader, writer

    async def stats(self) -> dict:
        return await self.runner.command("stats")

    async def lag_ms(self) -> float:
        """The longest loop stall of the server since the last ask."""
        return (await self.runner.command("lag")).get("max_lag_ms", -1.0)

    async def started(self) -> int:
        return (await self.stats()).get("handlers_started", -1)

    async def wait_stats(self, predicate, timeout: float) -> dict:
        end = now() + timeout
        while True:
            s = await self.stats()
            if predicate(s) or now() >= end:
                return s
            await asyncio.sleep(0.05)

    def close_all(self) -> None:
        for p in self.peers:
            try:
                p.close()
            except Exception:  # noqa: BLE001
                pass
        self.peers.clear()


def ms(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds * 1000:.0f} ms"


def slowest(times: list) -> float | None:
    """The latest of several refusals; None if one of them never came."""
    return None if not times or any(t is None for t in times) else max(times)


def refused_http(status: int | None) -> bool:
    return status is None or 400 <= status < 500


def ended(peer: RawH2, sids) -> Callable[[], bool]:
    def check() -> bool:
        return all(peer.streams[s].ended or peer.streams[s].rst is not None for s in sids) \
            or peer.closed_at is not None or (peer.goaway is not None and any(
                s > peer.goaway[2] for s in sids))
    return check


def stream_result(peer: RawH2, sid: int) -> str:
    s = peer.streams.get(sid)
    if s is None:
        return "?"
    if s.rst is not None:
        later = "".join(f", then RST {ERROR_NAMES.get(c, c)}" for c in s.rsts[1:3])
        return f"RST {ERROR_NAMES.get(s.rst, s.rst)}{later}"
    if s.grpc_status is not None:
        return f"grpc-status {s.grpc_status}" + (f" ({s.grpc_message[:50]})" if s.grpc_status else "")
    status = next((h.get(b":status") for h in s.headers if b":status" in h), None)
    if status is not None and status != b"200":
        return f":status {status.decode()}"
    if s.reset_sent is not None:
        return "reset by the client, nothing after"
    if peer.goaway is None and peer.closed_at is None:
        return "no end (open)"
    return peer.describe()


def stream_refused_at(peer: RawH2, sid: int) -> float | None:
    """When the server refused the stream (RST, non-zero grpc-status, non-200, GOAWAY or close)."""
    s = peer.streams.get(sid)
    if s is not None:
        if s.rst is not None:
            return s.rst_at
        status = next((h.get(b":status") for h in s.headers if b":status" in h), b"200")
        if (s.grpc_status not in (None, 0) or status != b"200") and s.first_headers_at is not None:
            return s.first_headers_at
        if s.grpc_status == 0:
            return None
    return peer.refused_at


# -- R1 --------------------------------------------------------------------------------------------
async def r1_http_without_credential(ctx: Ctx) -> Outcome:
    before = await ctx.started()
    post = await (await ctx.http()).request("POST", HTTP_UNARY, JSON, b'{"text": "r1"}')
    get = await (await ctx.http()).request("GET", "/vars")
    ran = await ctx.started() - before
    # gRPC without credential (handled today: ERPCAUTH): a regression check on the same server
    peer = await ctx.h2()
    sid = peer.start_call(Msg(text="r1").SerializeToString())
    await peer.wait(ended(peer, [sid]), 3)
    grpc_ran = await ctx.started() - before - ran
    times = [post.elapsed if refused_http(post.status) else None, get.elapsed if refused_http(get.status) else None]
    ok = post.status == 401 and get.status == 401 and ran == 0
    grpc_refused = stream_refused_at(peer, sid)
    return Outcome(slowest(times), ok and grpc_ran == 0 and grpc_refused is not None,
                   f"POST {HTTP_UNARY} -> {post.status or post.why}, GET /vars -> {get.status or get.why}, "
                   f"handlers run {ran}; gRPC without credential -> {stream_result(peer, sid)}, "
                   f"handlers run {grpc_ran}")


# -- R2 --------------------------------------------------------------------------------------------
async def r2_mtls_skipped_by_plaintext(ctx: Ctx) -> Outcome:
    before = await ctx.started()
    parts, times = [], []
    # baidu_std
    reader, writer = await ctx.raw()
    t0 = now()
    code, payload, why = await baidu_call(reader, writer, Msg(text="r2").SerializeToString(), timeout=3)
    refused = code is None or code != 0
    times.append(now() - t0 if refused else None)
    parts.append(f"baidu_std -> {'closed: ' + why if code is None else f'error_code {code}'}")
    # HTTP/1.1
    for method, target, body in (("POST", HTTP_UNARY, b'{"text": "r2"}'), ("GET", "/vars", b"")):
        r = await (await ctx.http()).request(method, target, JSON if body else (), body, timeout=3)
        times.append(r.elapsed if refused_http(r.status) else None)
        parts.append(f"HTTP {method} {target} -> {r.status or r.why}")
    # gRPC (h2c)
    peer = await ctx.h2()
    sid = peer.start_call(Msg(text="r2").SerializeToString())
    await peer.wait(ended(peer, [sid]), 3)
    at = stream_refused_at(peer, sid)
    times.append(None if at is None else at - peer.first_byte_at)
    parts.append(f"gRPC -> {stream_result(peer, sid)}")
    ran = await ctx.started() - before
    refusal = slowest(times)
    return Outcome(refusal, refusal is not None and ran == 0, "; ".join(parts) + f"; handlers run {ran}")


# -- R3 --------------------------------------------------------------------------------------------
async def r3_glob_patterns(ctx: Ctx) -> Outcome:
    n = 20 if ctx.quick else 100
    statuses: Counter = Counter()
    times: list = []
    slowest_req = 0.0
    await ctx.lag_ms()
    done = 0
    for page in ("vars", "flags"):
        conn = await ctx.http()
        for i in range(n):
            if ctx.left() < 4:
                ctx.note(f"stopped at {done} requests: the row's time ran out")
                break
            pattern = "a*" * 3998 + f"{i:04d}"  # 8000 characters, each one new (no cache helps)
            r = await conn.request("GET", f"/{page}/{pattern}", timeout=min(5.0, ctx.left() - 2))
            done += 1
            statuses[f"{page}:{r.status or r.why}"] += 1
            slowest_req = max(slowest_req, r.elapsed)
            times.append(r.elapsed if refused_http(r.status) and r.status is not None else None)
            if r.status is None or r.headers.get("connection", "").lower() == "close":
                conn = await ctx.http()
    lag = await ctx.lag_ms()
    stalled = lag > 250
    all_400 = set(k.split(":", 1)[1] for k in statuses) == {"400"} and done == 2 * n
    return Outcome(slowest(times), all_400 and not stalled,
                   f"{done} requests: {dict(statuses)}; slowest reply {ms(slowest_req)}; "
                   f"server loop's longest stall {lag:.0f} ms ({'stalled' if stalled else 'ok'}: limit 250 ms)")


# -- R4 --------------------------------------------------------------------------------------------
async def r4_control_bytes_in_headers(ctx: Ctx) -> Outcome:
    before = await ctx.started()
    parts, times = [], []
    for label, value in (("CRLF", b"a\r\nb"), ("NUL", b"a\x00b"), ("CR", b"a\rb"), ("LF", b"a\nb")):
        peer = await ctx.h2()
        sid = peer.start_call(Msg(text="r4").SerializeToString(), extra=[(b"x-evil", value)])
        await peer.wait(ended(peer, [sid]), 3)
        at = stream_refused_at(peer, sid)
        times.append(None if at is None else at - peer.first_byte_at)
        parts.append(f"gRPC {label} -> {stream_result(peer, sid)}")
    grpc_ran = await ctx.started() - before
    for label, value in (("NUL", b"a\x00b"), ("CR", b"a\rb")):
        conn = await ctx.http()
        raw = Http1.build("POST", HTTP_UNARY, JSON + [(b"X-Evil", value)], b'{"text": "r4"}')
        r = await conn.request("POST", HTTP_UNARY, raw=raw, timeout=3)
        times.append(r.elapsed if refused_http(r.status) else None)
        parts.append(f"HTTP {label} -> {r.status or r.why}")
    http_ran = await ctx.started() - before - grpc_ran
    refusal = slowest(times)
    return Outcome(refusal, refusal is not None and grpc_ran == 0 and http_ran == 0,
                   "; ".join(parts) + f"; handlers run: gRPC {grpc_ran}, HTTP {http_ran}")


# -- R5 --------------------------------------------------------------------------------------------
async def r5_zero_window_then_gone(ctx: Ctx) -> Outcome:
    rounds = 1 if ctx.quick else 3
    calls = 50
    started = await ctx.started()
    parts = []
    for r in range(rounds):
        peer = await ctx.h2(settings={SETTINGS_INITIAL_WINDOW_SIZE: 0}, auto_window=False)
        for _ in range(calls):
            peer.start_call(Msg(text="big", count=MIB).SerializeToString(), auth=ctx.cred)
        s = await ctx.wait_stats(lambda s: s["handlers_started"] >= started + calls, 5)
        started = s["handlers_started"]
        await asyncio.sleep(0.3)  # the replies are made and wait for a window that never opens
        s = await ctx.stats()
        parts.append(f"round {r + 1}: {s['concurrency']} calls in flight, RSS {s['rss_kib'] / 1024:.0f} MiB "
                     f"before the close")
        peer.close()
    t0 = now()
    s = await ctx.wait_stats(lambda s: s["concurrency"] == 0 and s["handlers_running"] == 0, 5)
    ok = s["concurrency"] == 0 and s["handlers_running"] == 0
    parts.append(f"after the last close: calls in flight {s['concurrency']}, handlers running "
                 f"{s['handlers_running']} ({'all ended in ' + ms(now() - t0) if ok else 'not all ended after 5 s'})")
    return Outcome(NA, ok, "; ".join(parts))


# -- R6 --------------------------------------------------------------------------------------------
async def r6_slow_auth_first_call_cancelled(ctx: Ctx) -> Outcome:
    parts, ok = [], True
    for how in ("grpc-timeout 100m", "RST_STREAM"):
        peer = await ctx.h2()
        first = peer.start_call(Msg(text="first").SerializeToString(), auth=b"secret",
                                timeout=b"100m" if how.startswith("grpc") else None)
        if how == "RST_STREAM":
            await asyncio.sleep(0.1)
            peer.reset(first)
        await peer.wait(ended(peer, [first]), 2)
        await asyncio.sleep(0.1)
        second = peer.start_call(Msg(text="second").SerializeToString(), auth=b"secret")
        await peer.wait(ended(peer, [second]), 4)
        good = peer.streams[second].grpc_status == 0
        ok = ok and good
        parts.append(f"first call cancelled by {how} -> {stream_result(peer, first)}; "
                     f"then a good call on that connection -> {stream_result(peer, second)}")
    return Outcome(NA, ok, "; ".join(parts))


# -- R7 --------------------------------------------------------------------------------------------
async def r7_client_goaway_with_calls_in_flight(ctx: Ctx) -> Outcome:
    peer = await ctx.h2()
    sids = [peer.start_call(Msg(text="r7", sleep_ms=500).SerializeToString(), auth=ctx.cred) for _ in range(20)]
    await ctx.wait_stats(lambda s: s["handlers_running"] >= 20, 3)
    peer.send(GoAwayFrame(0, last_stream_id=0, error_code=0))
    await peer.wait(ended(peer, sids), 5)
    results = Counter(stream_result(peer, s) for s in sids)
    ok = results.get("grpc-status 0", 0) == len(sids)
    return Outcome(NA, ok, f"after GOAWAY(NO_ERROR) from the client, {len(sids)} calls: {dict(results)}; "
                           f"connection {peer.describe()}")


# -- R8 --------------------------------------------------------------------------------------------
async def r8_far_deadlines(ctx: Ctx) -> Outcome:
    total = ctx.runner.r8_calls or (3000 if ctx.quick else 20000)
    peer = await ctx.h2()
    body = Msg(text="r8").SerializeToString()
    statuses: Counter = Counter()
    t0 = now()
    done = 0
    rss_mid = None
    while done < total and ctx.left() > 6 and peer.closed_at is None:
        batch = min(100, total - done)
        sids = [peer.start_call(body, auth=ctx.cred, timeout=b"1000S") for _ in range(batch)]
        if not await peer.wait(ended(peer, sids), min(10.0, ctx.left() - 5)):
            statuses["no end"] += sum(1 for s in sids if not peer.streams[s].ended)
        for s in sids:
            statuses[stream_result(peer, s)] += 1
            del peer.streams[s]
            peer.stream_windows.pop(s, None)
        done += batch
        if rss_mid is None and done >= total // 2:
            rss_mid = (await ctx.stats())["rss_kib"]
    took = now() - t0
    s = await ctx.stats()  # with the connection still open: the deadlines of ended calls must be gone
    ok = statuses.get("grpc-status 0", 0) == total and s["deadlines"] in (0, -1)
    return Outcome(NA, ok, f"{done} of {total} calls in {took:.1f} s ({done / max(took, 1e-9):.0f}/s): "
                           f"{dict(statuses)}; grpc-timeout entries held with the connection open: "
                           f"{s['deadlines'] if s['deadlines'] >= 0 else 'unreadable'}; server RSS at half "
                           f"{(rss_mid or 0) / 1024:.0f} MiB, at the end {s['rss_kib'] / 1024:.0f} MiB")


# -- R9 --------------------------------------------------------------------------------------------
async def r9_unfinished_bodies(ctx: Ctx) -> Outcome:
    streams = 60  # as many in --quick: fewer would fit under the limit whatever the server does
    declared = 2 * MIB - 1024  # within max_body_size=2 MiB
    body = grpc_message(b"", declared) + b"d" * (declared - 1024)  # all but the last 1 KiB
    peer = await ctx.h2()
    await peer.wait(lambda: peer.server_settings_at is not None, 2)
    sids = []
    for _ in range(streams):
        sid = peer.new_stream()
        peer.send_headers(sid, grpc_headers(auth=ctx.cred))
        sids.append(sid)
    until = now() + min(10.0, ctx.left() - 6)
    sent = 0
    for sid in sids:  # one stream after another, each as far as the windows let it go
        sent += await peer.send_data_flow(sid, body, False, until, max_frame=65536)
        if now() >= until or peer.closed_at is not None or peer.goaway is not None:
            break
    await peer.drain(2)
    await asyncio.sleep(0.5)
    s = await ctx.stats()
    resets = Counter(ERROR_NAMES.get(peer.streams[x].rst, peer.streams[x].rst) for x in sids
                     if peer.streams[x].rst is not None)
    return Outcome(NA, True, f"{streams} streams each declaring {declared} bytes: sent {sent / MIB:.1f} MiB of "
                             f"{streams * len(body) / MIB:.1f} MiB before the windows closed or time ran out; "
                             f"server RSS with them open {s['rss_kib'] / 1024:.0f} MiB; connection "
                             f"{peer.describe()}; resets {dict(resets) or 'none'}")


# -- R10 -------------------------------------------------------------------------------------------
async def r10_unread_server_stream(ctx: Ctx) -> Outcome:
    peer = await ctx.h2(settings={SETTINGS_INITIAL_WINDOW_SIZE: 2**31 - 1}, window_increment=2**31 - 1 - 65535)
    sid = peer.start_call(Msg(count=-1).SerializeToString(), path=SERVER_STREAM, auth=ctx.cred)
    await peer.wait(lambda: peer.streams[sid].data_len > 0, 3)
    peer.reading.clear()  # and from now on the socket is not read
    got = peer.streams[sid].data_len
    await asyncio.sleep(2 if ctx.quick else 4)
    s = await ctx.stats()
    return Outcome(NA, True, f"read {got / MIB:.1f} MiB, then stopped reading; after "
                             f"{2 if ctx.quick else 4} s: server RSS {s['rss_kib'] / 1024:.0f} MiB, "
                             f"handlers running {s['handlers_running']}")


# -- R11 -------------------------------------------------------------------------------------------
async def r11_continuation_megabytes(ctx: Ctx) -> Outcome:
    conns = 3
    frames = 20 if ctx.quick else 63
    chunk = b"\x40\x01a\x01b" * (MIB // 5)  # literal headers a: b, each indexed; 1 MiB - 1 bytes
    peers = [await ctx.h2() for _ in range(conns)]
    for p in peers:
        await p.wait(lambda p=p: p.server_settings_at is not None, 2)
    written = [0] * conns

    async def flood(i: int, p: RawH2) -> None:
        block = p.header_block([(b":method", b"POST"), (b":path", UNARY)])
        p.send(HeadersFrame(1, data=block))  # no END_HEADERS: CONTINUATION frames follow
        t0 = now()
        p.first_byte_at = t0
        for _ in range(frames):
            if p.refused_at is not None or not p.send(ContinuationFrame(1, data=chunk)):
                return
            if not await p.drain(min(5.0, max(0.1, ctx.left() - 6))):
                return
            written[i] += 1

    await asyncio.gather(*(flood(i, p) for i, p in enumerate(peers)))
    for p in peers:  # then silence
        await p.wait(lambda p=p: p.refused_at is not None, min(3.0, max(0.1, ctx.left() - 5)))
    s = await ctx.stats()
    times = [None if p.refused_at is None else p.refused_at - p.first_byte_at for p in peers]
    refusal = slowest(times)
    return Outcome(refusal, refusal is not None,
                   f"{conns} connections, CONTINUATION frames of 1 MiB written before the refusal: {written} "
                   f"of {frames}; {[p.describe() for p in peers]}; server RSS then {s['rss_kib'] / 1024:.0f} MiB")


# -- R12 -------------------------------------------------------------------------------------------
async def r12_huge_frame_header(ctx: Ctx) -> Outcome:
    parts, times = [], []
    length = (1 << 24) - 1  # 16 MiB (the most 24 bits hold)
    header = struct.pack(">I", length)[1:] + bytes([0x1, 0x4]) + struct.pack(">I", 1)  # HEADERS, END_HEADERS, stream 1
    for how in ("trickled", "nothing"):
        peer = await ctx.h2()
        await peer.wait(lambda: peer.server_settings_at is not None, 2)
        peer.send(header)
        t0 = now()
        if how == "trickled":
            while now() - t0 < 3 and peer.refused_at is None:
                peer.send(b"\x00")
                await asyncio.sleep(0.1)
        await peer.wait(lambda: peer.refused_at is not None, max(0.0, 3 - (now() - t0)))
        t = None if peer.refused_at is None else peer.refused_at - t0
        times.append(t)
        parts.append(f"body {how}: {peer.describe()} after {ms(t)}")
    refusal = slowest(times)
    return Outcome(refusal, refusal is not None and refusal <= 1.0, "; ".join(parts) + " (limit 1 s)")


# -- R13 -------------------------------------------------------------------------------------------
async def r13_preface_then_silence(ctx: Ctx) -> Outcome:
    peer = await ctx.h2(quiet=True)  # the preface and an empty SETTINGS, then nothing (not even an ACK)
    await peer.wait(lambda: peer.refused_at is not None, 5)
    t = None if peer.refused_at is None else peer.refused_at - peer.first_byte_at
    return Outcome(t, t is not None and t <= 2.5,
                   f"first_frame_timeout_sec=1: {peer.describe()} after {ms(t)} (limit 2.5 s, waited 5 s)")


# -- R14 -------------------------------------------------------------------------------------------
async def r14_more_streams_than_allowed(ctx: Ctx) -> Outcome:
    n, limit = 120, 100
    peer = await ctx.h2()
    await peer.wait(lambda: peer.server_settings_at is not None, 2)
    body = grpc_message(Msg(text="r14", sleep_ms=300).SerializeToString())
    frames = []
    sids = []
    for _ in range(n):
        sid = peer.new_stream()
        sids.append(sid)
        frames.append(HeadersFrame(sid, data=peer.header_block(grpc_headers(auth=ctx.cred)), flags=["END_HEADERS"]))
    peer.send(*frames)  # all the HEADERS at once, then the bodies
    for sid in sids:
        peer.send_data(sid, body, end_stream=True)
    await peer.wait(ended(peer, sids), 6)
    first, extra = Counter(stream_result(peer, s) for s in sids[:limit]), \
        Counter(stream_result(peer, s) for s in sids[limit:])
    ok_first = first.get("grpc-status 0", 0) == limit
    refused_extra = sum(v for k, v in extra.items() if k.startswith(("RST REFUSED_STREAM", "RST PROTOCOL_ERROR")))
    at = [peer.streams[s].rst_at for s in sids[limit:]]
    refusal = None if any(t is None for t in at) else max(at) - peer.first_byte_at
    return Outcome(refusal, ok_first and refused_extra == n - limit,
                   f"the first {limit}: {dict(first)}; the {n - limit} past the limit: {dict(extra)}; "
                   f"connection {peer.describe()}")


# -- F1-F5 -----------------------------------------------------------------------------------------
async def _goaway_row(ctx: Ctx, peer: RawH2, send, want: set, what: str, wait: float = 3.0,
                      close_ok: bool = False) -> Outcome:
    """A GOAWAY with a code in `want` (any but NO_ERROR when empty) after `send(peer)`; with
    `close_ok`, a close without one also counts (a server that closes while the flood is still
    arriving resets the connection, and the client's kernel drops the GOAWAY it had received)."""
    before = await ctx.started()
    t0 = now()
    send(peer)
    await peer.wait(lambda: peer.refused_at is not None, wait)
    t = None if peer.refused_at is None else peer.refused_at - t0
    code = peer.goaway[1] if peer.goaway else None
    ran = await ctx.started() - before
    ok = t is not None and ((code in want if want else code not in (None, 0)) or (close_ok and code is None))
    return Outcome(t, ok, f"{what}: {peer.describe()} after {ms(t)}; handlers started {ran}")


async def f1_rapid_reset(ctx: Ctx) -> Outcome:
    peer = await ctx.h2()
    await peer.wait(lambda: peer.server_settings_at is not None, 2)
    body = Msg(sleep_ms=1000).SerializeToString()

    def flood(p: RawH2) -> None:
        for _ in range(1000):
            sid = p.start_call(body, auth=ctx.cred)
            p.reset(sid)
    out = await _goaway_row(ctx, peer, flood, {11}, "1000 x (HEADERS+DATA, RST_STREAM)", close_ok=True)
    s = await ctx.wait_stats(lambda s: s["concurrency"] == 0, 3)
    out.note += f"; calls in flight 1 s on: {s['concurrency']}"
    return out


async def f2_hpack_bomb(ctx: Ctx) -> Outcome:
    peer = await ctx.h2()

    def bomb(p: RawH2) -> None:
        big = b"v" * 3000  # indexed once, then referenced: 1 byte each on the wire, 3 KB each decoded
        block = p.header_block(grpc_headers(auth=ctx.cred) + [(b"x-bomb", big)] * 200)
        p.send(HeadersFrame(1, data=block, flags=["END_HEADERS", "END_STREAM"]))
    return await _goaway_row(ctx, peer, bomb, set(), "a 3.5 KB header block decoding to 600 KB")


async def f3_settings_and_ping_floods(ctx: Ctx) -> Outcome:
    n = 2000 if ctx.quick else 10000
    outs = []
    for name, frame in (("SETTINGS", SettingsFrame(0)), ("PING", PingFrame(0, opaque_data=b"12345678"))):
        peer = await ctx.h2()
        one = frame.serialize()
        outs.append(await _goaway_row(ctx, peer, lambda p: p.send(one * n), {11}, f"{n} {name} frames",
                                      close_ok=True))
    return Outcome(slowest([o.refusal_s for o in outs]), all(o.expect_ok for o in outs),
                   "; ".join(o.note for o in outs))


async def f4_window_past_2_31(ctx: Ctx) -> Outcome:
    peer = await ctx.h2()
    await peer.wait(lambda: peer.server_settings_at is not None, 2)
    update = WindowUpdateFrame(0, window_increment=2**31 - 1)
    return await _goaway_row(ctx, peer, lambda p: p.send(update), {3}, "WINDOW_UPDATE(0, 2^31-1)")


async def f5_message_over_max_body_size(ctx: Ctx) -> Outcome:
    peer = await ctx.h2()
    await peer.wait(lambda: peer.server_settings_at is not None, 2)
    before = await ctx.started()
    sid = peer.new_stream()
    peer.send_headers(sid, grpc_headers(auth=ctx.cred))
    t0 = now()
    await peer.send_data_flow(sid, grpc_message(Msg(data=b"x" * 100_000).SerializeToString()), True, now() + 5)
    await peer.wait(ended(peer, [sid]), 3)
    first = peer.streams[sid]
    refusal = stream_refused_at(peer, sid)
    ran = await ctx.started() - before
    second = peer.start_call(Msg(text="after").SerializeToString(), auth=ctx.cred)
    await peer.wait(ended(peer, [second]), 3)
    ok = first.grpc_status == 8 and peer.streams[second].grpc_status == 0 and ran == 0
    return Outcome(None if refusal is None else refusal - t0, ok,
                   f"a 100 KB message, max_body_size=64 KiB -> {stream_result(peer, sid)}, handlers run {ran}; "
                   f"the next call on the connection -> {stream_result(peer, second)}")


ROWS = [
    Row("R1", "HTTP without credential (auth on)", r1_http_without_credential, {"auth": "secret"}),
    Row("R2", "plaintext on a mutual-TLS server", r2_mtls_skipped_by_plaintext, {"tls": True}),
    Row("R3", "/vars, /flags with 8000-char globs", r3_glob_patterns, {}, 16.0),
    Row("R4", "CR/LF/NUL in header values", r4_control_bytes_in_headers, {}),
    Row("R5", "zero window, 50 x 1 MiB replies, close", r5_zero_window_then_gone, {}, 16.0),
    Row("R6", "slow auth, first call cancelled", r6_slow_auth_first_call_cancelled, {"auth": "slow"}),
    Row("R7", "client GOAWAY(NO_ERROR) mid-calls", r7_client_goaway_with_calls_in_flight, {}),
    Row("R8", "many calls with grpc-timeout 1000S", r8_far_deadlines, {}, 32.0, "peak"),
    Row("R9", "60 x 2 MiB bodies short 1 KiB", r9_unfinished_bodies, {"max_body_size": 2 * MIB}, 48.0, "peak"),
    Row("R10", "huge windows, stream never read", r10_unread_server_stream, {"max_unwritten_bytes": MIB},
        16.0, "peak"),
    Row("R11", "63 x 1 MiB CONTINUATION, 3 conns", r11_continuation_megabytes, {}, 32.0, "peak"),
    Row("R12", "frame header of 16 MiB, then trickle", r12_huge_frame_header, {}),
    Row("R13", "preface + SETTINGS, then silence", r13_preface_then_silence, {"first_frame_timeout_sec": 1.0}),
    Row("R14", "120 streams vs MAX_CONCURRENT 100", r14_more_streams_than_allowed, {}),
    Row("F1", "rapid reset x1000", f1_rapid_reset, {}),
    Row("F2", "HPACK bomb", f2_hpack_bomb, {}),
    Row("F3", "SETTINGS and PING floods", f3_settings_and_ping_floods, {}),
    Row("F4", "WINDOW_UPDATE past 2^31-1", f4_window_past_2_31, {}),
    Row("F5", "gRPC message over max_body_size", f5_message_over_max_body_size, {"max_body_size": 64 * 1024}),
]


def describe_rows() -> str:
    return "\n".join(f"  {r.name:<4} {r.title}" + (f"  [server: {json.dumps(r.server)}]" if r.server else "")
                     for r in ROWS)
