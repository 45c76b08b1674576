"""Long-tail benchmark: do slow calls delay the normal calls beside them?

    python bench/longtail.py              # about a minute: 3 pairs of 5 s runs
    python bench/longtail.py --quick      # under 20 s: 1 pair of 3 s runs
    python bench/longtail.py --plots docs/img

aiobrpc (compiled twins, uvloop) with the echo server of bench/echo.py in another process and
an open-loop client in this one: calls are started at a fixed rate (5000/s by default) whether
or not earlier ones have returned, each in its own task, on one connection, with a 16-byte
attachment. The rate is first checked for 2 s (1 s with --quick): if this machine cannot
start the calls on time or the calls in flight keep growing, the rate is lowered by a fifth
until it can, and the rate used is reported.

Then pairs of runs, each after a 1 s warm-up at the rate: "normal", where every call is
normal, and "with slow", where every 100th call (1 %) asks the handler to sleep 5 ms
(sleep_ms=5). Reported for the NORMAL calls of each run: p50/p99/p99.9 latency from the
moment the call was started (and, in the JSON, from the moment it was due, which adds the
pacer's lag), and the ratio p99(with slow) / p99(normal); with several pairs the figures are
the medians over the pairs. A server that handles each request in its own task keeps the
ratio near 1; head-of-line blocking would push it towards 5 ms / p99.

The last line printed is one JSON object; it is also written to bench/results/longtail-*.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import echo

sys.path.insert(0, str(echo.ROOT))

SLOW_EVERY = 100
SLOW_MS = 5


class OpenLoop:
    """Start calls at `rate` per second for `seconds`; record each call's latency."""

    def __init__(self, stub, rate: float, payload, server_pid: int) -> None:
        import aiobrpc
        from aiobrpc._proto import echo_pb2
        self.echo = stub.Echo
        self.rate = rate
        self.payload = payload
        self.server_pid = server_pid
        self.Request = echo_pb2.EchoRequest
        self.Controller = aiobrpc.Controller
        self.RpcError = aiobrpc.RpcError

    async def run(self, seconds: float, slow_every: int, slow_ms: int, warmup: float) -> dict:
        loop = asyncio.get_running_loop()
        clock = time.perf_counter
        rate = self.rate
        n_warm = int(rate * warmup)
        n_total = n_warm + int(rate * seconds)
        # per call: due time, start time, end time, slow?, ok?
        due_at = np.zeros(n_total)
        started = np.zeros(n_total)
        ended = np.zeros(n_total)
        slow = np.zeros(n_total, dtype=bool)
        ok = np.zeros(n_total, dtype=bool)
        inflight = 0
        max_inflight = 0
        tasks: set = set()
        echo_call, Request, Controller, RpcError, payload = (self.echo, self.Request, self.Controller,
                                                             self.RpcError, self.payload)

        async def one(i: int, sleep_ms: int) -> None:
            nonlocal inflight
            cntl = Controller()
            cntl.request_attachment = payload
            started[i] = clock()
            try:
                await echo_call(Request(message="x", sleep_ms=sleep_ms), cntl)
                ok[i] = True
            except RpcError:
                pass
            ended[i] = clock()
            inflight -= 1

        t0 = clock() + 0.005
        m0 = echo.machine_cpu_seconds()[0] - echo.client_cpu_seconds() - echo.server_cpu_seconds(self.server_pid)
        i = 0
        while i < n_total:
            due = min(n_total, int((clock() - t0) * rate) + 1)
            while i < due:
                is_slow = slow_every > 0 and i % slow_every == slow_every - 1
                slow[i] = is_slow
                due_at[i] = t0 + i / rate
                task = loop.create_task(one(i, slow_ms if is_slow else 0))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                inflight += 1
                i += 1
            if inflight > max_inflight:
                max_inflight = inflight
            delay = t0 + i / rate - clock()
            await asyncio.sleep(delay if delay > 0 else 0)
        send_end = clock()
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        m1 = echo.machine_cpu_seconds()[0] - echo.client_cpu_seconds() - echo.server_cpu_seconds(self.server_pid)

        window = slice(n_warm, n_total)
        d, s, e, sl, good = due_at[window], started[window], ended[window], slow[window], ok[window]
        normal = good & ~sl
        lag = s - d
        out = {
            "rate_target": rate,
            "rate_started": len(d) / (s.max() - s.min()) if len(d) > 1 else 0.0,
            "calls": int(len(d)), "failed": int((~good).sum()),
            "normal_calls": int(normal.sum()), "slow_calls": int((good & sl).sum()),
            "max_inflight": max_inflight,
            "start_lag_p50_us": float(np.percentile(lag, 50) * 1e6),
            "start_lag_max_us": float(lag.max() * 1e6),
            "send_overrun_ms": (send_end - (t0 + n_total / rate)) * 1e3,
            # CPUs busy with other processes of the machine meanwhile: noise
            "other_cpus": max(0.0, m1 - m0) / (clock() - t0),
        }
        for key, mask in (("normal", normal), ("slow", good & sl)):
            if not mask.any():
                continue
            lat = (e[mask] - s[mask]) * 1e6
            lat_due = (e[mask] - d[mask]) * 1e6
            p = np.percentile(lat, [50, 99, 99.9])
            pd = np.percentile(lat_due, [50, 99, 99.9])
            out.update({f"{key}_p50_us": float(p[0]), f"{key}_p99_us": float(p[1]),
                        f"{key}_p999_us": float(p[2]), f"{key}_from_due_p50_us": float(pd[0]),
                        f"{key}_from_due_p99_us": float(pd[1]), f"{key}_from_due_p999_us": float(pd[2])})
            if key == "normal":
                out["normal_cdf_us"] = np.percentile(lat, np.linspace(0, 100, echo.CDF_POINTS)).round(1).tolist()
        return out


def sustained(r: dict) -> bool:
    """Calls started on time (the pacer kept up) and none failed."""
    return r["failed"] == 0 and r["send_overrun_ms"] < 20 and r["rate_started"] >= 0.97 * r["rate_target"]


async def client(port: int, server_pid: int, args) -> dict:
    import aiobrpc
    from aiobrpc import _fast
    from aiobrpc._proto import echo_pb2
    if _fast.IMPLEMENTATION != "cython":
        raise SystemExit("the compiled twins are not built: python setup.py build_ext --inplace")
    channel = aiobrpc.Channel(f"127.0.0.1:{port}", aiobrpc.ChannelOptions(timeout_ms=5000, max_retry=0))
    stub = aiobrpc.Stub(channel, echo_pb2.DESCRIPTOR.services_by_name["EchoService"])
    payload = np.arange(16, dtype=np.uint8)
    try:
        rate = float(args.rate)
        probes = []
        while True:
            r = await OpenLoop(stub, rate, payload, server_pid).run(args.probe, 0, 0, 0.3)
            probes.append({k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()
                           if not k.endswith("cdf_us")})
            print(json.dumps({"probe": probes[-1]}), flush=True)
            if sustained(r) or rate <= 100:
                break
            rate = round(rate * 0.8)
        pairs = []
        for n in range(args.pairs):
            if args.settle > 0:
                echo.wait_quiet(args.settle)
            pair = {}
            for name, every in (("normal", 0), ("with_slow", SLOW_EVERY)):
                r = await OpenLoop(stub, rate, payload, server_pid).run(args.seconds, every, SLOW_MS, 1.0)
                pair[name] = r
                short = {k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()
                         if not k.endswith("cdf_us") and "from_due" not in k}
                print(json.dumps({"pair": n, "run": name, **short}), flush=True)
            pair["p99_ratio"] = pair["with_slow"]["normal_p99_us"] / pair["normal"]["normal_p99_us"]
            pairs.append(pair)
        return {"rate": rate, "rate_requested": args.rate, "probes": probes, "pairs": pairs}
    finally:
        await channel.close()


def summarize(res: dict) -> dict:
    def med(run: str, key: str) -> float:
        return statistics.median(p[run][key] for p in res["pairs"])
    s = {"rate": res["rate"], "rate_requested": res["rate_requested"], "pairs": len(res["pairs"])}
    for run in ("normal", "with_slow"):
        for k in ("normal_p50_us", "normal_p99_us", "normal_p999_us", "normal_from_due_p50_us",
                  "normal_from_due_p99_us", "max_inflight", "rate_started", "other_cpus"):
            s[f"{run}.{k}"] = med(run, k)
    s["with_slow.slow_p50_us"] = med("with_slow", "slow_p50_us")
    s["p99_ratio"] = statistics.median(p["p99_ratio"] for p in res["pairs"])
    s["p99_ratio_all"] = [round(p["p99_ratio"], 3) for p in res["pairs"]]
    return s


def table(s: dict, markdown: bool = False) -> str:
    head = ["run", "normal calls p50", "normal calls p99", "normal calls p99.9", "max in flight",
            "other CPUs"]
    lines = []
    for run, label in (("normal", "all calls normal"), ("with_slow", f"1% of calls sleep {SLOW_MS} ms")):
        lines.append([label, echo.fmt_lat(s[f"{run}.normal_p50_us"]), echo.fmt_lat(s[f"{run}.normal_p99_us"]),
                      echo.fmt_lat(s[f"{run}.normal_p999_us"]), f"{s[f'{run}.max_inflight']:.0f}",
                      f"{s[f'{run}.other_cpus']:.2f}"])
    return echo._render(head, lines, markdown)


def plot(res: dict, s: dict, outdir: Path, date: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    outdir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    q = np.linspace(0, 1, echo.CDF_POINTS)
    # the pair whose ratio is the median one
    pair = sorted(res["pairs"], key=lambda p: p["p99_ratio"])[(len(res["pairs"]) - 1) // 2]
    for run, style, label in (("normal", "-", "all calls normal"),
                              ("with_slow", "--", f"1% of calls sleep {SLOW_MS} ms (normal calls shown)")):
        ax.plot(pair[run]["normal_cdf_us"], q, style, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("latency of normal calls (us)")
    ax.set_ylabel("fraction of calls")
    ax.set_title(f"aiobrpc open loop at {s['rate']:.0f} calls/s ({date[:10]}, uvloop, 2-core VM)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = outdir / "longtail_cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one pair of 3 s runs, 1 s probe (under 20 s)")
    p.add_argument("--rate", type=int, default=5000, help="calls started per second (default 5000)")
    p.add_argument("--seconds", type=float, help="length of each run (default 5, --quick 3)")
    p.add_argument("--pairs", type=int, help="pairs of runs (default 3, --quick 1)")
    p.add_argument("--settle", type=float, help="before each pair wait up to this many seconds for "
                   "other processes to use < 0.3 CPUs (default 60, --quick 0)")
    p.add_argument("--plots", metavar="DIR", help="write longtail_cdf.png here and print a markdown table")
    args = p.parse_args(argv)
    args.seconds = args.seconds or (3.0 if args.quick else 5.0)
    args.pairs = args.pairs or (1 if args.quick else 3)
    args.probe = 1.0 if args.quick else 2.0
    if args.settle is None:
        args.settle = 0.0 if args.quick else 60.0

    env = echo.impl_env("a", None)
    server, port, detail = echo.start_server("a", "uvloop", env)
    started = time.perf_counter()
    try:
        if detail != "cython":
            raise SystemExit("the server runs the pure twins: python setup.py build_ext --inplace")
        machine = echo.machine_info()
        res = echo.run_loop(client(port, server.pid, args), "uvloop")
    finally:
        echo.stop_server(server)
    s = summarize(res)
    date = datetime.datetime.now().isoformat(timespec="seconds")
    print(f"\n== long tail: aiobrpc compiled, uvloop, open loop at {s['rate']:.0f} calls/s "
          f"(requested {s['rate_requested']}), median of {s['pairs']} pair(s) of {args.seconds:g} s runs ==")
    print(table(s))
    target = "met" if s["p99_ratio"] <= 1.2 else "MISSED"
    print(f"\np99 of normal calls, with slow / without: {s['p99_ratio']:.2f}x "
          f"(each pair: {', '.join(f'{x:.2f}x' for x in s['p99_ratio_all'])}); target <= 1.2: {target}")
    print(f"slow calls p50: {echo.fmt_lat(s['with_slow.slow_p50_us'])}")
    if args.plots:
        print("\n" + table(s, markdown=True))
        print(f"wrote {plot(res, s, Path(args.plots), date)}")
    result = {"date": date, "machine": machine, "quick": args.quick, "seconds": args.seconds,
              "wall_seconds": round(time.perf_counter() - started, 1), "summary": s, **res}
    echo.RESULTS.mkdir(exist_ok=True)
    stamp = date.replace(":", "").replace("-", "")
    for path in (echo.RESULTS / f"longtail-{stamp}{'-quick' if args.quick else ''}.json",
                 echo.RESULTS / "longtail-latest.json"):
        path.write_text(json.dumps(result, indent=1))
    print(json.dumps({"summary": s}))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
