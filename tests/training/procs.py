"""Starting the ranks of a test group as real processes that use the parent test's twin."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from aiobrpc import _fast

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = pathlib.Path(__file__).resolve().parent / "scripts"


def child_env(loop: str = "uvloop", **extra: str) -> dict[str, str]:
    """The environment of a child rank: this test's twin and `loop`, this checkout first."""
    env = dict(os.environ)
    env.pop("AIOBRPC_NO_EXTENSIONS", None)
    if _fast.IMPLEMENTATION == "python":
        env["AIOBRPC_NO_EXTENSIONS"] = "1"
    env["AIOBRPC_TEST_LOOP"] = loop
    env["AIOBRPC_REPO"] = str(REPO)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def start_ranks(scenario: str, world: int, store_dir: str, env: dict[str, str]) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, str(SCRIPTS / "collective_worker.py"), scenario, str(r), str(world),
                              store_dir], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(world)]


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of each process; any still running after `timeout` is killed."""
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        results.append((p.returncode, out, err))
    return results
