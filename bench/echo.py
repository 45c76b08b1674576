"""End-to-end echo benchmark: aiobrpc against its pure twin, grpc.aio and a raw asyncio ceiling.

Run by hand from the repository root (needs numpy and grpcio-tools; --plots needs matplotlib):

    python bench/echo.py --quick                  # under a minute, rough figures
    python bench/echo.py                          # ~7 min: 3 rounds of a,b,c,d, median of each
    python bench/echo.py --only a,b,c,d,e --plots docs/img   # docs/benchmarks.md: tables, PNGs
    python bench/echo.py --only a,d --loop asyncio
    python bench/echo.py --replot bench/results/echo-latest.json --plots docs/img

Every implementation runs as two processes on 127.0.0.1: a server spawned by this script (it
prints its port) and one client process with one connection, closed loop: `concurrency`
tasks each send a call, wait for the reply, and send the next. Scenarios (payload bytes at a
concurrency): 16 B at 1, 16 and 128; 4 KiB at 16; 1 MiB at 4; 16 MiB at 1. Each runs 4 s
after a 1 s warm-up (--quick: 1 s after 0.3 s).

Implementations:
  a  aiobrpc, compiled twins (Cython), payload as attachment: a numpy array in, a numpy
     array (np.frombuffer of the response attachment) out
  b  aiobrpc, pure-Python twins (AIOBRPC_NO_EXTENSIONS=1 in both processes)
  c  grpc.aio unary echo (bench/grpc_echo.proto, compiled into a temp dir at start), payload
     in a bytes field (arr.tobytes() in, np.frombuffer(resp.payload) out)
  d  raw ceiling (bench/raw_ceiling.py): BufferedProtocol, 12-byte header, future per call,
     one writelines per loop turn, large bodies into their own buffer; echoes inline
  e  raw ceiling whose server runs an async handler in a Task per request (as aiobrpc does);
     not in the default set, ask for it with --only
  f  protocol floor (bench/protocol_floor.py): the raw ceiling's transport carrying real
     baidu_std frames, RpcMeta by aiobrpc's compiled kernel, EchoRequest/EchoResponse through
     protobuf, the attachment split off, an async handler stepped inline; no framework. What
     any Python baidu_std could reach; not in the default set, ask for it with --only
  g  as (a), the server without per-method status (ServerOptions(method_status=False)): what
     the figures of /status, /vars and /brpc_metrics cost per call; ask for it with --only
  h  as (a), the channel without per-method status (ChannelOptions(method_status=False)): what
     the figures of Channel.status() cost per call; ask for it with --only (the ratios show
     (a)/(h) of QPS and of client CPU per call)
  i  as (a), the server with every limit set high enough never to refuse (max_concurrency,
     a per-method constant limiter, max_connections, idle_timeout_sec, max_user_fields): what
     checking them costs per call; ask for it with --only (the ratios show (a)/(i) of QPS and of
     server CPU per call)

Measured per scenario, in the measurement window only: QPS, payload MB/s (10^6 bytes, one
direction), latency p50/p99/p99.9 of each call as its client task sees it, CPU seconds per
call of the client (getrusage of its own process) and of the server (utime+stime of
/proc/<server pid>/stat, which the client reads at the window's edges; 10 ms ticks), minor page
faults per call of each (fresh memory touched), and "other CPUs": what the rest of the machine
kept busy meanwhile (/proc/stat), the noise indicator of a shared VM. Both processes of every
implementation run on the same loop (uvloop by default, --loop asyncio).

Noise: before each implementation the bench waits (up to --settle s, default 60, --quick 0)
until other processes use < 0.3 CPUs. --pin puts the client on CPU 0 and the server on CPU 1.
--keep-heap sets glibc's trim/mmap thresholds in both processes so freed large buffers are
reused instead of faulted in again (not what a user gets by default; it isolates that cost).

Output: one JSON line per scenario as it finishes, then a table, the ratios (a)/(c), (a)/(d),
(a)/(b) per scenario, and the targets of the "Benchmarks" issue, met or missed. With
--repeat N (default 3, --quick 1) the implementations take turns N times and each figure is
the run with the median QPS. The whole result is written to bench/results/echo-<time>.json and
bench/results/echo-latest.json; --plots DIR also writes the PNGs of docs/benchmarks.md to DIR
and prints its markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"

SCENARIOS = [  # (name, payload bytes, concurrency)
    ("16B c=1", 16, 1),
    ("16B c=16", 16, 16),
    ("16B c=128", 16, 128),
    ("4KiB c=16", 4096, 16),
    ("1MiB c=4", 1 << 20, 4),
    ("16MiB c=1", 16 << 20, 1),
]

IMPLS = {
    "a": "aiobrpc compiled",
    "b": "aiobrpc pure",
    "c": "grpc.aio",
    "d": "raw ceiling",
    "e": "raw + task/request",
    "f": "protocol floor",
    "g": "aiobrpc, no method status",
    "h": "aiobrpc, no client method status",
    "i": "aiobrpc, limits on",
}
DEFAULT_IMPLS = "a,b,c,d"
CLK_TCK = os.sysconf("SC_CLK_TCK")
CDF_POINTS = 1001  # latency quantiles kept per scenario, 0..100 % in 0.1 % steps


# =============================================================================================
# Servers (run as `echo.py --role server --impl X`): print "PORT <n> <detail>", serve until SIGTERM
# =============================================================================================

async def _wait_for_sigterm() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def serve_aiobrpc() -> None:
    sys.path.insert(0, str(ROOT))
    import aiobrpc
    from aiobrpc import _fast
    from aiobrpc._proto import echo_pb2

    class Echo(aiobrpc.Servicer):
        SERVICE = echo_pb2.DESCRIPTOR.services_by_name["EchoService"]

        async def Echo(self, request, cntl):
            if request.sleep_ms:
                await asyncio.sleep(request.sleep_ms / 1000)
            cntl.response_attachment = cntl.request_attachment
            return echo_pb2.EchoResponse(message=request.message)

    limits = {}
    if os.environ.get("BENCH_LIMITS") == "1":  # every limit checked per request, none reached
        limits = dict(max_concurrency=1_000_000, method_max_concurrency=1_000_000, max_connections=10_000,
                      idle_timeout_sec=3600, max_user_fields=64)
    server = aiobrpc.Server(aiobrpc.ServerOptions(method_status=os.environ.get("BENCH_METHOD_STATUS") != "0",
                                                  **limits))
    server.add_service(Echo())
    await server.start("127.0.0.1:0")
    print(f"PORT {server.port} {_fast.IMPLEMENTATION}", flush=True)
    await _wait_for_sigterm()
    await server.stop()
    await server.join(timeout=1)


def _grpc_modules():
    sys.path.insert(0, os.environ["BENCH_GRPC_DIR"])
    import grpc_echo_pb2
    import grpc_echo_pb2_grpc
    return grpc_echo_pb2, grpc_echo_pb2_grpc


GRPC_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


async def serve_grpc() -> None:
    import grpc
    pb, pb_grpc = _grpc_modules()

    class Echo(pb_grpc.EchoServiceServicer):
        async def Echo(self, request, context):
            if request.sleep_ms:
                await asyncio.sleep(request.sleep_ms / 1000)
            return pb.EchoResponse(message=request.message, payload=request.payload)

    server = grpc.aio.server(options=GRPC_OPTIONS)
    pb_grpc.add_EchoServiceServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"PORT {port} grpc-{grpc.__version__}", flush=True)
    await _wait_for_sigterm()
    await server.stop(None)


# =============================================================================================
# Clients: one async `call()` per implementation that sends the payload and returns a numpy array
# =============================================================================================

async def aiobrpc_client(port: int):
    sys.path.insert(0, str(ROOT))
    import aiobrpc
    import numpy as np
    from aiobrpc import _fast
    from aiobrpc._proto import echo_pb2

    options = aiobrpc.ChannelOptions(timeout_ms=60000, max_retry=0,
                                     method_status=os.environ.get("BENCH_CLIENT_METHOD_STATUS") != "0")
    channel = aiobrpc.Channel(f"127.0.0.1:{port}", options)
    echo = aiobrpc.Stub(channel, echo_pb2.DESCRIPTOR.services_by_name["EchoService"]).Echo
    Request, Controller, frombuffer, u8 = echo_pb2.EchoRequest, aiobrpc.Controller, np.frombuffer, np.uint8

    async def call(arr):
        cntl = Controller()
        cntl.request_attachment = arr
        await echo(Request(message="x"), cntl)
        return frombuffer(cntl.response_attachment, u8)

    return call, channel.close, _fast.IMPLEMENTATION


async def grpc_client(port: int):
    import grpc
    import numpy as np
    pb, pb_grpc = _grpc_modules()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    echo = pb_grpc.EchoServiceStub(channel).Echo
    Request, frombuffer, u8 = pb.EchoRequest, np.frombuffer, np.uint8

    async def call(arr):
        resp = await echo(Request(message="x", payload=arr.tobytes()))
        return frombuffer(resp.payload, u8)

    return call, channel.close, f"grpc-{grpc.__version__}"


async def raw_client(port: int):
    import numpy as np
    from raw_ceiling import RawClient
    client = await RawClient.connect("127.0.0.1", port)
    rawcall, frombuffer, u8 = client.call, np.frombuffer, np.uint8

    async def call(arr):
        return frombuffer(await rawcall(arr), u8)

    async def close():
        client.close()

    return call, close, "raw"


async def floor_client(port: int):
    import numpy as np
    from protocol_floor import FloorClient
    from aiobrpc._proto import echo_pb2
    client = await FloorClient.connect("127.0.0.1", port)
    floorcall, Request, frombuffer, u8 = client.call, echo_pb2.EchoRequest, np.frombuffer, np.uint8

    async def call(arr):
        _, attachment = await floorcall(Request(message="x"), arr)
        return frombuffer(attachment, u8)

    async def close():
        client.close()

    return call, close, "floor"


CLIENTS = {"a": aiobrpc_client, "b": aiobrpc_client, "c": grpc_client, "d": raw_client, "e": raw_client,
           "f": floor_client, "g": aiobrpc_client, "h": aiobrpc_client,
           "i": aiobrpc_client}


def _proc_stat(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rpartition(b")")[2].split()  # fields from 3 (state) on


def server_cpu_seconds(pid: int) -> float:
    fields = _proc_stat(pid)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)


def page_faults(pid: int) -> int:
    """Minor page faults of a process so far (first touches of fresh memory, field 10)."""
    return int(_proc_stat(pid)[7])


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine so far, from /proc/stat."""
    with open("/proc/stat", "rb") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    return (user + nice + system + irq + softirq) / CLK_TCK, steal / CLK_TCK


def wait_quiet(max_wait: float, threshold: float = 0.3, sample: float = 1.0) -> float:
    """Wait (up to max_wait s) until other processes use at most `threshold` CPUs; return their load.

    A shared VM runs other people's work; a run beside it measures them as much as us.
    """
    deadline = time.monotonic() + max_wait
    while True:
        b0 = machine_cpu_seconds()[0]
        time.sleep(sample)
        load = (machine_cpu_seconds()[0] - b0) / sample
        if load <= threshold or time.monotonic() >= deadline:
            return load
        print(f"# waiting for a quiet machine: other processes use {load:.2f} CPUs", file=sys.stderr, flush=True)
        time.sleep(2.0)


def client_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def closed_loop(call, arr, concurrency: int, warmup: float, duration: float, server_pid: int):
    """Run `concurrency` tasks calling back to back; measure the window after `warmup`."""
    measuring = False
    stop = False
    latencies: list[int] = []
    record = latencies.append
    clock = time.perf_counter_ns

    async def worker():
        while not stop:
            t0 = clock()
            await call(arr)
            t1 = clock()
            if measuring:
                record(t1 - t0)

    tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
    await asyncio.sleep(warmup)
    me = os.getpid()
    before = _counters(me, server_pid)
    measuring = True
    await asyncio.sleep(duration)
    measuring = False
    after = _counters(me, server_pid)
    stop = True
    await asyncio.gather(*tasks)
    d = {k: after[k] - before[k] for k in before}
    # CPU the rest of the machine used meanwhile (other processes of a shared VM): noise.
    d["other_cpu"] = max(0.0, d["machine_busy"] - d["client_cpu"] - d["server_cpu"])
    return latencies, d


def _counters(client_pid: int, server_pid: int) -> dict:
    busy, steal = machine_cpu_seconds()
    return {"time": time.perf_counter(), "client_cpu": client_cpu_seconds(),
            "server_cpu": server_cpu_seconds(server_pid), "machine_busy": busy, "steal": steal,
            "client_faults": page_faults(client_pid), "server_faults": page_faults(server_pid)}


def summarize(latencies: list[int], d: dict, size: int) -> dict:
    """The figures of one scenario from its latencies (ns) and counter deltas (closed_loop)."""
    import numpy as np
    lat = np.asarray(latencies, dtype=np.float64) / 1000.0  # microseconds
    calls = int(lat.size)
    elapsed, client_cpu, server_cpu = d["time"], d["client_cpu"], d["server_cpu"]
    q = np.percentile(lat, [50, 99, 99.9]) if calls else [float("nan")] * 3
    cdf = np.percentile(lat, np.linspace(0, 100, CDF_POINTS)).round(1).tolist() if calls else []
    return {
        "calls": calls,
        "seconds": round(elapsed, 4),
        "qps": calls / elapsed,
        "mb_s": calls * size / elapsed / 1e6,
        "p50_us": float(q[0]), "p99_us": float(q[1]), "p999_us": float(q[2]),
        "mean_us": float(lat.mean()) if calls else float("nan"),
        "client_cpu_s": round(client_cpu, 4),
        "server_cpu_s": round(server_cpu, 4),
        "client_cpu_us_per_call": client_cpu / calls * 1e6 if calls else float("nan"),
        "server_cpu_us_per_call": server_cpu / calls * 1e6 if calls else float("nan"),
        # Fresh memory touched per call (4 KiB pages): a 1 MiB buffer faulted in costs 256.
        "client_faults_per_call": d["client_faults"] / calls if calls else float("nan"),
        "server_faults_per_call": d["server_faults"] / calls if calls else float("nan"),
        "other_cpus": round(d["other_cpu"] / elapsed, 3),  # CPUs busy with other processes meanwhile
        "steal_cpus": round(d["steal"] / elapsed, 3),
        "latency_cdf_us": cdf,
    }


async def client_main(args) -> None:
    import numpy as np
    scenarios = [s for s in SCENARIOS if s[0] in args.scenarios.split(";")] if args.scenarios else SCENARIOS
    rng = np.random.default_rng(7)
    call, close, detail = None, None, ""
    try:
        for name, size, concurrency in scenarios:
            arr = rng.integers(0, 256, size, dtype=np.uint8)
            if call is None:
                call, close, detail = await CLIENTS[args.impl](args.port)
            echoed = await call(arr)  # the reply must be the payload, byte for byte
            if echoed.shape != arr.shape or not np.array_equal(echoed, arr):
                raise SystemExit(f"{args.impl} {name}: the echo differs from the payload")
            lat, deltas = await closed_loop(call, arr, concurrency, args.warmup, args.duration, args.server_pid)
            row = {"impl": args.impl, "name": IMPLS[args.impl], "detail": detail, "loop": args.loop,
                   "scenario": name, "size": size, "concurrency": concurrency}
            row.update(summarize(lat, deltas, size))
            print(json.dumps(row), flush=True)
    finally:
        if close is not None:
            await close()


# =============================================================================================
# The driver: one server process and one client process per implementation, in turn
# =============================================================================================

def run_loop(coro, loop_name: str):
    if loop_name == "uvloop":
        import uvloop
        return uvloop.run(coro)
    return asyncio.run(coro)


def compile_grpc_proto() -> str:
    from grpc_tools import protoc
    out = tempfile.mkdtemp(prefix="aiobrpc-bench-grpc-")
    rc = protoc.main(["grpc_tools.protoc", f"-I{BENCH}", f"--python_out={out}",
                      f"--grpc_python_out={out}", str(BENCH / "grpc_echo.proto")])
    if rc != 0:
        raise SystemExit(f"grpc_tools.protoc failed with {rc}")
    return out


KEEP_HEAP = {  # glibc: keep freed memory instead of giving it back (and faulting it in again)
    "MALLOC_TRIM_THRESHOLD_": str(256 << 20),
    "MALLOC_MMAP_THRESHOLD_": str(64 << 20),
}


def impl_env(impl: str, grpc_dir: str | None, keep_heap: bool = False) -> dict:
    env = dict(os.environ)
    if keep_heap:
        env.update(KEEP_HEAP)
    env.pop("AIOBRPC_NO_EXTENSIONS", None)
    if impl == "b":
        env["AIOBRPC_NO_EXTENSIONS"] = "1"
    env["BENCH_METHOD_STATUS"] = "0" if impl == "g" else "1"
    env["BENCH_CLIENT_METHOD_STATUS"] = "0" if impl == "h" else "1"
    env["BENCH_LIMITS"] = "1" if impl == "i" else "0"
    if grpc_dir:
        env["BENCH_GRPC_DIR"] = grpc_dir
    return env


def _pinned(cpu: int | None):
    """preexec_fn that pins the child to one CPU (--pin), or None."""
    if cpu is None:
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


def start_server(impl: str, loop: str, env: dict, cpu: int | None = None) -> tuple[subprocess.Popen, int, str]:
    if impl in ("d", "e"):
        cmd = [sys.executable, str(BENCH / "raw_ceiling.py"), "--serve", "--loop", loop]
        if impl == "e":
            cmd.append("--task")
    elif impl == "f":
        cmd = [sys.executable, str(BENCH / "protocol_floor.py"), "--serve", "--loop", loop]
    else:
        cmd = [sys.executable, str(BENCH / "echo.py"), "--role", "server", "--impl", impl, "--loop", loop]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True, cwd=ROOT,
                            preexec_fn=_pinned(cpu))
    line = proc.stdout.readline().split()
    if len(line) < 2 or line[0] != "PORT":
        proc.kill()
        raise SystemExit(f"server {impl} did not start: {' '.join(line)!r}")
    return proc, int(line[1]), " ".join(line[2:])


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_impl(impl: str, loop: str, args, grpc_dir: str | None) -> list[dict]:
    env = impl_env(impl, grpc_dir, args.keep_heap)
    if args.settle > 0:
        wait_quiet(args.settle)
    server, port, server_detail = start_server(impl, loop, env, 1 if args.pin else None)
    try:
        cmd = [sys.executable, str(BENCH / "echo.py"), "--role", "client", "--impl", impl,
               "--loop", loop, "--port", str(port), "--server-pid", str(server.pid),
               "--warmup", str(args.warmup), "--duration", str(args.duration)]
        if args.scenarios:
            cmd += ["--scenarios", args.scenarios]
        client = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True, cwd=ROOT,
                                  preexec_fn=_pinned(0 if args.pin else None))
        rows = []
        for line in client.stdout:
            row = json.loads(line)
            row["server_detail"] = server_detail
            rows.append(row)
            short = {k: row[k] for k in ("impl", "loop", "scenario", "qps", "mb_s", "p50_us", "p99_us",
                                         "client_cpu_us_per_call", "server_cpu_us_per_call", "client_faults_per_call",
                                         "server_faults_per_call", "other_cpus")}
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in short.items()}),
                  flush=True)
        if client.wait() != 0:
            raise SystemExit(f"client {impl} failed with exit status {client.returncode}")
        if impl in ("a", "b", "g", "h", "i"):
            want = "python" if impl == "b" else "cython"
            for row in rows:
                if row["detail"] != want or server_detail != want:
                    raise SystemExit(f"{impl} ran {row['detail']}/{server_detail}, expected {want} "
                                     "(are the extensions built? python setup.py build_ext --inplace)")
        return rows
    finally:
        stop_server(server)


def median_rows(rows: list[dict]) -> list[dict]:
    """Per (loop, impl, scenario): the run with the median QPS, with the spread of all runs."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["loop"], r["impl"], r["scenario"]), []).append(r)
    out = []
    for runs in groups.values():
        runs = sorted(runs, key=lambda r: r["qps"])
        pick = dict(runs[(len(runs) - 1) // 2])
        pick["runs"] = len(runs)
        pick["qps_all"] = [round(r["qps"], 1) for r in runs]
        out.append(pick)
    order = {s[0]: i for i, s in enumerate(SCENARIOS)}
    out.sort(key=lambda r: (r["loop"], order[r["scenario"]], r["impl"]))
    return out


# -- reporting --------------------------------------------------------------------------------

def _find(rows, loop, impl, scenario):
    for r in rows:
        if r["loop"] == loop and r["impl"] == impl and r["scenario"] == scenario:
            return r
    return None


def _ratio(x, y):
    return x / y if x is not None and y and y == y else None


def fmt_lat(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 10000 else f"{us:.0f} us"


def results_table(rows: list[dict], loop: str, markdown: bool = False) -> str:
    head = ["scenario", "impl", "QPS", "MB/s", "p50", "p99", "p99.9", "client CPU/call", "server CPU/call",
            "page faults/call c+s", "other CPUs"]
    lines = []
    for r in rows:
        if r["loop"] != loop:
            continue
        lines.append([r["scenario"], f"({r['impl']}) {r['name']}", f"{r['qps']:,.0f}", f"{r['mb_s']:,.1f}",
                      fmt_lat(r["p50_us"]), fmt_lat(r["p99_us"]), fmt_lat(r["p999_us"]),
                      f"{r['client_cpu_us_per_call']:,.1f} us", f"{r['server_cpu_us_per_call']:,.1f} us",
                      f"{r.get('client_faults_per_call', 0):,.1f}+{r.get('server_faults_per_call', 0):,.1f}",
                      f"{r.get('other_cpus', 0):.2f}"])
    return _render(head, lines, markdown)


def ratio_rows(rows: list[dict], loop: str) -> list[list]:
    out = []
    for name, _, _ in SCENARIOS:
        a = _find(rows, loop, "a", name)
        if a is None:
            continue
        cells = [name]
        for other in ("c", "d", "b", "e", "f", "g", "h", "i"):
            o = _find(rows, loop, other, name)
            cells.append(_ratio(a["qps"], o["qps"] if o else None))
        h = _find(rows, loop, "h", name)
        cells.append(_ratio(a["client_cpu_us_per_call"], h["client_cpu_us_per_call"] if h else None))
        i = _find(rows, loop, "i", name)
        cells.append(_ratio(i["server_cpu_us_per_call"], a["server_cpu_us_per_call"]) if i else None)
        d = _find(rows, loop, "d", name)
        cells.append(_ratio(a["p50_us"], d["p50_us"] if d else None))
        out.append(cells)
    return out


def ratios_table(rows: list[dict], loop: str, markdown: bool = False) -> str:
    head = ["scenario", "QPS (a)/(c) grpc", "QPS (a)/(d) raw", "QPS (a)/(b) pure", "QPS (a)/(e) raw+task",
            "QPS (a)/(f) floor", "QPS (a)/(g) no status", "QPS (a)/(h) no client status",
            "QPS (a)/(i) limits on", "client CPU/call (a)/(h)", "server CPU/call (i)/(a)", "p50 (a)/(d)"]
    lines = [[c[0]] + [f"{x:.2f}x" if x is not None else "-" for x in c[1:]] for c in ratio_rows(rows, loop)]
    return _render(head, lines, markdown)


TARGETS = [  # (description, scenario, impl, other, metric, op, bound)
    ("16B c=128: (a) QPS >= 0.7x (d)", "16B c=128", "a", "d", "qps", ">=", 0.7),
    ("16B c=128: (a) QPS >= 30x (c)", "16B c=128", "a", "c", "qps", ">=", 30),
    ("16B c=1: (a) p50 <= 1.3x (d)", "16B c=1", "a", "d", "p50_us", "<=", 1.3),
    ("1MiB: (a) MB/s >= 0.9x (d)", "1MiB c=4", "a", "d", "mb_s", ">=", 0.9),
    ("16MiB: (a) MB/s >= 0.9x (d)", "16MiB c=1", "a", "d", "mb_s", ">=", 0.9),
    ("16B c=128: (a) QPS >= 1.5x (b)", "16B c=128", "a", "b", "qps", ">=", 1.5),
]


def targets_table(rows: list[dict], loop: str, markdown: bool = False) -> str:
    lines = []
    for desc, scenario, impl, other, metric, op, bound in TARGETS:
        x, y = _find(rows, loop, impl, scenario), _find(rows, loop, other, scenario)
        if x is None or y is None:
            continue
        ratio = x[metric] / y[metric]
        ok = ratio >= bound if op == ">=" else ratio <= bound
        lines.append([desc, f"{ratio:.2f}x", "met" if ok else "MISSED"])
    return _render(["target", "measured", "verdict"], lines, markdown)


def _render(head: list[str], lines: list[list[str]], markdown: bool) -> str:
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        out += ["| " + " | ".join(str(c) for c in line) + " |" for line in lines]
        return "\n".join(out)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)] if lines else [len(h) for h in head]
    fmt = "  ".join(f"{{:{'<' if i < 2 else '>'}{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))]
                     + [fmt.format(*map(str, line)) for line in lines])


def report(result: dict, markdown: bool) -> None:
    rows = result["rows"]
    for loop in result["loops"]:
        flags = "".join(f", {f}" for f in ("keep_heap", "pin") if result.get(f))
        print(f"\n== {loop}{flags}: median of {result['repeat']} run(s) per figure; "
              f"{result['duration']} s per scenario after {result['warmup']} s warm-up ==")
        print(results_table(rows, loop))
        print(f"\n-- ratios ({loop}) --")
        print(ratios_table(rows, loop))
        print(f"\n-- targets ({loop}) --")
        print(targets_table(rows, loop))
    if markdown:
        for loop in result["loops"]:
            print(f"\n<!-- markdown tables, {loop} -->\n")
            print(results_table(rows, loop, True))
            print()
            print(ratios_table(rows, loop, True))
            print()
            print(targets_table(rows, loop, True))


def make_plots(result: dict, outdir: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    outdir.mkdir(parents=True, exist_ok=True)
    rows = result["rows"]
    loop = "uvloop" if "uvloop" in result["loops"] else result["loops"][0]
    impls = [i for i in IMPLS if any(r["impl"] == i and r["loop"] == loop for r in rows)]
    marker = {"a": "o", "b": "s", "c": "^", "d": "D", "e": "v", "f": "x", "g": "+", "h": "*", "i": "1"}
    line = {"a": "-", "b": "--", "c": "-.", "d": ":", "e": (0, (5, 2, 1, 2, 1, 2)), "f": (0, (1, 1)),
            "g": (0, (3, 1)), "h": (0, (3, 1, 1, 1)), "i": (0, (2, 2))}
    written = []
    stamp = f"{result['date'][:10]}, {loop}, 2-core VM"

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i in impls:
        pts = [(c, r["qps"]) for n, _, c in SCENARIOS if n.startswith("16B")
               for r in [_find(rows, loop, i, n)] if r is not None]
        if pts:
            ax.plot(*zip(*pts), marker=marker[i], linestyle=line[i], label=f"({i}) {IMPLS[i]}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([1, 16, 128], ["1", "16", "128"])
    ax.set_xlabel("concurrency (calls in flight, one connection)")
    ax.set_ylabel("calls per second")
    ax.set_title(f"16 B echo: QPS vs concurrency ({stamp})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(outdir / "echo_qps_16b.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    sized = [s for s in SCENARIOS if s[0] != "16B c=1" and s[0] != "16B c=128"]
    for i in impls:
        pts = [(size, r["mb_s"]) for n, size, _ in sized for r in [_find(rows, loop, i, n)] if r is not None]
        if pts:
            ax.plot(*zip(*pts), marker=marker[i], linestyle=line[i], label=f"({i}) {IMPLS[i]}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([s for _, s, _ in sized], [n.replace(" ", "\n") for n, _, _ in sized])
    ax.set_xlabel("payload size (and concurrency)")
    ax.set_ylabel("payload MB/s (one direction)")
    ax.set_title(f"Echo throughput vs payload size ({stamp})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(outdir / "echo_mbs_size.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    q = np.linspace(0, 1, CDF_POINTS)
    for i in impls:
        r = _find(rows, loop, i, "16B c=16")
        if r is not None and r["latency_cdf_us"]:
            ax.plot(r["latency_cdf_us"], q, linestyle=line[i], label=f"({i}) {IMPLS[i]}")
    ax.set_xscale("log")
    ax.set_xlabel("latency (us)")
    ax.set_ylabel("fraction of calls")
    ax.set_title(f"Latency CDF, 16 B at concurrency 16 ({stamp})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    written.append(outdir / "echo_latency_cdf_16b_c16.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def machine_info() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    versions = {}
    for mod in ("uvloop", "grpc", "google.protobuf", "numpy"):
        try:
            versions[mod] = __import__(mod, fromlist=["__version__"]).__version__
        except Exception:
            versions[mod] = "missing"
    try:  # what was measured: the commit, and the files of aiobrpc changed since
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "aiobrpc", "setup.py"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.split("\n")
        dirty = [ln[3:] for ln in dirty if ln.strip()]
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", []
    return {"cpus": os.cpu_count(), "cpu_model": model, "loadavg_at_start": os.getloadavg(),
            "git_commit": commit, "aiobrpc_changed_files": dirty, "python": platform.python_version(),
            "platform": platform.platform(), "versions": versions}


def driver_main(args) -> None:
    if args.replot:
        result = json.loads(Path(args.replot).read_text())
        report(result, markdown=True)
        if args.plots:
            for p in make_plots(result, Path(args.plots)):
                print(f"wrote {p}")
        return
    impls = [i for i in args.only.split(",") if i]
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        raise SystemExit(f"--only takes letters of {', '.join(IMPLS)}; got {', '.join(bad)}")
    loops = ["uvloop", "asyncio"] if args.loop == "both" else [args.loop]
    grpc_dir = compile_grpc_proto() if "c" in impls else None
    machine = machine_info()
    started = time.perf_counter()
    all_rows: list[dict] = []
    for rnd in range(args.repeat):
        for loop in loops:
            for impl in impls:
                for row in run_impl(impl, loop, args, grpc_dir):
                    row["round"] = rnd
                    all_rows.append(row)
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine, "loops": loops, "impls": impls, "repeat": args.repeat,
        "warmup": args.warmup, "duration": args.duration, "quick": args.quick,
        "keep_heap": args.keep_heap, "pin": args.pin,
        "wall_seconds": round(time.perf_counter() - started, 1),
        "rows": median_rows(all_rows), "all_runs": all_rows,
    }
    RESULTS.mkdir(exist_ok=True)
    stamp = result["date"].replace(":", "").replace("-", "")
    for path in (RESULTS / f"echo-{stamp}{'-quick' if args.quick else ''}.json", RESULTS / "echo-latest.json"):
        path.write_text(json.dumps(result, indent=1))
    report(result, markdown=bool(args.plots) or args.markdown)
    print(f"\nresults: {RESULTS / 'echo-latest.json'} ({result['wall_seconds']} s)")
    if args.plots:
        for p in make_plots(result, Path(args.plots)):
            print(f"wrote {p}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 s per scenario after 0.3 s warm-up, one round")
    p.add_argument("--only", default=DEFAULT_IMPLS, help=f"implementations, e.g. a,d (default {DEFAULT_IMPLS})")
    p.add_argument("--loop", choices=("uvloop", "asyncio", "both"), default="uvloop")
    p.add_argument("--repeat", type=int, help="rounds; each figure is the median (default 3, --quick 1)")
    p.add_argument("--pin", action="store_true",
                   help="pin the client to CPU 0 and the server to CPU 1 (default: the scheduler places them)")
    p.add_argument("--keep-heap", action="store_true",
                   help="set MALLOC_TRIM_THRESHOLD_/MALLOC_MMAP_THRESHOLD_ in both processes so glibc "
                        "reuses freed large buffers instead of faulting fresh pages in (not the default "
                        "a user gets: shows what page faults cost)")
    p.add_argument("--settle", type=float,
                   help="before each implementation wait up to this many seconds for other processes "
                        "to use < 0.3 CPUs (default 60, --quick 0)")
    p.add_argument("--scenarios", help="';'-separated scenario names, e.g. '16B c=1;1MiB c=4'")
    p.add_argument("--plots", metavar="DIR", help="write the PNGs here and print markdown tables")
    p.add_argument("--markdown", action="store_true", help="print markdown tables")
    p.add_argument("--replot", metavar="JSON", help="report and plot a saved result instead of running")
    p.add_argument("--warmup", type=float, help=argparse.SUPPRESS)
    p.add_argument("--duration", type=float, help=argparse.SUPPRESS)
    p.add_argument("--role", choices=("driver", "server", "client"), default="driver", help=argparse.SUPPRESS)
    p.add_argument("--impl", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = 0.3 if args.quick else 1.0
    if args.duration is None:
        args.duration = 1.0 if args.quick else 4.0
    if args.repeat is None:
        args.repeat = 1 if args.quick else 3
    if args.settle is None:
        args.settle = 0.0 if args.quick else 60.0
    if args.scenarios:
        known = {s[0] for s in SCENARIOS}
        unknown = [s for s in args.scenarios.split(";") if s not in known]
        if unknown:
            p.error(f"unknown scenarios {unknown}; known: {'; '.join(sorted(known))}")
    if args.role == "server":
        run_loop(serve_grpc() if args.impl == "c" else serve_aiobrpc(), args.loop)
    elif args.role == "client":
        run_loop(client_main(args), args.loop)
    else:
        driver_main(args)


if __name__ == "__main__":
    main()
