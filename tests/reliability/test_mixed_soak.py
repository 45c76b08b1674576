"""A short run of bench/mixed_soak.py: unary baidu_std, HTTP/JSON, gRPC unary, server-streaming
and bidi, and brpc streams at once against three server processes behind a file:// naming
service, while servers are SIGKILLed and restarted, a second client process is SIGKILLed
mid-call, a third floods server 0 with hostile connections and slow readers stall big streams.

It asserts the soak's invariants (no call lost, completed twice or answered wrongly; streams in
order; every process's fds, tasks and handlers back to their baseline after each phase;
nothing reaching a loop's exception handler), and that the faults did happen. No timing is
asserted. The netns variant runs where `unshare --net` and nft work (root), else skips.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.helpers.netns import netns_available

ROOT = Path(__file__).resolve().parents[2]


def load_mixed_soak():
    """bench/mixed_soak.py as a module (bench/ is not a package)."""
    if "bench_mixed_soak" in sys.modules:
        return sys.modules["bench_mixed_soak"]
    spec = importlib.util.spec_from_file_location("bench_mixed_soak", ROOT / "bench" / "mixed_soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_mixed_soak"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def short_config(soak, **over):
    # Faults come fast, so that each kind happens within a few seconds of load. RSS flatness
    # within 5 % is a property of a long run (bench/mixed_soak.py's default, docs/soak.md): in
    # 4-second phases the client is still warming up (it grew 4-6 MiB over the first phases in
    # runs here), so this run only catches gross growth.
    # calls enough for two whole fault phases however fast the machine: the faults come by time
    cfg = dict(calls=20000, seconds=40.0, concurrency=24, servers=3, phase_seconds=3.0, warmup_seconds=1.5,
               kill_every_s=0.8, down_s=0.2, victim_every_s=0.8, hostile_rate=20.0, slow_every_s=1.0,
               net_every_s=0.5, settle_s=8.0, warm_phases=1, rss_tolerance=0.3, seed=11)
    cfg.update(over)
    return soak.MixedConfig(**cfg)


def assert_invariants(soak, r):
    table = soak.table(r)
    assert r["violations"] == [], table
    assert r["issued"] > 0 and r["phases"] >= 2, table
    assert r["lost"] == 0 and r["double"] == 0 and r["wrong"] == 0 and r["gaps"] == 0, table
    assert r["unexpected"] == 0 and r["loop_errors"] == [], table
    for kind, rec in r["kinds"].items():  # every kind was called, and most calls succeeded
        assert rec["issued"] > 0 and rec["ok"] > 0, (kind, table)
    # the series: one sample per phase, of the client and every server
    assert len(r["series"]) == r["phases"]
    assert all(len(s["procs"]) == 1 + r["config"]["servers"] for s in r["series"])


def test_mixed_soak_keeps_every_invariant_under_faults():
    soak = load_mixed_soak()
    r = asyncio.run(soak.run_mixed_soak(short_config(soak)))
    assert_invariants(soak, r)
    faults = r["faults"]
    assert faults.get("server_killed", 0) >= 1, soak.table(r)
    assert faults.get("client_killed", 0) >= 1, soak.table(r)
    assert faults.get("slow_reader_grpc", 0) + faults.get("slow_reader_strm", 0) >= 1, soak.table(r)
    assert sum(v for k, v in faults.items() if k.startswith("hostile_")) >= 1, soak.table(r)


def test_mixed_soak_in_a_network_namespace():
    reason = netns_available()
    if reason is not None:
        if os.environ.get("AIOBRPC_REQUIRE_TOOLS") == "1":
            pytest.fail(f"network namespace faults are unavailable: {reason}")
        pytest.skip(f"network namespace faults need root, unshare, ip and nft: {reason}")
    import json
    import subprocess
    import tempfile
    soak = load_mixed_soak()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        # a session of its own: the soak runs again inside `unshare`, and a timeout must kill both
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "mixed_soak.py"), "--netns", "--calls", "20000",
             "--seconds", "40", "--concurrency", "24", "--phase-seconds", "3", "--warmup-seconds", "1.5",
             "--kill-every", "0.8", "--down", "0.2", "--victim-every", "0.8", "--hostile-rate", "20",
             "--slow-every", "1", "--net-every", "0.5", "--warm-phases", "1", "--rss-tolerance", "0.3",
             "--seed", "12", "--loop", "asyncio", "--json", out],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            pytest.fail(f"the soak (--seconds 40) was still running after 150 s:\n{stdout}\n{stderr[-6000:]}")
        assert os.path.exists(out), stdout + stderr
        with open(out) as f:
            r = json.load(f)
    assert_invariants(soak, r)
    assert proc.returncode == 0, stdout
    assert sum(v for k, v in r["faults"].items() if k.startswith("net_")) >= 1, soak.table(r)


def test_the_loop_watch_counts_a_stall_and_tells_a_busy_loop_from_an_unscheduled_one():
    """The soak's "lost" check does not count time its own loop could not run: the watch must
    see a stall, whether the loop thread was busy (a blocking callback) or not running (here a
    sleep, as when the kernel does not schedule the process)."""
    import time

    from bench.mixed_soak_parts.loop_watch import LoopWatch

    async def main():
        watch = LoopWatch(tick=0.01)
        watch.start()
        await asyncio.sleep(0.05)
        before = watch.stalled()
        time.sleep(0.3)  # the loop blocked, its thread idle
        assert watch.stalled() - before >= 0.25  # a stall still going on counts at once
        await asyncio.sleep(0.05)
        idle = watch.worst
        assert idle[0] >= 0.25 and idle[1] < idle[0] / 2, idle
        watch.worst = (0.0, 0.0)
        end = time.thread_time() + 0.4
        while time.thread_time() < end:  # the loop blocked, its thread busy
            pass
        await asyncio.sleep(0.05)
        busy = watch.worst
        watch.stop()
        assert busy[0] >= 0.3 and busy[1] >= 0.3, busy
    asyncio.run(main())
