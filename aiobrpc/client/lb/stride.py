"""The prime strides brpc's rr, random and wr walk server lists with (bthread/offset_inl.list).

>>> STRIDE_PRIMES[0], STRIDE_PRIMES[-1]
(36809, 41579)
"""

from __future__ import annotations

import random


def _primes_between(low: int, high: int) -> tuple[int, ...]:
    sieve = bytearray([1]) * (high + 1)
    sieve[:2] = b"\0\0"
    for d in range(2, int(high ** 0.5) + 1):
        if sieve[d]:
            sieve[d * d::d] = bytes(len(range(d * d, high + 1, d)))
    return tuple(n for n in range(low, high + 1) if sieve[n])


# bthread::prime_offset() draws from the table of the primes in this range: large enough to be
# coprime with any realistic server count.
STRIDE_PRIMES = _primes_between(36809, 41579)


def random_stride(rng: random.Random, n: int) -> int:
    """A random prime of the table, or 1 where it divides `n` (a walk of n steps with that
    stride would not visit every server; only possible for n >= 36809)."""
    stride = rng.choice(STRIDE_PRIMES)
    return stride if n % stride else 1
