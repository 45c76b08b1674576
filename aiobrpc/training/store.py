"""Rendezvous stores: where the ranks of a group publish and find each other's address.

A store is any object with `set(key: str, value: bytes)` and `get(key: str) -> bytes`, the
latter waiting until the key exists (or raising when its own timeout passes). torch's stores
(`TCPStore`, `FileStore`, the one `init_process_group` hands a backend) are such objects;
`FileStore` here needs nothing but a directory every rank can reach.
"""

from __future__ import annotations

import os
import pathlib
import time
import urllib.parse
from typing import Protocol


class Store(Protocol):
    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...


class FileStore:
    """A store in a directory: one file per key, written whole then renamed into place.

    >>> import tempfile
    >>> store = FileStore(tempfile.mkdtemp(), timeout=1.0)
    >>> store.set("rank/0", b"127.0.0.1:8000")
    >>> store.get("rank/0")
    b'127.0.0.1:8000'
    """

    def __init__(self, path: str | os.PathLike, timeout: float = 300.0) -> None:
        self.path = pathlib.Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.timeout = timeout

    def _file(self, key: str) -> pathlib.Path:
        if not isinstance(key, str) or not key:
            raise ValueError(f"a store key must be a non-empty str, got {key!r}")
        return self.path / urllib.parse.quote(key, safe="")

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        final = self._file(key)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, final)

    def get(self, key: str) -> bytes:
        """The value of `key`, waiting up to `timeout` seconds for some rank to set it."""
        path = self._file(key)
        deadline = time.monotonic() + self.timeout
        delay = 0.001
        while True:
            try:
                return path.read_bytes()
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"store key {key!r} was not set within {self.timeout} s "
                                       f"(in {self.path})") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
