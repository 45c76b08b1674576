"""`aiobrpc serve MODULE[:ATTR]`: the servicers of a module served until SIGINT/SIGTERM."""

from __future__ import annotations

import json
import signal
import sys

import pytest

from tests.cli.conftest import ROOT, SERVICERS, assert_usage_error, run_cli, served

ECHO = ["example.EchoService/Echo", "--proto", str(ROOT / "proto" / "echo.proto")]

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="signals on subprocesses")


def test_serves_every_servicer_of_a_file(flaky_address):
    done = run_cli("call", flaky_address, *ECHO, "-d", '{"message": "hi"}')
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"message": "hi"}
    done = run_cli("call", flaky_address, *ECHO, "-d", '{"message": "bad"}')
    assert done.returncode == 1
    assert done.stderr.startswith("call failed: [E1003]") and "bad is refused" in done.stderr, done.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_named_servicer_of_a_dotted_module_stops_on_signal(signum):
    with served("serve", "tests.cli.servicers:FlakyEchoService", "--max-concurrency", "10",
                "--no-builtin-services") as (proc, address, label):
        assert label == "example.EchoService"
        done = run_cli("call", address, *ECHO, "-d", '{"message": "before"}')
        assert done.returncode == 0, done.stderr
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert f"got {signum.name}, stopping" in err
    assert "Traceback" not in err


ECHO_IMPORT = "from aiobrpc import Servicer\nfrom aiobrpc._proto import echo_pb2\n"
SERVICE = "    SERVICE = echo_pb2.DESCRIPTOR.services_by_name['EchoService']\n"


@pytest.mark.parametrize("source, attr, message", [
    (None, "", "no module named 'nope.services'"),
    ("x = 1\n", "", "defines no aiobrpc.Servicer subclass"),
    (ECHO_IMPORT + "class A(Servicer):\n    pass\n", "", "A has no SERVICE: set SERVICE = "),
    (ECHO_IMPORT + "class A(Servicer):\n" + SERVICE + "    def __init__(self, store):\n        pass\n", "",
     "A cannot be made with no argument (missing a required argument: 'store')"),
    (ECHO_IMPORT + "class A(Servicer):\n" + SERVICE, ":B", "has no attribute 'B'"),
    ("x = 1\n", ":x", ":x is 'int', not an aiobrpc.Servicer subclass or instance"),
    ("import nope_not_a_module\n", "", "failed: ModuleNotFoundError: No module named 'nope_not_a_module'"),
    (ECHO_IMPORT + "class A(Servicer):\n" + SERVICE + "class B(Servicer):\n" + SERVICE, "",
     "service example.EchoService is already added"),
], ids=["module", "no-servicer", "no-service", "constructor", "attr", "not-servicer", "import-fails", "twice"])
def test_user_errors_exit_2_in_one_line(tmp_path, source, attr, message):
    if source is None:
        target = "nope.services"
    else:
        target = str(tmp_path / "services.py")
        (tmp_path / "services.py").write_text(source)
    assert_usage_error(run_cli("serve", target + attr, "--port", "0"), "serve", message)


def test_a_base_class_without_service_is_not_served(tmp_path):
    (tmp_path / "services.py").write_text(ECHO_IMPORT + "class Base(Servicer):\n    pass\n"
                                          "class A(Base):\n" + SERVICE)
    with served("serve", str(tmp_path / "services.py")) as (proc, address, label):
        assert label == "example.EchoService"


def test_a_missing_file_exits_2():
    done = run_cli("serve", str(SERVICERS.with_name("missing.py")))
    assert done.returncode == 2
    assert done.stderr == f"aiobrpc serve: error: no such file: {SERVICERS.with_name('missing.py')}\n"
