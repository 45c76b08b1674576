"""The hash functions of brpc's consistent hashing balancers (brpc's policy/hasher.cpp).

>>> murmurhash32(b"127.0.0.1:8000-0")
2936034794
>>> md5hash32(b"hello") == int.from_bytes(hashlib.md5(b"hello").digest()[:4], "little")
True
"""

from __future__ import annotations

import hashlib

import mmh3


def murmurhash32(data: bytes) -> int:
    """MurmurHash3_x86_32 of `data` with seed 0, as an unsigned 32-bit int."""
    return mmh3.hash(data, 0, signed=False)


def md5hash32(data: bytes) -> int:
    """The first 4 bytes of MD5(data) read little-endian."""
    return int.from_bytes(hashlib.md5(data).digest()[:4], "little")


def ketama_hashes(data: bytes) -> tuple[int, int, int, int]:
    """The 4 ketama points of `data`: MD5(data) cut in 4 little-endian 32-bit ints."""
    digest = hashlib.md5(data).digest()
    return (int.from_bytes(digest[0:4], "little"), int.from_bytes(digest[4:8], "little"),
            int.from_bytes(digest[8:12], "little"), int.from_bytes(digest[12:16], "little"))
