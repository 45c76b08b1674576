"""`aiobrpc press` against `serve-echo` and `serve` processes, and its engine in process."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from aiobrpc import errors
from aiobrpc.errors import RpcError
from aiobrpc.press import LatencyHistogram, Press, plot_marks
from tests.cli.conftest import ROOT, assert_usage_error, cli_env, run_cli

ECHO = ["--proto", str(ROOT / "proto" / "echo.proto"), "--method", "example.EchoService/Echo"]
FIELDS = {"method", "server", "target_qps", "concurrency", "calls", "ok", "failed", "skipped", "elapsed_s", "qps",
          "latency_us", "errors"}

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="signals on subprocesses")


def press(server: str, *args: str, timeout: float = 30) -> tuple[subprocess.CompletedProcess, dict | None]:
    done = run_cli("press", *ECHO, "--server", server, "-q", *args, timeout=timeout)
    return done, json.loads(done.stdout) if "--json" in args and done.returncode != 2 else None


def test_count_run_prints_consistent_json(echo_address):
    done, out = press(echo_address, "--request", '{"message": "hi"}', "--count", "300", "--concurrency", "8",
                      "--attachment-size", "1000", "--json")
    assert done.returncode == 0, done.stderr
    assert set(out) == FIELDS
    assert (out["calls"], out["ok"], out["failed"], out["skipped"], out["errors"]) == (300, 300, 0, 0, [])
    assert (out["method"], out["server"], out["target_qps"], out["concurrency"]) == \
        ("example.EchoService/Echo", echo_address, 0, 8)
    lat = out["latency_us"]
    assert list(lat) == ["mean", "p50", "p90", "p99", "p999", "max"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p999"] <= lat["max"]
    assert lat["mean"] <= lat["max"]
    assert out["qps"] == pytest.approx(300 / out["elapsed_s"], rel=0.01)


def test_fixed_qps_is_kept_within_5_percent(echo_address):
    # The schedule is absolute: however noisy the latency, 200 calls are started each second.
    done, out = press(echo_address, "--request", '{"message": "hi"}', "--qps", "200", "--duration", "3", "--json")
    assert done.returncode == 0, done.stderr
    assert out["qps"] == pytest.approx(200, rel=0.05), out
    assert out["calls"] + out["skipped"] == pytest.approx(600, abs=2)
    assert out["elapsed_s"] == pytest.approx(3, rel=0.05)


def test_table_names_the_figures(echo_address):
    url = f"list://{echo_address},{echo_address}"
    done = run_cli("press", *ECHO, "--server", url, "--lb", "rr", "--request", '{"message": "hi"}',
                   "--count", "50", "--connection-type", "pooled")
    assert done.returncode == 0, done.stderr
    for word in ("calls", "QPS", "latency mean", "latency p50", "latency p99", "latency p999", "latency max"):
        assert word in done.stdout, done.stdout
    assert re.search(r"ok\W+50\W", done.stdout), done.stdout


@pytest.mark.parametrize("layout", ["array", "lines", "concatenated"])
def test_input_requests_round_robin_and_errors_by_code(flaky_address, tmp_path, layout):
    sent = [{"message": "ok"}, {"message": "bad"}, {"message": "crash"}, {"message": "fine"}]
    text = {"array": json.dumps(sent, indent=1), "lines": "\n".join(map(json.dumps, sent)) + "\n",
            "concatenated": "".join(map(json.dumps, sent))}[layout]
    path = tmp_path / "requests.json"
    path.write_text(text)
    done, out = press(flaky_address, "--input", str(path), "--count", "40", "--concurrency", "4", "--json")
    assert done.returncode == 1, done.stderr
    assert (out["calls"], out["ok"], out["failed"]) == (40, 20, 20)
    by_code = {e["code"]: e for e in out["errors"]}
    assert set(by_code) == {errors.EREQUEST, errors.EINTERNAL}
    assert by_code[errors.EREQUEST]["count"] == by_code[errors.EINTERNAL]["count"] == 10
    assert by_code[errors.EREQUEST]["name"] == "EREQUEST"
    assert by_code[errors.EREQUEST]["description"] == "Bad request"
    assert "bad is refused" in by_code[errors.EREQUEST]["text"]
    assert by_code[errors.EINTERNAL]["name"] == "EINTERNAL"


def test_timeouts_are_counted_as_erpctimedout(echo_address):
    done, out = press(echo_address, "--request", '{"message": "hi", "sleep_ms": 300}', "--timeout-ms", "30",
                      "--max-retry", "0", "--count", "6", "--concurrency", "3", "--json")
    assert done.returncode == 1, done.stderr
    assert (out["calls"], out["ok"], out["failed"]) == (6, 0, 6)
    assert [(e["code"], e["name"], e["count"]) for e in out["errors"]] == [(errors.ERPCTIMEDOUT, "ERPCTIMEDOUT", 6)]
    assert set(out["latency_us"].values()) == {None}


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_plot_writes_a_png(echo_address, tmp_path):
    png = tmp_path / "latency.png"
    done, _ = press(echo_address, "--request", '{"message": "hi"}', "--count", "200", "--plot", str(png))
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_marks_that_print_alike_share_one_label():
    # 200 calls: p999 is the slowest call, the max; drawn apart their labels were one over the other
    assert plot_marks([("p50", 120.0), ("p99", 480.2), ("p999", 950.4), ("max", 950.0)]) == [
        ("p50 120 us", 120.0), ("p99 480 us", 480.2), ("p999 = max 950 us", 950.4)]
    assert plot_marks([("p50", 7.0), ("p99", 7.0), ("p999", 7.0), ("max", 7.0)]) == [("p50 = p99 = p999 = max 7 us", 7.0)]
    assert [label for label, _ in plot_marks([("p50", 1.0), ("p99", 2.0), ("p999", 3.0), ("max", 4.0)])] == [
        "p50 1 us", "p99 2 us", "p999 3 us", "max 4 us"]


def test_plot_without_matplotlib_is_a_usage_error_before_any_call(echo_address, tmp_path):
    # matplotlib hidden (an import of it raises ImportError), as where it is not installed.
    code = ("import sys; sys.modules['matplotlib'] = None; from aiobrpc.cli import main; "
            f"sys.argv = ['aiobrpc', 'press', *{list(ECHO)!r}, '--server', {echo_address!r}, "
            f"'--request', '{{\"message\": \"hi\"}}', '--count', '5', '--plot', {str(tmp_path / 'x.png')!r}]; "
            "sys.exit(main())")
    done = subprocess.run([sys.executable, "-c", code], env=cli_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=30)
    assert_usage_error(done, "press", "--plot needs matplotlib: `pip install matplotlib`")
    assert not (tmp_path / "x.png").exists()


def test_sigint_ends_an_unbounded_run_with_the_figures(echo_address):
    proc = subprocess.Popen([sys.executable, "-m", "aiobrpc", "press", *ECHO, "--server", echo_address,
                             "--request", '{"message": "hi"}', "--qps", "100", "--json"], env=cli_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()  # the first progress line, after a second of calls
        assert " calls " in line, line + proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    figures = json.loads(out)
    assert figures["ok"] >= 50 and figures["failed"] == 0
    assert "Traceback" not in err


def test_closed_port_exits_1(tmp_path):
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done, out = press(f"127.0.0.1:{port}", "--request", '{"message": "hi"}', "--count", "5", "--json")
    assert done.returncode == 1, done.stderr
    assert out["ok"] == 0 and out["failed"] == 5
    assert {e["name"] for e in out["errors"]} <= {"ECONNREFUSED", "EHOSTDOWN"}


@pytest.mark.parametrize("args, message", [
    (["--proto", "missing.proto", "--method", "example.EchoService/Echo"], "proto file not found: missing.proto"),
    ([*ECHO[:2], "--method", "example.EchoService/Ping"], "no method 'Ping'"),
    ([*ECHO, "--request", '{"message": '], "--request: invalid JSON at line 1, column 13"),
    ([*ECHO, "--request", '{"mesage": "x"}'], '--request: line 1: example.EchoRequest has no field named "mesage"'),
    ([*ECHO, "--request", "{}"], "--request: line 1: example.EchoRequest lacks required fields: message"),
    ([*ECHO, "--request", '[{"message": "a"} {"message": "b"}]'], "--request: line 1: expected ',' or ']'"),
    ([*ECHO, "--request", '[{"message": "a"}'], "--request: the array of requests is not closed"),
    ([*ECHO, "--request", "[]"], "--request: no request in it"),
    ([*ECHO, "--input", "missing.json"], "cannot read --input missing.json: No such file or directory"),
    ([*ECHO, "--lb", "rr"], "--lb needs a naming service ADDR"),
    ([*ECHO, "--qps", "-1"], "argument --qps: must be >= 0"),
    ([*ECHO, "--connection-type", "udp"], "argument --connection-type: invalid choice"),
    ([*ECHO, "--input", "x.json", "--request", "{}"], "not allowed with argument"),
], ids=["proto", "method", "json", "field", "required", "array-comma", "array-open", "empty", "input", "lb", "qps",
        "connection-type", "input-and-request"])
def test_user_errors_exit_2_in_one_line(args, message):
    assert_usage_error(run_cli("press", "--server", "127.0.0.1:1", *args), "press", message)


def test_bad_request_in_input_names_its_line(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"message": "a"}\n{"message": "b", "sleep_ms": "x"}\n')
    done = run_cli("press", "--server", "127.0.0.1:1", *ECHO, "--input", str(path))
    assert done.returncode == 2
    assert done.stderr == (f"aiobrpc press: error: --input {path}: line 2: field \"sleep_ms\": "
                           "expected an integer, got \"x\"\n")


# -- the engine, in process -------------------------------------------------------------------
def test_histogram_percentiles_are_within_1_percent():
    rng = random.Random(7)
    values = sorted(int(rng.lognormvariate(12, 1.5)) + 1 for _ in range(20_000))
    h = LatencyHistogram()
    for v in values:
        h.record(v)
    for q in (0.5, 0.9, 0.99, 0.999, 1.0):
        exact = values[max(0, int(q * len(values) + 0.999999) - 1)]
        assert h.percentile(q) == pytest.approx(exact, rel=0.01)
    assert (h.count, h.max_ns, h.sum_ns) == (len(values), values[-1], sum(values))
    assert len(h.counts) < 4000  # fixed, whatever the calls


async def test_count_and_round_robin():
    seen = []

    async def call(request):
        seen.append(request)
        await asyncio.sleep(0)
        if request == "b":
            raise RpcError(errors.ELIMIT, "full")

    stats = await Press(call, ["a", "b", "c"], concurrency=5, count=30).run()
    assert sorted(seen) == ["a"] * 10 + ["b"] * 10 + ["c"] * 10
    assert (stats.calls, stats.ok, stats.failed, stats.errors) == (30, 20, 10, {errors.ELIMIT: [10, "full"]})


async def test_a_stall_skips_calls_beyond_100_ms_behind():
    starts = []
    stalled = False

    async def call(request):
        nonlocal stalled
        starts.append(time.monotonic())
        if not stalled and len(starts) == 20:
            stalled = True
            time.sleep(0.5)  # the loop is blocked: 500 calls fall due meanwhile

    stats = await Press(call, [None], qps=1000, concurrency=50, duration_s=1.0).run()
    # 100 ms of owed calls are started at once after the stall, the rest of it are given up.
    assert stats.skipped >= 300
    assert stats.calls + stats.skipped == pytest.approx(1000, abs=5)
    burst = sum(1 for t in starts if starts[19] + 0.5 <= t < starts[19] + 0.51)
    assert burst < 200  # 100 ms of calls plus those the callers had claimed before it
