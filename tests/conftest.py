"""Every test runs against both twins of aiobrpc (compiled and pure) and on both loops.

This process runs the suite on the twin it imported: the compiled one where it is built. The
pure twin (every module as Python: the _py twins of the _fast kernels and the sources of the
modules compiled in place, aiobrpc/_compiled.py) cannot be swapped into the same process, so
a second pytest process started with AIOBRPC_NO_EXTENSIONS=1 runs the same selection beside
this one; its output is printed at the end and its outcome is part of the exit status.
`--twins this` runs only this process's twin.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import tempfile
import weakref

import pytest
import uvloop
from hypothesis import HealthCheck, settings

import aiobrpc
from aiobrpc import _fast
from tests.helpers.twins import PURE_RUN_ENV, pure_run_of_parent

_PURE_RUN = pytest.StashKey[tuple]()

# The compiled and pure kernels side by side, and the split into two processes: the parent runs these.
_PARENT_ONLY = ("test_twins_differential.py", "test_twin_processes.py")
# Code that does not depend on the twin (the command line's tools, the stub generator and its
# mypy run, the blocking facade, the sans-IO gRPC codec, the docs) runs once: in the pure
# child when there is one, since the compiled parent is the longer of the two processes, else
# here. The call path under it is tested on both twins by the rest of the suite.
_ONCE_DIRS = ("cli", "tools", "sync", "grpc", "docs")

settings.register_profile("aiobrpc", suppress_health_check=[HealthCheck.function_scoped_fixture],
                          deadline=None)
settings.load_profile("aiobrpc")


@pytest.fixture(params=[_fast.IMPLEMENTATION], autouse=True)
def twin(request):
    """The twin under test in this process: "cython" or "python" (in the test ids too)."""
    return request.param


def pytest_collection_modifyitems(config, items):
    if pure_run_of_parent():
        dropped = [item for item in items if item.path.name in _PARENT_ONLY]
    elif config.stash.get(_PURE_RUN, None) is not None:  # the pure child runs beside this process
        dropped = [item for item in items if _run_once(item)]
    else:
        return
    if dropped:
        ids = {id(item) for item in dropped}
        items[:] = [item for item in items if id(item) not in ids]
        config.hook.pytest_deselected(items=dropped)


def pytest_collection_finish(session):
    # Everything alive once the tests are collected (modules, descriptors, test functions) lives
    # to the end: frozen, the full collections that loop_errors runs after each test skip it
    # (30 ms each otherwise here: with them the suite took twice as long).
    gc.collect()
    gc.freeze()


def _run_once(item) -> bool:
    return item.path.parent.name in _ONCE_DIRS and item.path.parent.parent.name == "tests"


def pytest_addoption(parser):
    parser.addoption("--twins", choices=("both", "this"), default="both",
                     help="both (default): where the compiled twin is built, also run the selected "
                          "tests on the pure twin in a second process; this: only this process's twin")


def pytest_sessionstart(session):
    config = session.config
    if (config.getoption("twins") != "both" or _fast.IMPLEMENTATION != "cython"
            or config.option.collectonly or pure_run_of_parent()):
        return
    args = list(config.invocation_params.args) + ["--twins", "this"]
    if "no:cacheprovider" not in args:
        args += ["-p", "no:cacheprovider"]  # the parent's cache is the one kept
    env = {**os.environ, "AIOBRPC_NO_EXTENSIONS": "1", PURE_RUN_ENV: "1"}
    out = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=config.invocation_params.dir,
                            env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    config.stash[_PURE_RUN] = (proc, out)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    run = session.config.stash.get(_PURE_RUN, None)
    if run is None:
        return
    proc, out = run
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        proc.kill()
    rc = proc.wait()
    out.seek(0)
    session.config.stash[_PURE_RUN] = (rc, out.read().decode(errors="replace"))
    out.close()
    # The child's 5 (no tests): every selected test is one the parent runs alone, whose status
    # stands. The parent's 5 with the child's 0: every selected test runs once, in the child.
    no_tests = pytest.ExitCode.NO_TESTS_COLLECTED
    if rc not in (0, no_tests) and session.exitstatus in (0, no_tests):
        session.exitstatus = rc
    elif rc == 0 and session.exitstatus == no_tests:
        session.exitstatus = 0


@pytest.hookimpl(trylast=True)  # after the terminal reporter is registered
def pytest_configure(config):
    # Both processes end with pytest's summary line ("12 passed in 3.0s"): each says its twin on
    # the line itself ("compiled twin: 12 passed in 3.0s", "pure-Python twin: ...").
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    label = "compiled twin" if _fast.IMPLEMENTATION == "cython" else "pure-Python twin"
    build = reporter.build_summary_stats_line

    def labelled_summary_stats_line():
        parts, color = build()
        if parts:
            (text, markup), *rest = parts
            parts = [(f"{label}: {text}", markup), *rest]
        return parts, color

    reporter.build_summary_stats_line = labelled_summary_stats_line


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    run = config.stash.get(_PURE_RUN, None)
    if run is None or not isinstance(run[0], int):
        return
    rc, output = run
    terminalreporter.write_sep("=", f"pure-Python twin (AIOBRPC_NO_EXTENSIONS=1, second process): exit {rc}")
    terminalreporter.write(output)


def pytest_asyncio_loop_factories(config, item):
    """Every async test runs on plain asyncio and on uvloop."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


# -- servers a failed test left running --------------------------------------------------------
# A test that fails between a server's start() and its stop() leaves the server listening,
# and uvloop's loop.close() then never returns: the suite would hang instead of reporting the
# failure. Every server started in a test is remembered here; after a failed test those still
# listening are stopped, on their own loop, before the test's fixtures (its event loop among
# them) are torn down. Passing tests stop their servers themselves (fixtures may still check
# theirs while torn down).
_FAILED = pytest.StashKey[bool]()
_started_servers: weakref.WeakSet = weakref.WeakSet()
_server_start = aiobrpc.Server.start


async def _remembered_start(self, *args, **kwargs):
    await _server_start(self, *args, **kwargs)
    _started_servers.add(self)


aiobrpc.Server.start = _remembered_start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.failed:
        item.stash[_FAILED] = True
    return rep


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    servers = list(_started_servers)
    _started_servers.clear()
    if not item.stash.get(_FAILED, False):
        return
    for srv in servers:
        listener = srv._listener
        if listener is None or srv.stopping:
            continue
        loop = listener.get_loop()
        if loop.is_closed() or loop.is_running():
            continue

        async def stop(srv=srv):
            await srv.stop()
            await srv.join(timeout=1)
        try:
            loop.run_until_complete(asyncio.wait_for(stop(), 5))
        except Exception as e:  # the test's own failure is what is reported
            print(f"stopping a server the test left running failed: {e!r}", file=sys.stderr)
