"""`python -m aiobrpc`: the same command as `aiobrpc` (see aiobrpc.cli)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
