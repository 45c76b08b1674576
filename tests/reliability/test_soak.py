"""A short run of bench/soak.py: a list:// cluster of three servers under 64 closed-loop
workers while server 0 is killed and restarted on its port and server 1's proxy blackholes,
resets, closes and refuses (docs/hostile_inputs.md E2, E3, E5-E7, brpc's docs/en/client.md).

The soak runs its own loop (asyncio.run), so it runs once per twin, not on both loops per
twin: the compiled twin on uvloop, the pure one on asyncio.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import uvloop

ROOT = Path(__file__).resolve().parents[2]


def load_soak():
    """bench/soak.py as a module (bench/ is not a package)."""
    if "bench_soak" in sys.modules:
        return sys.modules["bench_soak"]
    spec = importlib.util.spec_from_file_location("bench_soak", ROOT / "bench" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_soak"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_soak_loses_nothing_and_leaves_nothing_behind(twin):
    soak = load_soak()
    # Faults come fast so that each happens several times within the 8k calls.
    # seconds bounds the run only: it ends once its calls have (about 4 s here); a machine busy
    # enough to need more must not fail it for that (the pure build once did past 8.3 s).
    cfg = soak.SoakConfig(calls=8000, seconds=30.0, concurrency=64, timeout_ms=200,
                          health_check_interval_s=0.05, restart_every_s=0.15, down_s=0.05,
                          fault_every_s=0.06, fault_s=0.03, blackhole_s=0.25, seed=7)
    run = uvloop.run if twin == "cython" else asyncio.run
    r = run(soak.run_soak(cfg))
    assert soak.violations(r) == [], soak.table(r)
    assert r["issued"] == 8000 and r["lost"] == 0 and r["double"] == 0 and r["pending_after"] == 0
    assert not r["fds_leaked"] and r["tasks_after"] == r["tasks_before"]
    # The faults happened...
    assert r["restarts"] >= 2, soak.table(r)
    assert all(r["faults"].get(kind, 0) >= 1 for kind in soak.FAULTS), soak.table(r)
    stats = r["client_stats"]
    assert stats["servers_marked_down"] >= 2 and stats["servers_revived"] >= 1 and stats["retries"] > 0
    # ...and were survived: a healthy server was always there to retry on, so a call fails
    # only when its deadline passed (a blackhole: ERPCTIMEDOUT, or the attempt's own error
    # when it came in after the deadline but before the deadline's timer ran) or when the
    # retry throttle (ChannelOptions' default) refused its retry.
    not_timeouts = r["failed_total"] - r["failed"].get("ERPCTIMEDOUT", 0)
    assert not_timeouts <= stats["retries_throttled"] + r["failed_past_deadline"], soak.table(r)
    assert r["ok"] >= 7000, soak.table(r)
