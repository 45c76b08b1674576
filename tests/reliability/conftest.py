"""Reliability fixtures: no exception may reach the loop's exception handler."""

from tests.helpers.loop_errors import loop_errors  # noqa: F401  (autouse fixture)
