"""aiobrpc.testing's fixtures, as a user's conftest.py gets them, and the loop-error check."""

from __future__ import annotations

from aiobrpc.testing.pytest_plugin import aiobrpc_channel_for  # noqa: F401  (a fixture)
from tests.helpers.loop_errors import loop_errors  # noqa: F401  (autouse fixture)
