from tests.helpers.loop_errors import loop_errors  # noqa: F401  (autouse fixture)
