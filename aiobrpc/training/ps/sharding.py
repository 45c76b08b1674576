"""Which server holds a key: CRC-32C of the key's UTF-8 bytes, modulo the number of servers.

CRC-32C (Castagnoli, the checksum of iSCSI and of brpc's `butil::crc32c::Value`) is fixed by
its definition, so a C++ worker places keys exactly as this one does:
`butil::crc32c::Value(key.data(), key.size()) % servers.size()`, the servers listed in the
same order everywhere.

>>> shard_of("embedding", 3), shard_of("embedding", 3) == shard_of("embedding".encode(), 3)
(0, True)
"""

from __future__ import annotations

from collections.abc import Iterable

import crc32c

__all__ = ["key_hash", "shard_of", "split_by_shard"]


def key_hash(key: str | bytes) -> int:
    """CRC-32C of the key (its UTF-8 bytes for a str), seed 0: 0 .. 2**32 - 1."""
    return crc32c.crc32c(key.encode("utf-8") if isinstance(key, str) else bytes(key))


def shard_of(key: str | bytes, num_shards: int) -> int:
    """The index of the server that holds `key` among `num_shards` servers."""
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
    return key_hash(key) % num_shards


def split_by_shard(keys: Iterable[str], num_shards: int) -> dict[int, list[str]]:
    """shard index -> the keys it holds, in the order given."""
    out: dict[int, list[str]] = {}
    for key in keys:
        out.setdefault(shard_of(key, num_shards), []).append(key)
    return out
