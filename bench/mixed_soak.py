"""Mixed soak: every protocol of the serving port at once against a cluster of server processes
behind a file:// naming service, with faults on both sides at random.

    python bench/mixed_soak.py                               # 200k calls, at most 180 s
    python bench/mixed_soak.py --calls 20000 --seconds 40 --netns --json out.json
    python bench/mixed_soak.py --seconds 600 --calls 100000000 --plot docs/img/mixed_soak_memory.svg

The cluster: --servers processes (bench/mixed_soak_parts/server.py) on fixed ports, listed one a
line in a naming file that the client's channels read as `file://`. Each serves
interop.EchoService and aiobrpc.test.GrpcTestService on its one port.

The checked client (this process) runs --concurrency closed-loop workers; each call picks a kind
at random (weights --weights):
  unary         baidu_std Echo, load balancer rr over the file, max_retry 3, timeout 500 ms
  http          POST /interop.EchoService/Echo with JSON, a keep-alive h11 client
                (mixed_soak_parts/http_client.py) round-robin over the servers listed, 1 s
  grpc_unary    gRPC Unary over the file, max_retry 3, timeout 1 s
  grpc_sstream  gRPC ServerStream of 1-8 messages, timeout 2 s
  grpc_bidi     gRPC Bidi of 1-8 messages, timeout 2 s
  strm          a brpc stream (StartStream): 1-8 messages written, each echoed back, then closed
Every call carries a unique id that the reply (each streamed message) echoes.

Faults, at random times (exponential gaps) during each phase but the first:
  server_killed   SIGKILL of a server other than server 0, restarted on its port --down s later;
                  half the time its line leaves the naming file while it is down
  client_killed   a second client process (mixed_soak_parts/victim.py) making every kind of call,
                  SIGKILLed mid-call and restarted; its calls are counted apart (not checked)
  hostile_*       a third process flooding server 0 with garbage, baidu_std headers announcing
                  2 GiB, HTTP/2 rapid reset, 80 KiB HTTP header lines, slowloris
  slow_reader_*   a gRPC server stream / brpc stream of 1000 x 64 KiB from server 0, read 2
                  messages, then not read for 1.5 s: server 0's RSS may not grow by more than
                  --slow-bound-mib meanwhile (the server bounds its buffering), then cancelled
  net_*           with --netns only: the whole soak runs inside `unshare --net`, and nftables
                  rules on one server's port are toggled: random loss, RST, blackhole

Checked (exit status 1 when one does not hold):
  lost 0          every call ended within its deadline plus --slack s, not counting the
                  time the client's own loop could not run (mixed_soak_parts/loop_watch.py:
                  on a busy machine the process goes unscheduled, the library's timers
                  with it; the longest such stall is printed);
  double 0        a call's Controller did not change after the call ended (checked 1 s later);
  wrong 0         every reply (every streamed message) carried its own call's id;
  gaps 0          a stream's messages came in order, none missing before its end or its error;
  unexpected 0    no exception other than RpcError (HttpError for HTTP) out of a call;
  after each phase (faults stopped, killed servers restarted, victim and hostile killed, the
  client's HTTP connections closed), within --settle s:
    client: pending calls 0, asyncio tasks and non-TCP fds back to the first phase's, every TCP
            socket ESTABLISHED to a server;
    servers: handlers, streams, stream tasks 0; tasks and non-TCP fds back to the process's
            first sample (fewer tasks than there: that sample caught one ending, and the lower
            count is the baseline from then on); one LISTEN socket and every other socket
            ESTABLISHED to the client (nothing left of the killed client, the hostile one, or
            cut connections);
    RSS: after the warm-up (the fault-free phase 0 and --warm-phases fault phases) within
            --rss-tolerance of the process's warmed-up sample (client and every server
            incarnation that lived through a whole fault phase); each process collects
            garbage and calls malloc_trim(0) before it is sampled, so RSS counts memory
            in use, not pages glibc freed and kept (docs/soak.md, run C);
  loop errors 0   nothing reached the loop's exception handler, here or in a server.
Output: a table (QPS, p50/p99 per kind, faults by kind, failures by code, violations), the JSON
with --json FILE, the plot of RSS and fds over time with --plot FILE (SVG).

`run_mixed_soak(MixedConfig(...))` is the same run as a coroutine (tests/reliability/test_mixed_soak.py).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import logging
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiobrpc  # noqa: E402
from aiobrpc import errors  # noqa: E402
from bench.mixed_soak_parts.common import (ECHO, GRPC, HTTP_PATH, STATS, Msg, Req,  # noqa: E402
                                           rss_bytes, sample, tcp_table, trim_heap)
from bench.mixed_soak_parts.http_client import HttpError, HttpPool  # noqa: E402
from bench.mixed_soak_parts.loop_watch import LoopWatch  # noqa: E402
from bench.mixed_soak_parts.plot import memory_svg  # noqa: E402

PARTS = ROOT / "bench" / "mixed_soak_parts"
KINDS = ("unary", "http", "grpc_unary", "grpc_sstream", "grpc_bidi", "strm")
DEFAULT_WEIGHTS = {"unary": 40, "http": 15, "grpc_unary": 20, "grpc_sstream": 10, "grpc_bidi": 5, "strm": 10}
# Seconds a call of each kind may take by its own deadline (the slack comes on top).
LIMIT_S = {"unary": 0.5, "http": 1.0, "grpc_unary": 1.0, "grpc_sstream": 2.0, "grpc_bidi": 2.0}
STRM_IDLE_MS = 1000
MAX_STALL_GRANTED_S = 30.0  # a "lost" check waits at most this long beyond its window for stalls
_CODE_NAMES = {v: k for k, v in vars(errors).items() if k.startswith("E") and isinstance(v, int)}
IN_NETNS_ENV = "MIXED_SOAK_IN_NETNS"


@dataclasses.dataclass
class MixedConfig:
    calls: int = 200_000
    seconds: float = 180.0  # the whole run, first server start to last stop
    concurrency: int = 48
    servers: int = 3
    phase_seconds: float = 10.0
    warmup_seconds: float = 3.0  # phase 0: no faults
    seed: int = 1
    loop: str = "uvloop"
    netns: bool = False
    faults: bool = True
    kill_every_s: float = 2.0  # mean gap between server kills
    down_s: float = 0.3
    victim_every_s: float = 2.0  # mean gap between kills of the victim client
    victim_concurrency: int = 8
    hostile_rate: float = 10.0  # hostile bursts a second
    slow_every_s: float = 3.0  # mean gap between slow readers
    slow_bound_mib: float = 48.0
    net_every_s: float = 1.5  # mean gap between nftables faults (--netns)
    slack_s: float = 2.0
    settle_s: float = 8.0
    # A client that vanished while its RST was dropped (--netns) leaves a half-open connection:
    # the servers close connections idle this long and end echo streams idle this long (<= 0: never).
    server_idle_s: float = 2.0
    stream_idle_s: float = 2.0
    rss_tolerance: float = 0.05
    warm_phases: int = 2  # fault phases of warm-up before the RSS baseline is taken
    weights: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_WEIGHTS))


class LatencyHistogram:
    """Latencies in buckets 2 % wide: bounded memory however long the soak runs (a list of
    every latency would grow the client's RSS, which the soak checks)."""

    STEP = math.log(1.02)

    def __init__(self) -> None:
        self.buckets: collections.Counter = collections.Counter()
        self.n = 0
        self.max = 0.0

    def append(self, seconds: float) -> None:
        self.buckets[int(math.log(max(seconds, 1e-6) * 1e6) / self.STEP)] += 1
        self.n += 1
        self.max = max(self.max, seconds)

    def percentile(self, q: float) -> float:
        """The upper edge of the bucket holding the q-quantile, in seconds."""
        if not self.n:
            return 0.0
        rank, seen = q * self.n, 0
        for b in sorted(self.buckets):
            seen += self.buckets[b]
            if seen > rank:
                return min(self.max, math.exp((b + 1) * self.STEP) / 1e6)
        return self.max


class KindStats:
    __slots__ = ("issued", "ok", "failed", "lost", "wrong", "gaps", "unexpected", "lat", "samples")

    def __init__(self) -> None:
        self.issued = self.ok = self.lost = self.wrong = self.gaps = self.unexpected = 0
        self.failed: collections.Counter = collections.Counter()
        self.lat = LatencyHistogram()
        self.samples: list[str] = []  # the first few violations, described

    def note(self, text: str) -> None:
        if len(self.samples) < 5:
            self.samples.append(text)


def _code(e: BaseException) -> str:
    if isinstance(e, aiobrpc.RpcError):
        return _CODE_NAMES.get(e.code, str(e.code))
    return f"http:{e.reason}" if isinstance(e, HttpError) else repr(e)


def _snapshot(cntl):
    return (cntl.error_code, cntl.error_text, cntl.latency_us, cntl.retried_count, cntl.remote_side)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    def __init__(self, slot: int, port: int, cfg: MixedConfig, logdir: str) -> None:
        self.slot, self.port, self.cfg = slot, port, cfg
        self.proc: asyncio.subprocess.Process | None = None
        self.ready = False
        self.incarnation = 0
        self.log = open(os.path.join(logdir, f"server{slot}.log"), "ab")
        self.first: dict | None = None  # this incarnation's first sample after a phase
        self.warm_rss: int | None = None  # its RSS once it lived through a whole fault phase
        self.alive_since_phase = 0

    async def start(self, phase: int) -> None:
        self.ready = False
        stream_idle_ms = int(self.cfg.stream_idle_s * 1000) if self.cfg.stream_idle_s > 0 else -1
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, str(PARTS / "server.py"), "--port", str(self.port), "--loop", self.cfg.loop,
            "--idle-timeout", str(self.cfg.server_idle_s), "--stream-idle-ms", str(stream_idle_ms),
            stdout=asyncio.subprocess.PIPE, stderr=self.log, stdin=asyncio.subprocess.DEVNULL)
        line = await asyncio.wait_for(self.proc.stdout.readline(), 20)
        if not line.startswith(b"READY"):
            raise RuntimeError(f"server {self.slot} did not start: {line!r}")
        self.ready = True
        self.incarnation += 1
        self.first = None
        self.warm_rss = None
        self.alive_since_phase = phase

    async def kill(self, sig=signal.SIGKILL) -> None:
        self.ready = False
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(sig)
            await self.proc.wait()


class Helper:
    """The victim client or the hostile client: a process killed and restarted at will, whose
    stdout lines are handed to `on_line`."""

    def __init__(self, argv: list[str], on_line, log) -> None:
        self.argv, self.on_line, self.log = argv, on_line, log
        self.proc = None
        self.reader = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, *self.argv, stdout=asyncio.subprocess.PIPE, stderr=self.log,
            stdin=asyncio.subprocess.DEVNULL)
        self.reader = asyncio.get_running_loop().create_task(self._read(self.proc))

    async def _read(self, proc) -> None:
        while line := await proc.stdout.readline():
            self.on_line(line)

    async def kill(self) -> bool:
        if self.proc is None:
            return False
        proc, self.proc = self.proc, None
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        await proc.wait()
        await self.reader  # the last lines
        return True


class MixedSoak:
    def __init__(self, cfg: MixedConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.watch = LoopWatch()
        self.kinds = {k: KindStats() for k in KINDS}
        self.kind_names = [k for k in KINDS if cfg.weights.get(k, 0) > 0]
        self.kind_weights = [cfg.weights[k] for k in self.kind_names]
        self.next_id = 0
        self.faults: collections.Counter = collections.Counter()
        self.violations: list[str] = []
        self.loop_errors: list[str] = []
        self.to_verify: collections.deque = collections.deque()
        self.double = 0
        self.series: list[dict] = []
        self.victim = {"started": 0, "ended": 0, "cut": 0, "last": (0, 0)}
        self.hostile: collections.Counter = collections.Counter()
        self.slow: list[dict] = []
        self.http_rr = 0
        self.slow_i = 0
        self.phase = 0
        self.chaos_stop: asyncio.Event | None = None  # set: the fault loops end
        self.issue_s = 0.0

    # -- the cluster -------------------------------------------------------------------------
    def write_naming(self) -> None:
        tmp = self.naming + ".tmp"
        with open(tmp, "w") as f:
            for s in self.servers:
                if s.slot in self.listed:
                    f.write(f"127.0.0.1:{s.port}\n")
        os.replace(tmp, self.naming)

    async def restore(self) -> None:
        """Every server up and listed, no nft rule, victim and hostile killed."""
        if self.cfg.netns:
            await self.nft("flush ruleset")
        for s in self.servers:
            if not s.ready:
                await s.kill()
                await s.start(self.phase + 1)
        self.listed = {s.slot for s in self.servers}
        self.write_naming()
        await self.kill_victim()
        await self.hostile_proc.kill()

    async def nft(self, rules: str) -> None:
        proc = await asyncio.create_subprocess_exec("nft", "-f", "-", stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate(rules.encode())
        if proc.returncode:
            raise RuntimeError(f"nft failed: {err.decode()}\n{rules}")

    # -- the checked calls -------------------------------------------------------------------
    async def c_unary(self, cid: int):
        cntl = aiobrpc.Controller()
        try:
            r = await self.echo.Echo(Req(message=str(cid)), cntl)
        except aiobrpc.RpcError as e:
            return "failed", _code(e), cntl
        return ("ok", None, cntl) if r.message == str(cid) else ("wrong", f"got {r.message!r}", cntl)

    async def c_http(self, cid: int):
        listed = sorted(self.listed)
        if not listed:
            return "failed", "http:no server listed", None
        self.http_rr += 1
        port = self.servers[listed[self.http_rr % len(listed)]].port
        try:
            status, body = await self.http.post_json(f"127.0.0.1:{port}", HTTP_PATH, {"message": str(cid)},
                                                     LIMIT_S["http"])
        except HttpError as e:
            return "failed", _code(e), None
        if status != 200:
            return "failed", f"http:status {status}", None
        if not isinstance(body, dict) or body.get("message") != str(cid):
            return "wrong", f"got {body!r}"[:200], None
        return "ok", None, None

    async def c_grpc_unary(self, cid: int):
        cntl = aiobrpc.Controller()
        try:
            r = await self.grpc.Unary(Msg(text=str(cid)), cntl)
        except aiobrpc.RpcError as e:
            return "failed", _code(e), cntl
        return ("ok", None, cntl) if r.text == str(cid) else ("wrong", f"got {r.text!r}", cntl)

    async def _read_ordered(self, stream, cid: int, n: int):
        """Read a response stream to its end: (outcome, detail)."""
        got = 0
        try:
            while (m := await stream.read()) is not None:
                if m.text != str(cid):
                    return "wrong", f"message {got}: text {m.text!r}"
                if m.count != got:
                    return "gap", f"message {got}: count {m.count}"
                got += 1
        except aiobrpc.RpcError as e:
            return "failed", _code(e)
        if got != n:
            return "gap", f"ended cleanly after {got} of {n} messages"
        return "ok", None

    async def c_grpc_sstream(self, cid: int):
        cntl = aiobrpc.Controller()
        cntl.timeout_ms = int(LIMIT_S["grpc_sstream"] * 1000)
        n = self.rng.randint(1, 8)
        async with self.grpc.ServerStream(Msg(text=str(cid), count=n), cntl) as stream:
            outcome, detail = await self._read_ordered(stream, cid, n)
        return outcome, detail, cntl

    async def c_grpc_bidi(self, cid: int):
        cntl = aiobrpc.Controller()
        cntl.timeout_ms = int(LIMIT_S["grpc_bidi"] * 1000)
        n = self.rng.randint(1, 8)

        async def requests():
            for i in range(n):
                yield Msg(text=str(cid), count=i)
        async with self.grpc.Bidi(requests(), cntl) as stream:
            outcome, detail = await self._read_ordered(stream, cid, n)
        return outcome, detail, cntl

    async def c_strm(self, cid: int):
        cntl = aiobrpc.Controller()
        n = self.rng.randint(1, 8)
        stream = aiobrpc.Stream.create(cntl, idle_timeout_ms=STRM_IDLE_MS)
        try:
            try:
                await self.echo_strm.StartStream(Req(message="echo"), cntl)
                for i in range(n):
                    await stream.write(b"%d:%d" % (cid, i))
                for i in range(n):
                    m = await stream.read()
                    if m is None:
                        return "gap", f"ended cleanly after {i} of {n} messages", cntl
                    if bytes(m) != b"%d:%d" % (cid, i):
                        kind = "wrong" if not bytes(m).startswith(b"%d:" % cid) else "gap"
                        return kind, f"message {i}: {bytes(m)[:40]!r}", cntl
            except aiobrpc.RpcError as e:
                return "failed", _code(e), cntl
            return "ok", None, cntl
        finally:
            await stream.close()

    def limit(self, kind: str) -> float:
        if kind == "strm":  # the StartStream call, then each message within the idle timeout
            return 1.0 + 16 * STRM_IDLE_MS / 1000
        return LIMIT_S[kind]

    async def checked(self, kind: str, cid: int) -> None:
        rec = self.kinds[kind]
        rec.issued += 1
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        task = loop.create_task(getattr(self, "c_" + kind)(cid))
        window = self.limit(kind) + self.cfg.slack_s
        stalled0 = self.watch.stalled()
        done, _ = await asyncio.wait((task,), timeout=window)
        granted = 0.0
        while not done and granted < MAX_STALL_GRANTED_S:
            # The time this process was not run (the machine's load) is not the call's: its
            # own timers were as late as this check's.
            owed = self.watch.stalled() - stalled0 - granted
            if owed <= 0.01:
                break
            granted += owed
            done, _ = await asyncio.wait((task,), timeout=owed)
        if not done:
            rec.lost += 1
            rec.note(f"lost: call {cid} not ended {window} s after it began, not counting "
                     f"{granted:.2f} s in which this process's loop could not run")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return
        exc = task.exception()
        if exc is not None:
            rec.unexpected += 1
            rec.note(f"unexpected: call {cid}: {exc!r}")
            return
        outcome, detail, cntl = task.result()
        if outcome == "ok":
            rec.ok += 1
            rec.lat.append(time.perf_counter() - t0)
        elif outcome == "failed":
            rec.failed[detail] += 1
        elif outcome == "wrong":
            rec.wrong += 1
            rec.note(f"wrong: call {cid}: {detail}")
        else:
            rec.gaps += 1
            rec.note(f"gap: call {cid}: {detail}")
        if cntl is not None:
            self.to_verify.append((loop.time() + 1.0, kind, cid, cntl, _snapshot(cntl)))
            self.verify(loop.time())

    def verify(self, until: float) -> None:
        while self.to_verify and self.to_verify[0][0] <= until:
            _, kind, cid, cntl, snap = self.to_verify.popleft()
            if _snapshot(cntl) != snap:
                self.double += 1
                self.kinds[kind].note(f"double: call {cid}: {snap} became {_snapshot(cntl)}")

    async def worker(self, stop_at: float) -> None:
        loop = asyncio.get_running_loop()
        while self.next_id < self.cfg.calls and loop.time() < stop_at:
            cid = self.next_id
            self.next_id += 1
            kind = self.rng.choices(self.kind_names, self.kind_weights)[0]
            await self.checked(kind, cid)

    # -- faults ------------------------------------------------------------------------------
    async def chaos_pause(self, seconds: float) -> bool:
        """Sleep `seconds` unless the phase ends first: whether the faults go on."""
        try:
            await asyncio.wait_for(self.chaos_stop.wait(), seconds)
        except asyncio.TimeoutError:
            return True
        return False

    async def server_killer(self) -> None:
        victims = self.servers[1:]
        if not victims:
            return
        while await self.chaos_pause(self.rng.expovariate(1 / self.cfg.kill_every_s)):
            s = self.rng.choice(victims)
            if not s.ready:
                continue
            unlist = self.rng.random() < 0.5
            await s.kill()
            self.faults["server_killed"] += 1
            if unlist:
                self.listed.discard(s.slot)
                self.write_naming()
            await asyncio.sleep(self.cfg.down_s)
            await s.start(self.phase + 1)
            if unlist:
                self.listed.add(s.slot)
                self.write_naming()

    def victim_line(self, line: bytes) -> None:
        try:
            started, ended = map(int, line.split())
        except ValueError:
            return
        self.victim["last"] = (started, ended)

    async def kill_victim(self) -> None:
        if await self.victim_proc.kill():
            started, ended = self.victim["last"]
            self.victim["started"] += started
            self.victim["ended"] += ended
            self.victim["cut"] += started - ended
            self.victim["last"] = (0, 0)

    async def victim_killer(self) -> None:
        while not self.chaos_stop.is_set():
            await self.victim_proc.start()
            await self.chaos_pause(self.rng.expovariate(1 / self.cfg.victim_every_s))
            await self.kill_victim()
            self.faults["client_killed"] += 1

    def hostile_line(self, line: bytes) -> None:
        try:
            rec = json.loads(line)
        except ValueError:
            return
        self.hostile[rec["k"]] += 1
        self.hostile[f"{rec['k']} closed by the server"] += bool(rec["c"])

    async def slow_readers(self) -> None:
        while await self.chaos_pause(self.rng.expovariate(1 / self.cfg.slow_every_s)):
            kind = ("grpc", "strm")[self.slow_i % 2]
            self.slow_i += 1
            self.faults[f"slow_reader_{kind}"] += 1
            await getattr(self, f"slow_{kind}")(10**9 + self.slow_i)

    async def _stall(self, kind: str, before: int, client_before: int) -> None:
        await asyncio.sleep(1.5)
        s0 = self.servers[0]
        growth = rss_bytes(s0.proc.pid) - before
        client_growth = rss_bytes() - client_before
        self.slow.append({"kind": kind, "server_growth_mib": round(growth / 2**20, 1),
                          "client_growth_mib": round(client_growth / 2**20, 1)})
        bound = self.cfg.slow_bound_mib * 2**20
        if growth > bound:
            self.violations.append(f"phase {self.phase}: slow {kind} reader: server 0 RSS grew "
                                   f"{growth / 2**20:.1f} MiB > {self.cfg.slow_bound_mib} MiB")
        if client_growth > bound:
            self.violations.append(f"phase {self.phase}: slow {kind} reader: client RSS grew "
                                   f"{client_growth / 2**20:.1f} MiB > {self.cfg.slow_bound_mib} MiB")

    async def slow_grpc(self, cid: int, n: int = 1000, size: int = 65536) -> None:
        s0 = self.servers[0]
        before, client_before = rss_bytes(s0.proc.pid), rss_bytes()
        cntl = aiobrpc.Controller()
        cntl.timeout_ms = 10_000
        text = f"slow:{cid}:{size}"
        try:
            async with self.slow_grpc_stub.ServerStream(Msg(text=text, count=n), cntl) as stream:
                for i in range(22):
                    m = await stream.read()
                    if m is None or m.text != text or m.count != i or len(m.data) != size:
                        self.violations.append(f"phase {self.phase}: slow grpc reader: message {i} is "
                                               f"{None if m is None else (m.text, m.count, len(m.data))}")
                        return
                    if i == 1:
                        await self._stall("grpc", before, client_before)
                    elif i > 1:
                        await asyncio.sleep(0.01)
        except aiobrpc.RpcError as e:
            self.faults[f"slow_reader_grpc ended {_code(e)}"] += 1

    async def slow_strm(self, cid: int, n: int = 1000, size: int = 65536) -> None:
        s0 = self.servers[0]
        before, client_before = rss_bytes(s0.proc.pid), rss_bytes()
        cntl = aiobrpc.Controller()
        stream = aiobrpc.Stream.create(cntl)
        try:
            await self.slow_strm_stub.StartStream(Req(message=f"push:{cid}:{n}:{size}"), cntl)
            for i in range(22):
                m = await stream.read()
                if m is None or not bytes(m[:24]).startswith(b"%d:%d:" % (cid, i)) or len(m) != size:
                    self.violations.append(f"phase {self.phase}: slow strm reader: message {i} is "
                                           f"{None if m is None else bytes(m[:24])}")
                    return
                if i == 1:
                    await self._stall("strm", before, client_before)
                elif i > 1:
                    await asyncio.sleep(0.01)
        except aiobrpc.RpcError as e:
            self.faults[f"slow_reader_strm ended {_code(e)}"] += 1
        finally:
            await stream.close()

    async def net_faults(self) -> None:
        while await self.chaos_pause(self.rng.expovariate(1 / self.cfg.net_every_s)):
            port = self.rng.choice(self.servers).port
            kind = self.rng.choice(("loss", "reset", "blackhole"))
            if kind == "loss":
                pct = self.rng.choice((5, 10, 20))
                body = (f"tcp dport {port} numgen random mod 100 < {pct} drop\n"
                        f"  tcp sport {port} numgen random mod 100 < {pct} drop")
                hold = self.rng.uniform(0.5, 2.0)
            elif kind == "reset":
                body = f"tcp dport {port} reject with tcp reset"
                hold = self.rng.uniform(0.05, 0.3)
            else:
                body = f"tcp dport {port} drop\n  tcp sport {port} drop"
                hold = self.rng.uniform(0.2, 1.0)
            await self.nft("table inet soak {\n chain out {\n  type filter hook output priority 0; "
                           f"policy accept;\n  {body}\n }}\n}}\n")
            self.faults[f"net_{kind}"] += 1
            try:
                await asyncio.sleep(hold)
            finally:
                await self.nft("flush ruleset")

    # -- measuring ---------------------------------------------------------------------------
    async def server_stats(self, s: ServerProc) -> dict | None:
        """The server's own figures, over HTTP on a connection of its own: not through an
        aiobrpc channel, whose circuit breaker may keep the server isolated for up to 30 s
        after the faults (brpc's doubling isolation), which is not the server's state."""
        pool = HttpPool()
        try:
            status, body = await pool.post_json(f"127.0.0.1:{s.port}", HTTP_PATH, {"message": STATS}, 2.0)
            if status != 200 or not isinstance(body, dict):
                return {"error": f"status {status}: {body!r}"[:200]}
            return json.loads(body["message"])
        except HttpError as e:
            return {"error": e.reason}
        finally:
            pool.close()

    async def measure(self) -> dict:
        stats = [await self.server_stats(s) for s in self.servers]
        await asyncio.sleep(0.1)  # the control connections close on both sides
        table = tcp_table()
        trim_heap()  # RSS of memory in use: the servers trim theirs when asked for their figures
        client = sample("self", table)
        # A server the circuit breaker isolated is health-checked by a task until it is revived
        # (up to 30 s after the faults): those tasks are the channels', not leaks.
        client["tasks"] = sum(1 for t in asyncio.all_tasks()
                              if not t.get_coro().__qualname__.endswith("_health_check"))
        client["pending"] = sum(ch.pending_calls() for ch in self.channels)
        servers = []
        for s, st in zip(self.servers, stats):
            smp = sample(s.proc.pid, table)
            smp["stats"] = st
            servers.append(smp)
        return {"client": client, "servers": servers}

    def problems(self, m: dict, phase: int) -> list[str]:
        out = []
        c, base = m["client"], self.client_base
        ports = {s.port for s in self.servers}
        if c["pending"]:
            out.append(f"client: {c['pending']} calls pending")
        if c["tasks"] != base["tasks"]:
            out.append(f"client: {c['tasks']} tasks, {base['tasks']} at first")
        if c["other"] != base["other"]:
            out.append(f"client: non-TCP fds {c['other']}, at first {base['other']}")
        for local, remote, state in c["tcp"]:
            if state != "ESTABLISHED" or remote not in ports:
                out.append(f"client: TCP socket {local}->{remote} {state}")
        client_ports = {local for local, _, _ in c["tcp"]}
        for s, smp in zip(self.servers, m["servers"]):
            st = smp["stats"]
            if "error" in st:
                out.append(f"server {s.slot}: stats call failed: {st['error']}")
                continue
            for key in ("handlers", "streams", "stream_tasks", "loop_error_count"):
                if st[key]:
                    out.append(f"server {s.slot}: {key} = {st[key]}"
                               + (f" {st['loop_errors']}" if key == "loop_error_count" else ""))
            if st["concurrency"] > 1:  # the stats call itself
                out.append(f"server {s.slot}: concurrency {st['concurrency']}")
            first = s.first
            if first is not None:
                if st["tasks"] < first["stats"]["tasks"]:
                    # A restarted server's first sample may catch a task ending (a cut connection's
                    # handler finishing): fewer is no leak, and the lower count is the baseline.
                    first["stats"]["tasks"] = st["tasks"]
                elif st["tasks"] > first["stats"]["tasks"]:
                    out.append(f"server {s.slot}: {st['tasks']} tasks, {first['stats']['tasks']} at first")
                if smp["other"] != first["other"]:
                    out.append(f"server {s.slot}: non-TCP fds {smp['other']}, at first {first['other']}")
            listening = 0
            for local, remote, state in smp["tcp"]:
                if state == "LISTEN" and local == s.port:
                    listening += 1
                elif state != "ESTABLISHED" or remote not in client_ports:
                    out.append(f"server {s.slot}: TCP socket {local}->{remote} {state} "
                               f"(not a connection of the checked client)")
            if listening != 1:
                out.append(f"server {s.slot}: {listening} listening sockets")
        return out

    async def settle_and_check(self, phase: int, t0: float) -> None:
        self.http.close()
        loop = asyncio.get_running_loop()
        end = loop.time() + self.cfg.settle_s
        stalled0 = self.watch.stalled()
        while True:
            m = await self.measure()
            if phase == 0 and self.client_base is None:
                self.client_base = m["client"]
            bad = self.problems(m, phase)
            if not bad or loop.time() > end + min(MAX_STALL_GRANTED_S, self.watch.stalled() - stalled0):
                break
            await asyncio.sleep(0.25)
        for s, smp in zip(self.servers, m["servers"]):  # a settled server's first figures
            if s.first is None and "error" not in smp["stats"] and not any(
                    b.startswith(f"server {s.slot}:") for b in bad):
                s.first = smp
        self.violations.extend(f"phase {phase}: {b}" for b in bad)
        # RSS: warmed up after phase 0 and the first fault phase
        procs = {"client": {"rss": m["client"]["rss"], "fds": m["client"]["fds"]}}
        if phase == self.cfg.warm_phases:
            self.client_warm_rss = m["client"]["rss"]
        elif phase > self.cfg.warm_phases and m["client"]["rss"] > self.client_warm_rss * (1 + self.cfg.rss_tolerance):
            self.violations.append(f"phase {phase}: client RSS {m['client']['rss'] / 2**20:.1f} MiB > "
                                   f"{1 + self.cfg.rss_tolerance} x {self.client_warm_rss / 2**20:.1f} MiB")
        for s, smp in zip(self.servers, m["servers"]):
            procs[f"server {s.slot}"] = {"rss": smp["rss"], "fds": smp["fds"],
                                         "new": s.incarnation > 1 and s.alive_since_phase == phase + 1
                                         and s.warm_rss is None}
            # lived through a whole fault phase: started before this phase began
            if phase >= self.cfg.warm_phases and s.alive_since_phase < phase:
                if s.warm_rss is None:
                    s.warm_rss = smp["rss"]
                elif smp["rss"] > s.warm_rss * (1 + self.cfg.rss_tolerance):
                    self.violations.append(
                        f"phase {phase}: server {s.slot} RSS {smp['rss'] / 2**20:.1f} MiB > "
                        f"{1 + self.cfg.rss_tolerance} x {s.warm_rss / 2**20:.1f} MiB (incarnation {s.incarnation})")
        self.series.append({"t": round(loop.time() - t0, 2), "phase": phase, "calls": self.next_id,
                            "procs": procs})

    # -- the run -----------------------------------------------------------------------------
    def report_overrun(self, after_s: float) -> None:
        """The run should have ended by now: print where each task waits, for whoever kills it."""
        print(f"mixed soak: still running {after_s:.0f} s after its start (phase {self.phase}); "
              f"its tasks wait at:", file=sys.stderr, flush=True)
        for task in asyncio.all_tasks():
            task.print_stack(limit=6, file=sys.stderr)
        sys.stderr.flush()

    async def run(self) -> dict:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda lp, ctx: self.loop_errors.append(
            repr(ctx.get("exception", ctx.get("message")))))
        t0 = loop.time()
        end = t0 + cfg.seconds
        overrun = loop.call_later(cfg.seconds + 30, self.report_overrun, cfg.seconds + 30)
        self.watch.start()
        self.tmp = tempfile.mkdtemp(prefix="mixed_soak_")
        self.naming = os.path.join(self.tmp, "servers")
        logs = open(os.path.join(self.tmp, "helpers.log"), "ab")
        self.servers = [ServerProc(i, free_port(), cfg, self.tmp) for i in range(cfg.servers)]
        self.listed = set(range(cfg.servers))
        self.client_base = None
        self.client_warm_rss = None
        for s in self.servers:
            await s.start(0)
        self.write_naming()
        url = "file://" + self.naming
        ch = aiobrpc.Channel(url, aiobrpc.ChannelOptions(timeout_ms=int(LIMIT_S["unary"] * 1000), max_retry=3,
                                                         health_check_interval_s=0.2), load_balancer="rr")
        ch_strm = aiobrpc.Channel(url, aiobrpc.ChannelOptions(timeout_ms=1000, max_retry=0,
                                                              health_check_interval_s=0.2), load_balancer="rr")
        gch = aiobrpc.Channel(url, aiobrpc.ChannelOptions(protocol="grpc", timeout_ms=int(LIMIT_S["grpc_unary"] * 1000),
                                                          max_retry=3, health_check_interval_s=0.2),
                              load_balancer="rr")
        s0 = f"127.0.0.1:{self.servers[0].port}"
        slow_g = aiobrpc.Channel(s0, aiobrpc.ChannelOptions(protocol="grpc", timeout_ms=10_000))
        slow_s = aiobrpc.Channel(s0, aiobrpc.ChannelOptions(timeout_ms=2000))
        self.channels = [ch, ch_strm, gch, slow_g, slow_s]
        self.echo, self.echo_strm = aiobrpc.Stub(ch, ECHO), aiobrpc.Stub(ch_strm, ECHO)
        self.grpc = aiobrpc.Stub(gch, GRPC)
        self.slow_grpc_stub, self.slow_strm_stub = aiobrpc.Stub(slow_g, GRPC), aiobrpc.Stub(slow_s, ECHO)
        self.http = HttpPool()
        self.victim_proc = Helper([str(PARTS / "victim.py"), "--naming", self.naming, "--loop", cfg.loop,
                                   "--concurrency", str(cfg.victim_concurrency), "--seed", str(cfg.seed)],
                                  self.victim_line, logs)
        self.hostile_proc = Helper([str(PARTS / "hostile.py"), "--port", str(self.servers[0].port),
                                    "--rate", str(cfg.hostile_rate), "--seed", str(cfg.seed), "--loop", cfg.loop],
                                   self.hostile_line, logs)
        reserve = LIMIT_S["grpc_bidi"] + cfg.slack_s + cfg.settle_s + 3.0  # ending a phase, checking
        phase_walls = []
        try:
            while self.next_id < cfg.calls:
                left = end - loop.time() - reserve
                length = min(cfg.warmup_seconds if self.phase == 0 else cfg.phase_seconds, left)
                if length <= 0.5:
                    break
                chaos = []
                if self.phase > 0 and cfg.faults:
                    chaos = [self.server_killer(), self.victim_killer(), self.slow_readers()]
                    if cfg.hostile_rate > 0:
                        await self.hostile_proc.start()
                    if cfg.netns:
                        chaos.append(self.net_faults())
                self.chaos_stop = asyncio.Event()
                chaos = [loop.create_task(c) for c in chaos]
                p0 = time.perf_counter()
                stop_at = loop.time() + length
                workers = [loop.create_task(self.worker(stop_at)) for _ in range(cfg.concurrency)]
                await asyncio.wait(workers, timeout=max(0.0, stop_at - loop.time()))
                # The fault loops end themselves, never cancelled in the middle of a fault: a
                # process spawn cancelled half-way leaks its pipes (Python 3.10), and 3.10's
                # wait_for can swallow a cancel; cancelled only if one is stuck.
                self.chaos_stop.set()
                await asyncio.gather(*workers)
                phase_walls.append(time.perf_counter() - p0)
                _, stuck = await asyncio.wait(chaos, timeout=LIMIT_S["grpc_bidi"] + 10) if chaos else ((), ())
                for t in stuck:
                    t.cancel()
                await asyncio.gather(*chaos, return_exceptions=True)
                await self.restore()
                self.verify(loop.time() - 0.0)
                await self.settle_and_check(self.phase, t0)
                self.phase += 1
        finally:
            await asyncio.sleep(max(0.0, min(1.0, self.to_verify[-1][0] - loop.time())) if self.to_verify else 0)
            self.verify(float("inf"))
            await self.kill_victim()
            await self.hostile_proc.kill()
            self.http.close()
            for c in self.channels:
                await c.close()
            for s in self.servers:
                await s.kill(signal.SIGTERM)
                s.log.close()
            logs.close()
            await asyncio.sleep(0)
            loop.set_exception_handler(None)
            overrun.cancel()
            self.watch.stop()
        issued = self.next_id
        self.issue_s = sum(phase_walls)
        kinds = {}
        for k, rec in self.kinds.items():
            lat = rec.lat
            kinds[k] = {"issued": rec.issued, "ok": rec.ok, "failed": dict(rec.failed.most_common()),
                        "lost": rec.lost, "wrong": rec.wrong, "gaps": rec.gaps, "unexpected": rec.unexpected,
                        "p50_ms": round(lat.percentile(0.5) * 1000, 2),
                        "p99_ms": round(lat.percentile(0.99) * 1000, 2),
                        "max_ms": round(lat.max * 1000, 1), "samples": rec.samples}
        for k, rec in kinds.items():
            for what in ("lost", "wrong", "gaps", "unexpected"):
                if rec[what]:
                    self.violations.append(f"{k}: {what} = {rec[what]} {rec['samples']}")
            if rec["ok"] + sum(rec["failed"].values()) + rec["lost"] + rec["wrong"] + rec["gaps"] \
                    + rec["unexpected"] != rec["issued"]:
                self.violations.append(f"{k}: outcomes do not add up to {rec['issued']}")
        if self.double:
            self.violations.append(f"double = {self.double}")
        if self.loop_errors:
            self.violations.append(f"client loop errors: {len(self.loop_errors)} {self.loop_errors[:5]}")
        wall = loop.time() - t0
        if wall > cfg.seconds + 5:
            self.violations.append(f"wall {wall:.1f} s > --seconds {cfg.seconds}")
        faults = dict(self.faults)
        for k, v in self.hostile.items():
            if "closed" not in k:
                faults[f"hostile_{k}"] = v
        result = {
            "calls": cfg.calls, "issued": issued, "phases": self.phase,
            "ok": sum(r["ok"] for r in kinds.values()),
            "failed": sum(sum(r["failed"].values()) for r in kinds.values()),
            "lost": sum(r["lost"] for r in kinds.values()), "double": self.double,
            "wrong": sum(r["wrong"] for r in kinds.values()), "gaps": sum(r["gaps"] for r in kinds.values()),
            "unexpected": sum(r["unexpected"] for r in kinds.values()),
            "kinds": kinds, "faults": faults, "hostile": dict(self.hostile),
            "victim_calls": {k: v for k, v in self.victim.items() if k != "last"},
            "slow_readers": self.slow,
            "slow_max_server_growth_mib": max((s["server_growth_mib"] for s in self.slow), default=0),
            "qps": round(issued / self.issue_s, 1) if self.issue_s else 0.0,
            "issue_s": round(self.issue_s, 1), "wall_s": round(wall, 1),
            "series": self.series, "loop_errors": self.loop_errors[:10],
            "client_loop_stalled_s": round(self.watch.stalled(), 3),
            "client_loop_worst_stall": {"late_s": round(self.watch.worst[0], 3),
                                        "loop_cpu_s": round(self.watch.worst[1], 3)},
            "config": dataclasses.asdict(cfg), "violations": self.violations, "tmp": self.tmp,
        }
        if not self.violations:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return result


async def run_mixed_soak(cfg: MixedConfig) -> dict:
    return await MixedSoak(cfg).run()


def table(r: dict) -> str:
    lines = [f"mixed soak: {r['issued']} checked calls in {r['phases']} phases, {r['issue_s']} s of load "
             f"({r['wall_s']} s wall), {r['qps']} calls/s; loop {r['config']['loop']}, "
             f"{r['config']['servers']} servers, concurrency {r['config']['concurrency']}"
             + (", in a network namespace" if r["config"]["netns"] else ""),
             "",
             f"{'kind':<13} {'issued':>9} {'ok':>9} {'failed':>7} {'lost':>5} {'wrong':>5} {'gaps':>5} "
             f"{'unexp':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}"]
    for k, x in r["kinds"].items():
        lines.append(f"{k:<13} {x['issued']:>9} {x['ok']:>9} {sum(x['failed'].values()):>7} {x['lost']:>5} "
                     f"{x['wrong']:>5} {x['gaps']:>5} {x['unexpected']:>5} {x['p50_ms']:>8} {x['p99_ms']:>8} "
                     f"{x['max_ms']:>8}")
    lines.append(f"{'all':<13} {r['issued']:>9} {r['ok']:>9} {r['failed']:>7} {r['lost']:>5} {r['wrong']:>5} "
                 f"{r['gaps']:>5} {r['unexpected']:>5}")
    lines.append(f"completed twice: {r['double']}")
    if "client_loop_stalled_s" in r:
        w = r["client_loop_worst_stall"]
        lines.append(f"client loop late: {r['client_loop_stalled_s']} s in all; the longest {w['late_s']} s, "
                     f"of which its thread ran {w['loop_cpu_s']} s (the rest: the process not scheduled)")
    lines.append("")
    lines.append("failures by code (allowed: faults cause them):")
    for k, x in r["kinds"].items():
        if x["failed"]:
            lines.append(f"  {k}: " + ", ".join(f"{c} {n}" for c, n in x["failed"].items()))
    lines.append("faults injected: " + ", ".join(f"{k} {v}" for k, v in sorted(r["faults"].items())))
    v = r["victim_calls"]
    lines.append(f"victim client: {v['started']} calls started, {v['ended']} ended, {v['cut']} cut by its kills")
    if r["slow_readers"]:
        lines.append(f"slow readers: server 0 RSS grew at most {r['slow_max_server_growth_mib']} MiB while a "
                     f"1000 x 64 KiB stream was not read (bound {r['config']['slow_bound_mib']} MiB)")
    if r["series"]:
        first, last = r["series"][0], r["series"][-1]
        lines.append("RSS MiB / fds, first phase -> last: " + "; ".join(
            f"{n} {first['procs'][n]['rss'] / 2**20:.1f}/{first['procs'][n]['fds']} -> "
            f"{last['procs'][n]['rss'] / 2**20:.1f}/{last['procs'][n]['fds']}"
            for n in last["procs"] if n in first["procs"]))
    lines.append("")
    lines.append("OK: every invariant held" if not r["violations"] else
                 f"FAILED ({len(r['violations'])} violations; logs in {r['tmp']}):\n  "
                 + "\n  ".join(r["violations"][:40]))
    return "\n".join(lines)


def _in_netns(argv: list[str]) -> int:
    """Run this script again inside `unshare --net` (loopback up), where nft rules are ours."""
    env = dict(os.environ, **{IN_NETNS_ENV: "1"})
    cmd = ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
           sys.executable, str(Path(__file__).resolve()), *argv]
    return subprocess.call(cmd, env=env)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = MixedConfig()
    ap.add_argument("--calls", type=int, default=d.calls, help="checked calls in all")
    ap.add_argument("--seconds", type=float, default=d.seconds, help="limit of the whole run")
    ap.add_argument("--concurrency", type=int, default=d.concurrency)
    ap.add_argument("--servers", type=int, default=d.servers)
    ap.add_argument("--phase-seconds", type=float, default=d.phase_seconds)
    ap.add_argument("--warmup-seconds", type=float, default=d.warmup_seconds)
    ap.add_argument("--netns", action="store_true", help="run inside unshare --net, with nftables faults")
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--kill-every", type=float, default=d.kill_every_s)
    ap.add_argument("--down", type=float, default=d.down_s)
    ap.add_argument("--victim-every", type=float, default=d.victim_every_s)
    ap.add_argument("--hostile-rate", type=float, default=d.hostile_rate)
    ap.add_argument("--slow-every", type=float, default=d.slow_every_s)
    ap.add_argument("--net-every", type=float, default=d.net_every_s)
    ap.add_argument("--slack", type=float, default=d.slack_s)
    ap.add_argument("--settle", type=float, default=d.settle_s)
    ap.add_argument("--warm-phases", type=int, default=d.warm_phases)
    ap.add_argument("--rss-tolerance", type=float, default=d.rss_tolerance)
    ap.add_argument("--server-idle", type=float, default=d.server_idle_s,
                    help="the servers' idle_timeout_sec (<= 0: never)")
    ap.add_argument("--stream-idle", type=float, default=d.stream_idle_s,
                    help="the servers' echo streams' idle timeout in s (<= 0: never)")
    ap.add_argument("--weights", default=",".join(f"{k}={v}" for k, v in d.weights.items()))
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    ap.add_argument("--json", metavar="FILE", help="write the result as JSON ('-': stdout)")
    ap.add_argument("--plot", metavar="FILE", help="write RSS and fds over time as SVG")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    if a.netns and os.environ.get(IN_NETNS_ENV) != "1":
        return _in_netns(argv)
    logging.basicConfig(level=logging.WARNING if a.verbose else logging.CRITICAL)
    weights = {k: int(v) for k, v in (kv.split("=") for kv in a.weights.split(","))}
    cfg = MixedConfig(calls=a.calls, seconds=a.seconds, concurrency=a.concurrency, servers=a.servers,
                      phase_seconds=a.phase_seconds, warmup_seconds=a.warmup_seconds, seed=a.seed,
                      loop=a.loop, netns=a.netns, faults=not a.no_faults, kill_every_s=a.kill_every,
                      down_s=a.down, victim_every_s=a.victim_every, hostile_rate=a.hostile_rate,
                      slow_every_s=a.slow_every, net_every_s=a.net_every, slack_s=a.slack,
                      settle_s=a.settle, warm_phases=a.warm_phases, rss_tolerance=a.rss_tolerance,
                      server_idle_s=a.server_idle, stream_idle_s=a.stream_idle,
                      weights=weights)
    if a.loop == "uvloop":
        import uvloop
        r = uvloop.run(run_mixed_soak(cfg))
    else:
        r = asyncio.run(run_mixed_soak(cfg))
    if a.json:
        text = json.dumps(r)
        if a.json == "-":
            print(text)
        else:
            Path(a.json).write_text(text)
    if a.plot:
        Path(a.plot).write_text(memory_svg(r["series"], f"mixed soak: {r['issued']} calls, {r['wall_s']} s, "
                                                        f"{r['config']['servers']} servers"))
    print(table(r))
    return 1 if r["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
