"""docs/testing.md's example, copied as the page says into an empty directory, passes there:
pytest with pytest-asyncio's defaults (no configuration file, so strict mode) and aiobrpc's
pytest plugin."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / "docs" / "testing.md").read_text(), re.S | re.M)


def the_one(blocks: list[str], marker: str) -> str:
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"docs/testing.md has one ```python block with {marker!r}"
    return found[0]


def test_the_pages_example_passes_in_a_fresh_project(tmp_path):
    blocks = python_blocks()
    module = the_one(blocks, "pytestmark = pytest.mark.asyncio")
    conftest = the_one(blocks, "pytest_plugins = ")
    fixture_tests = the_one(blocks, "(aiobrpc_channel_for)")
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "test_echo.py").write_text(module + "\n\n" + fixture_tests)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    # aiobrpc as this suite imports it (an install, or this checkout)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^4 passed in ", done.stdout, re.M), done.stdout
