"""gRPC server benchmark: a grpcio client calling an aiobrpc server, against the same client
calling a grpc.aio server with the same handler, in one run.

Run by hand from the repository root:

    python bench/grpc_server.py --quick        # ~20 s, rough figures
    python bench/grpc_server.py                # 3 rounds, the median of each figure

Every server runs in a process of its own on 127.0.0.1 (aiobrpc on uvloop, grpc.aio on its
asyncio loop), and the client in another: a grpc.aio client (grpcio's C core under an asyncio
loop) on one channel, closed loop, `concurrency` tasks each sending a unary call, waiting for
the reply and sending the next. The handler echoes the request's `data` (GrpcService.Unary of
proto/grpc_test.proto). Scenarios (payload at a concurrency): 16 B at 1 and 32, 1 MiB at 4;
each runs 3 s after a 1 s warm-up (--quick: 1 s after 0.3 s). The implementations take turns
--repeat times (default 3, --quick 1) and each figure is the median.

Measured in the window only: QPS, and the server's CPU time per call (utime + stime of
/proc/<server pid>/stat, read by the client at the window's edges; 10 ms ticks): on a small
shared machine the client's own CPU caps both servers' QPS alike, and CPU per call is then
what tells them apart.

Output: one line per measurement (with the client's own CPU per call, time.process_time), then
a table of QPS, server CPU per call and the ratios aiobrpc / grpc.aio for each scenario (the
target of the gRPC issue: at least 2x the QPS on small calls), and the QPS no server can pass
with one call in flight: a round trip includes the client's own CPU time per call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

METHOD = "/aiobrpc.test.GrpcTestService/Unary"
SCENARIOS = [(16, 1), (16, 32), (1024 * 1024, 4)]
MAX_MESSAGE = 64 * 1024 * 1024


# -- servers (each in its own process: `--serve aiobrpc` / `--serve grpcaio`) ------------------------
async def serve_aiobrpc() -> None:
    from aiobrpc import Server, ServerOptions, Servicer
    from aiobrpc._proto import grpc_test_pb2

    class Bench(Servicer):
        SERVICE = grpc_test_pb2.DESCRIPTOR.services_by_name["GrpcTestService"]

        async def Unary(self, request, cntl):
            return grpc_test_pb2.GrpcMessage(data=request.data)

    server = Server(ServerOptions(max_body_size=MAX_MESSAGE))
    server.add_service(Bench())
    await server.start("127.0.0.1:0")
    await _serve_until_stdin_closes(server.port)
    await server.stop()
    await server.join(1)


async def serve_grpcaio() -> None:
    import grpc
    from aiobrpc._proto import grpc_test_pb2

    async def unary(request, context):
        return grpc_test_pb2.GrpcMessage(data=request.data)

    handler = grpc.method_handlers_generic_handler("aiobrpc.test.GrpcTestService", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, request_deserializer=grpc_test_pb2.GrpcMessage.FromString,
                                                     response_serializer=grpc_test_pb2.GrpcMessage.SerializeToString)})
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE),
                                      ("grpc.max_send_message_length", MAX_MESSAGE)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await _serve_until_stdin_closes(port)
    await server.stop(0.5)


async def _serve_until_stdin_closes(port: int) -> None:
    print(port, flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)


# -- the client (`--client PORT SIZE CONCURRENCY SECONDS WARMUP SERVER_PID`) -------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid`."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_client(port: int, size: int, concurrency: int, seconds: float, warmup: float, pid: int) -> dict:
    import grpc
    from aiobrpc._proto import grpc_test_pb2

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]) as ch:
        call = ch.unary_unary(METHOD, request_serializer=grpc_test_pb2.GrpcMessage.SerializeToString,
                              response_deserializer=grpc_test_pb2.GrpcMessage.FromString)
        request = grpc_test_pb2.GrpcMessage(data=b"x" * size)
        await call(request, timeout=10)
        counting = False
        done = 0
        stop = False

        async def worker() -> None:
            nonlocal done
            while not stop:
                response = await call(request, timeout=30)
                assert len(response.data) == size
                if counting:
                    done += 1
        tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        await asyncio.sleep(warmup)
        counting = True
        t0, cpu0, own0 = time.perf_counter(), cpu_seconds(pid), time.process_time()
        await asyncio.sleep(seconds)
        counting = False
        elapsed, cpu, own = time.perf_counter() - t0, cpu_seconds(pid) - cpu0, time.process_time() - own0
        stop = True
        await asyncio.gather(*tasks)
    return {"qps": done / elapsed, "server_cpu_us": cpu / max(done, 1) * 1e6,
            "client_cpu_us": own / max(done, 1) * 1e6}


# -- the driver ----------------------------------------------------------------------------------------
def measure(impl: str, seconds: float, warmup: float) -> dict:
    server = subprocess.Popen([sys.executable, __file__, "--serve", impl], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        port = int(server.stdout.readline())
        out = {}
        for size, concurrency in SCENARIOS:
            result = subprocess.run([sys.executable, __file__, "--client", str(port), str(size), str(concurrency),
                                     str(seconds), str(warmup), str(server.pid)], capture_output=True, text=True,
                                    check=True, cwd=ROOT, env={**os.environ, "GRPC_VERBOSITY": "ERROR"})
            got = json.loads(result.stdout.strip().splitlines()[-1])
            print(f"{impl:8} {_label(size, concurrency):>14}  {got['qps']:10.0f} QPS  "
                  f"{got['server_cpu_us']:8.0f} us server CPU per call  {got['client_cpu_us']:8.0f} us client CPU",
                  flush=True)
            out[(size, concurrency)] = got
        return out
    finally:
        server.stdin.close()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


def _label(size: int, concurrency: int) -> str:
    return f"{'1 MiB' if size >= 1 << 20 else f'{size} B'} x{concurrency}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int)
    parser.add_argument("--serve", choices=("aiobrpc", "grpcaio"))
    parser.add_argument("--client", nargs=6)
    args = parser.parse_args()
    if args.serve == "aiobrpc":
        import aiobrpc
        asyncio.set_event_loop_policy(aiobrpc.event_loop_policy())
        asyncio.run(serve_aiobrpc())
        return 0
    if args.serve == "grpcaio":
        asyncio.run(serve_grpcaio())
        return 0
    if args.client:
        port, size, concurrency, seconds, warmup, pid = args.client
        print(json.dumps(asyncio.run(run_client(int(port), int(size), int(concurrency), float(seconds),
                                                float(warmup), int(pid)))))
        return 0
    seconds, warmup = (1.0, 0.3) if args.quick else (3.0, 1.0)
    repeat = args.repeat or (1 if args.quick else 3)
    runs: dict = {"aiobrpc": [], "grpcaio": []}
    for _ in range(repeat):
        for impl in runs:
            runs[impl].append(measure(impl, seconds, warmup))
    print(f"\n{'scenario':>14}  {'aiobrpc QPS':>12}  {'grpc.aio QPS':>12}  ratio  "
          f"{'aiobrpc us/call':>15}  {'grpc.aio us/call':>16}  ratio")
    for key in SCENARIOS:
        a = statistics.median(r[key]["qps"] for r in runs["aiobrpc"])
        g = statistics.median(r[key]["qps"] for r in runs["grpcaio"])
        ac = statistics.median(r[key]["server_cpu_us"] for r in runs["aiobrpc"])
        gc = statistics.median(r[key]["server_cpu_us"] for r in runs["grpcaio"])
        print(f"{_label(*key):>14}  {a:12.0f}  {g:12.0f}  {a / g:4.2f}x  {ac:15.0f}  {gc:16.0f}  {gc / ac:4.2f}x")
    # One call in flight is a round trip: the client's own time per call is in each server's figure.
    key = SCENARIOS[0]
    client = statistics.median(r[key]["client_cpu_us"] for rs in runs.values() for r in rs)
    g = statistics.median(r[key]["qps"] for r in runs["grpcaio"])
    print(f"\n{_label(*key)}: the grpc.aio client spends {client:.0f} us of CPU per call itself, so no server "
          f"can pass {1e6 / client:.0f} QPS there ({1e6 / client / g:.1f}x grpc.aio's)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
