"""The suite's two processes (tests/conftest.py): this one runs the compiled twin where it is
built, a second one started with AIOBRPC_NO_EXTENSIONS=1 the pure twin, and a failure in either
fails the run. Run by the parent process only (the conftest deselects them in the child)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aiobrpc import _fast

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(_fast.IMPLEMENTATION != "cython",
                                reason="the compiled twin is not built here: the suite runs in one process")


def _pytest(fail: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("AIOBRPC_NO_EXTENSIONS", "PYTEST_ADDOPTS")}
    env["AIOBRPC_PROBE_FAIL"] = fail
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                           "tests/helpers/twin_probe.py"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_suite_runs_the_pure_twin_in_a_second_process():
    r = _pytest("")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "probe ran: compiled [True]" in r.stdout and "probe ran: pure [False]" in r.stdout
    assert "pure-Python twin (AIOBRPC_NO_EXTENSIONS=1, second process): exit 0" in r.stdout


def test_each_summary_line_names_its_twin():
    lines = _pytest("").stdout.splitlines()
    summaries = [line for line in lines if re.search(r"\d+ passed in ", line)]
    assert len(summaries) == 2, lines
    assert re.fullmatch(r"pure-Python twin: 1 passed in \S+", summaries[0]), summaries  # the child's, printed first
    assert re.fullmatch(r"compiled twin: 1 passed in \S+", summaries[1]), summaries


@pytest.mark.parametrize("fail", ["compiled", "pure"])
def test_a_failure_in_either_twin_fails_the_run(fail):
    r = _pytest(fail)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.count("1 failed") == 1 and r.stdout.count("1 passed") == 1, r.stdout
    passed, failed = ("pure-Python", "compiled") if fail == "compiled" else ("compiled", "pure-Python")
    assert f"{failed} twin: 1 failed" in r.stdout and f"{passed} twin: 1 passed" in r.stdout, r.stdout


def test_a_selection_run_once_in_the_child_passes_as_the_child_does():
    # tests/grpc runs in the pure child only: the parent deselects all, and its "no tests" (5)
    # must not fail a run whose every test passed
    env = {k: v for k, v in os.environ.items() if k not in ("AIOBRPC_NO_EXTENSIONS", "PYTEST_ADDOPTS")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/grpc/test_hpack_memo.py::test_a_decoded_list_is_the_callers_own"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 deselected" in r.stdout and "1 passed" in r.stdout, r.stdout
