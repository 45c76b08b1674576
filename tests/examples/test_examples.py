"""The programs of examples/ run and print what their docstrings promise (so they cannot rot).

Each runs as a subprocess on ephemeral ports on 127.0.0.1, against the twin under test.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.twins import pure_run_of_parent

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 60


@pytest.fixture
def env(twin):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("AIOBRPC_NO_EXTENSIONS", None)
    if twin == "python":
        env["AIOBRPC_NO_EXTENSIONS"] = "1"
    return env


# The 'train' extra pins torch for Python 3.11, and installs none elsewhere.
TORCH_MISSING = ("torch is not installed: pip install -e '.[train]'" if sys.version_info[:2] == (3, 11)
                 else "torch is not installed: the 'train' extra has it for Python 3.11 only")


def run(name: str, *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            return proc.stdout.readline()
        if proc.poll() is not None:
            break
    raise AssertionError(f"no line from the server in {timeout_s}s: {proc.stderr.read() if proc.poll() is not None else ''}")


def test_echo_client_and_server(env):
    server = subprocess.Popen([sys.executable, str(EXAMPLES / "echo_server.py"), "--port", "0"], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        m = re.fullmatch(r"listening on (127\.0\.0\.1:\d+)\n", read_line(server, TIMEOUT_S))
        assert m, "the server prints the address it listens on"
        address = m.group(1)

        ok = run("echo_client.py", address, "--message", "hi", env=env)
        assert ok.returncode == 0, ok.stderr
        assert re.fullmatch(rf"response: 'hi', attachment: 1024 bytes, from {address} in \d+ us\n", ok.stdout)

        bad = run("echo_client.py", address, "--message", "", env=env)
        assert bad.returncode == 1
        assert "message must not be empty (code 1003)" in bad.stderr

        server.send_signal(signal.SIGINT)
        out, err = server.communicate(timeout=TIMEOUT_S)
        assert server.returncode == 0, err
        assert out == "stopped\n"
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()


def test_echo_client_reports_a_server_that_is_not_there(env):
    # Port 1 on loopback: nothing listens there.
    r = run("echo_client.py", "127.0.0.1:1", env=env)
    assert r.returncode == 1
    assert "failed: [E111]Fail to connect 127.0.0.1:1" in r.stderr


def test_echo_client_tells_a_malformed_address_in_one_line(env):
    r = run("echo_client.py", "nonsense", env=env)
    assert r.returncode == 2
    assert r.stderr == "bad address: address must look like 'host:port' with a port in 1..65535, got 'nonsense'\n"


@pytest.mark.parametrize("args, why", [
    (["--port", "70000"], "port must be in 0..65535 (0 = any), got 70000"),
    (["--host", "nohost.invalid", "--port", "0"], ""),  # the resolver's words
], ids=["port", "host"])
def test_echo_server_that_cannot_listen_says_why_in_one_line(env, args, why):
    r = run("echo_server.py", *args, env=env)
    assert r.returncode == 1 and r.stdout == ""
    address = f"{args[1] if args[0] == '--host' else '127.0.0.1'}:{args[-1]}"
    assert r.stderr.startswith(f"cannot listen on {address}: {why}") and r.stderr.count("\n") == 1, r.stderr


# Each is run with the module made unimportable (None in sys.modules), as where it is not installed.
RUN_WITHOUT = ("import runpy, sys; sys.modules[sys.argv[1]] = None; sys.argv = sys.argv[2:]; "
               "runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.parametrize("name, module, hint", [
    ("numpy_attachments.py", "numpy", "numpy is not installed: pip install numpy"),
    ("ps_train.py", "numpy", "numpy is not installed: pip install numpy"),
    ("grpc_chat.py", "grpc", "grpcio is not installed: pip install grpcio"),
    ("train_three_ways.py", "torch", "torch is not installed: pip install torch (the 'train' extra pins it for "
                                     "Python 3.11)"),
    ("pipeline_parallel.py", "torch", "torch is not installed: pip install torch (the 'train' extra pins it for "
                                      "Python 3.11)"),
    ("fsdp_train.py", "torch", "torch is not installed: pip install torch (the 'train' extra pins it for "
                               "Python 3.11)"),
])
def test_an_example_says_which_optional_package_is_missing(env, name, module, hint):
    r = subprocess.run([sys.executable, "-c", RUN_WITHOUT, module, str(EXAMPLES / name)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == hint + "\n"


def test_cluster_retries_and_backups(env):
    r = run("cluster.py", env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    calls = [line for line in lines if line.startswith("call ")]
    assert len(calls) == 6
    assert all(re.match(r"call \d from (fast|slow) ", line) for line in calls), "every call succeeds"
    assert any(re.search(r"retried_count=[1-9]", line) for line in calls)
    assert any("has_backup_request=True" in line for line in calls)
    assert any("down:111" in line for line in calls), "the down server refused a connection"
    stats = dict(re.findall(r"(\w+)=(\d+)", next(line for line in lines if line.startswith("ClientStats("))))
    assert int(stats["retries"]) >= 1 and int(stats["backup_requests"]) >= 1
    assert int(stats["servers_marked_down"]) == 1
    assert lines[-1] == "{'fast': 'up', 'slow': 'up', 'down': 'down'}"


def test_numpy_attachments(env):
    r = run("numpy_attachments.py", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "doubled float32 (3, 4)",
        "[[ 0.  2.  4.  6.]",
        " [ 8. 10. 12. 14.]",
        " [16. 18. 20. 22.]]",
        "is a view: True",
        "a.T: [E1003]Fail to pack request: buffer must be C-contiguous to be sent without a copy",
        "doubled float32 (4, 3)",
        "kept a copy: True",
    ]


def test_kv_service_from_a_proto(env, tmp_path):
    # As examples/README.md tells a user: only --python_out, no gRPC plugin.
    protoc = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{EXAMPLES / 'proto'}",
                             f"--python_out={tmp_path}", str(EXAMPLES / "proto" / "kv.proto")],
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert protoc.returncode == 0, protoc.stderr
    assert (tmp_path / "kv_pb2.py").exists()

    path = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH")) if p)
    r = run("kv_service.py", env=dict(env, PYTHONPATH=path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert re.fullmatch(r"listening on 127\.0\.0\.1:\d+", lines[0])
    assert lines[1:] == [
        "serving example.kv.KvService/Put",
        "serving example.kv.KvService/Get",
        "Get color: found=True value=b'blue'",
        f"Put with an empty key: code=1003 [E1003][{lines[0].split()[-1]}][E1003]key must not be empty",
    ]


def test_grpc_chat_serves_grpcio_aiobrpc_grpc_and_baidu_std_on_one_port(env, tmp_path):
    protoc = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{EXAMPLES / 'proto'}",
                             f"--python_out={tmp_path}", str(EXAMPLES / "proto" / "chat.proto")],
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert protoc.returncode == 0, protoc.stderr
    path = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH")) if p)
    r = run("grpc_chat.py", env=dict(env, PYTHONPATH=path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "grpcio: you said 'hello'", "grpcio: news #1", "grpcio: news #2",
        "aiobrpc gRPC Say: you said 'hi'",
        "aiobrpc gRPC Subscribe: sports #1", "aiobrpc gRPC Subscribe: sports #2", "aiobrpc gRPC Subscribe: sports #3",
        "aiobrpc gRPC Upload: 3 lines, 11 characters",
        "aiobrpc gRPC Talk: PING", "aiobrpc gRPC Talk: PONG",
        "baidu_std Say: you said 'hey'",
    ]


def test_kv_service_says_how_to_make_the_pb2_module(env):
    r = run("kv_service.py", env=env)
    assert r.returncode == 1
    assert "kv_pb2 not found: generate it with grpc_tools.protoc" in r.stderr


def test_ps_train_two_workers_two_shards(env):
    r = run("ps_train.py", "--steps", "40", env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "mode sync, 2 workers, 2 shards" and lines[1].split() == ["step", "worker0", "worker1"]
    first, last = [list(map(float, line.split()[1:])) for line in (lines[2], lines[-1])]
    assert lines[-1].split()[0] == "39" and all(b < a / 20 for a, b in zip(first, last)), r.stdout


def test_train_three_ways_quick(env, twin, tmp_path):
    pytest.importorskip("torch", reason=TORCH_MISSING)
    pytest.importorskip("matplotlib", reason="matplotlib (the 'train' extra) draws the loss curves")
    if pure_run_of_parent():
        pytest.skip("runs once, with the compiled twin in the parent process: torch's start-up costs "
                    "seconds, and the twins are covered by tests/training")
    plot = tmp_path / "curves.png"
    r = run("train_three_ways.py", "--quick", "--plot", str(plot), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == "", "no warnings"
    lines = r.stdout.splitlines()
    assert lines[:2] == ["2 processes, 20 steps, batch 32 per rank, SGD lr 0.2", "way          final loss  wall s"]
    table = {way: (float(loss), float(seconds)) for way, loss, seconds in map(str.split, lines[2:5])}
    assert list(table) == ["ddp/gloo", "ddp/aiobrpc", "ps"]
    losses = [loss for loss, _ in table.values()]
    assert max(losses) < 1.25, "well below ln(4) = 1.39, where it starts: it learned"  # 1.1079 here
    assert max(losses) - min(losses) < 1e-3, "the same arithmetic three ways"
    differences = [float(re.fullmatch(rf"max \|{way} - ddp/gloo\| over the parameters: (\S+)", line).group(1))
                   for way, line in zip(["ddp/aiobrpc", "ps"], lines[5:7])]
    assert all(d < 1e-4 for d in differences), r.stdout
    assert lines[7:] == [f"plot: {plot}"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("stages, schedule", [(2, "1f1b"), (3, "gpipe")])
def test_pipeline_parallel_trains_what_one_process_trains(env, stages, schedule):
    pytest.importorskip("torch", reason=TORCH_MISSING)
    r = subprocess.run([sys.executable, str(EXAMPLES / "pipeline_parallel.py"), "--stages", str(stages),
                        "--schedule", schedule, "--steps", "6"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    lines = r.stdout.splitlines()
    assert [line.split()[:2] for line in lines[:6]] == [["step", str(k)] for k in range(6)], r.stdout
    m = re.fullmatch(rf"{stages} stages, {schedule}: every stage moved \(at least (\S+) from its initial weights\); "
                     r"the largest difference from the model trained in one process is (\S+) \(within float rounding\)",
                     lines[6])
    assert m and float(m.group(1)) > 0 and float(m.group(2)) <= 1e-5, r.stdout


def test_fsdp_train_resumes_after_a_killed_rank_to_the_same_parameters(env):
    """torchrun --max-restarts=1: the last rank dies in step 6, every rank is started again,
    loads the checkpoint of step 5 and ends where an uninterrupted run ends, bit for bit."""
    pytest.importorskip("torch", reason=TORCH_MISSING)
    r = subprocess.run([sys.executable, str(EXAMPLES / "fsdp_train.py"), "--steps", "8", "--kill-at", "5"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    out = r.stdout
    assert "attempt 0: rank 1 exits in step 5" in out
    assert "attempt 1: resumed from the checkpoint of step 4" in out
    assert "attempt 1: step 4 loss" not in out and "attempt 1: step 7 loss" in out
    # the peer's pending collective failed naming the dead rank (its traceback is torchrun's stderr)
    assert re.search(r"CollectiveError: .* failed on rank 0: rank 1 \(127\.0\.0\.1:\d+\)", r.stderr), r.stderr[-4000:]
    assert out.splitlines()[-1] == "the restarted run ends with the same parameters as the uninterrupted one, bit for bit"
    restarted = re.findall(r"attempt 1: step (\d+) loss (\S+)", out)
    uninterrupted = dict(re.findall(r"attempt 0: step (\d+) loss (\S+)", out.split("== uninterrupted")[1]))
    assert restarted and all(uninterrupted[step] == loss for step, loss in restarted)
