"""Soak: a list:// cluster under load while its servers die, restart and misbehave.

    python bench/soak.py                          # 100k calls, at most 60 s, uvloop
    python bench/soak.py --calls 20000 --loop asyncio --json-only

Three in-process servers of the interop EchoService on one loop with the client:
  server 0 is killed (stop, then join with a 50 ms grace: handlers still running are
           cancelled) every --restart-every s, and started again on the same port
           --down s later;
  server 1 sits behind a FaultProxy (tests/helpers/fault_proxy.py) that every --fault-every s
           applies the next fault of: blackhole for --blackhole s (longer than the timeout:
           calls sent there end with ERPCTIMEDOUT; then the blackholed connections are
           reset), reset every connection, close every connection, refuse connects for
           --fault s;
  server 2 is left alone.
The client is `Channel("list://s0,proxy,s2", load_balancer="rr")` with max_retry=3,
timeout_ms=500, health_check_interval_s=0.2, and --concurrency closed-loop workers issue
--calls calls in total (each a unique id, echoed back); no call is issued after
--seconds minus the time a last call may take, so the whole run ends within --seconds.

Checked (the run fails, exit status 1, if one does not hold):
  lost 0              every issued call ended within its deadline plus 1 s;
  double 0            each call's awaitable completed exactly once, and its Controller did not
                      change after the caller saw the result (a late second completion would
                      rewrite it), checked 1 s later;
  wrong replies 0     a successful call got its own id back;
  phantom 0           a successful call was executed by some server at least once;
  pending 0           channel.pending_calls() once every call ended;
  loop errors 0       nothing reached the loop's exception handler;
  fds, tasks          back to what they were before the servers started (uvloop's one
                      /dev/null fd, opened once per loop, aside).
Reported: ok, failed by error code, server-side executions (calls run more than once are
legal for idempotent calls whose reply was lost), QPS, latency percentiles, wall time, the
channel's counters, the faults applied. Output: one JSON line, then a table.

`run_soak(SoakConfig(...))` is the same run as a coroutine; tests/reliability/test_soak.py
runs a short one.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import collections
import dataclasses
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from tests.helpers.fault_proxy import FaultProxy
from tests.helpers.interop_server import SERVICE

Req = interop_pb2.EchoRequest
Resp = interop_pb2.EchoResponse
FAULTS = ("blackhole", "reset", "close", "refuse")
LOOP_CLOCK_US = 1000  # the resolution of uvloop's loop.time()
_CODE_NAMES = {v: k for k, v in vars(errors).items() if k.startswith("E") and isinstance(v, int)}


@dataclasses.dataclass
class SoakConfig:
    calls: int = 100_000
    seconds: float = 60.0  # the whole run, servers' start to last close
    concurrency: int = 64
    timeout_ms: int = 500
    max_retry: int = 3
    health_check_interval_s: float = 0.2
    connection_type: str = "single"
    backup_request_ms: int = -1
    restart_every_s: float = 1.0  # server 0 is killed this often...
    down_s: float = 0.3  # ...and stays down this long
    fault_every_s: float = 0.5  # server 1's proxy applies its next fault this often...
    fault_s: float = 0.2  # ...a refusal lasting this long...
    blackhole_s: float = 0.7  # ...or a blackhole lasting this long (past timeout_ms: ERPCTIMEDOUT)
    retry_throttle: bool = True  # ChannelOptions' default RetryThrottle; False: none
    slow_ratio: float = 0.05  # calls whose handler sleeps 1-5 ms (in flight when a fault hits)
    seed: int = 1


class SoakEcho(aiobrpc.Servicer):
    """Echoes the call id; counts each id's executions (shared by the three servers)."""

    SERVICE = SERVICE

    def __init__(self, executions: bytearray) -> None:
        self.executions = executions
        self.served = 0

    async def Echo(self, request, cntl):
        cid = int(request.message)
        if self.executions[cid] < 255:
            self.executions[cid] += 1
        self.served += 1
        if request.sleep_ms:
            await asyncio.sleep(request.sleep_ms / 1000)
        return Resp(message=request.message)


def open_fds() -> dict[str, str]:
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own fd, closed by now
            pass
    return fds


def new_fds(before: dict[str, str]) -> dict[str, str]:
    """fds opened since `before`, less the /dev/null fd uvloop (libuv) opens once per loop."""
    return {fd: t for fd, t in open_fds().items() if fd not in before and t != "/dev/null"}


def percentile(sorted_values, q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def _start(server: aiobrpc.Server, port: int) -> bool:
    """Start on `port`; a client socket may hold it for a moment (ephemeral ports): retry."""
    for _ in range(50):
        try:
            await server.start(f"127.0.0.1:{port}")
            return True
        except OSError:
            await asyncio.sleep(0.02)
    return False


async def run_soak(cfg: SoakConfig) -> dict:
    loop = asyncio.get_running_loop()
    loop_errors: list = []
    loop.set_exception_handler(lambda lp, ctx: loop_errors.append(
        repr(ctx.get("exception", ctx.get("message")))))
    rng = random.Random(cfg.seed)
    fds_before = open_fds()
    tasks_before = len(asyncio.all_tasks())
    t_start = loop.time()
    # A call may take its deadline; shutting down takes well under a second.
    issue_until = t_start + cfg.seconds - cfg.timeout_ms / 1000 - 1.5

    executions = bytearray(cfg.calls)
    servicers = [SoakEcho(executions) for _ in range(3)]
    servers = []
    for servicer in servicers:
        server = aiobrpc.Server()
        server.add_service(servicer)
        await server.start("127.0.0.1:0")
        servers.append(server)
    proxy = await FaultProxy(("127.0.0.1", servers[1].port)).start()
    addresses = [f"127.0.0.1:{servers[0].port}", proxy.address, f"127.0.0.1:{servers[2].port}"]
    channel = aiobrpc.Channel("list://" + ",".join(addresses), aiobrpc.ChannelOptions(
        timeout_ms=cfg.timeout_ms, max_retry=cfg.max_retry, connection_type=cfg.connection_type,
        health_check_interval_s=cfg.health_check_interval_s, backup_request_ms=cfg.backup_request_ms,
        **({} if cfg.retry_throttle else {"retry_throttle": None})),
        load_balancer="rr")
    stub = aiobrpc.Stub(channel, SERVICE)

    ok = 0
    failed: collections.Counter = collections.Counter()
    failure_samples: dict = {}  # code -> first few (text, retried_count)
    late_failures = 0
    lost: list[int] = []
    wrong: list[int] = []
    outcome = bytearray(cfg.calls)  # 1: ok, 2: failed, 3: lost
    completions = bytearray(cfg.calls)  # done callbacks of each call's awaitable
    latencies = array.array("d")
    to_verify: collections.deque = collections.deque()  # (due, cid, cntl, snapshot)
    changed_after_completion: list[int] = []
    next_id = 0
    grace = cfg.timeout_ms / 1000 + 1.0
    faults: collections.Counter = collections.Counter()
    restarts = 0
    restart_failures = 0

    def snapshot(cntl):
        return (cntl.error_code, cntl.error_text, cntl.latency_us, cntl.retried_count, cntl.remote_side)

    def verify(until: float) -> None:
        while to_verify and to_verify[0][0] <= until:
            _, cid, cntl, snap = to_verify.popleft()
            if snapshot(cntl) != snap:
                changed_after_completion.append(cid)

    def completed(cid: int) -> None:
        if completions[cid] < 255:
            completions[cid] += 1

    async def worker() -> None:
        nonlocal next_id, ok, late_failures
        while next_id < cfg.calls and loop.time() < issue_until:
            cid = next_id
            next_id += 1
            sleep_ms = rng.randint(1, 5) if rng.random() < cfg.slow_ratio else 0
            cntl = aiobrpc.Controller()
            t0 = time.perf_counter()
            task = loop.create_task(stub.Echo(Req(message=str(cid), sleep_ms=sleep_ms), cntl))
            task.add_done_callback(lambda _, cid=cid: completed(cid))
            done, _ = await asyncio.wait((task,), timeout=grace)
            if not done:  # the deadline did not end it: lost
                lost.append(cid)
                outcome[cid] = 3
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                continue
            exc = task.exception()
            if exc is None:
                if task.result().message == str(cid):
                    ok += 1
                    outcome[cid] = 1
                    latencies.append(time.perf_counter() - t0)
                else:
                    wrong.append(cid)
            else:
                outcome[cid] = 2
                key = exc.code if isinstance(exc, aiobrpc.RpcError) else repr(exc)
                failed[key] += 1
                # The deadline passed, its timer had not run yet. The call judges its deadline on
                # loop.time(), which uvloop keeps in whole milliseconds cached per iteration:
                # by that clock the deadline can pass up to 1 ms before latency_us says so.
                if key != errors.ERPCTIMEDOUT and cntl.latency_us >= cfg.timeout_ms * 1000 - LOOP_CLOCK_US:
                    late_failures += 1
                samples = failure_samples.setdefault(key, [])
                if len(samples) < 3:
                    samples.append(f"[retried {cntl.retried_count}, {cntl.latency_us / 1000:.1f} ms] {exc}")
            to_verify.append((loop.time() + 1.0, cid, cntl, snapshot(cntl)))
            verify(loop.time())

    s0_down = False

    async def killer() -> None:
        nonlocal restarts, restart_failures, s0_down
        server, port = servers[0], servers[0].port
        while True:
            await asyncio.sleep(cfg.restart_every_s)
            s0_down = True
            await server.stop()
            await server.join(timeout=0.05)
            await asyncio.sleep(cfg.down_s)
            if await _start(server, port):
                restarts += 1
                s0_down = False
            else:
                restart_failures += 1

    async def chaos() -> None:
        i = 0
        while True:
            await asyncio.sleep(cfg.fault_every_s)
            kind = FAULTS[i % len(FAULTS)]
            i += 1
            faults[kind] += 1
            if kind == "blackhole":
                proxy.blackhole = True
                try:
                    await asyncio.sleep(cfg.blackhole_s)
                finally:
                    proxy.blackhole = False
                    proxy.cut_all("reset")  # a connection accepted in a blackhole stays one
            elif kind in ("reset", "close"):
                proxy.cut_all(kind)
            else:
                await proxy.refuse()
                try:
                    await asyncio.sleep(cfg.fault_s)
                finally:
                    await proxy.accept_again()

    wall0 = time.perf_counter()
    cpu0 = time.process_time()
    chaos_tasks = [loop.create_task(killer()), loop.create_task(chaos())]
    await asyncio.gather(*[worker() for _ in range(cfg.concurrency)])
    issue_wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    for t in chaos_tasks:
        t.cancel()
    await asyncio.gather(*chaos_tasks, return_exceptions=True)
    pending_after = channel.pending_calls()
    states = channel.server_states()
    stats = channel.stats.as_dict()
    # Late completions would show up now: wait out the last calls' verification window.
    await asyncio.sleep(max(0.0, min(1.0, to_verify[-1][0] - loop.time())) if to_verify else 0.0)
    verify(float("inf"))
    await channel.close()
    if s0_down:  # killed as the run ended: join it again, so whatever the kill left ends
        await servers[0].stop()
        await servers[0].join(timeout=1)
    proxy_accepted = proxy.connections_accepted
    await proxy.close()
    for server in servers:
        await server.stop()
        await server.join(timeout=1)
    await asyncio.sleep(0)
    issued = next_id
    lat = sorted(latencies)
    result = {
        "calls": cfg.calls, "issued": issued, "ok": ok,
        "failed": {(_CODE_NAMES.get(k, str(k)) if isinstance(k, int) else k): v
                   for k, v in sorted(failed.items(), key=lambda kv: -kv[1])},
        "failed_total": sum(failed.values()), "lost": len(lost),
        "failed_past_deadline": late_failures,
        "failure_samples": {(_CODE_NAMES.get(k, str(k)) if isinstance(k, int) else k): v
                            for k, v in failure_samples.items()},
        "double": sum(1 for c in completions[:issued] if c > 1) + len(changed_after_completion),
        "not_completed": sum(1 for c in completions[:issued] if c == 0),
        "wrong_replies": len(wrong),
        "phantom_successes": sum(1 for cid in range(issued) if outcome[cid] == 1 and executions[cid] == 0),
        "server_executions": sum(s.served for s in servicers),
        "executions_by_server": [s.served for s in servicers],
        "calls_executed_more_than_once": sum(1 for c in executions[:issued] if c > 1),
        "failed_calls_executed": sum(1 for cid in range(issued) if outcome[cid] == 2 and executions[cid]),
        "restarts": restarts, "restart_failures": restart_failures, "faults": dict(faults),
        "proxy_connections": proxy_accepted,
        "pending_after": pending_after, "server_states_at_end": states,
        "fds_leaked": new_fds(fds_before), "tasks_before": tasks_before,
        "tasks_after": len(asyncio.all_tasks()),
        "loop_errors": loop_errors[:10], "loop_error_count": len(loop_errors),
        "qps": round(issued / issue_wall, 1) if issue_wall else 0.0,
        "cpu_us_per_call": round(cpu / issued * 1e6, 1) if issued else 0.0,
        "p50_ms": round(percentile(lat, 0.5) * 1000, 3), "p99_ms": round(percentile(lat, 0.99) * 1000, 3),
        "max_ms": round((lat[-1] if lat else 0.0) * 1000, 3),
        "wall_s": round(loop.time() - t_start, 3), "client_stats": stats,
        "config": dataclasses.asdict(cfg),
    }
    loop.set_exception_handler(None)
    return result


def violations(r: dict) -> list[str]:
    """The soak's invariants that do not hold in result `r` (empty: all hold)."""
    cfg = r["config"]
    bad = []
    for key in ("lost", "double", "not_completed", "wrong_replies", "phantom_successes",
                "pending_after", "loop_error_count", "restart_failures"):
        if r[key]:
            bad.append(f"{key} = {r[key]}")
    if r["ok"] + r["failed_total"] + r["lost"] + r["wrong_replies"] != r["issued"]:
        bad.append(f"ok + failed + lost + wrong != issued ({r['issued']})")
    if r["fds_leaked"]:
        bad.append(f"fds leaked: {r['fds_leaked']}")
    if r["tasks_after"] != r["tasks_before"]:
        bad.append(f"tasks {r['tasks_before']} before, {r['tasks_after']} after")
    if r["wall_s"] > cfg["seconds"]:
        bad.append(f"wall {r['wall_s']} s > {cfg['seconds']} s")
    return bad


def table(r: dict) -> str:
    stats = r["client_stats"]
    rows = [
        ("calls issued / asked", f"{r['issued']} / {r['calls']}"),
        ("ok", r["ok"]),
        ("failed", f"{r['failed_total']}  " + ", ".join(f"{k} {v}" for k, v in r["failed"].items())),
        ("  of which past deadline", r["failed_past_deadline"]),
        ("lost (no end)", r["lost"]),
        ("completed twice", r["double"]),
        ("wrong replies", r["wrong_replies"]),
        ("ok without execution", r["phantom_successes"]),
        ("server executions", f"{r['server_executions']}  by server {r['executions_by_server']}"),
        ("calls run > once", r["calls_executed_more_than_once"]),
        ("failed calls that ran", r["failed_calls_executed"]),
        ("server 0 restarts", r["restarts"]),
        ("proxy faults", ", ".join(f"{k} {v}" for k, v in r["faults"].items())),
        ("pending after", r["pending_after"]),
        ("fds leaked", len(r["fds_leaked"])),
        ("tasks before/after", f"{r['tasks_before']}/{r['tasks_after']}"),
        ("loop errors", r["loop_error_count"]),
        ("QPS", r["qps"]),
        ("CPU us per call", r["cpu_us_per_call"]),
        ("latency ok p50/p99/max ms", f"{r['p50_ms']} / {r['p99_ms']} / {r['max_ms']}"),
        ("wall s", r["wall_s"]),
        ("retries / backups", f"{stats['retries']} / {stats['backup_requests']}"),
        ("marked down / revived", f"{stats['servers_marked_down']} / {stats['servers_revived']}"),
        ("timeouts / throttled", f"{stats['timeouts']} / {stats['retries_throttled']}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = SoakConfig()
    ap.add_argument("--calls", type=int, default=d.calls)
    ap.add_argument("--seconds", type=float, default=d.seconds, help="limit of the whole run")
    ap.add_argument("--concurrency", type=int, default=d.concurrency)
    ap.add_argument("--timeout-ms", type=int, default=d.timeout_ms)
    ap.add_argument("--max-retry", type=int, default=d.max_retry)
    ap.add_argument("--connection-type", default=d.connection_type, choices=("single", "pooled", "short"))
    ap.add_argument("--backup-ms", type=int, default=d.backup_request_ms)
    ap.add_argument("--restart-every", type=float, default=d.restart_every_s)
    ap.add_argument("--down", type=float, default=d.down_s)
    ap.add_argument("--fault-every", type=float, default=d.fault_every_s)
    ap.add_argument("--fault", type=float, default=d.fault_s)
    ap.add_argument("--blackhole", type=float, default=d.blackhole_s)
    ap.add_argument("--no-retry-throttle", action="store_true",
                    help="ChannelOptions(retry_throttle=None): retries are never throttled")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    ap.add_argument("--pure", action="store_true", help="every module as Python (a process with AIOBRPC_NO_EXTENSIONS=1)")
    ap.add_argument("--json-only", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="show the client's warnings")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.CRITICAL)
    if a.pure:
        import pure  # bench/pure.py
        if pure.needs_own_process():
            raise SystemExit(pure.rerun(sys.argv[1:] if argv is None else argv))
    cfg = SoakConfig(calls=a.calls, seconds=a.seconds, concurrency=a.concurrency, timeout_ms=a.timeout_ms,
                     max_retry=a.max_retry, connection_type=a.connection_type,
                     backup_request_ms=a.backup_ms, restart_every_s=a.restart_every, down_s=a.down,
                     fault_every_s=a.fault_every, fault_s=a.fault, blackhole_s=a.blackhole,
                     retry_throttle=not a.no_retry_throttle, seed=a.seed)
    if a.loop == "uvloop":
        import uvloop
        result = uvloop.run(run_soak(cfg))
    else:
        result = asyncio.run(run_soak(cfg))
    result["loop"] = a.loop
    bad = violations(result)
    result["violations"] = bad
    print(json.dumps(result), flush=True)
    if not a.json_only:
        print(table(result))
        print("OK: every invariant held" if not bad else "FAILED:\n  " + "\n  ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
