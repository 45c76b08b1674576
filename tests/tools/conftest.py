"""Fixtures of the code-generation tests: a test fails on any exception that reaches the loop's handler."""

from __future__ import annotations

from tests.helpers.loop_errors import loop_errors  # noqa: F401  (autouse fixture)
